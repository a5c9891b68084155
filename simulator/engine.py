"""The event-driven simulator: a virtual clock around the real round engine and agents.

Events are app arrivals, rounds (lease expiries, releases and arrivals, coalesced by the round
engine, D10), job completions, successive-halving phase ends and curve-stopping checkpoints. Between
events every job runs at Eq. 1's speed on the GPUs it actually holds: min(|G|, demand_max) /
(iter_time_serial * S(G)) iterations per second, S from the D1 level of its own GPUs. A job whose
GPU set changes after it has started pays the restart delay (D11); one that keeps its GPUs pays
nothing. With a contention model (D35, ``simulator.contention``) that speed is multiplied by the
job's contention ratio, from the jobs that share its machines. Reports, bids and grants all come from the code the service runs: ``agent.agent.Agent``
and ``arbiter.rounds.RoundEngine`` with a policy from ``arbiter.policies``.

Inside an app, its own scheduler decides which job runs on which held GPU (D3's split,
``agent.fairness.split_allocation``); jobs keep the GPUs they have wherever the split allows, and
GPUs the app can no longer use are released at once (a resource-available event).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from agent.agent import Agent
from agent.appsched import AppScheduler, CurveStoppingApp, JobInfo, SuccessiveHalvingApp
from agent.fairness import ideal_time, split_counts
from agent.placement import ModelProfile, profiles_with, slowdown_of
from agent.termination import ConvergenceRule
from arbiter.admission import AdmissionPolicy
from arbiter.auction import keep_best_locality
from arbiter.cluster import Cluster
from arbiter.policies import Policy
from arbiter.rounds import DEFAULT_COALESCE_S, RoundEngine, RoundResult
from simulator.apps import SimCurveStoppingApp, SimSuccessiveHalvingApp, build_app, checkpoint_every, converge_points
from simulator.contention import ContentionAccount, ContentionModel
from simulator.workload import AppSpec, Workload

DEFAULT_RESTART_S = 35.0  # D11, paper 6.2.3
#: Why a job restarted, by what happened to its app's GPUs since its jobs were last placed (issue
#: 13, item 5): the app gained GPUs and lost none, lost some and gained none, kept exactly the same
#: ones (its jobs or their shares changed), or lost some and gained others.
RESTART_CAUSES = ("grew", "shrank", "resplit", "moved")
#: When an app whose GPUs grew re-splits its running jobs (``--resplit``; D11, D23): at once when
#: that ends its phase sooner, or after the idle GPUs have cost as much as the restarts would.
RESPLITS = ("now", "rent-or-buy")
#: A restart by the time since the same job's previous restart (upper edges in seconds; "first" when
#: it had none): the restart delay, two minutes, a default lease, longer.
RESTART_GAPS = ((35.0, "<=35s"), (120.0, "<=2min"), (600.0, "<=10min"), (math.inf, ">10min"))
_EPS = 1e-6


@dataclass
class JobRun:
    job_id: str
    gpus: tuple[str, ...] = ()
    rate: float = 0.0  # iterations per second while running
    slowdown: float = 1.0
    demand: int = 1  # the job's GPU demand in its current phase
    ready_at: float = 0.0  # end of a restart delay
    started: bool = False
    restarts: int = 0
    restarted_at: float | None = None
    base_rate: float = 0.0  # rate before network contention (D35)
    ratio: float = 1.0  # contention ratio: rate = base_rate x ratio (D35; 1 without a contention model)


@dataclass
class AppRun:
    spec: AppSpec
    app: AppScheduler
    agent: Agent
    jobs: dict[str, JobRun] = field(default_factory=dict)
    finished_at: float | None = None
    n_avg_at_finish: float = 1.0
    gpu_seconds: float = 0.0
    busy_gpu_seconds: float = 0.0  # GPU-seconds on which a job ran
    scored: float = 0.0  # sum of busy GPU-seconds / S
    restarts: int = 0
    restarts_by: dict[str, int] = field(default_factory=dict)  # by cause, RESTART_CAUSES
    restart_gaps: dict[str, int] = field(default_factory=dict)  # by time since the job's last, RESTART_GAPS
    placed_on: frozenset[str] = frozenset()  # what it held when its jobs were last placed
    renting: tuple[float, float, int] | None = None  # rent-or-buy (D23): (since, idle GPU-s paid, idle GPUs)
    resplit_at: float | None = None  # when a deferred growth re-split is due (D23)
    deferred: int = 0  # growth re-splits deferred (D23)
    next_checkpoint: dict[str, float] = field(default_factory=dict)
    auction_wins: int = 0  # rounds in which the auction's PF gave it a row (D8)
    kept_sum: float = 0.0  # sum of its c_i over those rounds: 1 - c_i was its hidden payment
    #: D42: of those rounds, the ones whose lottery bounds decided (``payments="bounds"``), and the
    #: sums of their c_i's lower and upper bounds (the exact c_i is then not known)
    bounded_wins: int = 0
    kept_bounds: tuple[float, float] = (0.0, 0.0)
    admitted_at: float | None = None  # when the admission policy let it in (D33)
    first_gpu_s: float | None = None  # arrival to its first GPU (Blox's responsiveness)
    converge_at: dict[str, float] = field(default_factory=dict)  # job -> iteration its loss rule ends it (D34)
    converged: set[str] = field(default_factory=set)  # jobs loss-based termination ended (D34)
    contention: ContentionAccount | None = None  # what contention did to it, with a contention model (D35)


@dataclass
class SimulationResult:
    policy: str
    cluster: str
    workload: str
    apps: list[AppRun]
    rounds: int
    auctions: int
    makespan: float
    wall_seconds: float
    cluster_size: int
    round_results: list[RoundResult] = field(default_factory=list)
    granted_by: dict[str, int] = field(default_factory=dict)  # GPUs per source, in rounds with bidders
    noncanonical: int = 0  # auctions whose allocation was the MILP's own, not the canonical one (D16)
    zeroed: int = 0  # auctions in which a PF winner had c_i = 0 (D8, D25)
    zeroed_first: int = 0  # ... the first-ranked contender, holding nothing (the starving kind, D25)
    reclaimed: int = 0  # leases ended early for apps that held nothing (D27)
    bounded: int = 0  # PF winners whose lottery bounds on c_i decided (D39, D42; 0 with exact payments)


class Simulation:
    def __init__(
        self,
        cluster: Cluster,
        workload: Workload,
        policy: Policy,
        *,
        lease_s: float = 600.0,
        restart_s: float = DEFAULT_RESTART_S,
        restart_costs: Mapping[str, float] | None = None,
        coalesce_s: float = DEFAULT_COALESCE_S,
        expiry_window_s: float | None = None,
        seed: int = 0,
        profiles: dict[str, ModelProfile] | None = None,
        agent_factory: Callable[[AppSpec, AppScheduler], Agent] | None = None,
        keep_rounds: bool = False,
        resplit: str = "now",
        rank: str = "reported",
        reclaim: bool = True,
        admission: AdmissionPolicy | None = None,
        convergence: ConvergenceRule | None = None,
        contention: ContentionModel | None = None,
    ):
        if restart_s < 0:
            raise ValueError("restart delay must be >= 0")
        if resplit not in RESPLITS:
            raise ValueError(f"unknown resplit {resplit!r}; choose from {', '.join(RESPLITS)}")
        self.resplit = resplit
        self.cluster = cluster
        self.workload = workload
        self.policy = policy
        self.restart_s = restart_s
        #: D32: per model, the restart delay its jobs pay instead of ``restart_s`` (None: ``restart_s`` for all)
        self.restart_costs = _checked_restart_costs(restart_costs, workload)
        self.engine = RoundEngine(
            cluster, policy, lease_s=lease_s, coalesce_s=coalesce_s, expiry_window_s=expiry_window_s, seed=seed,
            rank=rank, reclaim=reclaim, admission=admission,
        )
        self.convergence = convergence  # D34: every app's jobs end when their losses stop improving by it
        self.profiles = profiles or profiles_with(*workload.profile_tables)
        self.agent_factory = agent_factory or (lambda spec, app: Agent(app, name=spec.app_id))
        self.keep_rounds = keep_rounds
        unknown = sorted({a.model for a in workload.apps} - set(self.profiles))
        if unknown:
            raise ValueError(f"workload {workload.name!r} names models with no profile: {unknown}")
        self.runs: dict[str, AppRun] = {}
        self.now = 0.0
        #: D35: jobs slowed by the jobs that share their machines (None: every job runs as if alone)
        self.contention = contention.tracker(self) if contention is not None else None
        #: called with each round's result as it closes, before its apps re-place their jobs (what a
        #: recording of the run reads: ``simulator.recording``); it must not change the simulation
        self.on_round: Callable[[RoundResult], None] | None = None

    def restart_of(self, spec: AppSpec) -> float:
        """The restart delay the app's jobs pay when they move (D11): ``restart_s`` for every model,
        or, with ``restart_costs``, its model's measured cost (D32)."""
        return self.restart_s if self.restart_costs is None else self.restart_costs[spec.model]

    # -- the app's side ----------------------------------------------------------------------

    def _arrive(self, spec: AppSpec) -> None:
        app = build_app(spec, self.profiles[spec.model].slowdown)
        agent = self.agent_factory(spec, app)
        agent.restart_s = self.restart_of(spec)  # what its jobs pay to move here (D11); its bids carry it (D17)
        if self.contention is not None and self.policy.contention_aware and agent.contention is None:
            agent.contention = self.contention.pricing(spec.app_id)  # D36: its model's class prices its rows
        run = AppRun(spec, app, agent)
        if isinstance(app, SimCurveStoppingApp):
            step = checkpoint_every(spec)
            run.next_checkpoint = {j.job_id: step for j in spec.jobs}
        if self.convergence is not None:
            run.converge_at = converge_points(app, spec, self.convergence)
        self.runs[spec.app_id] = run
        # the arbiter knows each app's model, and so its placement slowdowns (D21's measured rank)
        self.engine.add_app(spec.app_id, self.now, slowdown=self.profiles[spec.model].slowdown)

    @staticmethod
    def _current_jobs(app: AppScheduler) -> list[JobInfo]:
        if isinstance(app, SuccessiveHalvingApp):
            return app.jobs_in_phase(app.current_phase(), ())
        return list(app.jobs_remaining(()))

    def _targets(self, run: AppRun, jobs: list[JobInfo], n_gpus: int) -> dict[str, int]:
        """How many GPUs each job should run on (D3): the app's even split when there are enough
        GPUs; otherwise one each, running jobs first (an app does not preempt its own jobs), then
        the longest waiting ones."""
        if n_gpus >= len(jobs):
            return dict(zip((j.job_id for j in jobs), split_counts(jobs, n_gpus)))
        running = [j for j in jobs if run.jobs.get(j.job_id, JobRun(j.job_id)).gpus]
        waiting = sorted((j for j in jobs if j not in running), key=lambda j: -j.iters_remaining * j.iter_time_serial)
        return {j.job_id: 1 for j in (running + waiting)[:n_gpus]}

    def _keep_targets(self, run: AppRun, jobs: list[JobInfo], held: set[str]) -> dict[str, int]:
        """The split that moves nobody: running jobs whose GPUs are all still held keep them, and
        the other GPUs are split (D3) among the jobs that have none."""
        keep: dict[str, int] = {}
        for job in jobs:
            mine = run.jobs[job.job_id].gpus if job.job_id in run.jobs else ()
            if mine and set(mine) <= held:
                keep[job.job_id] = len(mine)
        rest = [j for j in jobs if j.job_id not in keep]
        spare = len(held) - sum(keep.values())
        if rest and spare > 0:
            keep.update(self._targets(run, rest, spare))
        return keep

    def _phase_end(self, run: AppRun, jobs: list[JobInfo], targets: dict[str, int]) -> float:
        """When the app's current jobs would all be done under ``targets`` (D3's phase time), with
        the restart each moved job pays (D11) and its slowdown guessed one machine wide."""
        worst = 0.0
        for job in jobs:
            n = targets.get(job.job_id, 0)
            if n <= 0:
                return math.inf
            jr = run.jobs.get(job.job_id)
            same = jr is not None and len(jr.gpus) == n
            slowdown = jr.slowdown if same else (job.slowdown[1] if n > 1 else 1.0)
            delay = 0.0 if same or jr is None or not jr.started else self.restart_of(run.spec)
            worst = max(worst, delay + job.iters_remaining * job.iter_time_serial * slowdown / min(n, job.demand_max))
        return worst

    def _rent(self, run: AppRun, keep: dict[str, int], targets: dict[str, int], n_held: int) -> bool:
        """Rent or buy (D23): whether to keep the running jobs where they are for now. The re-split
        costs each running job it moves a restart on its new GPUs (restart delay x GPUs); keeping
        them leaves the GPUs the jobs do not use idle. The deterministic ski-rental rule keeps them
        until the idle GPU-seconds paid since the growth equal that cost, then re-splits, so the
        waste is at most twice what knowing the future would allow; a change in the meantime (more
        GPUs, a job done) is taken by the one re-split that follows."""
        moved = sum(n for job_id, n in targets.items()
                    if job_id in run.jobs and run.jobs[job_id].gpus and keep.get(job_id) != n)
        idle = n_held - sum(keep.values())
        if moved == 0 or idle <= 0:
            return False
        cost = self.restart_of(run.spec) * moved
        since, paid, was_idle = run.renting or (self.now, 0.0, idle)
        paid += was_idle * (self.now - since)
        due = self.now + (cost - paid) / idle
        if paid >= cost * (1 - 1e-9) or due <= self.now:  # paid, or too little left for the clock to move
            return False
        run.renting = (self.now, paid, idle)
        run.resplit_at = due
        run.deferred += 1
        return True

    def _place(self, name: str) -> None:
        """Give the app's GPUs to its jobs (D3). A job that may keep its GPUs keeps them; jobs
        whose share changed get the best-placed GPUs left, biggest shares first. When the app's GPUs
        grew, its jobs are re-split only if that finishes them sooner than leaving the running
        ones where they are, restarts included (D11): an even split that moves every job for one
        more GPU each costs more than it gains near the end of a phase. With ``resplit="rent-or-buy"``
        a growth re-split that does end the phase sooner still waits until the idle GPUs have cost
        what its restarts would (D23, ``_rent``)."""
        run = self.runs[name]
        held = set(self.engine.held(name))
        if held and run.first_gpu_s is None:
            run.first_gpu_s = self.now - run.spec.arrival_s
        before = run.placed_on
        cause = ("resplit" if held == before else "grew" if held > before else "shrank" if held < before
                 else "moved")
        jobs = self._current_jobs(run.app)
        targets = self._targets(run, jobs, len(held))
        rented = False
        if self.restart_of(run.spec) and len(held) >= len(jobs):
            keep = self._keep_targets(run, jobs, held)
            if keep != targets and self._phase_end(run, jobs, keep) <= self._phase_end(run, jobs, targets):
                targets = keep
            elif keep != targets and self.resplit == "rent-or-buy" and cause in ("grew", "resplit"):
                rented = self._rent(run, keep, targets, len(held))
                if rented:
                    targets = keep
        if not rented:
            run.renting = run.resplit_at = None
        assigned: dict[str, tuple[str, ...]] = {}
        for job in jobs:
            mine = run.jobs[job.job_id].gpus if job.job_id in run.jobs else ()
            if mine and set(mine) <= held and len(mine) == targets.get(job.job_id, 0):
                assigned[job.job_id] = mine
        pool = sorted(held - {g for gpus in assigned.values() for g in gpus})
        for job in sorted(jobs, key=lambda j: (-targets.get(j.job_id, 0), j.job_id)):
            want = targets.get(job.job_id, 0)
            if job.job_id in assigned or not want:
                continue
            chosen = keep_best_locality(pool, want, self.cluster.position)
            assigned[job.job_id] = tuple(sorted(chosen))
            pool = [g for g in pool if g not in chosen]
        live = {j.job_id: j for j in jobs}
        # A halving job that finished this phase's work waits for the phase to end and may go on
        # as a survivor: it keeps its record (started, restarts) but no GPUs.
        waiting = set(run.app.phase_jobs()) - set(live) if isinstance(run.app, SuccessiveHalvingApp) else set()
        for job_id in list(run.jobs):
            if job_id in waiting:
                run.jobs[job_id].gpus, run.jobs[job_id].rate = (), 0.0
            elif job_id not in live:
                del run.jobs[job_id]
        for job_id, job in live.items():
            jr = run.jobs.setdefault(job_id, JobRun(job_id))
            gpus = assigned.get(job_id, ())
            if gpus != jr.gpus:
                if gpus and jr.started:
                    jr.ready_at = self.now + self.restart_of(run.spec)
                    jr.restarts += 1
                    run.restarts += 1
                    run.restarts_by[cause] = run.restarts_by.get(cause, 0) + 1
                    gap = "first" if jr.restarted_at is None else next(
                        label for edge, label in RESTART_GAPS if self.now - jr.restarted_at <= edge)
                    run.restart_gaps[gap] = run.restart_gaps.get(gap, 0) + 1
                    jr.restarted_at = self.now
                elif gpus:
                    jr.ready_at = self.now
                jr.gpus = gpus
            if gpus:
                jr.started = True
                jr.slowdown = slowdown_of(job.slowdown, [self.cluster.position(g) for g in gpus])
                jr.demand = job.demand_max
                jr.base_rate = min(len(gpus), job.demand_max) / (job.iter_time_serial * jr.slowdown)
                jr.rate = jr.base_rate * jr.ratio
            else:
                jr.rate = 0.0
        demand = run.app.demand_now()
        if pool and len(held) > demand:
            self.engine.release(name, pool, self.now)
        run.placed_on = frozenset(self.engine.held(name))
        self.engine.set_demand(name, demand, self.now)
        if self.contention is not None:
            self.contention.moved(name)

    def _progress(self, until: float) -> None:
        """Run every job from ``self.now`` to ``until`` (no event falls in between)."""
        dt = until - self.now
        if dt <= 0:
            return
        for name in sorted(self.runs):
            run = self.runs[name]
            if run.finished_at is not None:
                continue
            run.gpu_seconds += len(self.engine.held(name)) * dt
            for jr in run.jobs.values():
                if not jr.gpus:
                    continue
                run.busy_gpu_seconds += len(jr.gpus) * dt
                run.scored += len(jr.gpus) * dt / jr.slowdown
                work = max(0.0, until - max(self.now, jr.ready_at)) * jr.rate
                if work > 0:
                    self._advance_job(run, jr.job_id, work)
        self.now = until

    @staticmethod
    def _advance_job(run: AppRun, job_id: str, iterations: float) -> None:
        app = run.app
        run.app.losses.done[job_id] += iterations
        app.advance(job_id, iterations)

    def _next_event(self, run: AppRun) -> float:
        """When one of the app's jobs next finishes its work or reaches a loss checkpoint."""
        app = run.app
        lefts = self._lefts(app)
        best = math.inf
        for jr in run.jobs.values():
            if not jr.gpus or jr.rate <= 0:
                continue
            if isinstance(app, CurveStoppingApp):
                left = self._report_at(run, app, jr.job_id) - app.job(jr.job_id).done
            else:
                left = self._to_converge(run, jr.job_id, lefts.get(jr.job_id, 0.0))
            best = min(best, max(self.now, jr.ready_at) + max(0.0, left) / jr.rate)
        return best

    @staticmethod
    def _report_at(run: AppRun, app: CurveStoppingApp, job_id: str) -> float:
        """The next iteration at which the job reports a loss: its next checkpoint, or earlier
        where the app's current prediction says it stops (so the app can stop it there, D4)."""
        job = app.job(job_id)
        return min(run.next_checkpoint[job_id], job.max_iterations, max(job.done, app.predicted_end(job_id)))

    @staticmethod
    def _to_converge(run: AppRun, job_id: str, left: float) -> float:
        """Iterations until the job's next event: the end of its work, or sooner the loss report at
        which loss-based termination ends it (D34)."""
        stop = run.converge_at.get(job_id)
        return left if stop is None else min(left, max(0.0, stop - run.app.losses.done[job_id]))

    def _lefts(self, app: AppScheduler) -> dict[str, float]:
        return {j.job_id: j.iters_remaining for j in self._current_jobs(app)}

    def _job_events(self, run: AppRun) -> bool:
        """Handle what happened to the app's jobs at ``self.now``; True if its job set changed."""
        app = run.app
        changed = False
        if isinstance(app, CurveStoppingApp):
            step = checkpoint_every(run.spec)
            for job in app.jobs:
                if job.stopped or job.job_id not in run.jobs:
                    continue
                target = self._report_at(run, app, job.job_id)
                if self._due(target - job.done, run.jobs[job.job_id].rate):
                    job.done = max(job.done, target)
                    if job.done >= run.next_checkpoint[job.job_id] - _EPS:
                        run.next_checkpoint[job.job_id] += step
                    app.report(job.job_id, job.done, app.losses.loss(job.job_id))
                    changed |= job.stopped
            return changed
        lefts = self._lefts(app)
        for jr in list(run.jobs.values()):
            left = lefts.get(jr.job_id, 0.0)
            stop = self._to_converge(run, jr.job_id, left)
            if jr.gpus and stop < left and self._due(stop, jr.rate):
                self._advance_job(run, jr.job_id, stop)
                run.app.advance(jr.job_id, left - stop)  # D34: its loss stopped improving; the rest is not run
                run.converged.add(jr.job_id)
                changed = True
                continue
            if jr.gpus and self._due(left, jr.rate):
                self._advance_job(run, jr.job_id, left)
                changed = True
        if isinstance(app, SimSuccessiveHalvingApp) and app.phase_done():
            app.end_phase(app.survivors())
            changed = True
        return changed

    def _due(self, left: float, rate: float) -> bool:
        """Whether ``left`` iterations at ``rate`` are done now: fewer than ``_EPS``, or so few that
        their end rounds to the current time (a tiny iteration time late in a long run): the next
        event would then be now again and the clock would never move."""
        return left <= _EPS or (rate > 0 and self.now + left / rate <= self.now)

    def _finish(self, name: str) -> None:
        run = self.runs[name]
        run.finished_at = self.now
        run.n_avg_at_finish = self.engine.n_avg(name, self.now)
        run.admitted_at = self.engine.admitted_at.get(name)
        run.jobs.clear()
        self.engine.remove_app(name, self.now)
        if self.contention is not None:
            self.contention.moved(name)

    # -- the loop --------------------------------------------------------------------------

    def run(self, progress: Callable[[float], None] | None = None) -> SimulationResult:
        wall = time.perf_counter()
        arrivals = sorted(self.workload.apps, key=lambda a: (a.arrival_s, a.app_id))
        nxt = 0
        rounds = auctions = noncanonical = zeroed = zeroed_first = reclaimed = bounded = 0
        granted_by: dict[str, int] = {}
        kept: list[RoundResult] = []
        while True:
            candidates = []
            if nxt < len(arrivals):
                candidates.append(arrivals[nxt].arrival_s)
            wake = self.engine.next_wakeup()
            if wake is not None:
                candidates.append(max(wake, self.now))
            for run in self.runs.values():
                if run.finished_at is None:
                    candidates.append(self._next_event(run))
                    if run.resplit_at is not None:
                        candidates.append(max(run.resplit_at, self.now))
            if self.contention is not None and self.contention.next_wakeup() is not None:
                candidates.append(max(self.contention.next_wakeup(), self.now))
            t = min(candidates, default=math.inf)
            if t == math.inf or (nxt == len(arrivals) and not self.engine.apps):
                break
            self._progress(t)
            touched: set[str] = set()
            while nxt < len(arrivals) and arrivals[nxt].arrival_s <= self.now:
                self._arrive(arrivals[nxt])
                touched.add(arrivals[nxt].app_id)
                nxt += 1
            for name in sorted(self.runs):
                run = self.runs[name]
                if run.finished_at is None and self._job_events(run):
                    touched.add(name)
                if run.finished_at is None and run.resplit_at is not None and run.resplit_at <= self.now:
                    touched.add(name)
            for name in sorted(touched):
                run = self.runs[name]
                if run.app.finished():
                    self._finish(name)
                else:
                    self._place(name)
            if self.engine.round_due(self.now):
                result = self.engine.run_round(self.now, {a: self.runs[a].agent for a in self.engine.apps})
                if self.on_round is not None:
                    self.on_round(result)
                rounds += 1
                outcome = result.decision.auction if result.decision is not None else None
                auctions += outcome is not None
                noncanonical += outcome is not None and not outcome.canonical
                reclaimed += len(result.reclaimed)
                if outcome is not None:
                    zeros = [a for a in outcome.pf if outcome.hidden_payment.get(a) == 0.0
                             or outcome.payment_bounds.get(a, (0.0, 1.0))[1] == 0.0]
                    zeroed += bool(zeros)
                    first = outcome.contenders[0] if outcome.contenders else None
                    zeroed_first += first in zeros and math.isinf(result.rho.get(first, 0.0))
                    for app in outcome.pf:
                        run = self.runs[app]
                        run.auction_wins += 1
                        if app in outcome.payment_bounds:
                            lo, hi = outcome.payment_bounds[app]
                            run.bounded_wins += 1
                            run.kept_bounds = (run.kept_bounds[0] + lo, run.kept_bounds[1] + hi)
                            bounded += 1
                        else:
                            run.kept_sum += outcome.hidden_payment[app]
                if result.bidders:
                    for source, n in result.granted_by.items():
                        granted_by[source] = granted_by.get(source, 0) + n
                changed = {lease.app for lease in result.expired} | {g.app for g in result.grants}
                for name in sorted(changed & set(self.engine.apps)):
                    self._place(name)
                if self.keep_rounds:
                    kept.append(result)
            if self.contention is not None:
                self.contention.apply()
            if progress is not None:
                progress(self.now)
        unfinished = [n for n, r in self.runs.items() if r.finished_at is None]
        if unfinished or nxt < len(arrivals):
            raise RuntimeError(f"simulation stalled at t={self.now:.0f}s with unfinished apps {unfinished[:5]}")
        return SimulationResult(
            policy=self.policy.name,
            cluster=self.cluster.name,
            workload=self.workload.name,
            apps=[self.runs[a.app_id] for a in self.workload.apps],
            rounds=rounds,
            auctions=auctions,
            makespan=max((r.finished_at or 0.0) for r in self.runs.values()) if self.runs else 0.0,
            wall_seconds=time.perf_counter() - wall,
            cluster_size=self.cluster.size,
            round_results=kept,
            granted_by=granted_by,
            noncanonical=noncanonical,
            zeroed=zeroed,
            zeroed_first=zeroed_first,
            reclaimed=reclaimed,
            bounded=bounded,
        )


