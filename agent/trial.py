"""The trial: what a tuner asks the agent to run (issue 11, item 8).

It lives in the agent because the launcher and the runner start trials: tuner adapters
(``hyperparam_adapters``) build on the agent, never the reverse. ``hyperparam_adapters.base``
re-exports it for code written against its old home.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["TrialSpec"]


@dataclass(frozen=True)
class TrialSpec:
    """A job the tuner wants running: its id, hyperparameters, GPU demand and where it resumes."""

    job_id: str
    params: Mapping[str, Any]
    demand_max: int = 1
    start_iteration: int = 0  # resume from this iteration (its checkpoint), 0 for a fresh start
    target_iteration: int | None = None  # run until here (the rung's budget), None: until stopped
