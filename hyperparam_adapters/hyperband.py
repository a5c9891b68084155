"""Hyperband and successive halving as Themis app schedulers (paper 4.3.2, Figure 8; mechanism D3).

Successive halving (Jamieson & Talwalkar; paper 4.3.2) trains ``n`` configurations to a first
*rung* of ``r`` iterations, keeps the best ``n / eta`` and trains them on to ``r * eta``, and so on
until one is left. Hyperband (Li et al., the paper's [22]) runs several successive-halving
*brackets* s = s_max..0 that trade many short trials against few long ones.

**How rungs and brackets map to Figure 8's phases.** Every rung is one phase, and the brackets run
one after another (Hyperband's Algorithm 1 is a loop over s), so the phases are the rungs of the
current bracket still to run followed by all rungs of the later brackets, in order. This is what
Eq. 2 can express exactly: T_sh is a *sum* of phase times, each phase ending when its slowest job
reaches the rung (D3). Running the brackets in parallel as one app would need the union of the
brackets' i-th rungs to end together -- a barrier Hyperband does not have, between jobs of very
different lengths (bracket 0 starts at R iterations while bracket s_max starts at R / eta^s_max),
so Eq. 2 would either misstate the app's remaining time or force the app to idle GPUs at the
barrier. With sequential brackets the app's demand is the largest rung's (bracket s_max's first),
and ``budget()`` is the planned work of all rungs of all brackets.

Survivors keep their id and resume from their checkpoint (``TrialSpec.start_iteration``), so a
rung's resource is cumulative: phase i runs ``r_i - r_(i-1)`` more iterations per job. The current
phase's jobs carry their own iterations left and iteration time (measured, else declared); later
phases -- whose jobs are not chosen or not even sampled yet -- use the median iteration time of the
current rung's jobs, as the paper's 4.3.3 example and ``agent.appsched.SuccessiveHalvingApp`` do.

``iter_time_s`` in :meth:`observe` is the job's *serial* time per iteration (one GPU, S = 1): the
runner, which knows how many GPUs and which placement the job had, divides its measured time by
that speed-up (the profiler of paper section 5 does this).

Resuming (issue 36, item 3): the tuner journals what it is told (``base.JournaledTuner``), and a
resumed run replays it, so decided rungs stay decided and trials at their rung are not run again.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from agent.appsched import JobInfo, SuccessiveHalvingScheduler
from agent.placement import NO_SLOWDOWN, Position, Slowdown
from agent.trial import TrialSpec
from hyperparam_adapters.base import JournaledTuner, Result, TunerAdapter

Params = Mapping[str, Any]
Sampler = Callable[[random.Random], Params]
IterTime = float | Callable[[Params], float]


def make_sampler(space: Sampler | Mapping[str, Any]) -> Sampler:
    """A seeded draw of one configuration: ``space`` is a callable ``sample(rng) -> dict`` or a
    search space whose values are lists/tuples/ranges (uniform choice), callables ``f(rng)``, or
    constants."""
    if callable(space):
        return space
    if not isinstance(space, Mapping) or not space:
        raise TypeError("sample must be a callable sample(rng) or a non-empty search-space dict")

    def draw(rng: random.Random) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, dom in space.items():
            if isinstance(dom, (list, tuple, range)):
                if len(dom) == 0:
                    raise ValueError(f"search space {name!r} is empty")
                out[name] = rng.choice(dom)
            elif callable(dom):
                out[name] = dom(rng)
            else:
                out[name] = dom
        return out

    return draw


def declared_time(iter_time: IterTime, params: Params) -> float:
    """A configuration's serial iteration time before it has reported one (a number, or a function
    of the hyperparameters: batch size or model width change it, paper 4.3.3 footnote 2)."""
    t = float(iter_time(params) if callable(iter_time) else iter_time)
    if not (t > 0 and math.isfinite(t)):
        raise ValueError(f"declared iteration time must be finite and > 0, got {t!r} for {dict(params)}")
    return t


@dataclass(frozen=True, slots=True)
class Rung:
    """One rung of a bracket: ``count`` configurations trained to ``resource`` iterations in all."""

    count: int
    resource: int


def hyperband_brackets(max_resource: int, eta: int = 3, min_resource: int = 1) -> list[list[Rung]]:
    """Li et al.'s brackets for max resource R, reduction factor eta, in run order s = s_max..0.

    s_max = floor(log_eta(R / r_min)); bracket s starts n = ceil((s_max + 1) eta^s / (s + 1))
    configurations at r = R eta^-s; its rung i keeps floor(n eta^-i) of them to R eta^(i - s).
    Integer arithmetic throughout, so R = 81, eta = 3 gives the paper's table exactly.
    """
    if eta < 2:
        raise ValueError(f"eta must be an integer >= 2, got {eta}")
    if not 1 <= min_resource <= max_resource:
        raise ValueError(f"need 1 <= min_resource <= max_resource, got {min_resource}, {max_resource}")
    ratio = Fraction(max_resource, min_resource)
    s_max = 0
    while eta ** (s_max + 1) <= ratio:
        s_max += 1
    brackets = []
    for s in range(s_max, -1, -1):
        n = -(-((s_max + 1) * eta**s) // (s + 1))
        rungs: list[Rung] = []
        for i in range(s + 1):
            r = max(1, round(Fraction(max_resource, eta ** (s - i))))
            if rungs:
                r = max(r, rungs[-1].resource + 1)
            rungs.append(Rung(n // eta**i, r))
        brackets.append(rungs)
    return brackets


def halving_counts(n: int, eta: int = 2) -> list[int]:
    """Configurations per rung of one successive-halving run: n, n // eta, ... down to 1."""
    if n < 1 or eta < 2:
        raise ValueError(f"need n >= 1 and eta >= 2, got n={n}, eta={eta}")
    counts = [n]
    while n // eta ** len(counts) >= 1:
        counts.append(n // eta ** len(counts))
    return counts


def even_budget_iterations(budget: float, counts: Sequence[int], iter_time: float) -> list[int]:
    """Per-phase iterations that split ``budget`` GPU-seconds evenly over the phases (paper 4.3.3:
    "to evenly divide the budget across the phases ... 8, 16, 36 iterations"): phase i gets
    floor(B / P / (n_i t)) iterations at the median iteration time t, the last phase what is left."""
    if not (budget > 0 and math.isfinite(budget)):
        raise ValueError(f"budget must be finite and > 0, got {budget!r}")
    share = budget / len(counts)
    its = [int(share // (n * iter_time)) for n in counts[:-1]]
    spent = sum(i * n * iter_time for i, n in zip(its, counts))
    its.append(int((budget - spent) // (counts[-1] * iter_time)))
    if min(its) < 1:
        raise ValueError(f"a budget of {budget} GPU-s leaves a phase without one iteration: {its}")
    return its


@dataclass
class _Trial:
    job_id: str
    params: Params
    bracket: int
    order: int
    declared_s: float
    done: float = 0.0
    times: list[float] = field(default_factory=list)
    state: str = "pending"  # pending (in its rung), paused (rung reached), stopped (lost), finished
    rung_loss: float = math.inf
    last_loss: float = math.inf
    failed: bool = False  # the runner gave up on its job: it never runs again

    def iter_time(self) -> float:
        """Median of the measured serial iteration times (robust to a slow first one), else declared."""
        return statistics.median(self.times) if self.times else self.declared_s


class BracketTuner(JournaledTuner, TunerAdapter, SuccessiveHalvingScheduler):
    """Successive-halving brackets run one after another, each rung one Figure 8 phase (module doc).

    ``plan`` lists the brackets' rungs; configurations of a bracket are drawn from ``sample`` (seeded
    by ``seed``) when the bracket starts. Each job asks ``job_demand`` GPUs, times the number of
    jobs the bracket started with over the rung's count when ``grow_demand`` (paper 4.3.2: n jobs of
    1 GPU, then n/2 of 2, ...).
    """

    def __init__(
        self,
        sample: Sampler | Mapping[str, Any],
        plan: Sequence[Sequence[Rung]],
        *,
        seed: int = 0,
        iter_time: IterTime = 1.0,
        job_demand: int = 1,
        grow_demand: bool = False,
        slowdown: Slowdown = NO_SLOWDOWN,
        start_time: float = 0.0,
        budget_gpu_seconds: float | None = None,
    ):
        if not plan or any(not b for b in plan):
            raise ValueError("a plan needs at least one bracket, each with at least one rung")
        for b in plan:
            for lo, hi in zip(b, b[1:]):
                if not (1 <= hi.count <= lo.count and hi.resource > lo.resource):
                    raise ValueError(f"rungs must keep fewer configurations for more iterations: {list(b)}")
            if b[0].count < 1 or b[0].resource < 1:
                raise ValueError(f"rungs need count >= 1 and resource >= 1: {list(b)}")
        if job_demand < 1:
            raise ValueError("job_demand must be >= 1")
        if budget_gpu_seconds is not None and not (budget_gpu_seconds > 0 and math.isfinite(budget_gpu_seconds)):
            raise ValueError("budget_gpu_seconds must be finite and > 0")
        self._sample = make_sampler(sample)
        self._rng = random.Random(seed)
        self._iter_time = iter_time
        self.job_demand, self.grow_demand, self.slowdown = job_demand, grow_demand, slowdown
        self.start_time = start_time
        self.plan = [list(b) for b in plan]
        # flat phase list: (bracket, rung, iterations this phase adds per job)
        self._phases: list[tuple[int, Rung, int]] = [
            (bi, r, r.resource - (b[i - 1].resource if i else 0)) for bi, b in enumerate(self.plan) for i, r in
            enumerate(b)
        ]
        self._phase = 1
        self._trials: dict[str, _Trial] = {}
        self._members: list[str] = []
        self._best: Result | None = None
        self._cache: dict[int, list[JobInfo]] = {}
        self._members = self._start_bracket(0)
        if budget_gpu_seconds is None:
            med = statistics.median(self._trials[m].declared_s for m in self._members)
            budget_gpu_seconds = sum(r.count * inc * med for _, r, inc in self._phases)
        self._budget = float(budget_gpu_seconds)

    # ---- Figure 8 ---------------------------------------------------------------------------
    def num_phases(self) -> int:
        return len(self._phases)

    def current_phase(self) -> int:
        return self._phase

    def phase_demand(self, phase: int) -> int:
        """GPUs one job of ``phase`` may use."""
        bracket, rung, _ = self._phases[phase - 1]
        return self.job_demand * (self.plan[bracket][0].count // rung.count if self.grow_demand else 1)

    def jobs_in_phase(self, phase: int, gpu_alloc: Sequence[Position]) -> list[JobInfo]:
        """The current rung's jobs with their iterations left to the rung; later rungs estimated with
        the median iteration time of the current rung's jobs (D3). Cached until the next change."""
        if phase < self._phase or phase > self.num_phases():
            return []
        cached = self._cache.get(phase)
        if cached is not None:
            return cached
        _, rung, inc = self._phases[phase - 1]
        demand = self.phase_demand(phase)
        if phase == self._phase:
            jobs = [
                JobInfo(rung.resource - t.done, t.iter_time(), self.slowdown, demand, t.job_id)
                for t in map(self._trials.__getitem__, self._members)
                if t.state == "pending" and rung.resource > t.done
            ]
        else:
            med = statistics.median(self._trials[m].iter_time() for m in self._members)
            jobs = [JobInfo(float(inc), med, self.slowdown, demand, f"p{phase}-{k}") for k in range(rung.count)]
        self._cache[phase] = jobs
        return jobs

    def budget(self) -> float:
        """B: the given budget, else every rung's planned work at the first bracket's median declared
        iteration time (fixed, like the paper's 10,000 GPU-s of 4.3.3)."""
        return self._budget

    def job_starts(self) -> int:
        """D30: every rung launches its trials again (survivors resume from their checkpoints)."""
        return sum(r.count * self.phase_demand(p + 1) for p, (_, r, _) in enumerate(self._phases))

    def demand_max(self) -> int:
        return max(r.count * self.phase_demand(p + 1) for p, (_, r, _) in enumerate(self._phases))

    def demand_now(self) -> int:
        if self._phase > self.num_phases():
            return 0
        return sum(1 for m in self._members if self._trials[m].state == "pending") * self.phase_demand(self._phase)

    def touch(self, *, plan: bool = True) -> None:
        self._cache.clear()
        super().touch(plan=plan)

    # ---- the tuner's side -----------------------------------------------------------------------
    def runnable(self) -> list[TrialSpec]:
        """The current rung's jobs that have not reached it, longest remaining work first (the order
        D3's split and packing assume), each resuming from its checkpoint."""
        if self._phase > self.num_phases():
            return []
        rung = self._phases[self._phase - 1][1]
        demand = self.phase_demand(self._phase)
        live = [self._trials[m] for m in self._members if self._trials[m].state == "pending"]
        live.sort(key=lambda t: (-(rung.resource - t.done) * t.iter_time(), t.order))
        return [TrialSpec(t.job_id, t.params, demand, int(t.done), rung.resource) for t in live]

    def observe(self, job_id: str, iteration: float, loss: float, iter_time_s: float | None = None) -> list[str]:
        """Record a report. Returns the jobs to stop now: this job if it reached its rung (paused
        until the rung ends, or finished), and -- when this report completes the rung -- the rung's
        losers (stopped for good; they may already be paused) and the bracket's finishers. A survivor
        that completes the rung is not returned: it trains on towards the next rung."""
        trial = self._trials[job_id]
        if not (math.isfinite(iteration) and iteration >= 0):
            raise ValueError(f"iteration must be finite and >= 0, got {iteration!r}")
        if iter_time_s is not None and not (iter_time_s > 0 and math.isfinite(iter_time_s)):
            raise ValueError(f"iter_time_s must be finite and > 0, got {iter_time_s!r}")
        self.journal_report(job_id, iteration, loss, iter_time_s)  # what a resumed run replays
        value = float(loss) if math.isfinite(loss) else math.inf  # a diverged job ranks last
        if math.isfinite(loss) and (self._best is None or loss < self._best.loss):
            self._best = Result(job_id, trial.params, float(loss), float(iteration))
        plan = False
        if iter_time_s is not None:
            before = trial.iter_time()
            trial.times.append(float(iter_time_s))
            plan = trial.iter_time() != before and job_id in self._members
        trial.done = max(trial.done, float(iteration))
        trial.last_loss = value
        if trial.state != "pending":
            if plan:
                self.touch()
            return [job_id]
        rung = self._phases[self._phase - 1][1]
        if trial.done >= rung.resource:
            trial.state, trial.rung_loss = "paused", value
        ended = self._close_rungs()
        self.touch(plan=plan or bool(ended))
        out = list(ended)
        if trial.state == "paused" and job_id not in out:
            out.append(job_id)
        return out

    def fail(self, job_id: str) -> list[str]:
        """The runner gave up on the job (it kept failing) and will never start it again, so it must
        never be kept for a next rung, which would wait for it forever: it leaves its rung now, ranked
        last. Returns the jobs to stop, as :meth:`observe` does."""
        trial = self._trials[job_id]
        self.journal_fail(job_id)
        trial.failed = True
        if trial.state != "pending":
            return []
        trial.state, trial.rung_loss = "paused", math.inf
        ended = self._close_rungs()
        self.touch()
        return ended

    def best(self) -> Result | None:
        """The lowest loss any job reported (Li et al. return the best intermediate loss seen)."""
        return self._best

    # ---- introspection ----------------------------------------------------------------------
    def trial_params(self, job_id: str) -> Params:
        return self._trials[job_id].params

    def status(self, job_id: str) -> str:
        """pending (in its rung), paused (rung reached, waiting), stopped (lost a rung) or finished."""
        return self._trials[job_id].state

    def outcome(self, job_id: str) -> str | None:
        """For the run's record: ``paused`` (reached its rung; the rung's end decides), ``pruned`` (lost
        a rung), ``completed`` (its bracket's last rung), ``failed`` (the runner gave up on it), None
        while it trains."""
        t = self._trials[job_id]
        if t.failed:
            return "failed"
        return {"paused": "paused", "stopped": "pruned", "finished": "completed"}.get(t.state)

    def trials_planned(self) -> int:
        return sum(bracket[0].count for bracket in self.plan)

    def trials_decided(self) -> int:
        return sum(1 for t in self._trials.values() if t.failed or t.state in ("stopped", "finished"))

    def last_result(self, job_id: str) -> tuple[float, float] | None:
        t = self._trials[job_id]
        return (t.done, t.last_loss) if t.done > 0 else None

    def rung_members(self) -> list[str]:
        """Ids of the current rung's jobs, in the order they were ranked into it."""
        return list(self._members)

    def trials(self) -> list[str]:
        return list(self._trials)

    # ---- internals --------------------------------------------------------------------------
    def _start_bracket(self, bracket: int) -> list[str]:
        ids = []
        for _ in range(self.plan[bracket][0].count):
            params = dict(self._sample(self._rng))
            job_id = f"t{len(self._trials)}"
            self._trials[job_id] = _Trial(
                job_id, params, bracket, len(self._trials), declared_time(self._iter_time, params)
            )
            ids.append(job_id)
        return ids

    def _close_rungs(self) -> list[str]:
        """End every rung whose jobs all reached it: keep the best of the next rung's count (ties by
        age; never a failed job, so a rung may keep fewer), stop the rest; after a bracket's last rung,
        start the next bracket."""
        ended: list[str] = []
        while self._phase <= self.num_phases() and all(self._trials[m].state == "paused" for m in self._members):
            bracket = self._phases[self._phase - 1][0]
            ranked = sorted(self._members, key=lambda m: (self._trials[m].rung_loss, self._trials[m].order))
            self._phase += 1
            nxt = self._phases[self._phase - 1] if self._phase <= self.num_phases() else None
            if nxt is None or nxt[0] != bracket:  # the bracket's last rung: its jobs are done
                for m in ranked:
                    self._trials[m].state = "finished"
                ended += ranked
                self._members = self._start_bracket(nxt[0]) if nxt is not None else []
                continue
            target, count = nxt[1].resource, nxt[1].count
            kept = [m for m in ranked if not self._trials[m].failed][:count]
            for m in ranked:
                if m not in kept:
                    self._trials[m].state = "stopped"
                    ended.append(m)
            for m in kept:
                t = self._trials[m]
                t.state = "paused" if t.done >= target else "pending"  # an overshooting survivor
                t.rung_loss = t.last_loss
            self._members = kept
        return ended


class HyperbandAdapter(BracketTuner):
    """Hyperband (Li et al.): brackets s = s_max..0 of :func:`hyperband_brackets`, run in order."""

    def __init__(
        self,
        sample: Sampler | Mapping[str, Any],
        max_resource: int,
        eta: int = 3,
        *,
        min_resource: int = 1,
        **kwargs: Any,
    ):
        self.max_resource, self.eta, self.min_resource = max_resource, eta, min_resource
        super().__init__(sample, hyperband_brackets(max_resource, eta, min_resource), **kwargs)


class SuccessiveHalvingAdapter(BracketTuner):
    """One successive-halving bracket: ``n`` configurations, rung counts n, n // eta, ..., 1.

    Rung resources are ``min_resource * eta^i`` (Jamieson & Talwalkar), or the cumulative sums of
    ``phase_iterations`` when given, or -- with ``budget_gpu_seconds`` and no ``phase_iterations``
    -- the paper's even split of the budget over the phases (4.3.3; :func:`even_budget_iterations`
    at the median declared iteration time of the ``n`` configurations).
    """

    def __init__(
        self,
        sample: Sampler | Mapping[str, Any],
        n: int,
        eta: int = 2,
        *,
        min_resource: int = 1,
        phase_iterations: Sequence[int] | None = None,
        budget_gpu_seconds: float | None = None,
        seed: int = 0,
        iter_time: IterTime = 1.0,
        **kwargs: Any,
    ):
        counts = halving_counts(n, eta)
        sampler = make_sampler(sample)
        if phase_iterations is None and budget_gpu_seconds is not None:
            rng = random.Random(seed)
            drawn = [dict(sampler(rng)) for _ in range(n)]
            med = statistics.median(declared_time(iter_time, p) for p in drawn)
            phase_iterations = even_budget_iterations(budget_gpu_seconds, counts, med)
            replay = iter(drawn)
            sampler = lambda _rng: next(replay)  # noqa: E731 -- the same draws, in order
        if phase_iterations is None:
            if min_resource < 1:
                raise ValueError("min_resource must be >= 1")
            resources = [min_resource * eta**i for i in range(len(counts))]
        else:
            if len(phase_iterations) != len(counts):
                raise ValueError(f"{n} configurations with eta={eta} make {len(counts)} phases, "
                                 f"got {len(phase_iterations)} phase_iterations")
            if any(int(i) != i or i < 1 for i in phase_iterations):
                raise ValueError(f"phase_iterations must be integers >= 1, got {list(phase_iterations)}")
            resources = [int(sum(phase_iterations[: i + 1])) for i in range(len(counts))]
        self.n, self.eta = n, eta
        super().__init__(
            sampler, [[Rung(c, r) for c, r in zip(counts, resources)]], seed=seed, iter_time=iter_time,
            budget_gpu_seconds=budget_gpu_seconds, **kwargs,
        )
