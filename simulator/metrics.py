"""What a simulation run measured (paper 6.1 "Metrics"): finish-time fairness, GPU time,
placement score, completion times, and where the GPUs came from.

Per app: rho = (finish - arrival) / T_id with N_avg over the app's life (D5); the
contention-normalised ``rho_share`` = (finish - arrival) / (time on a dedicated 1/N_avg share of the
cluster), which Shockwave and Gavel publish and which Eq. 1 understates for apps smaller than the
cluster; the ideal time T_id; completion time, GPU time (GPU-seconds held), placement score (1/S
averaged over the GPU time its jobs ran), restarts (by cause, ``RESTART_CAUSES``, and by the time
since the same job's previous restart, ``RESTART_GAPS``).

Per app also the contention ratio its jobs ran at and, with a contention model (D35), the time they
held GPUs (``running_s``) and their preemptions.

Per run: max / mean / median / p95 / p99 rho, max rho over apps whose ideal time is at least
``FLOOR_S`` (a one-minute app's rho is set by waiting for a round and a restart under any policy),
Jain's index of rho, the same for rho_share, average and p95 completion time (and average, p90
and max as ``avg_jct_s``, ``p90_jct_s``, ``max_jct_s``), the apps' mean contention ratio, total GPU time,
makespan, utilization (GPU time / (cluster size x makespan)), restarts per job and by cause, rounds, auctions,
the share of GPUs granted by the auction, by the reserve in rank order and by the random leftover
in rounds with bidders (D8, D9, D14), auctions that were not canonical (D16), wall time.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from agent.fairness import ideal_time
from simulator.engine import RESTART_CAUSES, RESTART_GAPS, AppRun, SimulationResult, app_rho, share_time

RESTART_GAP_LABELS = ("first", *(label for _, label in RESTART_GAPS))  # the summary's order
FLOOR_S = 600.0  # apps with an ideal time below this are left out of ``max_rho_floor``


def percentile(values: list[float], q: float) -> float:
    """The sorted values' element at index round(q / 100 * (n - 1)) (q in [0, 100]; Python's
    round, halves to even): the lower-interpolation rank rounded, not the textbook nearest rank
    ceil(q / 100 * n) - 1, which is one higher at some sizes. 0 for no values. Below about 100
    apps the p99 is the max."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def jain_index(values: list[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one value holds everything."""
    if not values:
        return 1.0
    square_sum = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * square_sum) if square_sum else 1.0


def app_rows(result: SimulationResult) -> list[dict[str, Any]]:
    rows = []
    for run in result.apps:
        assert run.finished_at is not None
        rows.append(
            {
                "app": run.spec.app_id,
                "model": run.spec.model,
                "kind": run.spec.kind,
                "jobs": len(run.spec.jobs),
                "arrival_s": run.spec.arrival_s,
                "finish_s": run.finished_at,
                "jct_s": run.finished_at - run.spec.arrival_s,
                "rho": app_rho(run, result.cluster_size),
                "rho_share": (run.finished_at - run.spec.arrival_s) / share_time(run, result.cluster_size),
                "ideal_s": ideal_time(run.app, n_avg=run.n_avg_at_finish, cluster_size=result.cluster_size),
                "n_avg": run.n_avg_at_finish,
                "gpu_time_s": run.gpu_seconds,
                "placement_score": run.scored / run.busy_gpu_seconds if run.busy_gpu_seconds else 1.0,
                "restarts": run.restarts,
                "restarts_by_cause": dict(run.restarts_by),
                "restart_gaps": dict(run.restart_gaps),
                "deferred_resplits": run.deferred,
                "auction_wins": run.auction_wins,
                "mean_hidden_payment": _mean_payment(run),
                **({"hidden_payment_bounds": _payment_bounds(run)} if run.bounded_wins else {}),
                # D35: the contention ratio its jobs ran at (GPU-time weighted; 1 without a contention
                # model), the time they held GPUs and their preemptions (None without one)
                "mean_ratio": run.contention.mean_ratio if run.contention is not None else 1.0,
                "running_s": run.contention.running_s if run.contention is not None else None,
                "preempted": run.contention.preempted if run.contention is not None else None,
            }
        )
    return rows


