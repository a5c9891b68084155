"""Apps as the simulator runs them: the agent-side app schedulers plus simulated loss curves.

Each :class:`~simulator.workload.AppSpec` becomes one of the reference app schedulers of
``agent.appsched`` (the same objects a real agent would hold), extended only with what a simulation
must invent: every job's loss curve. Losses decide which jobs survive a successive-halving phase,
when a curve-stopping job stops (the app fits the curve it observes, D4), and what SLAQ's policy
reads (loss decrease per GPU-second).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

from agent.appsched import (
    AppScheduler,
    CurveJob,
    CurveStoppingApp,
    FixedJobsApp,
    JobInfo,
    SuccessiveHalvingApp,
)
from agent.placement import Slowdown
from agent.termination import ConvergenceRule, LossWatch
from simulator.workload import AppSpec

STOP_TOLERANCE = 0.01  # a curve-stopping job stops when its fitted loss is this close to its floor


@dataclass(frozen=True)
class LossCurve:
    """Optimus's form (seeds/004): loss(k) = 1 / (b0 k + b1) + b2."""

    b0: float
    b1: float
    b2: float

    def loss(self, k: float) -> float:
        return 1.0 / (self.b0 * k + self.b1) + self.b2

    def slope(self, k: float) -> float:
        """Loss decrease per iteration at iteration k."""
        return self.b0 / (self.b0 * k + self.b1) ** 2

    @staticmethod
    def draw(rng: random.Random, converge_at: float) -> "LossCurve":
        """A curve that comes within ``STOP_TOLERANCE`` of its floor near ``converge_at``."""
        floor = rng.uniform(0.1, 1.0)
        start = floor + rng.uniform(1.0, 3.0)
        b1 = 1.0 / (start - floor)
        b0 = max(1e-9, (1.0 / STOP_TOLERANCE - b1) / max(1.0, converge_at))
        return LossCurve(b0, b1, floor)


class SimulatedLosses:
    """The true loss curve of every job of one app, and where each job is on it."""

    def __init__(self, curves: Mapping[str, LossCurve], iter_times: Mapping[str, float]):
        self.curves = dict(curves)
        self.iter_times = dict(iter_times)
        self.done: dict[str, float] = {j: 0.0 for j in curves}

    def loss(self, job: str) -> float:
        return self.curves[job].loss(self.done[job])

    def decrease_rate(self, running: list[str]) -> float:
        """Loss shed per GPU-second by the running jobs (one GPU each, no slowdown)."""
        return sum(self.curves[j].slope(self.done[j]) / self.iter_times[j] for j in running)


class SimFixedJobsApp(FixedJobsApp):
    losses: SimulatedLosses

    def loss_decrease_rate(self) -> float:
        return self.losses.decrease_rate([j.job_id for j in self.jobs_remaining(())])


class SimSuccessiveHalvingApp(SuccessiveHalvingApp):
    losses: SimulatedLosses

    def loss_decrease_rate(self) -> float:
        return self.losses.decrease_rate([j.job_id for j in self.jobs_in_phase(self.current_phase(), ())])

    def survivors(self) -> list[str]:
        """The better half of the phase's jobs by their current loss (Hyperband's rule)."""
        jobs = sorted(self.phase_jobs(), key=lambda j: (self.losses.loss(j), j))
        return jobs[: max(1, len(jobs) // 2)]


class SimCurveStoppingApp(CurveStoppingApp):
    losses: SimulatedLosses

    def loss_decrease_rate(self) -> float:
        return self.losses.decrease_rate([j.job_id for j in self.jobs if not j.stopped])


def build_app(spec: AppSpec, slowdown: Slowdown) -> AppScheduler:
    """The app scheduler for ``spec``, with seeded loss curves for its jobs."""
    rng = random.Random(f"losses:{spec.seed}:{spec.app_id}")
    iter_times = {j.job_id: j.iter_time_s for j in spec.jobs}
    app: AppScheduler
    if spec.kind == "fixed":
        curves = {j.job_id: LossCurve.draw(rng, j.iterations) for j in spec.jobs}
        app = SimFixedJobsApp(
            [JobInfo(j.iterations, j.iter_time_s, slowdown, j.gpus, j.job_id) for j in spec.jobs],
            start_time=spec.arrival_s,
        )
    elif spec.kind == "successive_halving":
        total = sum(spec.phase_iterations)
        curves = {j.job_id: LossCurve.draw(rng, total * rng.uniform(0.5, 1.5)) for j in spec.jobs}
        app = SimSuccessiveHalvingApp(
            [j.iter_time_s for j in spec.jobs],
            list(spec.phase_iterations),
            job_demand_max=max(j.gpus for j in spec.jobs),
            slowdown=slowdown,
            start_time=spec.arrival_s,
            job_ids=[j.job_id for j in spec.jobs],
            grow_demand=True,
        )
    else:
        curves = {j.job_id: LossCurve.draw(rng, j.iterations * rng.uniform(0.3, 1.0)) for j in spec.jobs}
        app = SimCurveStoppingApp(
            [CurveJob(j.job_id, j.iter_time_s, j.iterations, j.gpus) for j in spec.jobs],
            tolerance=STOP_TOLERANCE,
            slowdown=slowdown,
            start_time=spec.arrival_s,
        )
    app.losses = SimulatedLosses(curves, iter_times)
    return app


def converge_points(app: AppScheduler, spec: AppSpec, rule: ConvergenceRule) -> dict[str, float]:
    """Where loss-based termination (D34) ends each job of a ``fixed`` or ``successive_halving``
    app: the first of its loss reports -- 20 over the most it can train (:func:`report_every`), as
    a 20-epoch job reports once per epoch -- at which ``rule`` says its simulated curve stopped
    improving. Jobs it never ends are left out. The simulator ends a job there (its app learns it
    only then, as a real app would); the curves are noise-free, so the rule sees exactly the curve.
    Curve-stopping apps are not in it: they stop their jobs themselves (D4)."""
    if isinstance(app, CurveStoppingApp):
        return {}
    out = {}
    for job in spec.jobs:
        most = sum(spec.phase_iterations) if spec.kind == "successive_halving" else job.iterations
        step = report_every(most)
        watch = LossWatch(rule)
        k = step
        while k < most:
            if watch.report(job.job_id, k, app.losses.curves[job.job_id].loss(k)):
                out[job.job_id] = k
                break
            k += step
    return out


def report_every(iterations: float) -> float:
    """Iterations between the loss reports of a job that trains at most ``iterations`` (20 reports)."""
    return max(1.0, math.ceil(iterations / 20))


def checkpoint_every(spec: AppSpec) -> float:
    """Iterations between loss reports of a curve-stopping job (20 reports over its cap)."""
    return max(1.0, math.ceil(max(j.iterations for j in spec.jobs) / 20))
