"""What a real hyperparameter tuner must answer to share a Themis cluster (paper Figure 8).

A :class:`TunerAdapter` is two things at once:

* an app scheduler the agent computes rho and bids from (``agent.appsched``): a subclass is also a
  :class:`~agent.appsched.SuccessiveHalvingScheduler` (jobs per phase, number of phases) or a
  :class:`~agent.appsched.CurveStoppingScheduler` (jobs remaining), exactly Figure 8's narrow API;
* the tuner's side of running jobs: which trials should run now (:meth:`runnable`), what a job
  reported (:meth:`observe`, which answers with the jobs the tuner stops), each trial's
  hyperparameters, and the best result so far.

The job runner (the launcher, or a simulator) places the runnable trials on the GPUs the arbiter
granted with :meth:`assign` (D3: an even split in best-locality runs), starts them, feeds their
metrics to :meth:`observe`, and stops the jobs it is told to stop. A new tuner is one file with one
subclass, as an Optuna sampler is.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.appsched import AppScheduler, JobInfo, SuccessiveHalvingScheduler
from agent.fairness import split_allocation
from agent.placement import Position
from agent.trial import TrialSpec  # re-exported: its home until issue 11; adapters outside this repo import it here

__all__ = ["Observation", "Result", "TrialSpec", "TunerAdapter"]


@dataclass(frozen=True)
class Result:
    job_id: str
    params: Mapping[str, Any]
    loss: float
    iteration: float


@dataclass
class Observation:
    """Everything a job reported: iterations, losses and iteration times (the profiler's input)."""

    iterations: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    iter_times: list[float] = field(default_factory=list)


class TunerAdapter(AppScheduler):
    """Base class of the tuner adapters; see the module docstring."""

    @abstractmethod
    def runnable(self) -> list[TrialSpec]:
        """Trials that should be running now, most important first (the runner gives GPUs in
        this order when it has fewer than the demand)."""

    @abstractmethod
    def observe(self, job_id: str, iteration: float, loss: float, iter_time_s: float | None = None) -> list[str]:
        """A job reports its loss at ``iteration`` (and its last iteration time). Returns the ids of
        jobs the tuner stops now (pruned, rung finished, curve flattened); the runner stops them."""

    @abstractmethod
    def best(self) -> Result | None:
        """The best trial so far (lowest loss), or None before any report."""

    def current_jobs(self, gpus: Sequence[Position] = ()) -> list[JobInfo]:
        """The jobs of the app as Figure 8 sees them right now (what :meth:`assign` splits)."""
        if isinstance(self, SuccessiveHalvingScheduler):
            return self.jobs_in_phase(self.current_phase(), gpus)
        return list(self.jobs_remaining(gpus))  # type: ignore[attr-defined]

    def assign(self, gpus: Mapping[str, Position]) -> dict[str, tuple[str, ...]]:
        """Which runnable job runs on which of ``gpus`` (D3): the app's even split over contiguous
        best-locality runs when there are enough GPUs, else one GPU each for the first jobs."""
        by_position: dict[Position, list[str]] = {}
        for gpu, pos in sorted(gpus.items()):
            by_position.setdefault(pos, []).append(gpu)
        positions = [p for p, ids in by_position.items() for _ in ids]
        jobs = {j.job_id: j for j in self.current_jobs(positions)}
        wanted = [jobs[t.job_id] for t in self.runnable() if t.job_id in jobs]
        out: dict[str, tuple[str, ...]] = {}
        for job, chunk in split_allocation(wanted, positions):
            out[job.job_id] = tuple(by_position[p].pop(0) for p in chunk)
        return out
