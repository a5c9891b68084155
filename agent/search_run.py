"""A search run: the identity that checkpoints and records of one run of a search carry (issue 11, item 1).

Why. Checkpoints used to live at ``<workdir>/<job>/checkpoint.pkl``, and job ids repeat from one run
of a search to the next (``t0``, ``trial-0``...). A second run in the same workdir therefore
"resumed" 40 of 41 new trials from the first run's checkpoints, with other hyperparameters, and
reported a best result at an iteration the trial never reached. Now every run of a search gets a
run id, recorded in ``<workdir>/themis-run.json``; its jobs keep their folders (checkpoint, log,
metrics) under ``<workdir>/<run id>/``, and ``agent.job`` writes the run, job and hyperparameters
into every checkpoint and refuses one that another trial wrote.

Resuming on purpose. ``SearchRun.begin(workdir, resume=True)`` (``AppRunner.create(resume=True)``)
takes the run id recorded in the workdir instead of a new one, so the interrupted run's jobs find
their own checkpoints again, and :meth:`SearchRun.attach` gives the tuner its journal
(``tuner.jsonl``, ``agent.run_record.TunerJournal``) and asks it to take up where the run stopped
(issue 36, item 3: a resume re-ran the whole Hyperband search, and re-ran a finished one without a
word). A run that finished is not resumed: :class:`RunFinished` says so, and a new run (without
``resume``) is the way to run the search again.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.run_record import JOURNAL, TunerJournal, finished_at

__all__ = ["RUN_FILE", "RunFinished", "SearchRun"]

RUN_FILE = "themis-run.json"

log = logging.getLogger("themis.runner")


class RunFinished(RuntimeError):
    """``resume=True`` on a run that finished: there is nothing to resume, and nothing is run."""

    def __init__(self, run_id: str, at: float | None, how: str = "finished") -> None:
        self.run_id, self.at = run_id, at
        when = "" if at is None else " at " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))
        super().__init__(f"run {run_id} {how}{when}; nothing to resume (to run the search again, start a new "
                         "run: AppRunner.create without resume=True, or the example without --resume)")


def _started_a_job(folder: Path) -> bool:
    """A job folder in the run's folder. Files alone do not count: a runner whose agent was refused or
    never got in still closes its record there (``record.jsonl``, the plot)."""
    return any(p.is_dir() for p in folder.iterdir())


@dataclass(frozen=True)
class SearchRun:
    """One run of a search in ``workdir``: ``folder`` holds its jobs' folders and its records."""

    run_id: str
    workdir: Path
    resumed: bool

    @property
    def folder(self) -> Path:
        return self.workdir / self.run_id

    @classmethod
    def begin(cls, workdir: str | os.PathLike[str], *, resume: bool = False) -> SearchRun:
        """A new run (a fresh id, recorded in the workdir), or with ``resume`` the run recorded there.
        FileNotFoundError when there is nothing to resume; :class:`RunFinished` when that run
        finished (its ``record.jsonl`` ends with ``done``)."""
        workdir = Path(workdir)
        record = workdir / RUN_FILE
        if resume:
            try:
                data = json.loads(record.read_text())
                run_id = str(data["run"])
            except FileNotFoundError:
                raise FileNotFoundError(f"nothing to resume in {workdir}: no earlier run recorded there ({RUN_FILE}); "
                                        "start without resume") from None
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{record}: not a run record ({exc}); start without resume") from None
            if not (workdir / run_id).is_dir():
                raise FileNotFoundError(f"cannot resume run {run_id}: its folder {workdir / run_id} is gone")
            if not _started_a_job(workdir / run_id):
                # that run never started a job (it could not register or connect): the run to go on
                # with is the latest one that did
                started = sorted(p.name for p in workdir.glob("run-*") if p.is_dir() and _started_a_job(p))
                run_id = started[-1] if started else run_id
            done = finished_at(workdir / run_id)
            if done is not None:
                raise RunFinished(run_id, done)
            return cls(run_id, workdir, True)
        workdir.mkdir(parents=True, exist_ok=True)
        run_id = time.strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(3)
        (workdir / run_id).mkdir()
        tmp = record.with_name(f".{RUN_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"run": run_id, "started": time.time()}) + "\n")
        os.replace(tmp, record)
        return cls(run_id, workdir, False)

    def attach(self, adapter: Any) -> list[str] | None:
        """Make ``adapter`` part of this run (``AppRunner.create`` calls it): its ``run_id`` (the Optuna
        adapter tags its trials with it), its ``journal`` (``<run folder>/tuner.jsonl``: the Hyperband,
        successive-halving and curve-stopping adapters journal what they are told), and on a resumed
        run ``adapter.resume()``: the tuner takes up where the run stopped (a replay of its journal; the
        Optuna adapter reads its study). Returns what ``resume()`` returned (the jobs that go on), None
        on a new run or an adapter without ``resume``. :class:`RunFinished` when the resumed tuner has
        nothing left to run (a run kept without ``record.jsonl``, or one that ended before writing it)."""
        if hasattr(adapter, "run_id"):
            adapter.run_id = self.run_id
        journal = TunerJournal(self.folder / JOURNAL)
        if hasattr(adapter, "journal"):
            adapter.journal = journal
        if not (self.resumed and hasattr(adapter, "resume")):
            return None
        going_on = adapter.resume()
        if adapter.finished():
            raise RunFinished(self.run_id, journal.modified(), "has nothing left to run: its tuner finished")
        log.info("resuming run %s in %s", self.run_id, self.folder)
        return going_on
