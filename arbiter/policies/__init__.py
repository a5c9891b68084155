"""Cross-app scheduling policies, selectable by name (architecture: baselines go through the
same door as Themis)."""

from __future__ import annotations

from arbiter.policies.base import Decision, Policy, RoundContext
from arbiter.policies.themis import ThemisPolicy

POLICIES: dict[str, type[Policy]] = {ThemisPolicy.name: ThemisPolicy}


def make_policy(name: str, **options) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}") from None
    return cls(**options)


__all__ = ["Decision", "Policy", "RoundContext", "ThemisPolicy", "POLICIES", "make_policy"]
