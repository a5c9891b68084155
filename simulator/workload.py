"""What the simulator replays: apps (each a hyperparameter search or one job) and their jobs.

Workloads come from ``simulator.workloads`` (the Philly trace, its Hyperband variant, a synthetic
generator, or a user's CSV trace); the simulator turns each :class:`AppSpec` into an app scheduler
of the kind it names (``agent.appsched``) and runs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("fixed", "successive_halving", "curve_stopping")


@dataclass(frozen=True)
class JobSpec:
    """One training job: ``iterations`` to run (for ``curve_stopping``: its cap; for
    ``successive_halving``: unused, phases set the work), its one-GPU iteration time and its
    maximum GPU demand."""

    job_id: str
    iterations: float
    iter_time_s: float
    gpus: int

    def __post_init__(self) -> None:
        if not (self.iterations > 0 and math.isfinite(self.iterations)):
            raise ValueError(f"job {self.job_id!r}: iterations must be finite and > 0")
        if not (self.iter_time_s > 0 and math.isfinite(self.iter_time_s)):
            raise ValueError(f"job {self.job_id!r}: iter_time_s must be finite and > 0")
        if self.gpus < 1:
            raise ValueError(f"job {self.job_id!r}: gpus must be >= 1")


@dataclass(frozen=True)
class AppSpec:
    """An app arriving at ``arrival_s`` with its jobs.

    ``kind``: ``fixed`` (every job runs to completion, as in a trace), ``successive_halving`` (the
    jobs are phase 1 of a halving search running ``phase_iterations[i]`` iterations per job in
    phase i+1), or ``curve_stopping`` (each job stops when its loss curve flattens, at most at its
    ``iterations``). ``model`` names a profile entry (``agent/profiles/slowdowns.toml`` or a user
    table, ``agent.placement.use_profiles``); ``seed`` fixes the app's simulated losses.
    """

    app_id: str
    arrival_s: float
    model: str
    kind: str
    jobs: tuple[JobSpec, ...]
    phase_iterations: tuple[float, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"app {self.app_id!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if not self.jobs:
            raise ValueError(f"app {self.app_id!r} has no jobs")
        if not (self.arrival_s >= 0 and math.isfinite(self.arrival_s)):
            raise ValueError(f"app {self.app_id!r}: arrival_s must be finite and >= 0")
        if self.kind != "successive_halving" and self.phase_iterations:
            raise ValueError(f"app {self.app_id!r}: phase_iterations are for successive_halving apps, not {self.kind}")
        if any(not (x > 0 and math.isfinite(x)) for x in self.phase_iterations):
            raise ValueError(f"app {self.app_id!r}: phase_iterations must be finite and > 0, "
                             f"got {self.phase_iterations}")
        if self.kind == "successive_halving":
            if not self.phase_iterations:
                raise ValueError(f"app {self.app_id!r}: successive halving needs phase_iterations")
            if len(self.jobs) < 2 ** (len(self.phase_iterations) - 1):
                raise ValueError(f"app {self.app_id!r}: {len(self.jobs)} jobs cannot be halved "
                                 f"{len(self.phase_iterations) - 1} times")

    @property
    def demand_max(self) -> int:
        return sum(j.gpus for j in self.jobs)


@dataclass(frozen=True)
class Workload:
    name: str
    apps: tuple[AppSpec, ...]
    source: str = ""  # where it came from, for summaries
    #: profile tables (slowdowns.toml's form) its models need beyond the shipped one, by path
    #: (the DeepShare workload's models, agent/profiles/deepshare.toml); the simulator adds them
    profile_tables: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        ids = [a.app_id for a in self.apps]
        if len(set(ids)) != len(ids):
            raise ValueError(f"workload {self.name!r}: app ids must be unique")