def _mean_payment(run: AppRun) -> float | None:
    """1 - the mean c_i over the app's auction wins; None when the bounds decided some of its
    lotteries (D42): their exact c_i is not known, and a number in between would look like it."""
    if run.bounded_wins:
        return None
    return 1 - run.kept_sum / run.auction_wins if run.auction_wins else 0.0


def _payment_bounds(run: AppRun) -> list[float]:
    """[least, most] the app's mean hidden payment can be, from its exact c_i and the bounds (D42)."""
    lo, hi = run.kept_bounds
    return [1 - (run.kept_sum + hi) / run.auction_wins, 1 - (run.kept_sum + lo) / run.auction_wins]


def summarize(result: SimulationResult, **extra: Any) -> dict[str, Any]:
    """The run's ``summary.json``: the headline numbers first, then one row per app."""
    apps = app_rows(result)
    rho = [a["rho"] for a in apps]
    shared = [a["rho_share"] for a in apps]
    floored = [a["rho"] for a in apps if a["ideal_s"] >= FLOOR_S]
    jct = [a["jct_s"] for a in apps]
    gpu_time = sum(a["gpu_time_s"] for a in apps)
    granted = sum(result.granted_by.values())
    jobs = sum(a["jobs"] for a in apps)
    return {
        "policy": result.policy,
        "cluster": result.cluster,
        "workload": result.workload,
        **extra,
        "apps_count": len(apps),
        "max_rho": max(rho, default=0.0),
        "mean_rho": statistics.fmean(rho) if rho else 0.0,
        "median_rho": statistics.median(rho) if rho else 0.0,
        "p95_rho": percentile(rho, 95),
        "p99_rho": percentile(rho, 99),
        "max_rho_floor": max(floored, default=0.0),
        "floor_s": FLOOR_S,
        "jain_rho": jain_index(rho),
        "share_rho_le_1": sum(r <= 1.0 for r in rho) / len(rho) if rho else 1.0,
        "max_rho_share": max(shared, default=0.0),
        "mean_rho_share": statistics.fmean(shared) if shared else 0.0,
        "share_rho_share_gt_1": sum(r > 1.0 for r in shared) / len(shared) if shared else 0.0,
        "jain_rho_share": jain_index(shared),
        "gpu_time": gpu_time,
        "avg_jct": statistics.fmean(jct) if jct else 0.0,
        "p95_jct": percentile(jct, 95),
        # completion time from submission under the names of the DeepShare comparison (seconds)
        "avg_jct_s": statistics.fmean(jct) if jct else 0.0,
        "p90_jct_s": percentile(jct, 90),
        "max_jct_s": max(jct, default=0.0),
        # D35: the apps' mean contention ratio (1: every job ran as if alone, as it does without a model)
        "mean_contention_ratio": statistics.fmean(a["mean_ratio"] for a in apps) if apps else 1.0,
        "makespan": result.makespan,
        "utilization": gpu_time / (result.cluster_size * result.makespan) if result.makespan else 0.0,
        "mean_placement_score": statistics.fmean(a["placement_score"] for a in apps) if apps else 1.0,
        "restarts": sum(a["restarts"] for a in apps),
        "restarts_per_job": sum(a["restarts"] for a in apps) / jobs if jobs else 0.0,
        "restarts_by_cause": {cause: sum(a["restarts_by_cause"].get(cause, 0) for a in apps) for cause in RESTART_CAUSES},
        "restart_gaps": {gap: sum(a["restart_gaps"].get(gap, 0) for a in apps) for gap in RESTART_GAP_LABELS},
        "rounds": result.rounds,
        "auctions": result.auctions,
        "noncanonical_auctions": result.noncanonical,
        "zeroed_auctions": result.zeroed,
        "zeroed_first": result.zeroed_first,
        "reclaimed_leases": result.reclaimed,
        "granted_by": dict(result.granted_by),
        "share_auction": result.granted_by.get("auction", 0) / granted if granted else 0.0,
        "share_queue": result.granted_by.get("queue", 0) / granted if granted else 0.0,
        "share_leftover": result.granted_by.get("leftover", 0) / granted if granted else 0.0,
        "wall_seconds": result.wall_seconds,
        "apps": apps,
    }


def write_summary(summary: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=1))
    return path
