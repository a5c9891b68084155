"""Blox's Philly-Trace (seeds/000, section 4 "Workloads" and 5.1, Figs. 12-13): single training
jobs from the Philly trace arriving as a Poisson process, optionally with a daily spike.

Blox "randomly assign[s] jobs to use one of the models" and "assign[s] job arrival times using a
Poisson arrival process"; Figs. 12-13 run it at 8 jobs per hour on 128 GPUs, Fig. 13 with "an
additional 16 jobs during one hour in each day". This module rebuilds that from the Philly trace
the project ships (``data/philly/philly-jobs.csv``); every step is a knob of :func:`blox_philly`.

1. Jobs: the trace's rows whose duration is above 10^1.5 minutes (31.6 min) and below 10^4
   minutes (6.9 days) and that use at most 16 GPUs -- the window of Blox's Philly parser (Gavel's
   "gavel/gandiva like workload"; ``min_duration_s``, ``max_duration_s``, ``max_gpus``): 31,676 of
   the trace's 82,247 rows, 21.1 GPU-hours each on average (91% one GPU).
2. ``jobs`` of them are drawn uniformly at random (the seed's ``blox-jobs`` stream). Each is one
   app of one ``fixed`` job (Blox schedules jobs, not searches) running its trace duration on its
   trace GPU count at linear speedup, as in Workload 1 (``philly.trace_app``).
3. Arrivals: exponential gaps at ``rate_per_hour``, the first at 0. At 8 jobs per hour that is 169
   GPU-hours offered per hour: 1.32 times a 128-GPU cluster, so the backlog grows while jobs
   arrive (Blox: LAS's average JCT climbs steeply above 7 jobs per hour, its Fig. 6).
4. Spike (``spike_jobs``, ``spike_hour``): that many more jobs on every simulated day whose
   ``spike_hour``-th hour starts before the last regular arrival, each arriving uniformly within
   that hour (their own draws, so a spike leaves the regular jobs as they were).
5. Models and one-GPU iteration times as Workload 1 (``philly.draw_model``, ``draw_iter_times``).

Blox tracks jobs 3,000-4,000 of a long stream for a steady state; a run of a few hundred jobs here
includes the ramp-up and the drain after the last arrival (docs/reproduction.md says what that
changes).
"""

from __future__ import annotations

import random
from pathlib import Path

from simulator.workload import AppSpec, Workload
from simulator.workloads import WorkloadError, register
from simulator.workloads.philly import (
    DEFAULT_TRACE,
    TraceJob,
    draw_iter_times,
    draw_model,
    read_philly,
    shown_path,
    trace_app,
)

#: Blox's window on the trace (its Philly parser): 10^1.5 to 10^4 minutes, at most 16 GPUs.
MIN_DURATION_S = 10 ** 1.5 * 60
MAX_DURATION_S = 10 ** 4 * 60
MAX_GPUS = 16


def blox_jobs(trace: str | Path, min_duration_s: float, max_duration_s: float, max_gpus: int) -> list[TraceJob]:
    """The trace's rows in Blox's window (step 1), in file order."""
    return [j for j in read_philly(trace) if min_duration_s < j.duration_s < max_duration_s and j.gpus <= max_gpus]


@register("blox-philly", "blox")
def blox_philly(*, seed: int = 0, jobs: int = 300, rate_per_hour: float = 8.0, spike_jobs: int = 0,
                spike_hour: float = 12.0, min_duration_s: float = MIN_DURATION_S,
                max_duration_s: float = MAX_DURATION_S, max_gpus: int = MAX_GPUS,
                trace: str = str(DEFAULT_TRACE)) -> Workload:
    """Blox's Philly-Trace: single Philly jobs, Poisson arrivals, optionally a daily spike (Figs. 12-13)."""
    checks = [(isinstance(jobs, int) and jobs >= 1, f"jobs must be a whole number >= 1, got {jobs!r}"),
              (rate_per_hour > 0, f"rate_per_hour must be > 0, got {rate_per_hour!r}"),
              (isinstance(spike_jobs, int) and spike_jobs >= 0, f"spike_jobs must be a whole number >= 0, got {spike_jobs!r}"),
              (0 <= spike_hour < 24, f"spike_hour must be within [0, 24), got {spike_hour!r}"),
              (0 <= min_duration_s < max_duration_s, "min_duration_s must be >= 0 and below max_duration_s"),
              (isinstance(max_gpus, int) and max_gpus >= 1, f"max_gpus must be a whole number >= 1, got {max_gpus!r}")]
    for ok, message in checks:
        if not ok:
            raise WorkloadError(f"blox-philly: {message}")
    pool = blox_jobs(trace, min_duration_s, max_duration_s, max_gpus)
    if len(pool) < jobs:
        raise WorkloadError(f"blox-philly: {trace} has {len(pool)} jobs in the window, fewer than jobs={jobs}")
    pick, gaps, spike_rng = (random.Random(f"{seed}:{s}") for s in ("blox-jobs", "blox-arrivals", "blox-spike"))
    chosen = [pool[i] for i in pick.sample(range(len(pool)), jobs)]
    arrivals, t = [], 0.0
    for k in range(jobs):
        arrivals.append(t)
        t += gaps.expovariate(rate_per_hour / 3600.0)
    last = arrivals[-1]
    spikes = []
    day = 0
    while spike_jobs and day * 86_400 + spike_hour * 3600 <= last:
        start = day * 86_400 + spike_hour * 3600
        spikes += [(start + spike_rng.uniform(0, 3600), pool[spike_rng.randrange(len(pool))]) for _ in range(spike_jobs)]
        day += 1
    timed = sorted([(a, j, False) for a, j in zip(arrivals, chosen)] + [(a, j, True) for a, j in spikes],
                   key=lambda x: (x[0], x[2], x[1].line))
    model_rng, time_rng, seed_rng = (random.Random(f"{seed}:blox-{s}") for s in ("models", "iter-times", "app-seeds"))
    apps: list[AppSpec] = []
    for i, (arrival, job, spiked) in enumerate(timed):
        model = draw_model(model_rng)
        app_id = f"bx-{i:04d}" + ("s" if spiked else "")
        apps.append(trace_app(app_id, [job], arrival, model, draw_iter_times(time_rng, model, 1), None,
                              seed_rng.randrange(2**31)))
    gpu_hours = sum(j.duration_s * j.gpus for _, j, _ in timed) / 3600
    source = (f"Blox's Philly-Trace from {shown_path(trace)}: {jobs} of its {len(pool)} jobs of "
              f"{min_duration_s / 60:.3g}-{max_duration_s / 60:.4g} min on <= {max_gpus} GPUs, Poisson arrivals at "
              f"{rate_per_hour:g}/h" + (f", +{spike_jobs} in hour {spike_hour:g} of each day ({len(spikes)} in all)"
                                       if spike_jobs else "") + f", {gpu_hours:.0f} GPU-hours, seed {seed}")
    return Workload("blox-philly", tuple(apps), source)
