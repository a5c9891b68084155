"""The narrow API between an agent and its app's own scheduler (paper Figure 8).

Figure 8 has ``JobInfo(itersRemaining, avgTimePerIter, localitySensitivity)``, and per kind of app:
successive halving answers ``getJobsInPhase(phase, gpuAlloc)`` and ``getNumPhases()``; performance
curve stopping answers ``getJobsRemaining(gpuAlloc)``. Those are the two base classes below, plus
what Eq. 1/2 need for T_id: the app's budget B (GPU-seconds), its maximum demand, its start time.

Concrete schedulers here are the small reference ones the paper's example and the round engine's
tests need; real tuners (Hyperband, Optuna, curve fitting) live in ``hyperparam_adapters/``.
"""

from __future__ import annotations

import math
import statistics
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

from agent.placement import NO_SLOWDOWN, Position, Slowdown


@dataclass(frozen=True, slots=True)
class JobInfo:
    """Figure 8's JobInfo. ``slowdown`` is the job's locality sensitivity, S by D1 level."""

    iters_remaining: float
    iter_time_serial: float
    slowdown: Slowdown = NO_SLOWDOWN
    demand_max: int = 1
    job_id: str = ""

    def __post_init__(self) -> None:
        if not (self.iters_remaining >= 0 and math.isfinite(self.iters_remaining)):
            raise ValueError(f"job {self.job_id!r}: iters_remaining must be finite and >= 0")
        if not (self.iter_time_serial > 0 and math.isfinite(self.iter_time_serial)):
            raise ValueError(f"job {self.job_id!r}: iter_time_serial must be finite and > 0")
        if self.demand_max < 1:
            raise ValueError(f"job {self.job_id!r}: demand_max must be >= 1")


class AppScheduler(ABC):
    """What every app scheduler tells its agent, whatever its kind."""

    #: when the app arrived (T_start of Eq. 1), on the caller's clock
    start_time: float
    #: bumped whenever the app's remaining work changes, so agents can reuse rho computations
    version: int = 0
    #: bumped whenever what the app says about phases after the current one changes (D3's estimates)
    plan_version: int = 0
    #: True when the jobs an app lists (their iterations and serial times) depend on the allocation
    #: it is asked about. None of the schedulers here do; bids then skip the GPU counts whose best
    #: placement cannot beat rho_old (``agent.fairness.least_time_left``), which needs that.
    work_depends_on_allocation: ClassVar[bool] = False
    #: D30: seconds from a job's launch to its first iteration, as measured (``AppRunner`` sets it
    #: from its jobs' start-ups); 0 where starting costs nothing, as in the simulator's apps
    start_up_s: float = 0.0

    def touch(self, *, plan: bool = True) -> None:
        """The app's work changed. ``plan=False`` says only the current phase progressed, so
        agents may keep what they computed for later phases (``agent.fairness.TimeLeftCache``)."""
        self.version += 1
        if plan:
            self.plan_version += 1

    @abstractmethod
    def budget(self) -> float:
        """B: the app's total work in GPU-seconds at S = 1 (Eq. 2's T_cluster numerator)."""

    def job_starts(self) -> int:
        """D30: GPU-starts the app pays even alone on the whole cluster: one per GPU of each job it
        plans, and again per phase where its tuner restarts the survivors. 0 where unknown."""
        return 0

    def total_work(self) -> float:
        """B plus the start-ups it pays even alone (D30): the numerator of T_cluster (Eq. 2)."""
        budget = self.budget()
        return budget + self.start_up_s * self.job_starts() if self.start_up_s else budget

    @abstractmethod
    def demand_max(self) -> int:
        """app_demand_max: the most GPUs the app can use at once."""

    @abstractmethod
    def demand_now(self) -> int:
        """How many GPUs the app could use right now (0 when it is done)."""

    def finished(self) -> bool:
        return self.demand_now() == 0

    def placement_slowdown(self) -> Slowdown:
        """The app's sensitivity to placement, S by D1 level (what Gandiva's policy asks for)."""
        return getattr(self, "slowdown", NO_SLOWDOWN)

    def loss_decrease_rate(self) -> float:
        """Expected loss decrease per GPU-second from here on (what SLAQ's policy asks for);
        0 when the app does not track its loss."""
        return 0.0


