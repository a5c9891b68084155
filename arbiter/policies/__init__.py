"""Cross-app scheduling policies, selectable by name (architecture: baselines go through the
same door as Themis; paper 6.1: "all apps report X and the arbiter allocates by X")."""

from __future__ import annotations

from arbiter.policies.base import Decision, Policy, RoundContext
from arbiter.policies.drf import DrfPolicy
from arbiter.policies.fifo import FifoPolicy
from arbiter.policies.gandiva import GandivaPolicy
from arbiter.policies.optimus import OptimusPolicy
from arbiter.policies.slaq import SlaqPolicy
from arbiter.policies.themis import ThemisPolicy
from arbiter.policies.tiresias import TiresiasPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (ThemisPolicy, GandivaPolicy, TiresiasPolicy, OptimusPolicy, SlaqPolicy, FifoPolicy, DrfPolicy)
}


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
    "POLICIES",
    "make_policy",
]
