"""Performance-curve early stopping as a Themis app scheduler (paper 4.3.2, Figure 8; mechanism D4).

Each running job's loss curve is fitted online with three 3-parameter families,

* Optimus (seeds/004, Peng et al.): loss = A / (k + h) + c, i.e. 1 / (b0 k + b1) + b2 with
  b0 = 1 / A, b1 = h / A, b2 = c;
* power law: loss = A k^-b + c;
* exponential decay: loss = A exp(-b k) + c;

and the family that fits best (robust objective below) makes the point prediction. For a fixed shape
parameter (h, b) each family is linear in (A, c), so the shape is scanned on a log grid (then
refined around the best value) and (A, c) solved in closed form -- no optimiser, no local minima,
vectorised over the grid. Noise and outliers: the fits are M-estimates by iteratively reweighted
least squares (Huber rounds, then Tukey biweight rounds, whose loss is constant beyond 4.7 sigma, so
a spike costs every family the same fixed amount and gets weight zero instead of bending the curve
-- with Huber alone a power law wins by passing through a spiked first report). Each report's sigma
comes from a sliding-window median of the losses' second differences (family-free, and local because
minibatch noise shrinks with the loss), rescaled by the best fit's residuals. This replaces
Optimus's neighbour-based outlier replacement (seeds/004), which on a noisy flat tail flags about a
third of all points and cannot judge the first report.

A job's *stop* is where its fitted loss comes within ``tolerance`` of its asymptote (A phi(k) <=
tolerance), or its iteration cap. The prediction's error bar is the spread of stop iterations over
every candidate whose objective is within :func:`plausible_delta` of the best (a 95% profile-likelihood
region, F-based because the noise is estimated from the same reports), so it narrows as the job
reports more losses. rho uses its pessimistic (latest) end (D4), and the adapter stops a job when it
gets there, so rho forecasts exactly the rule that ends the job.

Pruning compares optimistic against assured: a running job is stopped when the *lowest* plausible
loss it could end at is worse, by more than ``margin``, than what another job is sure to reach (its
fitted loss now, or the highest plausible loss at its own stop if lower) -- noise in either curve
widens the intervals instead of killing a good job.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agent.appsched import CurveStoppingScheduler, JobInfo
from agent.placement import NO_SLOWDOWN, Position, Slowdown
from agent.trial import TrialSpec
from hyperparam_adapters.base import JournaledTuner, Result, TunerAdapter
from hyperparam_adapters.hyperband import IterTime, Params, Sampler, declared_time, make_sampler

FAMILIES = ("optimus", "power", "exponential")
# 95% quantiles of F(3, m) by m = reports - 3: the plausible region below is {candidates whose
# objective is within (3 / 2) F(3, n - 3) of the best}, the profile-likelihood region with the noise
# estimated from the same n reports (chi^2_3 / 2 = 3.91 as n grows)
_F3 = {1: 215.7, 2: 19.16, 3: 9.28, 4: 6.59, 5: 5.41, 6: 4.76, 7: 4.35, 8: 4.07, 9: 3.86, 10: 3.71, 12: 3.49,
       15: 3.29, 20: 3.10, 30: 2.92, 60: 2.76, 120: 2.68}
HUBER = 1.345  # 95% efficiency under Gaussian noise
TUKEY = 4.685  # likewise for the biweight
_GRID = 48
_MAX_POINTS = 600


@dataclass(frozen=True, slots=True)
class CurveFit:
    """The best fit of one job's curve and the spread of its plausible stops (D4)."""

    family: str  # one of FAMILIES, or "flat" when no decreasing curve fits
    amplitude: float  # A
    shape: float  # h (optimus), b (power, exponential)
    asymptote: float  # c
    stop: float  # the best fit's stop iteration (clipped to [done, max_iterations])
    optimistic: float  # earliest plausible stop
    pessimistic: float  # latest plausible stop (what rho uses, D4)
    final_loss: float  # the best fit's loss at its stop
    final_low: float  # lowest plausible loss at stop (what the job could still reach)
    final_high: float  # highest plausible loss at stop
    noise: float  # robust noise scale of the losses

    def value(self, k: float) -> float:
        """The fitted loss at iteration ``k``."""
        if self.family == "flat":
            return self.asymptote
        return float(self.amplitude * _phi(self.family, np.float64(k), np.float64(self.shape)) + self.asymptote)


