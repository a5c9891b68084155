"""Jobs that progress on the wall clock exactly as Eq. 1 says, on the GPUs the app holds.

A stand-in for real training processes (the launcher of the adapters issue runs those), so that
the service can be run, demonstrated and tested end to end with the apps of ``agent.app_config``:
each tick, every job of the current phase advances by the elapsed time over its iteration time on
its share of the held GPUs (D3's split, D1's slowdown); a successive-halving phase that is done
keeps its faster half; GPUs the app can no longer use are released at once, and the agent tells
the arbiter when its demand changes (D6). ``speedup`` runs the jobs faster than real time.

Network contention (D35), only while the arbiter models it (it sends the agent a Neighbourhood): a
job spread over several machines also runs at its contention ratio, the table's (the one the arbiter
names) against the other apps' jobs on its machines, so the demo shows what contention does. The
agent's profiler measures each job's iteration times against its profile (``agent.profiler``), and
the jobs, their GPUs and the measured ratios go to the arbiter (``RunningJobs``), which publishes them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from agent.appsched import AppScheduler, FixedJobsApp, JobInfo, SuccessiveHalvingApp
from agent.client import AgentClient
from agent.fairness import job_time, split_allocation
from agent.placement import Position
from agent.profiler import Profiler
from arbiter.contention import ContentionError, ContentionTable, JobKind, Placed, load_table, ratio_of
from protos.messages import RunningJob

log = logging.getLogger("themis.agent")


#: ``on_result(job, iteration, outcome)``: a trial's end, ``"stopped"`` (the worse half of a
#: successive-halving phase) or ``"done"`` (it ran all its iterations).
ResultHook = Callable[[str, float, str], None]


def contention_class(model: str) -> str:
    """The contention class of a model of the profile table (D35's class mapping); "" for none or
    one it cannot place (the arbiter then uses the class of the model bound to the app, if any)."""
    from agent.placement import load_profiles
    from arbiter.contention import load_classes

    profile = load_profiles().get(model) if model else None
    if profile is None:
        return ""
    try:
        return load_classes().class_of(model, profile.category, load_table())
    except ContentionError:
        return ""


class EmulatedJobs:
    def __init__(self, client: AgentClient, app: AppScheduler, *, speedup: float = 1.0, tick_s: float = 0.2,
                 on_result: ResultHook | None = None, cls: str = ""):
        if not isinstance(app, (SuccessiveHalvingApp, FixedJobsApp)):
            raise TypeError(f"emulated jobs run successive-halving or fixed-job apps, not {type(app).__name__}")
        if not speedup > 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        self.client, self.app, self.speedup, self.tick_s = client, app, speedup, tick_s
        self.on_result = on_result
        self.cls = cls  # its jobs' contention class (D35) when no model is bound to the app at the arbiter
        self.demand = app.demand_now()
        self.finished_at: float | None = None
        self._reported: set[str] = set()
        self.profiler = Profiler(app.placement_slowdown())  # measures the contention ratio (D35)
        self.ratios: dict[str, float] = {}  # job -> the ratio it runs at now (D35; 1 without contention)
        self.lowest_ratio = 1.0  # the lowest any job ran at (D35)
        self._tables: dict[str, ContentionTable | None] = {}
        self._told: tuple = ()  # (jobs and their GPUs, ratios) last sent to the arbiter

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

    def _table(self) -> ContentionTable | None:
        """The table the arbiter names, None while it models no contention (or names one this
        machine cannot read: the jobs then run uncontended, said once)."""
        if self.client.contention is None:
            return None
        name = self.client.contention[0]
        if name not in self._tables:
            try:
                self._tables[name] = load_table(name)
            except ContentionError as exc:
                log.warning("%s: jobs run without contention: %s", self.client.app, exc)
                self._tables[name] = None
        return self._tables[name]

    def _ratios(self, table: ContentionTable, placed) -> list[float]:
        """D35 for each placed job among its neighbours: the other apps' jobs the arbiter names on
        its machines, and the app's own other jobs (they share the network as much)."""
        cls = (self.client.contention[1] if self.client.contention else "") or self.cls
        if cls not in table.classes:
            return [1.0] * len(placed)
        mine = [Placed.on(cls, [p[1] for p in chunk]) for _, chunk in placed]
        others = [Placed(JobKind(n.cls, n.gpus, n.machines), frozenset({m}))
                  for m, near in self.client.neighbourhood.items() for n in near if n.cls in table.classes]
        return [ratio_of(table, job, others + mine[:k] + mine[k + 1:]) for k, job in enumerate(mine)]

    def step(self, dt: float) -> None:
        """Advance the jobs by ``dt`` seconds of (emulated) training on the GPUs held now."""
        held = dict(self.client.held)
        positions = [h.position for h in held.values()]
        table = self._table()
        placed: list[tuple[JobInfo, list[Position]]] = []
        if positions and dt > 0:
            placed = split_allocation(self._jobs(positions), positions)
            ratios = [1.0] * len(placed) if table is None else self._ratios(table, placed)
            for (job, chunk), ratio in zip(placed, ratios):
                t = job_time(job, chunk)
                if t > 0:
                    self.ratios[job.job_id] = ratio
                    self.lowest_ratio = min(self.lowest_ratio, ratio)
                    t /= ratio
                    if table is not None:  # what the job's profiler sees: its iteration time now
                        self.profiler.profile_job(job.job_id, job.iter_time_serial, job.slowdown)
                        self.profiler.observe(job.job_id, t / job.iters_remaining, chunk, job.demand_max)
                    self.app.advance(job.job_id, job.iters_remaining * min(1.0, dt / t))
        if self.client.contention is not None:
            self._tell(held, placed)
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

    def _tell(self, held, placed) -> None:
        """The jobs as they run (their GPUs by id) and their measured ratios, to the arbiter when
        where they run changes or a ratio moves by a percent."""
        ids: dict[Position, list[str]] = {}
        for gpu in sorted(held):
            ids.setdefault(held[gpu].position, []).append(gpu)
        jobs = []
        for job, chunk in placed:
            gpus = frozenset(ids[p].pop() for p in chunk)
            measured = self.profiler.contention_ratio(job.job_id)
            jobs.append(RunningJob(job.job_id, gpus, self.cls, 0.0 if measured is None else min(1.0, measured)))
        key = tuple((j.job, j.gpus) for j in jobs)
        ratios = [j.ratio for j in jobs]
        if not self._told or key != self._told[0] or any(abs(a - b) > 0.01 for a, b in zip(ratios, self._told[1])):
            self._told = (key, ratios)
            self.client.report_jobs(jobs)

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
