"""Workload 2 (paper section 6.1): Workload 1's arrivals, Hyperband's successive-halving apps.

The paper keeps "the app arrival times from Workload 1, generate[s] jobs per app using the
successive halving pattern characteristic of the Hyperband algorithm, and increase[s] the number
of tasks per job". Here each Workload 1 app (same knobs, same seed) becomes:

- jobs: n = 2^k configurations with 2^k the largest power of two not above the Workload 1 app's
  job count, and k at most ``max_halvings`` (6: at most 64 jobs, 7 phases; Workload 1's apps
  have up to 100 jobs);
  the configurations are the app's first n jobs, with their iteration times.
- phases: k + 1 (n, n/2, ..., 1 jobs). The app's budget B is the Workload 1 app's total work
  (GPU-seconds at S = 1), spread evenly over the phases as in paper 4.3.3 (its 4-job app with
  B = 10,000 and 100 s median iterations runs "about 8, 16, 36" iterations per phase; exactly
  even shares are 8.3, 16.7, 33.3):
  phase i runs B / ((k + 1) * (n / 2^i) * median iteration time) iterations per job.
- GPUs per job: drawn uniformly from ``gpus_choices`` (1, 2, 4 or 8; every job of an app has the
  same demand), where 98% of Workload 1's jobs use one GPU.
- model, arrival and loss seed: those of the Workload 1 app, so both workloads share Table 4's mix
  and the same arrival process.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence

from simulator.workload import AppSpec, JobSpec, Workload
from simulator.workloads import WorkloadError, register
from simulator.workloads.philly import PHILLY_KNOBS, workload1

DEFAULT_GPUS_CHOICES = (1, 2, 4, 8)
DEFAULT_MAX_HALVINGS = 6


def halving_phases(n_jobs: int, budget_gpu_s: float, iter_time_s: float) -> tuple[float, ...]:
    """Iterations per job of each successive-halving phase, each phase getting an equal share of
    ``budget_gpu_s`` (paper 4.3.2/4.3.3). Phase i (from 0) runs ``max(1, n // 2**i)`` jobs at
    ``iter_time_s``, the same estimate ``agent.appsched.SuccessiveHalvingApp.budget`` uses, so the
    app's planned work adds up to the budget."""
    if n_jobs < 1 or not budget_gpu_s > 0 or not iter_time_s > 0:
        raise ValueError("halving needs >= 1 job, a budget > 0 and an iteration time > 0")
    phases = int(math.log2(n_jobs)) + 1
    share = budget_gpu_s / phases
    return tuple(share / (max(1, n_jobs // 2**i) * iter_time_s) for i in range(phases))


def halving_app(app: AppSpec, app_id: str, gpus: int, max_halvings: int) -> AppSpec:
    """The successive-halving version of a Workload 1 app (module docstring)."""
    halvings = min(max_halvings, int(math.log2(len(app.jobs))))
    configs = app.jobs[: 2**halvings]
    iter_times = [j.iter_time_s for j in configs]
    budget = sum(j.iterations * j.iter_time_s for j in app.jobs)
    phases = halving_phases(len(configs), budget, statistics.median(iter_times))
    jobs = tuple(JobSpec(f"{app_id}/j{k}", phases[0], t, gpus) for k, t in enumerate(iter_times))
    return AppSpec(app_id, app.arrival_s, app.model, "successive_halving", jobs, phases, app.seed)


def check_knobs(gpus_choices: Sequence[int], max_halvings: int) -> None:
    if not gpus_choices or any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in gpus_choices):
        raise WorkloadError(f"gpus_choices must be whole numbers >= 1, got {gpus_choices!r}")
    if max_halvings < 0:
        raise WorkloadError("max_halvings must be >= 0")


@register("workload2", "hyperband", knobs=("gpus_choices", "max_halvings", *PHILLY_KNOBS))
def workload2(
    *,
    seed: int = 0,
    gpus_choices: Sequence[int] = DEFAULT_GPUS_CHOICES,
    max_halvings: int = DEFAULT_MAX_HALVINGS,
    **philly_knobs,
) -> Workload:
    """Paper Workload 2: Workload 1's arrivals with Hyperband successive-halving apps, wider jobs."""
    check_knobs(gpus_choices, max_halvings)
    base = workload1(seed=seed, **philly_knobs)
    rng = random.Random(f"{seed}:hyperband-gpus")
    apps = tuple(
        halving_app(app, app.app_id.replace("w1-", "w2-", 1), rng.choice(tuple(gpus_choices)), max_halvings)
        for app in base.apps
    )
    jobs = sum(len(a.jobs) for a in apps)
    source = (f"Workload 1's arrivals and budgets, successive halving of up to {2**max_halvings} jobs, "
              f"GPUs per job from {tuple(gpus_choices)}: {len(apps)} apps, {jobs} phase-1 jobs; "
              f"from {base.source}")
    return Workload("workload2", apps, source)