class SuccessiveHalvingScheduler(AppScheduler):
    """Figure 8, successive halving: phases of shrinking job sets (D3)."""

    @abstractmethod
    def num_phases(self) -> int: ...

    @abstractmethod
    def current_phase(self) -> int:
        """1-based index of the phase that runs now; ``num_phases() + 1`` when done."""

    @abstractmethod
    def jobs_in_phase(self, phase: int, gpu_alloc: Sequence[Position]) -> list[JobInfo]:
        """Jobs of ``phase`` with what remains of them; future phases use estimates (D3)."""


class CurveStoppingScheduler(AppScheduler):
    """Figure 8, performance-curve stopping: the running jobs and their predicted ends (D4)."""

    @abstractmethod
    def jobs_remaining(self, gpu_alloc: Sequence[Position]) -> list[JobInfo]: ...


@dataclass
class FixedJobsApp(CurveStoppingScheduler):
    """Jobs of known length that all run to completion (a trace's jobs; D2 for each job, D4 with
    exact ends). ``jobs`` give each job's full length in ``iters_remaining``."""

    jobs: Sequence[JobInfo]
    start_time: float = 0.0

    def __post_init__(self) -> None:
        if not self.jobs:
            raise ValueError("an app needs at least one job")
        ids = [j.job_id for j in self.jobs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"job ids must be unique, got {ids}")
        self._left = {j.job_id: j.iters_remaining for j in self.jobs}
        self._work = sum(j.iters_remaining * j.iter_time_serial for j in self.jobs)
        self._cache: list[JobInfo] | None = None

    def jobs_remaining(self, gpu_alloc: Sequence[Position]) -> list[JobInfo]:
        if self._cache is None:
            left = self._left  # the constructor, not dataclasses.replace: half the cost, run after every advance
            self._cache = [
                JobInfo(iters_remaining=left[j.job_id], iter_time_serial=j.iter_time_serial, slowdown=j.slowdown,
                        demand_max=j.demand_max, job_id=j.job_id)
                for j in self.jobs if left[j.job_id] > 0
            ]
        return self._cache

    def budget(self) -> float:
        return self._work

    def job_starts(self) -> int:
        """D30: each job starts once."""
        return sum(j.demand_max for j in self.jobs)

    def demand_max(self) -> int:
        return sum(j.demand_max for j in self.jobs)

    def demand_now(self) -> int:
        return sum(j.demand_max for j in self.jobs if self._left[j.job_id] > 0)

    def placement_slowdown(self) -> Slowdown:
        return self.jobs[0].slowdown

    def advance(self, job_id: str, iterations: float) -> None:
        """Record progress (the simulator and the launcher call this)."""
        self._left[job_id] = max(0.0, self._left[job_id] - iterations)
        self._cache = None
        self.touch()


class SingleJobApp(FixedJobsApp):
    """One training job of known length: Eq. 1 (D2)."""

    def __init__(self, job: JobInfo, start_time: float = 0.0):
        super().__init__([job], start_time)

    @property
    def job(self) -> JobInfo:
        return self.jobs_remaining(())[0] if self.demand_now() else replace(self.jobs[0], iters_remaining=0.0)


