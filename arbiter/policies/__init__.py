"""Cross-app scheduling policies, selectable by name (architecture: baselines go through the
same door as Themis; paper 6.1: "all apps report X and the arbiter allocates by X")."""

from __future__ import annotations

from arbiter.policies.base import Decision, Policy, RoundContext
from arbiter.policies.deepshare_las import DeepShareLasPolicy
from arbiter.policies.deepshare_srtf import DeepShareSrtfPolicy
from arbiter.policies.drf import DrfPolicy
from arbiter.policies.fifo import FifoPolicy
from arbiter.policies.gandiva import GandivaPolicy
from arbiter.policies.las import LasPolicy
from arbiter.policies.optimus import OptimusPolicy
from arbiter.policies.slaq import SlaqPolicy
from arbiter.policies.srtf import SrtfPolicy
from arbiter.policies.themis import ContentionAwareThemisPolicy, ThemisPolicy
from arbiter.policies.tiresias import TiresiasPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (ThemisPolicy, GandivaPolicy, TiresiasPolicy, OptimusPolicy, SlaqPolicy, FifoPolicy, DrfPolicy)
}
POLICIES[ContentionAwareThemisPolicy.name] = ContentionAwareThemisPolicy  # D36
# DeepShare's baselines (seeds/002): textbook LAS and SRTF and DeepShare's own two, placed as it does
POLICIES.update({cls.name: cls for cls in (LasPolicy, SrtfPolicy, DeepShareLasPolicy, DeepShareSrtfPolicy)})


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Make a policy class selectable by its ``name`` (a decorator; issue 13 item 6: a policy in a
    file outside the repository, loaded with ``themis-sim --plugin FILE``). Registering the same
    class again is a no-op; another class under a taken name is refused."""
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise TypeError(f"register_policy expects a Policy subclass, got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or "," in name:
        raise ValueError(f"policy class {cls.__qualname__} needs a class attribute name = '...' (no commas)")
    other = POLICIES.get(name)
    if other is not None and other is not cls:
        raise ValueError(f"policy name {name!r} is taken by {other.__module__}.{other.__qualname__}")
    POLICIES[name] = cls
    return cls


def make_policy(name: str, **options) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}") from None
    return cls(**options)


__all__ = [
    "Decision",
    "Policy",
    "RoundContext",
    "ThemisPolicy",
    "GandivaPolicy",
    "TiresiasPolicy",
    "OptimusPolicy",
    "SlaqPolicy",
    "FifoPolicy",
    "DrfPolicy",
    "LasPolicy",
    "SrtfPolicy",
    "DeepShareLasPolicy",
    "DeepShareSrtfPolicy",
    "POLICIES",
    "make_policy",
    "register_policy",
]
