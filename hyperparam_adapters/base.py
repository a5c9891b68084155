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
subclass, as an Optuna sampler is. :class:`TunerAdapter` and :class:`Result` live in ``agent.tuner``
(the agent's runner drives them; this package builds on the agent) and are re-exported here.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.appsched import JobInfo
from agent.run_record import TunerJournal
from agent.trial import TrialSpec  # re-exported: its home until issue 11; adapters outside this repo import it here
from agent.tuner import Result, TunerAdapter  # re-exported: the agent's runner drives them, so they live there

__all__ = ["JournaledTuner", "Observation", "Result", "TrialSpec", "TunerAdapter"]

log = logging.getLogger("themis.tuner")


@dataclass
class Observation:
    """Everything a job reported: iterations, losses and iteration times (the profiler's input)."""

    iterations: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    iter_times: list[float] = field(default_factory=list)


def _params_text(params: Mapping[str, Any]) -> str:
    """Hyperparameters as ``agent.job`` writes them in a checkpoint's owner (compared on resume)."""
    return json.dumps(dict(params), sort_keys=True, separators=(",", ":"), default=str)


class JournaledTuner:
    """A tuner whose state is its seed plus what it was told: it journals every report it takes and
    every give-up (``agent.run_record.TunerJournal``, ``<run folder>/tuner.jsonl``) and, on a resumed
    run, replays them (issue 36, item 3). Its draws are seeded and its decisions depend only on the
    reports and their order, so the replay comes back to the same trials, the same rungs decided and
    the same curves: trials already stopped or finished stay so, trials that reached their target are
    not started again, and the running ones go on from their checkpoints.

    A mixin for :class:`TunerAdapter` subclasses that define ``observe``, ``fail`` and
    ``trial_params``: their ``observe`` calls :meth:`journal_report` once the report is accepted,
    their ``fail`` :meth:`journal_fail`. ``agent.search_run.SearchRun.attach`` sets :attr:`journal`
    and, on a resumed run, calls :meth:`resume`.
    """

    #: where to journal (SearchRun.attach sets it); None: not kept, nothing to replay
    journal: TunerJournal | None = None
    _replaying: bool = False

    def _journal_line(self, what: str, job_id: str, **fields: Any) -> None:
        if self.journal is None or self._replaying:
            return
        seen = self.__dict__.setdefault("_journaled_jobs", set())
        if job_id not in seen:
            fields["params"] = _params_text(self.trial_params(job_id))  # type: ignore[attr-defined]
            seen.add(job_id)
        self.journal.write(what, job_id, **fields)

    def journal_report(self, job_id: str, iteration: float, loss: float, iter_time_s: float | None) -> None:
        """Journal a report ``observe`` accepted (call it before acting on the report)."""
        if self.journal is None or self._replaying:  # the common case outside a runner: the simulator's
            return
        self._journal_line("observe", job_id, iteration=float(iteration), loss=float(loss),
                           iter_time_s=None if iter_time_s is None else float(iter_time_s))

    def journal_fail(self, job_id: str) -> None:
        """Journal a job the runner gave up on (``fail``)."""
        self._journal_line("fail", job_id)

    def resume(self) -> list[str]:
        """Replay the journal of the run being resumed (what ``AppRunner.create(resume=True)`` asks):
        every report and give-up again, in order, without journaling them twice. Returns the jobs that
        go on (``runnable()`` now). ValueError when the journal is not this search's: a trial it names
        does not exist here, or has other hyperparameters (another space, seed or size: build the
        adapter as the interrupted run did)."""
        if self.journal is None:
            return []
        lines = self.journal.read()
        seen = self.__dict__.setdefault("_journaled_jobs", set())
        self._replaying = True
        try:
            for n, line in enumerate(lines, 1):
                job, what = line["job"], line.get("what")
                try:
                    params = _params_text(self.trial_params(job))  # type: ignore[attr-defined]
                except KeyError:
                    raise ValueError(f"cannot resume from {self.journal.path}: line {n} names trial {job}, which this "
                                     "search does not have; build the adapter as the interrupted run did (the same "
                                     "search space, seed and sizes)") from None
                if "params" in line and line["params"] != params:
                    raise ValueError(f"cannot resume from {self.journal.path}: trial {job} had the hyperparameters "
                                     f"{line['params']} there and draws {params} here; build the adapter as the "
                                     "interrupted run did (the same search space, seed and sizes)")
                seen.add(job)
                if what == "observe":
                    loss = line.get("loss")
                    self.observe(job, float(line["iteration"]),  # type: ignore[attr-defined]
                                 math.inf if loss is None else float(loss), line.get("iter_time_s"))
                elif what == "fail":
                    self.fail(job)  # type: ignore[attr-defined]
                else:
                    raise ValueError(f"{self.journal.path}, line {n}: unknown entry {what!r}")
        finally:
            self._replaying = False
        going_on = [t.job_id for t in self.runnable()]  # type: ignore[attr-defined]
        if lines:
            log.info("resumed from %s: %d reports and give-ups replayed; %s go on", self.journal.path, len(lines),
                     ", ".join(going_on) or "no trial")
        return going_on


def lanes(heads: list[tuple[str, float, float]], queued: list[float], parallel: int, prefix: str, default: float,
          slowdown: Any, demand: int) -> tuple[list[JobInfo], float]:
    """A search's work as at most ``parallel`` lanes (D4, the curve-stopping adapters): each running
    trial, ``(job id, serial iteration time, work left in s)``, heads a lane; lanes not headed start
    from nothing (named ``<prefix>next-k``, at ``default`` s per iteration); the ``queued`` trials'
    work goes, in order, onto the lane that frees first. One JobInfo per lane with work, and the
    work left in all (GPU-seconds at S = 1)."""
    count = min(parallel, len(heads) + len(queued))
    heads = heads + [(f"{prefix}next-{k}", default, 0.0) for k in range(count - len(heads))]
    loads = [w for _, _, w in heads]
    for work in queued:
        if loads:
            k = loads.index(min(loads))
            loads[k] += work
    jobs = [JobInfo(load / t, t, slowdown, demand, job) for (job, t, _), load in zip(heads, loads) if load > 0]
    return jobs, sum(loads)