@dataclass
class SuccessiveHalvingApp(SuccessiveHalvingScheduler):
    """A successive-halving app as in paper 4.3.2/4.3.3.

    ``iter_times`` are the serial iteration times of the first phase's jobs; phase i runs
    ``len(iter_times) / 2**(i-1)`` jobs for ``iterations[i-1]`` iterations each. The jobs that
    survive a phase are chosen by :meth:`end_phase`; before that, future phases are estimated with
    the median iteration time of the current phase's jobs (D3). Each job of phase i may use
    ``job_demand_max`` GPUs.
    """

    iter_times: Sequence[float]
    iterations: Sequence[float]
    job_demand_max: int = 1
    slowdown: Slowdown = NO_SLOWDOWN
    start_time: float = 0.0
    app_demand: int | None = None
    budget_gpu_seconds: float | None = None
    job_ids: Sequence[str] | None = None  # default job0, job1, ...
    grow_demand: bool = False  # paper 4.3.2: each phase doubles the surviving jobs' demand
    phase: int = 1
    _running: dict[str, float] = field(default_factory=dict)  # job id -> iterations left
    _times: dict[str, float] = field(default_factory=dict)  # job id -> serial iteration time
    _phase_cache: dict[int, list[JobInfo]] = field(default_factory=dict, repr=False, compare=False)
    _planned: float | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.iter_times)
        if n < 1:
            raise ValueError("a successive-halving app needs at least one job")
        if len(self.iterations) < 1:
            raise ValueError("a successive-halving app needs at least one phase")
        if n < 2 ** (len(self.iterations) - 1):
            raise ValueError(f"{n} jobs cannot be halved over {len(self.iterations)} phases")
        if any(not (t > 0 and math.isfinite(t)) for t in self.iter_times):
            raise ValueError("iteration times must be finite and > 0")
        if any(not (i > 0 and math.isfinite(i)) for i in self.iterations):
            raise ValueError("iterations per phase must be finite and > 0")
        ids = list(self.job_ids) if self.job_ids is not None else [f"job{k}" for k in range(n)]
        if len(ids) != n or len(set(ids)) != n:
            raise ValueError("job_ids must be unique, one per iteration time")
        if not self._running:
            self._times = {j: float(t) for j, t in zip(ids, self.iter_times)}
            self._running = {j: float(self.iterations[0]) for j in self._times}

    def touch(self, *, plan: bool = True) -> None:
        """Also forget the cached phase lists when more than the current phase's progress changed
        (e.g. a profiler updated the slowdown the JobInfo carry)."""
        super().touch(plan=plan)
        if plan:
            self._phase_cache.clear()

    def num_phases(self) -> int:
        return len(self.iterations)

    def current_phase(self) -> int:
        return self.phase

    def job_demand(self, phase: int) -> int:
        """A job's GPU demand in ``phase``: ``job_demand_max``, doubled per phase when
        ``grow_demand`` (paper 4.3.2: n jobs of 1 GPU, then n/2 of 2, ..., 1 job of n)."""
        return self.job_demand_max * (2 ** (phase - 1) if self.grow_demand else 1)

    def jobs_in_phase(self, phase: int, gpu_alloc: Sequence[Position]) -> list[JobInfo]:
        """This app's jobs do not depend on the allocation, so each phase's list is built once
        per change of progress (bids ask for it once per candidate shape and phase)."""
        if phase < self.phase or phase > self.num_phases():
            return []
        cached = self._phase_cache.get(phase)
        if cached is not None:
            return cached
        if phase == self.phase:
            jobs = [
                JobInfo(left, self._times[j], self.slowdown, self.job_demand(phase), j)
                for j, left in self._running.items()
                if left > 0
            ]
        else:
            median = statistics.median(self._times[j] for j in self._running)
            count = max(1, len(self.iter_times) // 2 ** (phase - 1))
            jobs = [
                JobInfo(float(self.iterations[phase - 1]), median, self.slowdown, self.job_demand(phase),
                        f"p{phase}-{k}")
                for k in range(count)
            ]
        self._phase_cache[phase] = jobs
        return jobs

    def budget(self) -> float:
        """B: the given budget, else the planned work at median speed (paper 4.3.3 uses 10,000)."""
        if self.budget_gpu_seconds is not None:
            return self.budget_gpu_seconds
        if self._planned is None:
            med = statistics.median(self.iter_times)
            self._planned = sum(max(1, len(self.iter_times) // 2**i) * iters * med for i, iters in enumerate(self.iterations))
        return self._planned

    def job_starts(self) -> int:
        """D30: each phase starts its jobs again."""
        return sum(max(1, len(self.iter_times) // 2**i) * self.job_demand(i + 1) for i in range(self.num_phases()))

    def demand_max(self) -> int:
        if self.app_demand is not None:
            return self.app_demand
        return max(
            max(1, len(self.iter_times) // 2**i) * self.job_demand(i + 1) for i in range(self.num_phases())
        )

    def demand_now(self) -> int:
        if self.phase > self.num_phases():
            return 0
        live = sum(1 for left in self._running.values() if left > 0)
        return live * self.job_demand(self.phase)

    def phase_jobs(self) -> list[str]:
        """Ids of the current phase's jobs, finished or not."""
        return sorted(self._running)

    def phase_done(self) -> bool:
        return self.phase <= self.num_phases() and all(left <= 0 for left in self._running.values())

    def advance(self, job_id: str, iterations: float) -> None:
        self._running[job_id] = max(0.0, self._running[job_id] - iterations)
        self._phase_cache.pop(self.phase, None)
        self.touch(plan=False)  # later phases are estimated from the phase's job set, not its progress

    def end_phase(self, survivors: Sequence[str]) -> None:
        """Close the current phase, keeping ``survivors`` (the better half) for the next one."""
        if self.phase > self.num_phases():
            raise ValueError("the app has already finished")
        unknown = [j for j in survivors if j not in self._running]
        if unknown:
            raise ValueError(f"survivors {unknown} are not jobs of phase {self.phase}")
        self._phase_cache.clear()
        self.touch()
        self.phase += 1
        if self.phase > self.num_phases():
            self._running = {}
            return
        self._running = {j: float(self.iterations[self.phase - 1]) for j in survivors}


@dataclass
class CurveJob:
    """One job of a curve-stopping app: its speed, its cap, and the losses it reported."""

    job_id: str
    iter_time_serial: float
    max_iterations: float
    demand_max: int = 1
    done: float = 0.0
    stopped: bool = False
    iterations_seen: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


@dataclass
class CurveStoppingApp(CurveStoppingScheduler):
    """A performance-curve-stopping app (paper 4.3.2, D4).

    Each running job's end is predicted from its loss curve (``agent.curves``); rho uses the
    pessimistic end. A job stops when it reaches its predicted stop or its iteration cap.
    """

    jobs: Sequence[CurveJob]
    tolerance: float = 1e-3
    slowdown: Slowdown = NO_SLOWDOWN
    start_time: float = 0.0

    def __post_init__(self) -> None:
        if not self.jobs:
            raise ValueError("a curve-stopping app needs at least one job")
        ids = [j.job_id for j in self.jobs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"job ids must be unique, got {ids}")
        self._by_id = {j.job_id: j for j in self.jobs}
        self._ends: dict[tuple[str, int], float] = {}

    def _end(self, job: CurveJob) -> float:
        """The job's pessimistic predicted stop, refitted only when it reports a new loss."""
        from agent.curves import predict_stop

        key = (job.job_id, len(job.losses))
        if key not in self._ends:
            self._ends[key] = predict_stop(
                job.iterations_seen, job.losses, tolerance=self.tolerance, max_iterations=job.max_iterations
            ).pessimistic
        return self._ends[key]

    def job(self, job_id: str) -> CurveJob:
        return self._by_id[job_id]

    def advance(self, job_id: str, iterations: float) -> None:
        """Record progress between loss reports (the simulator and the launcher call this)."""
        job = self._by_id[job_id]
        job.done = min(job.max_iterations, job.done + iterations)
        self.touch()

    def predicted_end(self, job_id: str) -> float:
        """The iteration at which the job is predicted to stop (pessimistic end, D4)."""
        return self._end(self._by_id[job_id])

    def jobs_remaining(self, gpu_alloc: Sequence[Position]) -> list[JobInfo]:
        out = []
        for job in self.jobs:
            if job.stopped:
                continue
            left = max(0.0, self._end(job) - job.done)
            if left > 0:
                out.append(JobInfo(left, job.iter_time_serial, self.slowdown, job.demand_max, job.job_id))
        return out

    def budget(self) -> float:
        return sum(
            (job.done if job.stopped else max(job.done, self._end(job))) * job.iter_time_serial for job in self.jobs
        )

    def demand_max(self) -> int:
        return sum(j.demand_max for j in self.jobs)

    def demand_now(self) -> int:
        return sum(j.demand_max for j in self.jobs if not j.stopped)

    def report(self, job_id: str, iteration: float, loss: float) -> None:
        """A job's progress and loss (from the profiler); stops it when its curve says so."""
        job = self._by_id[job_id]
        self.touch()
        job.done = max(job.done, iteration)
        job.iterations_seen.append(iteration)
        job.losses.append(loss)
        if job.done >= min(job.max_iterations, self._end(job)):
            job.stopped = True
