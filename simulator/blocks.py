"""What Blox's two blocks did in one simulation: admission waits (D33) and loss-based termination
(D34), as numbers added to the run's summary.

Added only when a run names an admission policy or a convergence rule (``simulate(admission=...,
convergence=...)``, ``themis-sim --admission/--converge``), so every other summary stays as it was.
Per run: the admission policy, how many apps waited for it and how long (mean, max), the apps'
mean time from arrival to their first GPU (Blox's *responsiveness*), the convergence rule, how many
jobs it ended, and the mean over apps of each app's best loss (the lowest loss any of its jobs
reached on its simulated curve: what a search returns). Per app: its wait, its time to a first
GPU, the jobs the rule ended and its best loss.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from simulator.engine import AppRun, Simulation


def best_loss(run: AppRun) -> float:
    """The lowest loss any of the app's jobs reached (its simulated curve where the job stopped)."""
    losses = run.app.losses  # type: ignore[attr-defined]
    return min(losses.curves[j].loss(losses.done[j]) for j in losses.curves)


def app_blocks(run: AppRun) -> dict[str, Any]:
    arrival = run.spec.arrival_s
    wait = (run.admitted_at - arrival) if run.admitted_at is not None else 0.0
    return {"admission_wait_s": wait, "first_gpu_s": run.first_gpu_s, "converged_jobs": len(run.converged),
            "best_loss": best_loss(run)}


def add_blocks(summary: dict[str, Any], sim: Simulation, apps: Sequence[AppRun]) -> dict[str, Any]:
    """``summary`` (``simulator.metrics.summarize``'s, rows in ``apps``' order) with the blocks'
    numbers added, run level first."""
    rows = [app_blocks(run) for run in apps]
    waits = [r["admission_wait_s"] for r in rows]
    firsts = [r["first_gpu_s"] for r in rows if r["first_gpu_s"] is not None]
    rule = sim.convergence
    summary.update({
        "admission": sim.engine.admission.spec(),
        "admission_waited": sum(w > 0 for w in waits),
        "admission_mean_wait_s": statistics.fmean(waits) if waits else 0.0,
        "admission_max_wait_s": max(waits, default=0.0),
        "mean_first_gpu_s": statistics.fmean(firsts) if firsts else 0.0,
        "convergence": rule.spec() if rule is not None else None,
        "converged_jobs": sum(r["converged_jobs"] for r in rows),
        "mean_best_loss": statistics.fmean(r["best_loss"] for r in rows) if rows else 0.0,
    })
    for row, extra in zip(summary.get("apps", []), rows, strict=True):
        row.update(extra)
    return summary
