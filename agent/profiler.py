"""The agent's profiler: placement slowdowns and serial iteration times learned from what jobs report
(paper 5: "a profiler in the AM ... tracks iteration times and loss values for all the jobs in an
app ... iteration times are used to accurately estimate the placement sensitivity (S) from
different GPU placements"; mechanism D1, D2).

Jobs report their metrics on ``themis/<cluster>/apps/<app>/jobs/<job>/metrics``
(``arbiter.events.job_metrics_topic``), one JSON object per report, built with
:func:`metrics_payload` so jobs and profilers agree:

    {"iteration": 120,              # iterations the job has completed (number >= 0)
     "loss": 0.53,                  # its latest loss, or null (no loss, or not finite)
     "iter_time_s": 0.84,           # wall-clock seconds per iteration, measured on the GPUs below
     "gpus": [["r0", "m3", "s1"], ["r0", "m3", "s2"]],   # the job's GPUs: (rack, machine, slot) each
     "demand": 2}                   # the job's demand_max (GPUs it can use at most)

All five keys are required; other keys are ignored (room to grow). :func:`parse_metrics` checks a
payload and raises ValueError naming what is wrong.

The estimate. D2 says ``iter_time(G) = serial * S(G) / min(|G|, demand)``, so every report gives
``u = iter_time_s * min(|G|, demand)``: the serial time itself for one GPU (S = 1 by D1), else a
sample of ``serial * S_L`` at G's D1 level L. The profiler keeps, per job and level, the sum and the
count of u, and:

* serial time: a job's own one-GPU reports when it has some (jobs of one search differ in speed);
  the app's serial time otherwise, which is ``iter_time_serial`` (the prior) blended with all
  one-GPU reports: ``(w * prior + sum) / (w + n)`` with ``w = prior_weight`` pseudo-observations;
* S_L: each multi-GPU report contributes ``u / serial(job)``; per level,
  ``S_L = (w * prior_L + sum of samples) / (w + n_L)``, clamped to >= 1 -- with few reports the
  shipped profile (``agent/profiles/slowdowns.toml``) dominates, with many the measurements do;
* the levels are then made non-decreasing (``agent.placement`` requires it) by weighted isotonic
  regression (pool adjacent violators) with the report counts as weights: two measured levels in
  the wrong order are pooled, and a level nobody measured follows its measured neighbour instead of
  pulling it back towards the prior (cross-rack is at least as slow as cross-machine).

The measured contention ratio (D35's measured side). A job spread over machines shares their
network with its neighbours; the table predicts what that costs, the profiler measures it: per job,
``ratio = sum of expected iteration times / sum of measured ones`` over its last ``RATIO_WINDOW``
reports since its GPU set last changed (neighbours come and go while a job stays put), where the
expected time is the job's *profile* on those GPUs, ``serial * S_L / min(|G|, demand)`` with the
profile's S (the prior, not the learned S, which would absorb the contention it is meant to show)
and the job's profiled serial time (:meth:`Profiler.profile_job`), else its own one-GPU reports,
else the app's serial time. 1 is as profiled; 0.6 is 40% slower. A profile that is wrong reads as
contention (or its absence): the ratio is only as good as the profile.

:meth:`Profiler.apply` hands the learned slowdown (and serial times, where the app takes them) to
an app scheduler and calls ``app.touch()``, so agents recompute rho and bids follow reality.
"""

from __future__ import annotations

import asyncio
import logging
import math
import numbers
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.appsched import AppScheduler, CurveStoppingApp
from agent.placement import NO_SLOWDOWN, ModelProfile, Position, Slowdown, load_profiles, locality_of

if TYPE_CHECKING:  # agent imports arbiter only where it talks to the bus (docs/architecture.md)
    from arbiter.events import Event, EventBus

__all__ = ["JobMetrics", "Profiler", "metrics_payload", "parse_metrics", "publish_metrics"]

log = logging.getLogger("themis.profiler")

LEVELS = 4  # D1: slot, machine, rack, cluster
DEFAULT_PRIOR_WEIGHT = 5.0
RATIO_WINDOW = 8  # reports a measured contention ratio is taken over: neighbours come and go while a job stays
_EPSILON_WEIGHT = 1e-9  # weight of a level nobody measured in the monotone fit


