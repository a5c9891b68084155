"""``themis-sim experiment blox-admission``: Blox's admission study (seeds/000, section 5.1, Figs.
12-13) on this project's engine, then the same admission in front of Themis (D33).

Blox composes a FIFO admission block with LAS and consolidated placement and runs its Philly-Trace
at 8 jobs per hour on 128 GPUs (4 V100 per server), with and without "an additional 16 jobs during
one hour in each day". Its claims: FIFO admission at 1.2x the cluster's GPUs cuts LAS's average JCT
by 15% (Fig. 12; 1.5x: 5%, 1.0x: 30%) and by 27.3% with the spike (Fig. 13; 1.5x: 15.4%), at the
price of responsiveness (time to a first allocation).

Here: LAS is the ``tiresias`` policy (least attained GPU-seconds first, each app served its whole
demand while GPUs last; Blox's ``Las`` sorts by attained service too), the trace is
``simulator.workloads.blox_philly``, rounds are Blox's 5 minutes (the lease, D10), and admission is
``arbiter.admission.fifo`` at 1.0x, 1.2x and 1.5x beside accept-all. Every setting runs with both
workloads and LAS and Themis, at every seed.

Scale: Blox tracks jobs 3,000-4,000 of a stream at 8 jobs per hour on 128 GPUs; that needs about a
thousand jobs before the long ones (up to a week) fill the cluster, and Themis takes minutes per
such run. The default (``SCALES["sim"]``) keeps the offered load and every job as they are and
divides the cluster, the arrival rate and the spike by 4: 32 GPUs (8 x 4), 2 jobs per hour, a spike
of 4, 250 jobs -- the same 125 hours of arrivals as 1,000 jobs at Blox's rate, so the cluster fills
as it would. ``--quick`` runs accept-all and 1.2x only, without the restart-cost sweep (half the jobs
would never fill the cluster: nobody would wait). ``SCALES["blox"]`` is
Blox's own size, for :func:`blox_admission` called with ``scale="blox"``.

Reported per workload, policy and admission (mean and 95% interval over the seeds): average JCT of
all jobs and of the *tracked* jobs -- the middle half by arrival, this run's stand-in for Blox's
jobs 3,000-4,000, leaving out the ramp-up and the drain after the last arrival --, its change
against accept-all, max and mean rho (the waiting counts in rho, D33), time to a first GPU
(Blox's responsiveness), restarts per job and the admission waits. A last sweep runs LAS on the
steady workload with a restart cost of one whole round (``SENSITIVITY_RESTART_S``): admission saves
LAS's preemptions, and what they cost decides what it saves (docs/reproduction.md).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simulator.runs import console, run_seeds
from simulator.seeds import interval

ADMISSIONS = ("accept-all", "fifo:1.0", "fifo:1.2", "fifo:1.5")
QUICK_ADMISSIONS = ("accept-all", "fifo:1.2")
POLICIES = ("tiresias", "themis")  # LAS, then Themis
ROUND_S = 300.0  # Blox's round: 5 minutes
SENSITIVITY_RESTART_S = ROUND_S  # a preemption that costs a whole round
QUICK_CAVEAT = "accept-all and 1.2x only, and no restart-cost sweep (fewer jobs would never fill the cluster)"
#: Blox's claims: avg JCT change against accept-all, LAS (Figs. 12-13)
BLOX_CLAIMS = {"steady": {"fifo:1.0": -0.30, "fifo:1.2": -0.15, "fifo:1.5": -0.05},
               "spike": {"fifo:1.2": -0.273, "fifo:1.5": -0.154}}


@dataclass(frozen=True)
class Scale:
    gpus: int
    rate_per_hour: float
    spike_jobs: int
    jobs: int


SCALES = {
    "blox": Scale(128, 8.0, 16, 1000),  # Blox's own (one Themis run took over 16 minutes here: not run)
    "sim": Scale(32, 2.0, 4, 250),  # the same load and jobs on a quarter of the cluster
}


def blox_cluster(folder: Path, gpus: int) -> str:
    """Blox's cluster shape: servers of 4 GPUs (p3.8xlarge: one NVLink slot each), in one rack (its
    network is one 10 Gbps fabric); written into ``folder``."""
    if gpus % 4:
        raise ValueError(f"a Blox cluster has 4-GPU servers; {gpus} GPUs is not a multiple of 4")
    path = folder / "clusters" / f"blox-{gpus}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'name = "blox-{gpus}"\n[[racks]]\nname = "r0"\n'
                    f'machines = [{{ gpus = 4, slots = 1, count = {gpus // 4} }}]\n')
    return str(path)


def tracked_jct(summary: dict[str, Any]) -> float:
    """Average JCT of the middle half of the apps by arrival (Blox's steady-state window)."""
    apps = sorted(summary["apps"], key=lambda a: (a["arrival_s"], a["app"]))
    n = len(apps)
    middle = apps[n // 4: n - n // 4] or apps
    return statistics.fmean(a["jct_s"] for a in middle)


#: per-seed numbers kept for each setting: name -> how to read it from a run summary
MEASURES = {
    "avg_jct": lambda s: s["avg_jct"],
    "tracked_jct": tracked_jct,
    "max_rho": lambda s: s["max_rho"],
    "mean_rho": lambda s: s["mean_rho"],
    "first_gpu_s": lambda s: s["mean_first_gpu_s"],
    "restarts_per_job": lambda s: s["restarts_per_job"],
    "admission_waited": lambda s: s["admission_waited"],
    "admission_mean_wait_s": lambda s: s["admission_mean_wait_s"],
    "gpu_time": lambda s: s["gpu_time"],
}


def _point(summaries: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]] | None) -> dict[str, Any]:
    out = {name: interval([read(s) for s in summaries]) for name, read in MEASURES.items()}
    if base is not None:  # the change against accept-all, seed by seed (same workload and seed)
        for name in ("avg_jct", "tracked_jct", "max_rho"):
            out[f"{name}_change"] = interval([MEASURES[name](s) / MEASURES[name](b) - 1
                                              for s, b in zip(summaries, base, strict=True)])
    return out


