"""Jobs that progress on the wall clock exactly as Eq. 1 says, on the GPUs the app holds.

A stand-in for real training processes (the launcher of the adapters issue runs those), so that
the service can be run, demonstrated and tested end to end with the apps of ``agent.app_config``:
each tick, every job of the current phase advances by the elapsed time over its iteration time on
its share of the held GPUs (D3's split, D1's slowdown); a successive-halving phase that is done
keeps its faster half; GPUs the app can no longer use are released at once, and the agent tells
the arbiter when its demand changes (D6). ``speedup`` runs the jobs faster than real time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from agent.appsched import AppScheduler, FixedJobsApp, SuccessiveHalvingApp
from agent.client import AgentClient
from agent.fairness import job_time, split_allocation

log = logging.getLogger("themis.agent")


#: ``on_result(job, iteration, outcome)``: a trial's end, ``"stopped"`` (the worse half of a
#: successive-halving phase) or ``"done"`` (it ran all its iterations).
ResultHook = Callable[[str, float, str], None]


class EmulatedJobs:
    def __init__(self, client: AgentClient, app: AppScheduler, *, speedup: float = 1.0, tick_s: float = 0.2,
                 on_result: ResultHook | None = None):
        if not isinstance(app, (SuccessiveHalvingApp, FixedJobsApp)):
            raise TypeError(f"emulated jobs run successive-halving or fixed-job apps, not {type(app).__name__}")
        if not speedup > 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        self.client, self.app, self.speedup, self.tick_s = client, app, speedup, tick_s
        self.on_result = on_result
        self.demand = app.demand_now()
        self.finished_at: float | None = None
        self._reported: set[str] = set()

    @property
    def trials(self) -> int:
        """How many trials the app runs in all."""
        app = self.app
        return len(app.iter_times) if isinstance(app, SuccessiveHalvingApp) else len(app.jobs)

    def _result(self, job: str, iteration: float, outcome: str) -> None:
        if job not in self._reported:
            self._reported.add(job)
            if self.on_result is not None:
                self.on_result(job, iteration, outcome)

    def _jobs(self, positions):
        app = self.app
        if isinstance(app, SuccessiveHalvingApp):
            return app.jobs_in_phase(app.current_phase(), positions)
        return app.jobs_remaining(positions)

    def step(self, dt: float) -> None:
        """Advance the jobs by ``dt`` seconds of (emulated) training on the GPUs held now."""
        held = dict(self.client.held)
        positions = [h.position for h in held.values()]
        if positions and dt > 0:
            for job, chunk in split_allocation(self._jobs(positions), positions):
                t = job_time(job, chunk)
                if t > 0:
                    self.app.advance(job.job_id, job.iters_remaining * min(1.0, dt / t))
        app = self.app
        if isinstance(app, SuccessiveHalvingApp) and app.phase_done():
            speed = {j: app._times[j] for j in app.phase_jobs()}
            survivors = sorted(speed, key=lambda j: (speed[j], j))[: max(1, len(speed) // 2)]
            reached = float(sum(app.iterations[: app.current_phase()]))
            last = app.current_phase() == app.num_phases()
            app.end_phase(survivors)
            for job in sorted(speed):
                if last or job not in survivors:
                    self._result(job, reached, "done" if last else "stopped")
        elif isinstance(app, FixedJobsApp):
            running = {j.job_id for j in app.jobs_remaining(positions)}
            for job in app.jobs:  # as given: their full length
                if job.job_id not in running:
                    self._result(job.job_id, float(job.iters_remaining), "done")
        demand = app.demand_now()
        if demand != self.demand:
            self.demand = demand
            if demand and len(held) > demand:
                self.client.release(sorted(held)[demand:])
            self.client.set_demand(demand)

    async def run(self) -> None:
        last = time.monotonic()
        while not self.app.finished():
            await asyncio.sleep(self.tick_s)
            now = time.monotonic()
            self.step((now - last) * self.speedup)
            last = now
        self.finished_at = time.time()
        self.client.done()
        log.info("app %s finished", self.client.app)
