"""What ``themis-agent run`` shows and keeps of its run (issue 11, item 2), as ``AppRunner`` does for a
wrapped search.

Why. The command used to print only connection details and one line per lease event; rho over time,
the GPUs held and the trials' results were nowhere. Now a run of the emulated app:

* prints one line per grant, revocation and trial result, with GPU ids and the app's rho on what it
  then holds, and a progress bar (trials done of all, the phase) unless ``quiet``;
* writes ``<workdir>/<app>/<run id>/record.jsonl`` in :mod:`agent.run_record`'s format (``rho``
  every ``rho_every_s``, ``grant``/``revoke``, ``trial``, and ``done``/``stopped`` at the end);
* draws ``rho_gpus.png`` next to it when the run ends, however it ends.

rho is Eq. 1 on the GPUs held, with the N_avg and cluster size of the last round that asked the app
(D13); before any round asked, no rho is known and none is written.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

from agent.agent import Agent
from agent.console import SearchProgress, show_progress_lines
from agent.fairness import finish_time_fairness
from agent.run_record import PLOT, RunRecord, plot
from agent.search_run import SearchRun

log = logging.getLogger("themis.runner")  # the logger show_progress_lines() prints at INFO


class TellingAgent(Agent):
    """An agent that keeps the round's N_avg and cluster size, so the run can say the rho the app has
    on what it holds."""

    context: tuple[float, int] | None = None

    def report(self, request):
        self.context = (request.n_avg, request.cluster_size)
        return super().report(request)


class EmulatedRunRecord:
    """Lines, progress bar, ``record.jsonl`` and the closing plot of one ``themis-agent run``."""

    def __init__(self, client, agent: TellingAgent, workdir: str | Path, *, trials: int, quiet: bool = False,
                 rho_every_s: float = 2.0) -> None:
        self.client, self.agent = client, agent
        self.run = SearchRun.begin(Path(workdir) / client.app)
        self.record = RunRecord(self.run.folder)
        self.quiet, self.rho_every_s, self.trials = quiet, rho_every_s, trials
        self.started = time.time()
        self.rho: list[tuple[float, float]] = []
        self.held: list[tuple[float, int]] = []
        self.done = 0
        self._bar: SearchProgress | None = None
        if not quiet:
            show_progress_lines()
            self._bar = SearchProgress(client.app, trials)
        client.on_grant, client.on_revoke = self._granted, self._revoked
        log.info("%s: run %s in %s", client.app, self.run.run_id, self.run.folder)

    def rho_now(self) -> float | None:
        """Eq. 1 on the GPUs held now; None before any round told the app N_avg."""
        if self.agent.context is None:
            return None
        positions = [h.position for h in self.client.held.values()]
        try:
            return finish_time_fairness(self.agent.app, positions, now=time.time(), n_avg=self.agent.context[0],
                                        cluster_size=self.agent.context[1])
        except (ValueError, ZeroDivisionError):  # a record must never stop the agent
            return None

    def _rho_text(self) -> str:
        rho = self.rho_now()
        return "-" if rho is None else ("inf" if math.isinf(rho) else f"{rho:.3f}")

    def _lease_event(self, what: str, gpus: Sequence[str], reason: str | None = None) -> None:
        now = time.time()
        self.held.append((now, len(self.client.held)))
        fields = {"gpus": sorted(gpus), "held": sorted(self.client.held)}
        if reason is not None:
            fields["reason"] = reason
        self.record.write(now - self.started, what, **fields)

    def _granted(self, got) -> None:
        self._lease_event("grant", list(got))
        log.info("%s: granted %s; holds %d GPUs, rho %s", self.client.app, ",".join(sorted(got)),
                 len(self.client.held), self._rho_text())

    def _revoked(self, gpus, reason: str) -> None:
        self._lease_event("revoke", list(gpus), reason)
        log.info("%s: lost %s (%s); holds %d GPUs, rho %s", self.client.app, ",".join(sorted(gpus)), reason,
                 len(self.client.held), self._rho_text())

    def trial(self, job: str, iteration: float, outcome: str) -> None:
        """``EmulatedJobs``' ``on_result``: one trial ended."""
        self.done += 1
        self.record.write(time.time() - self.started, "trial", job=job, iteration=iteration, outcome=outcome)
        log.info("%s: trial %s %s at iteration %g (%d of %d trials); rho %s", self.client.app, job, outcome,
                 iteration, self.done, self.trials, self._rho_text())
        if self._bar is not None:
            self._bar.update(self.done, f"phase {getattr(self.agent.app, 'phase', '-')}")

    async def sample_rho(self) -> None:
        """Every ``rho_every_s``: the app's rho on what it holds (cancelled when the run ends)."""
        while True:
            rho = self.rho_now()
            if rho is not None:
                now = time.time()
                self.rho.append((now, rho))
                self.record.write(now - self.started, "rho", rho=rho, gpus=len(self.client.held))
            await asyncio.sleep(self.rho_every_s)

    def close(self, finished: bool, **fields) -> Path | None:
        """The last record, the progress bar off the display, and the plot; returns the PNG's path."""
        now = time.time()
        self.record.write(now - self.started, "done" if finished else "stopped", trials=self.done, **fields)
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        try:
            return plot(self.run.folder / PLOT, self.client.app, self.rho, self.held, self.started, now)
        except Exception as exc:  # a record must never fail the run
            log.warning("%s: could not draw %s: %s", self.client.app, PLOT, exc)
            return None
