"""A seeded generator of hyperparameter-search workloads, and the bundled ``small`` workload.

Knobs (:func:`synthetic`):

- ``apps``: how many apps; ``app_size``: jobs per app, a number or an inclusive (min, max) range
  drawn uniformly per app.
- ``kind``: ``fixed``, ``successive_halving``, ``curve_stopping`` (paper 4.3.2); a list of kinds
  draws each app's kind uniformly from it, and ``mixed`` is the list of all three.
- ``gpus``: each app's GPUs per job (its jobs' ``job_demand_max``), a number or choices drawn
  uniformly; ``job_duration_s``: a job's run time on those GPUs at linear speedup, drawn
  log-uniformly from a (min, max) range (the default, 15 minutes to 4 hours, is about the bulk of
  Philly's search jobs: their 20th to 90th percentiles are 11 minutes to 2.5 hours). An app's work
  is the sum of duration x GPUs of its jobs; a successive-halving app spreads that same budget
  evenly over its phases (``hyperband.halving_phases``), a curve-stopping app has it as the cap.
- ``load``: the offered load on ``cluster_gpus`` GPUs, i.e. arrival rate x mean app work /
  cluster GPUs. Arrivals are a Poisson process (exponential gaps, first app at 0) at rate
  ``load * cluster_gpus / mean work``: doubling ``load`` halves every arrival time. For
  curve-stopping apps the work counted is the cap, so their real load is lower.
- ``network_fraction``: ``None`` draws models by paper Table 4's mix (``philly.draw_model``);
  a number f puts round(f x apps) apps, chosen at random, on network-intensive models (those whose
  slowdown across racks, level 3, is at least 1.5 in the profile table: alexnet, vgg16, vgg19, lm,
  transformer, bidaf, gnmt) and the rest on the others, uniformly within each set. This is the
  knob of the paper's placement-sensitivity study (section 6.3, Figure 13: 0-100% network-
  intensive apps).

Each aspect draws from its own seeded stream, so changing one knob changes only what it governs:
``network_fraction`` never moves arrivals, ``load`` never changes the apps.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from agent.placement import ModelProfile
from simulator.workload import KINDS, AppSpec, JobSpec, Workload
from simulator.workloads import WorkloadError, register
from simulator.workloads.hyperband import halving_phases
from simulator.workloads.philly import draw_iter_times, draw_model, shipped_profiles

NETWORK_SLOWDOWN = 1.5  # level-3 slowdown from which a model counts as network-intensive

def as_kinds(kind: str | Sequence[str]) -> tuple[str, ...]:
    kinds = KINDS if kind == "mixed" else (kind,) if isinstance(kind, str) else tuple(kind)
    if not kinds or any(k not in KINDS for k in kinds):
        raise WorkloadError(f"kind must be one of {', '.join(KINDS)}, a list of them, or 'mixed', got {kind!r}")
    return kinds


def network_intensive(profiles: Mapping[str, ModelProfile]) -> tuple[str, ...]:
    """Models whose cross-rack slowdown S (D1 level 3) is at least :data:`NETWORK_SLOWDOWN`."""
    return tuple(sorted(name for name, p in profiles.items() if p.slowdown[3] >= NETWORK_SLOWDOWN))


@dataclass(frozen=True)
class AppDraw:
    """What the content stream decides for one app, before models and arrivals."""

    kind: str
    gpus: int
    durations_s: tuple[float, ...]  # per job, on ``gpus`` GPUs

    @property
    def work_gpu_s(self) -> float:
        return sum(self.durations_s) * self.gpus


def as_range(value: int | Sequence[int], name: str) -> tuple[int, int]:
    lo, hi = (value, value) if isinstance(value, int) else tuple(value)
    if not 1 <= lo <= hi:
        raise WorkloadError(f"{name} must be >= 1 (or a range lo <= hi), got {value!r}")
    return lo, hi


def as_choices(value: int | Sequence[int], name: str) -> tuple[int, ...]:
    choices = (value,) if isinstance(value, int) else tuple(value)
    if not choices or any(not isinstance(c, int) or c < 1 for c in choices):
        raise WorkloadError(f"{name} must be whole numbers >= 1, got {value!r}")
    return choices


def draw_apps(rng: random.Random, apps: int, size: tuple[int, int], kinds: tuple[str, ...], gpus: tuple[int, ...],
              duration_s: tuple[float, float]) -> list[AppDraw]:
    lo, hi = math.log(duration_s[0]), math.log(duration_s[1])
    draws = []
    for _ in range(apps):
        n = rng.randint(*size)
        app_kind = rng.choice(kinds) if len(kinds) > 1 else kinds[0]
        draws.append(AppDraw(app_kind, rng.choice(gpus), tuple(math.exp(rng.uniform(lo, hi)) for _ in range(n))))
    return draws


def draw_models(rng: random.Random, apps: int, network_fraction: float | None) -> list[str]:
    profiles = shipped_profiles()
    if network_fraction is None:
        return [draw_model(rng, profiles) for _ in range(apps)]
    heavy = network_intensive(profiles)
    light = tuple(sorted(set(profiles) - set(heavy)))
    chosen = set(rng.sample(range(apps), round(network_fraction * apps)))
    return [rng.choice(heavy if i in chosen else light) for i in range(apps)]


def poisson_arrivals(rng: random.Random, apps: int, rate_per_s: float) -> list[float]:
    """Arrival times of a Poisson process at ``rate_per_s``, the first at 0."""
    times, now = [], 0.0
    for i in range(apps):
        if i:
            now += rng.expovariate(rate_per_s)
        times.append(now)
    return times


def build_app(app_id: str, draw: AppDraw, model: str, iter_times: Sequence[float], arrival_s: float,
              seed: int) -> AppSpec:
    if draw.kind == "successive_halving":
        phases = halving_phases(len(iter_times), draw.work_gpu_s, statistics.median(iter_times))
        jobs = tuple(JobSpec(f"{app_id}/j{k}", phases[0], t, draw.gpus) for k, t in enumerate(iter_times))
        return AppSpec(app_id, arrival_s, model, draw.kind, jobs, phases, seed)
    jobs = tuple(JobSpec(f"{app_id}/j{k}", d * draw.gpus / t, t, draw.gpus)
                 for k, (d, t) in enumerate(zip(draw.durations_s, iter_times, strict=True)))
    return AppSpec(app_id, arrival_s, model, draw.kind, jobs, seed=seed)


@register("synthetic")
def synthetic(
    *,
    seed: int = 0,
    apps: int = 50,
    app_size: int | Sequence[int] = 4,
    kind: str | Sequence[str] = "fixed",
    load: float = 0.8,
    cluster_gpus: int = 256,
    network_fraction: float | None = None,
    gpus: int | Sequence[int] = (1, 2, 4, 8),
    job_duration_s: Sequence[float] = (900.0, 14_400.0),
) -> Workload:
    """Poisson arrivals of generated searches: apps, app_size, kind, load, network_fraction."""
    if apps < 1:
        raise WorkloadError(f"apps must be >= 1, got {apps!r}")
    kinds = as_kinds(kind)
    if not (load > 0 and math.isfinite(load)) or cluster_gpus < 1:
        raise WorkloadError("load must be > 0 and cluster_gpus >= 1")
    if network_fraction is not None and not 0 <= network_fraction <= 1:
        raise WorkloadError(f"network_fraction must be between 0 and 1, got {network_fraction!r}")
    d_lo, d_hi = (float(x) for x in job_duration_s)
    if not 0 < d_lo <= d_hi:
        raise WorkloadError(f"job_duration_s must be a range 0 < lo <= hi, got {job_duration_s!r}")
    streams = {s: random.Random(f"{seed}:{s}") for s in ("apps", "models", "iter-times", "arrivals", "app-seeds")}
    draws = draw_apps(streams["apps"], apps, as_range(app_size, "app_size"), kinds, as_choices(gpus, "gpus"),
                      (d_lo, d_hi))
    models = draw_models(streams["models"], apps, network_fraction)
    rate = load * cluster_gpus / statistics.fmean(d.work_gpu_s for d in draws)
    arrivals = poisson_arrivals(streams["arrivals"], apps, rate)
    specs = tuple(
        build_app(f"syn-{i:04d}", draw, model,
                  draw_iter_times(streams["iter-times"], model, len(draw.durations_s)),
                  arrival, streams["app-seeds"].randrange(2**31))
        for i, (draw, model, arrival) in enumerate(zip(draws, models, arrivals, strict=True))
    )
    source = (f"synthetic: {apps} apps of {app_size} jobs, kind {kind}, load {load:g} on {cluster_gpus} GPUs, "
              f"network_fraction {network_fraction}, GPUs per job {gpus}, job durations {d_lo:g}-{d_hi:g} s, "
              f"seed {seed}")
    return Workload("synthetic", specs, source)


@register("small")
def small(*, seed: int = 0) -> Workload:
    """24 fixed and successive-halving apps arriving over about an hour: the quick run on sim-256.

    Curve-stopping apps are left out: with them a run this size currently takes minutes rather
    than seconds (every loss report refits a curve); ``synthetic(kind="mixed")`` has all three.
    """
    workload = synthetic(seed=seed, apps=24, app_size=(2, 8), kind=("fixed", "successive_halving"), load=1.2,
                         gpus=(1, 2, 4, 8), job_duration_s=(600.0, 3600.0))
    return replace(workload, name="small", source=f"small (bundled, seed {seed}) = {workload.source}")


@register("contended")
def contended(*, seed: int = 0) -> Workload:
    """The main job's workload (issue 11): 48 searches arriving at offered load 2 on testbed-64.

    Same generator and apps as ``small`` (fixed and successive-halving searches of 2-8 jobs, 1-8
    GPUs per job, 10-60 min per job) but twice the work the cluster can do while they arrive: the
    contention Themis is for (paper 6.2), where a policy that ignores finish-time fairness leaves
    some apps finishing later than on their own 1/N share (rho > 1). Its numbers were chosen once,
    from the issue's floor (load >= 2) and the smallest cluster we ship, not from any result.
    """
    workload = synthetic(seed=seed, apps=48, app_size=(2, 8), kind=("fixed", "successive_halving"), load=2.0,
                         cluster_gpus=64, gpus=(1, 2, 4, 8), job_duration_s=(600.0, 3600.0))
    return replace(workload, name="contended",
                   source=f"contended (bundled, seed {seed}; run it on testbed-64) = {workload.source}")
