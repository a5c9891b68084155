"""What a simulation run measured (paper 6.1 "Metrics"): finish-time fairness, GPU time,
placement score, completion times.

Per app: rho = (finish - arrival) / T_id with N_avg over the app's life (D5), completion time,
GPU time (GPU-seconds held), placement score (1/S averaged over the GPU time its jobs ran), restarts.
Per run: max / mean / median / p95 rho, Jain's index of rho, average and p95 completion time, total
GPU time, makespan, utilization (GPU time / (cluster size x makespan)), rounds, auctions, wall time.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from simulator.engine import SimulationResult, app_rho


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0 for no values."""
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
                "n_avg": run.n_avg_at_finish,
                "gpu_time_s": run.gpu_seconds,
                "placement_score": run.scored / run.busy_gpu_seconds if run.busy_gpu_seconds else 1.0,
                "restarts": run.restarts,
            }
        )
    return rows


def summarize(result: SimulationResult, **extra: Any) -> dict[str, Any]:
    """The run's ``summary.json``: the headline numbers first, then one row per app."""
    apps = app_rows(result)
    rho = [a["rho"] for a in apps]
    jct = [a["jct_s"] for a in apps]
    gpu_time = sum(a["gpu_time_s"] for a in apps)
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
        "jain_rho": jain_index(rho),
        "share_rho_le_1": sum(r <= 1.0 for r in rho) / len(rho) if rho else 1.0,
        "gpu_time": gpu_time,
        "avg_jct": statistics.fmean(jct) if jct else 0.0,
        "p95_jct": percentile(jct, 95),
        "makespan": result.makespan,
        "utilization": gpu_time / (result.cluster_size * result.makespan) if result.makespan else 0.0,
        "mean_placement_score": statistics.fmean(a["placement_score"] for a in apps) if apps else 1.0,
        "restarts": sum(a["restarts"] for a in apps),
        "rounds": result.rounds,
        "auctions": result.auctions,
        "wall_seconds": result.wall_seconds,
        "apps": apps,
    }


def write_summary(summary: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=1))
    return path
