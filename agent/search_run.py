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
their own checkpoints again.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RUN_FILE", "SearchRun"]

RUN_FILE = "themis-run.json"


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
        FileNotFoundError when there is nothing to resume."""
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
            return cls(run_id, workdir, True)
        workdir.mkdir(parents=True, exist_ok=True)
        run_id = time.strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(3)
        (workdir / run_id).mkdir()
        tmp = record.with_name(f".{RUN_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"run": run_id, "started": time.time()}) + "\n")
        os.replace(tmp, record)
        return cls(run_id, workdir, False)
