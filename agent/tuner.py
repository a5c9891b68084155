"""The tuner as the agent runs it: what a real hyperparameter tuner must answer (paper Figure 8).

A :class:`TunerAdapter` is two things at once:

* an app scheduler the agent computes rho and bids from (``agent.appsched``): a subclass is also a
  :class:`~agent.appsched.SuccessiveHalvingScheduler` (jobs per phase, number of phases) or a
  :class:`~agent.appsched.CurveStoppingScheduler` (jobs remaining), exactly Figure 8's narrow API;
* the tuner's side of running jobs: which trials should run now (:meth:`runnable`), what a job
  reported (:meth:`observe`, which answers with the jobs the tuner stops), each trial's
  hyperparameters, and the best result so far.

It lives in the agent because the agent's runner drives it: the adapters of real tuners
(``hyperparam_adapters``) build on the agent, never the reverse, and ``hyperparam_adapters.base``
re-exports it (as it does :class:`~agent.trial.TrialSpec`).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.appsched import AppScheduler, JobInfo, SuccessiveHalvingScheduler
from agent.fairness import split_allocation
from agent.placement import Position
from agent.trial import TrialSpec

__all__ = ["Result", "TunerAdapter"]


@dataclass(frozen=True)
class Result:
    job_id: str
    params: Mapping[str, Any]
    loss: float
    iteration: float



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

    def outcome(self, job_id: str) -> str | None:
        """The trial's fate as the tuner sees it now, for the run's record (``record.jsonl``'s trial
        lines): ``paused`` (at a rung whose end decides it), ``pruned``, ``completed``, ``diverged``,
        ``failed``; None while it runs, or where the adapter does not say."""
        return None

    def trials_planned(self) -> int | None:
        """How many trials the search will run in all (the progress bar's total); None if unknown."""
        return None

    def trials_decided(self) -> int | None:
        """How many trials have their fate (pruned, completed, failed), before a resume too; None
        where the adapter does not say (the runner then counts the results it saw)."""
        return None

    def last_result(self, job_id: str) -> tuple[float, float] | None:
        """(iteration, loss) of the trial's last report, None before one or where the adapter does not
        keep it (the runner's record uses it for a trial whose fate is decided after a resume)."""
        return None

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