def blox_admission(setup: Any, scale: str | None = None, policies: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the study (module docstring) into ``setup.out`` (a ``simulator.experiments.Setup``, not
    imported: that module imports this one); the result as JSON-ready data. ``policies`` None:
    :data:`POLICIES`."""
    size = SCALES[scale or "sim"]
    cluster = blox_cluster(setup.out, size.gpus)
    policies = list(policies or POLICIES)
    admissions = list(QUICK_ADMISSIONS if setup.quick else ADMISSIONS)
    knobs = {"jobs": size.jobs, "rate_per_hour": size.rate_per_hour}
    workloads = {"steady": knobs, "spike": {**knobs, "spike_jobs": size.spike_jobs}}
    base = {"cluster": cluster, "workload": "blox-philly", "lease": ROUND_S, **setup.run_options}
    grid = [(w, p, a) for w in workloads for p in policies for a in admissions]
    runs = [{**base, "workload_knobs": workloads[w], "policy": p, "admission": a} for w, p, a in grid]
    sensitive = [] if setup.quick or "tiresias" not in policies else [
        {**base, "workload_knobs": workloads["steady"], "policy": "tiresias", "admission": a,
         "restart": SENSITIVITY_RESTART_S} for a in admissions]
    done = run_seeds(runs + sensitive, setup.seeds, setup.workers,
                     f"blox-admission ({len(runs) + len(sensitive)} settings)", setup.store)
    by = dict(zip(grid, done[:len(runs)]))
    points: dict[str, dict[str, dict[str, Any]]] = {}
    for w, p, a in grid:
        points.setdefault(w, {}).setdefault(p, {})[a] = _point(
            by[(w, p, a)], by[(w, p, "accept-all")] if a != "accept-all" else None)
    sens = {}
    if sensitive:
        plain = done[len(runs)]
        sens = {a: _point(s, plain if a != "accept-all" else None) for a, s in zip(admissions, done[len(runs):])}
    first = by[grid[0]][0]
    result = {
        **setup.header("blox-admission"), "cluster": Path(cluster).stem, "gpus": size.gpus, "scale": vars(size),
        "round_s": ROUND_S, "policies": policies, "admissions": admissions, "workloads": workloads,
        "workload_source": {w: by[(w, policies[0], admissions[0])][0].get("workload_source") for w in workloads},
        "points": points, "blox_claims": BLOX_CLAIMS,
        "restart_sensitivity": {"restart_s": SENSITIVITY_RESTART_S, "policy": "tiresias", "workload": "steady",
                                "points": sens} if sens else None,
        "restart_s": first.get("restart_s"),
    }
    if setup.quick:
        result["quick_does_not_reproduce"] = [QUICK_CAVEAT]
    blox_plots(setup.out, result)
    _print_table(result)
    return result


def blox_plots(out: Path, result: dict[str, Any]) -> list[Path]:
    """Two PNGs, one group of bars per workload and policy (and the restart-cost sweep): the change
    in the tracked jobs' average JCT against accept-all, with Blox's claims marked, and max rho; a
    bar is the mean over the seeds, a dot each seed (the seeds differ in offered load)."""
    from simulator.plots import fit_titles, plt

    groups = [(f"{'LAS' if p == 'tiresias' else p}\n{w}", w, by_a) for w, by_p in result["points"].items()
              for p, by_a in by_p.items()]
    sens = result.get("restart_sensitivity")
    if sens:
        groups.append((f"LAS steady\nrestart {sens['restart_s']:g} s", None, sens["points"]))
    paths = []
    for name, key, label, admissions in (
            ("tracked_jct_change", "tracked_jct_change", "tracked jobs' avg JCT vs accept-all (%)",
             [a for a in result["admissions"] if a != "accept-all"]),
            ("max_rho", "max_rho", "max rho", list(result["admissions"]))):
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(admissions)
        for k, a in enumerate(admissions):
            xs = [g + (k - (len(admissions) - 1) / 2) * width for g in range(len(groups))]
            scale = 100.0 if key.endswith("change") else 1.0
            stats = [by_a[a][key] for _, _, by_a in groups]
            bars = ax.bar(xs, [st["mean"] * scale for st in stats], width, label=a, alpha=0.8)
            for x, st in zip(xs, stats):
                ax.plot([x] * len(st["values"]), [v * scale for v in st["values"]], "k.", markersize=4)
            if key.endswith("change"):
                claims = [result["blox_claims"].get(w, {}).get(a) if w and lab.startswith("LAS") else None
                          for lab, w, _ in groups]
                for x, c in zip(xs, claims):
                    if c is not None:
                        ax.plot(x, c * 100, marker="x", color=bars.patches[0].get_facecolor(), markersize=9,
                                markeredgewidth=2)
        if key.endswith("change"):
            ax.axhline(0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(groups)), [lab for lab, _, _ in groups], fontsize=8)
        ax.set_ylabel(label)
        note = " (x: Blox's claim)" if key.endswith("change") else ""
        ax.set_title(f"Blox admission on {result['cluster']}: {label}{note}; bars the mean, dots the "
                     f"{len(result['seeds'])} seeds")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        fit_titles(fig, 70)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _pct(stat: dict[str, Any] | None) -> str:
    return "" if stat is None else f" ({stat['mean']:+.0%})"


def _print_table(result: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"blox-admission: avg JCT of the tracked jobs in hours (change vs accept-all) / max rho, "
                        f"mean over {len(result['seeds'])} seed(s)")
    table.add_column("workload, policy")
    for a in result["admissions"]:
        table.add_column(a, justify="right")
    rows = [(f"{w}, {'LAS' if p == 'tiresias' else p}", by_a) for w, by_p in result["points"].items()
            for p, by_a in by_p.items()]
    sens = result.get("restart_sensitivity")
    if sens:
        rows.append((f"steady, LAS, restart {sens['restart_s']:g} s", sens["points"]))
    for name, by_a in rows:
        table.add_row(name, *(f"{by_a[a]['tracked_jct']['mean'] / 3600:.2f}{_pct(by_a[a].get('tracked_jct_change'))}"
                              f" / {by_a[a]['max_rho']['mean']:.2f}" for a in result["admissions"]))
    console.print(table)