def _phi(family: str, k: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """phi(k; theta), elementwise with broadcasting."""
    if family == "optimus":
        return 1.0 / (k + theta)
    if family == "power":
        return k ** (-theta)
    if family == "exponential":
        return np.exp(-theta * k)
    raise ValueError(f"unknown curve family {family!r}; expected one of {FAMILIES}")


def _basis(family: str, k: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """phi for every theta (rows) and k (columns)."""
    return _phi(family, k[None, :], theta[:, None])


def _stop_iteration(family: str, amp: np.ndarray, theta: np.ndarray, tol: float) -> np.ndarray:
    """The k at which A phi(k) = tol (the loss is within ``tol`` of the asymptote)."""
    ratio = np.maximum(amp / tol, 1e-300)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        if family == "optimus":
            return ratio - theta
        if family == "power":
            return np.exp(np.log(ratio) / theta)
        return np.log(ratio) / theta


def _grid(family: str, kmax: float) -> np.ndarray:
    if family == "optimus":
        return kmax * np.geomspace(1e-4, 1e2, _GRID)
    if family == "power":
        return np.geomspace(0.03, 4.0, _GRID)
    return np.geomspace(0.02, 60.0, _GRID) / kmax


def plausible_delta(n: int) -> float:
    """How much worse than the best fit's objective a candidate may be and still be plausible."""
    m = max(1, n - 3)
    if m in _F3:
        return 1.5 * _F3[m]
    keys = sorted(_F3)
    if m > keys[-1]:
        return 1.5 * 2.605
    lo = max(x for x in keys if x < m)
    hi = min(x for x in keys if x > m)
    t = (1 / lo - 1 / m) / (1 / lo - 1 / hi)  # F is close to linear in 1 / m
    return 1.5 * (_F3[lo] + t * (_F3[hi] - _F3[lo]))


def _rho(u: np.ndarray) -> np.ndarray:
    """Tukey's biweight loss: quadratic near 0, constant beyond ``TUKEY`` (an outlier costs a fixed
    amount, so a family cannot win by bending through a spike)."""
    v = np.minimum(u / TUKEY, 1.0)
    return TUKEY * TUKEY / 6 * (1 - (1 - v * v) ** 3)


def _irls(y: np.ndarray, phi: np.ndarray, sigma: np.ndarray, rounds: int = 8):
    """Robust fits of y = A phi + c for every row of ``phi`` at once: Huber rounds from least
    squares, then Tukey biweight rounds, each residual scaled by its point's noise ``sigma``.
    Returns (A, c, residuals, ok)."""
    scale = phi.max(axis=1, keepdims=True)
    p = phi / scale
    w = np.broadcast_to(1.0 / sigma**2, p.shape)
    ok = np.ones(len(p), dtype=bool)
    amp = c = np.zeros(len(p))
    r = np.zeros_like(p)
    for rnd in range(2 * rounds):
        sw, sp, spp = w.sum(1), (w * p).sum(1), (w * p * p).sum(1)
        sy, spy = (w * y).sum(1), (w * p * y).sum(1)
        det = sw * spp - sp * sp
        ok = det > 1e-10 * sw * spp
        det = np.where(ok, det, 1.0)
        amp = (sw * spy - sp * sy) / det
        c = (spp * sy - sp * spy) / det
        r = y[None, :] - amp[:, None] * p - c[:, None]
        u = np.abs(r) / sigma
        if rnd < rounds:
            w = np.minimum(1.0, HUBER / np.maximum(u, 1e-300)) / sigma**2
        else:
            w = np.clip(1 - (u / TUKEY) ** 2, 0.0, None) ** 2 / sigma**2
    return amp / scale[:, 0], c, r, ok


def noise_profile(losses: np.ndarray) -> np.ndarray:
    """Each report's noise sigma from the losses' second differences (trend-free): 1.4826 times the
    median |second difference| over a window of the reports around it, over sqrt(6). Local, because
    minibatch loss noise shrinks as the loss falls; a median over at least 17 reports (windows shift
    inwards at the ends instead of padding), kept within 4x of the global value, so a few smooth or
    spiked reports cannot make a point look exact or worthless. Under 33 reports: the global value."""
    n = len(losses)
    d2 = np.abs(losses[2:] - 2 * losses[1:-1] + losses[:-2])
    if d2.size == 0:
        return np.zeros(n)
    d2 = np.concatenate([d2[:1], d2, d2[-1:]])  # one value per report
    overall = 1.4826 * float(np.median(d2)) / math.sqrt(6)
    half = max(8, n // 10)
    if n < 4 * half + 1:
        return np.full(n, overall)
    width = 2 * half + 1
    medians = np.median(np.lib.stride_tricks.sliding_window_view(d2, width), axis=1)
    start = np.clip(np.arange(n) - half, 0, n - width)
    return np.clip(1.4826 * medians[start] / math.sqrt(6), overall / 4, overall * 4)


def fit_curve(
    iterations: Sequence[float],
    losses: Sequence[float],
    *,
    tolerance: float,
    max_iterations: float,
    families: Sequence[str] = FAMILIES,
) -> CurveFit | None:
    """Fit a job's (iteration, loss) reports; None with fewer than 4 usable reports.

    Reports with a non-finite value or an iteration <= 0 are ignored; long curves are thinned to
    600 evenly spaced reports (the last one always kept)."""
    if not tolerance > 0:
        raise ValueError("tolerance must be > 0")
    if not families or any(f not in FAMILIES for f in families):
        raise ValueError(f"families must be a non-empty subset of {FAMILIES}, got {families!r}")
    k = np.asarray(iterations, dtype=float)
    y = np.asarray(losses, dtype=float)
    if k.shape != y.shape:
        raise ValueError("iterations and losses must have the same length")
    keep = np.isfinite(k) & np.isfinite(y) & (k > 0)
    k, y = k[keep], y[keep]
    order = np.argsort(k, kind="stable")
    k, y = k[order], y[order]
    if len(k) < 4:
        return None
    if len(k) > _MAX_POINTS:
        idx = np.unique(np.linspace(0, len(k) - 1, _MAX_POINTS).round().astype(int))
        k, y = k[idx], y[idx]
    done = float(k[-1])
    floor = 1e-9 * max(float(np.ptp(y)), abs(float(np.median(y))), 1e-12)
    sigma0 = np.maximum(noise_profile(y), floor)

    fams: list[str] = []
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    for fam in families:
        theta = _grid(fam, done)
        amp, c, r, ok = _irls(y, _basis(fam, k, theta), sigma0)
        grid = theta
        for _ in range(2):  # refine twice between the best value's neighbours (1.3x, then 1.025x apart)
            obj = np.where(ok & (amp > 0), _rho(np.abs(r) / sigma0).sum(1), np.inf)
            if not np.isfinite(obj).any():
                break
            i = int(np.argmin(obj))
            below, above = grid[grid < theta[i]], grid[grid > theta[i]]
            lo = below.max() if below.size else theta[i]
            hi = above.min() if above.size else theta[i]
            grid = np.geomspace(lo, hi, 25)
            amp2, c2, r2, ok2 = _irls(y, _basis(fam, k, grid), sigma0)
            theta, amp, c = np.concatenate([theta, grid]), np.concatenate([amp, amp2]), np.concatenate([c, c2])
            r, ok = np.concatenate([r, r2]), np.concatenate([ok, ok2])
        valid = ok & (amp > 0) & np.isfinite(amp) & np.isfinite(c)
        fams += [fam] * int(valid.sum())
        parts.append((theta[valid], amp[valid], c[valid], r[valid]))
    if not fams:
        level = float(np.median(y[-max(3, len(y) // 4):]))
        return CurveFit("flat", 0.0, 0.0, level, done, done, done, level, level, level, float(np.median(sigma0)))
    theta, amp, c, r = (np.concatenate(x) for x in zip(*parts))
    fam_arr = np.asarray(fams)
    # calibrate the noise profile on the best fit's residuals, then judge every candidate with it
    u0 = np.abs(r) / sigma0
    best0 = int(np.argmin(_rho(u0).sum(1)))
    dof = math.sqrt(len(y) / max(1, len(y) - 3))  # residuals of a 3-parameter fit are shrunk
    sigma = np.maximum(sigma0 * max(1.4826 * float(np.median(u0[best0])) * dof, 1e-12), floor)
    obj = _rho(np.abs(r) / sigma).sum(1)
    stop = np.empty_like(theta)
    final = np.empty_like(theta)
    for fam in set(fams):
        sel = fam_arr == fam
        raw = np.nan_to_num(_stop_iteration(fam, amp[sel], theta[sel], tolerance), nan=max_iterations,
                            posinf=max_iterations)
        stop[sel] = np.clip(raw, done, max_iterations)
        final[sel] = amp[sel] * _phi(fam, stop[sel], theta[sel]) + c[sel]
    best = int(np.argmin(obj))
    plausible = obj <= obj[best] + plausible_delta(len(y))
    return CurveFit(
        str(fam_arr[best]), float(amp[best]), float(theta[best]), float(c[best]), float(stop[best]),
        float(stop[plausible].min()), float(stop[plausible].max()), float(final[best]),
        float(final[plausible].min()), float(final[plausible].max()), float(np.median(sigma)),
    )


@dataclass
class _CurveTrial:
    job_id: str
    params: Params
    order: int
    declared_s: float
    done: float = 0.0
    iterations: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    state: str = "running"  # running, stopped (pruned, diverged or failed) or finished (converged or cap)
    reason: str = ""
    fit: CurveFit | None = None
    fitted_at: int = -1  # number of reports the fit used

    def iter_time(self) -> float:
        return statistics.median(self.times) if self.times else self.declared_s


class CurveStoppingAdapter(JournaledTuner, TunerAdapter, CurveStoppingScheduler):
    """Trials drawn from ``sample`` up to ``max_trials``, ``parallel`` at once; each runs until its
    curve flattens (predicted stop reached), it reaches ``max_iterations``, or its best plausible
    final loss is worse than ``margin`` above what another trial is sure to reach (pruned). Stopping
    decisions wait for ``min_reports`` losses; until then rho assumes the iteration cap (D4).

    Figure 8 / D4: ``jobs_remaining`` lists the running trials with their pessimistic remaining
    iterations. D4 counts running jobs only; this app also knows it will start ``max_trials`` minus
    the started ones later, each as soon as a slot frees, so their pessimistic work (the cap, at the
    median iteration time) is queued onto the slot that frees first and reported as part of that
    slot's running job. With no trials left to start this is exactly D4.

    ``iter_time_s`` in :meth:`observe` is the serial time per iteration (one GPU, S = 1), as in
    ``hyperparam_adapters.hyperband``; before a trial reports one, ``iter_time`` (a number or a
    function of the hyperparameters) stands in.
    """

    def __init__(
        self,
        sample: Sampler | Mapping[str, Any],
        *,
        max_trials: int,
        parallel: int,
        max_iterations: int,
        tolerance: float,
        margin: float = 0.0,
        min_reports: int = 5,
        seed: int = 0,
        iter_time: IterTime = 1.0,
        job_demand: int = 1,
        slowdown: Slowdown = NO_SLOWDOWN,
        start_time: float = 0.0,
        families: Sequence[str] = FAMILIES,
    ):
        if max_trials < 1 or parallel < 1 or job_demand < 1 or max_iterations < 1:
            raise ValueError("max_trials, parallel, job_demand and max_iterations must be >= 1")
        if not tolerance > 0 or not margin >= 0 or min_reports < 4:
            raise ValueError("need tolerance > 0, margin >= 0 and min_reports >= 4")
        self._sample, self._rng = make_sampler(sample), random.Random(seed)
        self._iter_time = iter_time
        self.max_trials, self.parallel, self.max_iterations = max_trials, parallel, max_iterations
        self.tolerance, self.margin, self.min_reports = tolerance, margin, min_reports
        self.job_demand, self.slowdown, self.start_time = job_demand, slowdown, start_time
        self.families = tuple(families)
        self._trials: dict[str, _CurveTrial] = {}
        self._best: Result | None = None
        self._cache: list[JobInfo] | None = None
        self._fill()

    # ---- Figure 8 ---------------------------------------------------------------------------
    def jobs_remaining(self, gpu_alloc: Sequence[Position]) -> list[JobInfo]:
        if self._cache is None:
            running = self._running()
            loads = [max(0.0, self._end(t) - t.done) * t.iter_time() for t in running]
            queued = self.max_trials - len(self._trials)
            if running and queued:
                work = self.max_iterations * self._median_time()
                for _ in range(queued):  # list scheduling: the next trial takes the first free slot
                    i = min(range(len(loads)), key=loads.__getitem__)
                    loads[i] += work
            self._cache = [
                JobInfo(load / t.iter_time(), t.iter_time(), self.slowdown, self.job_demand, t.job_id)
                for t, load in zip(running, loads)
                if load > 0
            ]
        return self._cache

    def budget(self) -> float:
        """Predicted total work: what stopped trials did, running ones to their pessimistic end, and
        the trials still to start at the cap (like ``agent.appsched.CurveStoppingApp``)."""
        work = sum((t.done if t.state != "running" else max(t.done, self._end(t))) * t.iter_time()
                   for t in self._trials.values())
        return work + (self.max_trials - len(self._trials)) * self.max_iterations * self._median_time()

    def job_starts(self) -> int:
        """D30: each trial starts once when it runs alone."""
        return self.max_trials * self.job_demand

    def demand_max(self) -> int:
        return min(self.parallel, self.max_trials) * self.job_demand

    def demand_now(self) -> int:
        return len(self._running()) * self.job_demand

    def touch(self, *, plan: bool = True) -> None:
        self._cache = None
        super().touch(plan=plan)

    # ---- the tuner's side -----------------------------------------------------------------------
    def runnable(self) -> list[TrialSpec]:
        """Running trials, longest pessimistic remaining work first, each resuming where it was."""
        running = sorted(self._running(), key=lambda t: (-(self._end(t) - t.done) * t.iter_time(), t.order))
        return [TrialSpec(t.job_id, t.params, self.job_demand, int(t.done), self.max_iterations) for t in running]

    def observe(self, job_id: str, iteration: float, loss: float, iter_time_s: float | None = None) -> list[str]:
        """Record a report, refit, and return the trials stopped now: this one if it diverged, hit the
        cap or reached its predicted stop, and any running trial that can no longer beat the best.
        Stopped trials are replaced by new ones (visible in :meth:`runnable`)."""
        trial = self._trials[job_id]
        if not (math.isfinite(iteration) and iteration >= 0):
            raise ValueError(f"iteration must be finite and >= 0, got {iteration!r}")
        if iter_time_s is not None and not (iter_time_s > 0 and math.isfinite(iter_time_s)):
            raise ValueError(f"iter_time_s must be finite and > 0, got {iter_time_s!r}")
        self.journal_report(job_id, iteration, loss, iter_time_s)  # what a resumed run replays
        if iter_time_s is not None:
            trial.times.append(float(iter_time_s))
        trial.iterations.append(float(iteration))
        trial.losses.append(float(loss))
        trial.done = max(trial.done, float(iteration))
        if math.isfinite(loss) and (self._best is None or loss < self._best.loss):
            self._best = Result(job_id, trial.params, float(loss), float(iteration))
        if trial.state != "running":
            self.touch()  # a late report: the stopped trial's work (in budget()) grew
            return [job_id]
        out: list[str] = []
        if not math.isfinite(loss):
            self._stop(trial, "stopped", "diverged", out)
        elif trial.done >= self.max_iterations:
            self._stop(trial, "finished", "cap", out)
        else:
            fit = self._fit(trial)
            if fit is not None and self._ready(trial) and trial.done >= fit.pessimistic:
                self._stop(trial, "finished", "converged", out)
        for other in self._running():
            if self._hopeless(other):
                self._stop(other, "stopped", "pruned", out)
        self._fill()
        self.touch()
        return out

    def fail(self, job_id: str) -> list[str]:
        """The runner gave up on the trial's job (it kept failing): the trial stops where it got to,
        so its work in :meth:`budget` is what it did, and a new trial takes its slot. Returns the
        jobs to stop, as :meth:`observe` does (none: pruning waits for a report)."""
        trial = self._trials[job_id]
        self.journal_fail(job_id)
        if trial.state == "running":
            self._stop(trial, "stopped", "failed", [])
            self._fill()
            self.touch()
        return []

    def best(self) -> Result | None:
        """The lowest loss any trial reported."""
        return self._best

    # ---- introspection ----------------------------------------------------------------------
    def status(self, job_id: str) -> tuple[str, str]:
        """(state, reason): running, or stopped (pruned, diverged, failed), or finished (converged, cap)."""
        t = self._trials[job_id]
        return t.state, t.reason

    def outcome(self, job_id: str) -> str | None:
        """For the run's record: ``completed`` (converged or at the cap), ``pruned``, ``diverged``,
        ``failed``; None while it runs."""
        t = self._trials[job_id]
        if t.state == "finished":
            return "completed"
        return t.reason if t.state == "stopped" else None

    def trials_planned(self) -> int:
        return self.max_trials

    def trials_decided(self) -> int:
        return sum(1 for t in self._trials.values() if t.state in ("stopped", "finished"))

    def last_result(self, job_id: str) -> tuple[float, float] | None:
        t = self._trials[job_id]
        return (t.iterations[-1], t.losses[-1]) if t.iterations else None

    def prediction(self, job_id: str) -> CurveFit | None:
        return self._fit(self._trials[job_id])

    def predicted_end(self, job_id: str) -> float:
        """The iteration rho assumes the trial stops at (pessimistic end, D4)."""
        return self._end(self._trials[job_id])

    def trial_params(self, job_id: str) -> Params:
        return self._trials[job_id].params

    def trials(self) -> list[str]:
        return list(self._trials)

    # ---- internals --------------------------------------------------------------------------
    def _running(self) -> list[_CurveTrial]:
        return [t for t in self._trials.values() if t.state == "running"]

    def _ready(self, trial: _CurveTrial) -> bool:
        return sum(1 for v in trial.losses if math.isfinite(v)) >= self.min_reports

    def _fit(self, trial: _CurveTrial) -> CurveFit | None:
        if trial.fitted_at != len(trial.losses):
            trial.fit = fit_curve(trial.iterations, trial.losses, tolerance=self.tolerance,
                                  max_iterations=self.max_iterations, families=self.families)
            trial.fitted_at = len(trial.losses)
        return trial.fit

    def _end(self, trial: _CurveTrial) -> float:
        fit = self._fit(trial)
        if fit is None or not self._ready(trial):
            return float(self.max_iterations)
        return max(trial.done, fit.pessimistic)

    def _assured(self, trial: _CurveTrial) -> float | None:
        """A loss the trial has surely reached or will reach: its fitted loss now, or, while it runs,
        the highest plausible final loss if lower. None without a usable fit."""
        fit = self._fit(trial)
        if fit is None or not self._ready(trial):
            return None
        now = fit.value(trial.done)
        return min(now, fit.final_high) if trial.state == "running" else now

    def _hopeless(self, trial: _CurveTrial) -> bool:
        fit = self._fit(trial)
        if fit is None or not self._ready(trial):
            return False
        refs = [a for t in self._trials.values() if t is not trial and (a := self._assured(t)) is not None]
        return bool(refs) and fit.final_low > min(refs) + self.margin

    def _stop(self, trial: _CurveTrial, state: str, reason: str, out: list[str]) -> None:
        trial.state, trial.reason = state, reason
        out.append(trial.job_id)

    def _fill(self) -> None:
        while len(self._running()) < self.parallel and len(self._trials) < self.max_trials:
            params = dict(self._sample(self._rng))
            job_id = f"c{len(self._trials)}"
            self._trials[job_id] = _CurveTrial(job_id, params, len(self._trials), declared_time(self._iter_time, params))

    def _median_time(self) -> float:
        return statistics.median(t.iter_time() for t in self._trials.values())