def share_time(run: AppRun, cluster_size: int) -> float:
    """The app's finish time on a dedicated 1/N_avg share of the cluster: its work B on
    min(its demand, R_C / N_avg) GPUs, time-sliced below one GPU. Eq. 1's T_id approximates this
    by T_cluster x N_avg, which is N_avg times too long for an app that cannot use the whole
    cluster (paper 4.3.1). For one-GPU jobs it is Shockwave's and Gavel's "time alone x
    max(1, jobs / GPUs)" with jobs averaged over the app's life."""
    app = run.app
    return app.total_work() / min(max(1, app.demand_max()), cluster_size / run.n_avg_at_finish)


def app_rho(run: AppRun, cluster_size: int) -> float:
    """Finish-time fairness the app got: (finish - arrival) / T_id with N_avg over its life (D5)."""
    assert run.finished_at is not None
    t_id = ideal_time(run.app, n_avg=run.n_avg_at_finish, cluster_size=cluster_size)
    return (run.finished_at - run.spec.arrival_s) / t_id


def _checked_restart_costs(costs: Mapping[str, float] | None, workload: Workload) -> dict[str, float] | None:
    """D32's per-model restart delays, refused when one is negative or a workload model has none."""
    if costs is None:
        return None
    bad = {m: c for m, c in costs.items() if not 0 <= c < math.inf}
    if bad:
        raise ValueError(f"restart costs must be finite seconds >= 0, got {bad}")
    missing = sorted({a.model for a in workload.apps} - set(costs))
    if missing:
        raise ValueError(f"workload {workload.name!r} names models with no restart cost: {missing} "
                         f"(the table has {', '.join(sorted(costs))})")
    return dict(costs)
