"""Several seeds per claim: simulations run in parallel processes, each metric reported as its mean
with a 95% confidence interval and the per-seed values (issue 13; every published figure).

A seed fixes everything random in a run: the workload's draws, the loss curves, the rounds'
tie-break and lottery draws (D13, D15). Runs are independent, so they go to a process pool; results
come back in submission order, so the aggregate does not depend on which process finished first.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, TypeVar

T = TypeVar("T")

# Two-sided 95% critical values of Student's t by degrees of freedom (1-30); beyond, t95() expands.
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042]

# The headline numbers of a run summary that get an interval (simulator.metrics.summarize).
METRICS = ("max_rho", "mean_rho", "median_rho", "p95_rho", "p99_rho", "max_rho_floor", "jain_rho",
           "share_rho_le_1", "max_rho_share", "mean_rho_share", "share_rho_share_gt_1", "jain_rho_share",
           "gpu_time", "avg_jct", "p95_jct", "makespan", "utilization", "mean_placement_score", "restarts",
           "restarts_per_job", "rounds", "auctions", "noncanonical_auctions", "zeroed_auctions", "zeroed_first",
           "reclaimed_leases", "share_auction", "share_queue",
           "share_leftover", "wall_seconds")


def t95(n: int) -> float:
    """The critical value for a 95% interval of a mean of ``n`` values. Beyond 30 degrees of
    freedom, the Cornish-Fisher expansion of t around the normal 1.96 (within 1e-4 of the table's
    values there; 1.96 itself was 3% narrow at 40 seeds)."""
    if 2 <= n <= len(_T95) + 1:
        return _T95[n - 2]
    if n < 2:
        return 1.96
    z, df = 1.959964, n - 1
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def interval(values: Sequence[float]) -> dict[str, Any]:
    """Mean, 95% interval (Student's t) and the values themselves; one value has no interval."""
    xs = [float(v) for v in values]
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return {"mean": mean, "ci95": [mean, mean], "half": 0.0, "values": xs}
    half = t95(len(xs)) * statistics.stdev(xs) / math.sqrt(len(xs))
    return {"mean": mean, "ci95": [mean - half, mean + half], "half": half, "values": xs}


#: Fields of a run summary that are the run's outcome but no metric: never a setting the seeds share,
#: even when there is one seed (a one-seed result kept them, and ``themis-sim pool`` then took them
#: for settings that differ between its parts and refused to pool).
PER_RUN = ("apps", "seed", "granted_by", "restarts_by_cause", "restart_gaps")


def aggregate(summaries: Sequence[Mapping[str, Any]], keys: Iterable[str] = METRICS) -> dict[str, Any]:
    """One run summary per seed -> per metric :func:`interval`, plus the seeds and the fields every
    seed shares (policy, cluster, workload, settings)."""
    out: dict[str, Any] = {"seeds": [s.get("seed") for s in summaries]}
    first = summaries[0]
    for key, value in first.items():
        if key in PER_RUN or key in keys:
            continue
        if all(s.get(key) == value for s in summaries):
            out[key] = value
    for key in keys:
        values = [s[key] for s in summaries if isinstance(s.get(key), (int, float))]
        if len(values) == len(summaries):
            out[key] = interval(values)
    return out


def run_parallel(fn: Callable[..., T], jobs: Sequence[Mapping[str, Any]], *, workers: int | None = None,
                 progress: Callable[[int], None] | None = None) -> list[T]:
    """``fn(**job)`` for every job, in a pool of ``workers`` processes (default: the machine's
    cores, at most the number of jobs); results in the order of ``jobs``. ``progress`` is called
    with the number of finished jobs as each one finishes, whatever its place in ``jobs``.

    The workers are spawned, not forked: a fork copies whatever threads and native state the
    parent holds (gRPC channels, solver and BLAS pools in a test run or a service), and one such
    child crashed in the garbage collector and another spun for 15 minutes. A spawned worker starts
    clean and learns user additions from the environment (``THEMIS_PLUGINS``, ``THEMIS_PROFILES``)."""
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    if workers == 1:
        out = []
        for job in jobs:
            out.append(fn(**job))
            if progress:
                progress(len(out))
        return out
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(fn, **job) for job in jobs]
        try:
            for done, future in enumerate(as_completed(futures), start=1):
                future.result()
                if progress:
                    progress(done)
        except BaseException:
            for future in futures:  # a failed run (or Ctrl-C) ends the batch without running the rest
                future.cancel()
            raise
        return [future.result() for future in futures]


def fmt(stat: Mapping[str, Any] | float, spec: str = "{:.2f}", scale: float = 1.0) -> str:
    """'mean±half' for an interval, plain for a number."""
    if isinstance(stat, Mapping):
        mean, half = stat["mean"] / scale, stat["half"] / scale
        return spec.format(mean) + (f"±{spec.format(half)}" if half else "")
    return spec.format(stat / scale)