# ---------------------------------------------------------------------------------------------- the payload


@dataclass(frozen=True)
class JobMetrics:
    """One report of a job (see the module docstring for its JSON form)."""

    iteration: float
    loss: float | None
    iter_time_s: float
    gpus: tuple[Position, ...]
    demand: int


def _position(value: Any, where: str) -> Position:
    if (not isinstance(value, (list, tuple)) or len(value) != 3
            or not all(isinstance(v, str) and v for v in value)):
        raise ValueError(f"{where} must be [rack, machine, slot] (three non-empty strings), got {value!r}")
    return (value[0], value[1], value[2])


def _number(value: Any, where: str) -> float:
    """numbers.Real, so numpy's and JAX's scalars (np.float32, np.int64) are numbers too."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number, got {value!r}")
    return float(value)


def _check(iteration: Any, loss: Any, iter_time_s: Any, gpus: Any, demand: Any) -> JobMetrics:
    it = _number(iteration, "iteration")
    if it < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration!r}")
    t = _number(iter_time_s, "iter_time_s")
    if t <= 0:
        raise ValueError(f"iter_time_s must be > 0, got {iter_time_s!r}")
    if loss is not None:
        if isinstance(loss, bool) or not isinstance(loss, numbers.Real):
            raise ValueError(f"loss must be a number or null, got {loss!r}")
        loss = float(loss) if math.isfinite(loss) else None
    if not isinstance(gpus, (list, tuple)) or not gpus:
        raise ValueError(f"gpus must be a non-empty list of [rack, machine, slot], got {gpus!r}")
    positions = tuple(_position(g, f"gpus[{k}]") for k, g in enumerate(gpus))
    if isinstance(demand, bool) or not isinstance(demand, int) or demand < 1:
        raise ValueError(f"demand must be an int >= 1, got {demand!r}")
    return JobMetrics(it, loss, t, positions, demand)


def metrics_payload(
    *, iteration: float, iter_time_s: float, gpus: Sequence[Position], demand: int, loss: float | None = None
) -> dict[str, Any]:
    """The JSON object a job publishes on its metrics topic; ValueError if a field is unusable.
    A loss that is NaN or infinite is sent as null (the bus refuses non-JSON numbers)."""
    m = _check(iteration, loss, iter_time_s, list(gpus), demand)
    return {
        "demand": m.demand,
        "gpus": [list(p) for p in m.gpus],
        "iter_time_s": m.iter_time_s,
        "iteration": int(m.iteration) if m.iteration == int(m.iteration) else m.iteration,
        "loss": m.loss,
    }


def parse_metrics(payload: Any) -> JobMetrics:
    """A received payload as :class:`JobMetrics`; ValueError naming the problem."""
    if not isinstance(payload, Mapping):
        raise ValueError(f"a metrics payload must be a JSON object, got {type(payload).__name__}")
    missing = [k for k in ("iteration", "loss", "iter_time_s", "gpus", "demand") if k not in payload]
    if missing:
        raise ValueError(f"a metrics payload needs {', '.join(missing)}")
    return _check(payload["iteration"], payload["loss"], payload["iter_time_s"], payload["gpus"], payload["demand"])


def publish_metrics(
    bus: EventBus, cluster: str, app: str, job: str, *, iteration: float, iter_time_s: float,
    gpus: Sequence[Position], demand: int, loss: float | None = None,
) -> None:
    """What a job (or its launcher) calls after each reporting interval."""
    from arbiter.events import job_metrics_topic

    payload = metrics_payload(iteration=iteration, iter_time_s=iter_time_s, gpus=gpus, demand=demand, loss=loss)
    bus.publish(job_metrics_topic(cluster, app, job), payload)


# ---------------------------------------------------------------------------------------------- the estimate


def _monotone(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """Weighted isotonic (non-decreasing) least-squares fit: pool adjacent violators."""
    blocks: list[list[float]] = []  # [weighted mean, weight, number of levels]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [b[0] for b in blocks for _ in range(int(b[2]))]


class Profiler:
    """Learns one app's (or model's) slowdown by D1 level and its serial iteration time.

    ``prior`` is the profile table's slowdown (a ``Slowdown`` or a ``ModelProfile``);
    ``iter_time_serial`` the serial time the app was configured with (None: unknown);
    ``prior_weight`` how many reports the prior is worth at each level.
    """

    def __init__(
        self,
        prior: Slowdown | ModelProfile = NO_SLOWDOWN,
        iter_time_serial: float | None = None,
        *,
        prior_weight: float = DEFAULT_PRIOR_WEIGHT,
    ) -> None:
        values = prior.slowdown if isinstance(prior, ModelProfile) else prior
        if len(values) != LEVELS or any(not (v >= 1 and math.isfinite(v)) for v in values):
            raise ValueError(f"a prior slowdown is 4 finite numbers >= 1 (levels 0-3), got {values!r}")
        if any(a > b for a, b in zip(values, values[1:])):
            raise ValueError(f"a prior slowdown must not decrease with the level, got {values!r}")
        if iter_time_serial is not None and not (iter_time_serial > 0 and math.isfinite(iter_time_serial)):
            raise ValueError(f"iter_time_serial must be finite and > 0, got {iter_time_serial!r}")
        if not (prior_weight > 0 and math.isfinite(prior_weight)):
            raise ValueError(f"prior_weight must be finite and > 0, got {prior_weight!r}")
        self.prior: Slowdown = tuple(float(v) for v in values)  # type: ignore[assignment]
        self.prior_iter_time_serial = iter_time_serial
        self.prior_weight = float(prior_weight)
        self._single: dict[str, list[float]] = {}  # job -> [sum of one-GPU iteration times, count]
        self._multi: dict[tuple[str, int], list[float]] = {}  # (job, level) -> [sum of u, count]
        self.reports = 0
        self.rejected = 0  # bus messages that were not usable reports
        self._cache: tuple[int, Slowdown, float | None] | None = None
        self._profiled: dict[str, tuple[float, Slowdown]] = {}  # job -> its profiled serial time and S
        self._ratio: dict[str, list[Any]] = {}  # job -> [its GPUs, its last (expected, measured) times] (D35)
        self.ratio_window = RATIO_WINDOW

    @classmethod
    def for_model(
        cls, model: str, iter_time_serial: float | None = None, *, profiles: Mapping[str, ModelProfile] | None = None,
        prior_weight: float = DEFAULT_PRIOR_WEIGHT,
    ) -> Profiler:
        """A profiler whose prior is ``model``'s row of the profile table (the shipped one by default)."""
        table = profiles if profiles is not None else load_profiles()
        if model not in table:
            raise ValueError(f"unknown model {model!r}; known: {', '.join(sorted(table))}")
        return cls(table[model], iter_time_serial, prior_weight=prior_weight)

    # -- input ----------------------------------------------------------------------------------------

    def observe(self, job_id: str, iter_time_s: float, gpus: Sequence[Position], demand: int | None = None) -> int:
        """One report: ``iter_time_s`` measured on ``gpus`` by a job of ``demand`` (default |G|).
        Returns the report's D1 level, -1 for a single GPU (a serial-time sample)."""
        m = _check(0, None, iter_time_s, list(gpus), len(gpus) if demand is None else demand)
        n = len(m.gpus)
        self.reports += 1
        self._cache = None
        self._track_ratio(job_id, m)
        if n == 1:
            cell = self._single.setdefault(job_id, [0.0, 0])
            cell[0] += m.iter_time_s
            cell[1] += 1
            return -1
        level = locality_of(m.gpus)
        cell = self._multi.setdefault((job_id, level), [0.0, 0])
        cell[0] += m.iter_time_s * min(n, m.demand)
        cell[1] += 1
        return level

    def profile_job(self, job_id: str, iter_time_serial: float, slowdown: Slowdown | None = None) -> None:
        """What ``job_id`` is expected to take per iteration alone (its serial time, and its S by D1
        level; the prior when not given): the baseline of its measured contention ratio."""
        if not (iter_time_serial > 0 and math.isfinite(iter_time_serial)):
            raise ValueError(f"iter_time_serial must be finite and > 0, got {iter_time_serial!r}")
        self._profiled[job_id] = (float(iter_time_serial), self.prior if slowdown is None else tuple(slowdown))

    def _expected(self, job_id: str, gpus: Sequence[Position], demand: int) -> float | None:
        """The job's profiled iteration time on ``gpus`` (module docstring); None when unknown."""
        profiled = self._profiled.get(job_id)
        if profiled is not None:
            serial, slowdown = profiled
        else:
            serial, slowdown = self.job_iter_time_serial(job_id) or self._app_serial(), self.prior
        if serial is None:
            return None
        n = len(gpus)
        return serial * (1.0 if n == 1 else slowdown[locality_of(gpus)]) / min(n, demand)

    def _track_ratio(self, job_id: str, m: JobMetrics) -> None:
        expected = self._expected(job_id, m.gpus, m.demand)
        if expected is None:
            return
        where = tuple(sorted(m.gpus))
        cell = self._ratio.get(job_id)
        if cell is None or cell[0] != where:  # moved: a new placement, new neighbours
            cell = self._ratio[job_id] = [where, deque(maxlen=self.ratio_window)]
        cell[1].append((expected, m.iter_time_s))

    def contention_ratio(self, job_id: str) -> float | None:
        """The job's measured contention ratio on its current GPUs (module docstring): its profiled
        iteration time over the measured one; None before a report it can be computed from."""
        cell = self._ratio.get(job_id)
        if cell is None or not cell[1]:
            return None
        return sum(e for e, _ in cell[1]) / sum(s for _, s in cell[1])

    def contention_ratios(self) -> dict[str, float]:
        """Every job's measured contention ratio (jobs with none left out)."""
        return {job: r for job in sorted(self._ratio) if (r := self.contention_ratio(job)) is not None}

    def forget_job(self, job_id: str) -> None:
        """The job ended: no ratio for it any more (its iteration samples stay in the estimate)."""
        self._ratio.pop(job_id, None)
        self._profiled.pop(job_id, None)

    def consume(self, event: Event) -> tuple[str, JobMetrics] | None:
        """Take one bus event from ``.../jobs/<job>/metrics``; None (and ``rejected`` + 1, logged) when
        it is not a usable report: a bad report must not stop the profiler."""
        parts = event.topic.split("/")
        try:
            if len(parts) < 3 or parts[-1] != "metrics" or parts[-3] != "jobs":
                raise ValueError("not a job metrics topic")
            metrics = parse_metrics(event.payload)
        except ValueError as exc:
            self.rejected += 1
            log.warning("ignoring a job report on %s: %s", event.topic, exc)
            return None
        job = parts[-2]
        self.observe(job, metrics.iter_time_s, metrics.gpus, metrics.demand)
        return job, metrics

    async def follow(
        self,
        bus: EventBus,
        cluster: str,
        app_name: str,
        *,
        app: AppScheduler | None = None,
        on_report: Callable[[str, JobMetrics], None] | None = None,
        ready: asyncio.Event | None = None,
    ) -> int:
        """Consume ``job_metrics_pattern(cluster, app_name)`` until the subscription ends (the bus
        stops, or the task is cancelled); after each report, call ``on_report(job, metrics)`` (e.g.
        to feed the tuner's ``observe``) and apply the estimate to ``app``. ``ready`` is set once
        the subscription is active. Returns the number of reports taken."""
        from arbiter.events import job_metrics_pattern

        if app is not None and not hasattr(app, "slowdown"):
            raise TypeError(f"{type(app).__name__} has no slowdown attribute its jobs use; cannot apply a profile")
        taken = 0
        async with bus.subscribe(job_metrics_pattern(cluster, app_name)) as subscription:
            if ready is not None:
                ready.set()
            async for event in subscription:
                got = self.consume(event)
                if got is None:
                    continue
                taken += 1
                if on_report is not None:
                    on_report(*got)
                if app is not None:
                    self.apply(app)
        return taken

    # -- output ---------------------------------------------------------------------------------------

    def observations(self) -> tuple[int, int, int, int]:
        """Multi-GPU reports per D1 level."""
        counts = [0] * LEVELS
        for (_, level), (_, n) in self._multi.items():
            counts[level] += int(n)
        return (counts[0], counts[1], counts[2], counts[3])

    def serial_observations(self) -> int:
        return int(sum(n for _, n in self._single.values()))

    @property
    def iter_time_serial(self) -> float | None:
        """The app's serial iteration time: the prior blended with every one-GPU report; without a
        prior, their mean, or (no one-GPU report either) the lowest measured level divided by its
        prior slowdown; None when nothing is known."""
        return self._estimate()[1]

    @property
    def slowdown(self) -> Slowdown:
        """The learned S by D1 level, in the form app schedulers use (``agent.placement.Slowdown``)."""
        return self._estimate()[0]

    def job_iter_time_serial(self, job_id: str) -> float | None:
        """One job's serial time: the mean of its one-GPU reports, None without any. (Its multi-GPU
        reports are not used: dividing them by a prior-blended S would move the serial time by the
        prior's error, and the product serial * S, which is what rho uses, is learned already.)"""
        single = self._single.get(job_id)
        return single[0] / single[1] if single else None

    def _app_serial(self) -> float | None:
        total = sum(c[0] for c in self._single.values())
        count = sum(c[1] for c in self._single.values())
        if self.prior_iter_time_serial is not None:
            w = self.prior_weight
            return (w * self.prior_iter_time_serial + total) / (w + count)
        if count:
            return total / count
        for level in range(LEVELS):
            cells = [c for (_, lv), c in self._multi.items() if lv == level]
            if cells:
                return sum(c[0] for c in cells) / sum(c[1] for c in cells) / self.prior[level]
        return None

    def _estimate(self) -> tuple[Slowdown, float | None]:
        if self._cache is not None and self._cache[0] == self.reports:
            return self._cache[1], self._cache[2]
        app_serial = self._app_serial()
        sums, counts = [0.0] * LEVELS, [0] * LEVELS
        if app_serial is not None:
            for (job, level), (u, n) in self._multi.items():
                single = self._single.get(job)
                serial = single[0] / single[1] if single else app_serial
                sums[level] += u / serial
                counts[level] += int(n)
        w = self.prior_weight
        blended = [max(1.0, (w * p + s) / (w + n)) for p, s, n in zip(self.prior, sums, counts)]
        fitted = _monotone(blended, [n or _EPSILON_WEIGHT for n in counts])
        slowdown: Slowdown = (fitted[0], fitted[1], fitted[2], fitted[3])
        self._cache = (self.reports, slowdown, app_serial)
        return slowdown, app_serial

    # -- applying it ----------------------------------------------------------------------------------

    def apply(self, app: AppScheduler, *, min_change: float = 0.005) -> bool:
        """Give ``app`` the learned slowdown (and serial times where it takes them) and call
        ``app.touch()``, so agents recompute rho. Changes below ``min_change`` (relative) are not
        applied, so noise does not empty the agents' caches at every report. Returns whether
        anything changed.

        The app must carry a settable ``slowdown`` that its JobInfo use (``SuccessiveHalvingApp``,
        ``CurveStoppingApp``, ``hyperparam_adapters.optuna_adapter.OptunaAdapter``); TypeError
        otherwise (``FixedJobsApp`` keeps a slowdown per JobInfo). Serial times go to
        ``CurveStoppingApp``'s jobs (each its own, once it reported from one GPU) and to an app with an
        ``iter_time_serial`` attribute (its time for jobs it has not measured, e.g. the Optuna
        adapter's), once any job reported from one GPU.
        """
        changed = False
        new = self.slowdown
        if _differs(app.placement_slowdown(), new, min_change):
            if not hasattr(app, "slowdown"):
                raise TypeError(f"{type(app).__name__} has no slowdown attribute its jobs use; cannot apply a profile")
            app.slowdown = new  # type: ignore[attr-defined]
            changed = True
        if isinstance(app, CurveStoppingApp):
            for job in app.jobs:
                t = self.job_iter_time_serial(job.job_id)
                if t is not None and _differs((job.iter_time_serial,), (t,), min_change):
                    job.iter_time_serial = t
                    changed = True
        elif isinstance(getattr(app, "iter_time_serial", None), float) and self.serial_observations():
            t = self.iter_time_serial
            if t is not None and _differs((app.iter_time_serial,), (t,), min_change):  # type: ignore[attr-defined]
                app.iter_time_serial = t  # type: ignore[attr-defined]
                changed = True
        if changed:
            app.touch()
        return changed


def _differs(old: Sequence[float], new: Sequence[float], tolerance: float) -> bool:
    return any(abs(a - b) > tolerance * max(abs(a), abs(b)) for a, b in zip(old, new))
