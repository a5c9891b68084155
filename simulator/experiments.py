"""The paper's simulator experiments (Themis section 6), each one command writing JSON and PNGs.

    themis-sim experiment fig9 --out results/fig9 [--quick] [--seeds 5] [--policies themis,tiresias]

Every point of every figure is run at ``--seeds`` seeds (default 5) in parallel processes and
reported as its mean with a 95% interval; the JSON keeps every seed's value and the plots draw
error bars (``simulator.seeds``). ``--quick`` swaps the two-week Philly workloads for smaller
synthetic ones and uses fewer points; docs/reproduction.md says which numbers came from which
mode. Nothing here tunes the mechanism: every run is ``simulator.runs.simulate`` with the defaults
of the mechanism (D1-D17) unless the figure varies a knob. Cluster files an experiment makes (Fig.
12's smaller clusters, Fig. 15's) are written into its ``--out`` folder.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from arbiter.cluster import load_cluster
from simulator.plots import compare_plots, line_plot
from simulator.runs import run_seeds
from simulator.seeds import aggregate

POLICIES = ["themis", "gandiva", "tiresias", "optimus", "slaq"]
DEFAULT_SEEDS = 5


class Setup:
    """What every experiment gets: where to write, the mode, the seeds, the processes, the policies."""

    def __init__(self, out: Path, quick: bool, seed: int, seeds: int, workers: int | None,
                 policies: Sequence[str] | None):
        self.out, self.quick, self.workers = out, quick, workers
        self.seeds = list(range(seed, seed + seeds))
        self.policies = list(policies or POLICIES)

    def run(self, runs: Sequence[dict[str, Any]], label: str) -> list[dict[str, Any]]:
        """Each run (``simulate`` keyword arguments) at every seed -> its multi-seed aggregate."""
        per_run = run_seeds(runs, self.seeds, self.workers, label)
        return [{**aggregate(summaries), "per_seed": [_headline(s) for s in summaries], "first": summaries[0]}
                for summaries in per_run]


def _headline(s: dict[str, Any]) -> dict[str, Any]:
    keep = ("policy", "workload", "cluster", "seed", "max_rho", "max_rho_floor", "p99_rho", "mean_rho",
            "median_rho", "p95_rho", "jain_rho", "share_rho_le_1", "max_rho_share", "mean_rho_share",
            "share_rho_share_gt_1", "gpu_time", "avg_jct", "p95_jct", "makespan", "utilization",
            "mean_placement_score", "restarts", "restarts_per_job", "rounds", "auctions", "noncanonical_auctions",
            "share_auction", "share_queue", "share_leftover", "wall_seconds", "fairness_knob", "lease_s")
    return {k: s.get(k) for k in keep}


def _public(agg: dict[str, Any]) -> dict[str, Any]:
    """An aggregate without the first run's per-app rows (kept apart, they are large)."""
    return {k: v for k, v in agg.items() if k != "first"}


def _workloads(quick: bool) -> dict[str, tuple[str, dict[str, Any]]]:
    if quick:
        return {"workload1": ("synthetic", {"apps": 30, "kind": "fixed", "load": 1.5}),
                "workload2": ("synthetic", {"apps": 30, "kind": "successive_halving", "load": 1.5})}
    return {"workload1": ("workload1", {}), "workload2": ("workload2", {})}


def shrunk(fraction: int, folder: Path) -> str:
    """sim-256 with 1/fraction of its machines (every fraction-th machine of each kind), written as a
    TOML file into ``folder`` so the run's summary names it (paper Fig. 12's contention)."""
    if fraction == 1:
        return "sim-256"
    full = load_cluster("sim-256")
    kinds: dict[int, list[str]] = {}
    for m, gpus in full.machines.items():
        kinds.setdefault(len(gpus), []).append(m)
    keep = [m for ms in kinds.values() for m in ms[::fraction]]
    racks: dict[str, list[dict[str, int]]] = {}
    for m in keep:
        n = len(full.machines[m])
        slots = len({full.gpus[g].slot for g in full.machines[m]})
        racks.setdefault(full.gpus[full.machines[m][0]].rack, []).append({"gpus": n, "slots": slots})
    path = folder / "clusters" / f"sim-256-div{fraction}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f'name = "sim-256/{fraction}"']
    for rack, machines in racks.items():
        specs = ", ".join(f"{{ gpus = {m['gpus']}, slots = {m['slots']} }}" for m in machines)
        lines.append(f'[[racks]]\nname = "{rack}"\nmachines = [{specs}]')
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def fig15_cluster(folder: Path) -> str:
    """Paper 6.3: 64 GPUs, one 8-GPU machine and the rest 2-GPU machines, in one rack."""
    path = folder / "clusters" / "fig15-64.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('name = "fig15-64"\n[[racks]]\nname = "r0"\n'
                    'machines = [{ gpus = 8, slots = 4 }, { gpus = 2, slots = 1, count = 28 }]\n')
    return str(path)


def fig9_10_11(setup: Setup, which: str) -> dict[str, Any]:
    """Figs. 9-11: rho CDF and max rho, GPU time, placement scores; all policies, both workloads."""
    result: dict[str, Any] = {"figure": which, "quick": setup.quick, "seeds": setup.seeds, "workloads": {}}
    for label, (workload, knobs) in _workloads(setup.quick).items():
        runs = setup.run([{"cluster": "sim-256", "workload": workload, "policy": p, "workload_knobs": knobs}
                          for p in setup.policies], f"{which} {label}")
        compare_plots([r["first"] for r in runs], setup.out / label, aggregated=runs)
        result["workloads"][label] = {
            "runs": [_public(r) for r in runs],
            "rho": {r["policy"]: [a["rho"] for a in r["first"]["apps"]] for r in runs},
            "placement": {r["policy"]: [a["placement_score"] for a in r["first"]["apps"]] for r in runs},
        }
    return result


def _policy_sweep(setup: Setup, xs: list[float], runs: list[list[dict[str, Any]]], *, xlabel: str,
                  figure: str) -> dict[str, dict[str, Any]]:
    """Per policy, each metric along a swept parameter (mean, 95% half-width, per-seed values), and
    plots with error bars."""
    points: dict[str, dict[str, Any]] = {}
    for at_x in runs:
        for r in at_x:
            p = points.setdefault(r["policy"], {})
            for key in ("max_rho", "max_rho_floor", "p99_rho", "jain_rho", "mean_rho", "max_rho_share",
                        "gpu_time", "mean_placement_score", "avg_jct", "restarts_per_job"):
                p.setdefault(key, []).append({k: r[key][k] for k in ("mean", "half", "values")})
    for key, ylabel, scale in (("max_rho", "max rho", 1.0), ("max_rho_floor", "max rho, T_id >= 10 min", 1.0),
                               ("jain_rho", "Jain's index of rho", 1.0), ("gpu_time", "GPU time (GPU-hours)", 3600.0)):
        means = {k: [pt["mean"] / scale for pt in v[key]] for k, v in points.items()}
        halves = {k: [pt["half"] / scale for pt in v[key]] for k, v in points.items()}
        log = key.startswith("max_rho") and max(max(m) for m in means.values()) > 20 * min(min(m) for m in means.values())
        line_plot(setup.out / f"{key}.png", xs, means, errors=halves, xlabel=xlabel, ylabel=ylabel, log_y=log,
                  title=f"{figure}: {ylabel} (mean, 95% CI, {len(setup.seeds)} seeds)")
    return points


def fig12(setup: Setup) -> dict[str, Any]:
    """Fig. 12: contention 1x, 2x, 4x (the same workload on sim-256 shrunk to 1/2 and 1/4)."""
    workload, knobs = _workloads(setup.quick)["workload2"]
    levels = [1, 2, 4]
    runs = [setup.run([{"cluster": shrunk(level, setup.out), "workload": workload, "policy": p,
                        "workload_knobs": knobs} for p in setup.policies], f"fig12 {level}x") for level in levels]
    points = _policy_sweep(setup, levels, runs, xlabel="contention (x)", figure="Fig. 12")
    return {"figure": "fig12", "quick": setup.quick, "seeds": setup.seeds, "contention": levels, "policies": points,
            "runs": [[_public(r) for r in at] for at in runs]}


def fig13(setup: Setup) -> dict[str, Any]:
    """Fig. 13: 0-100% network-intensive apps (synthetic workload)."""
    fractions = [0.0, 0.5, 1.0] if setup.quick else [0.0, 0.25, 0.5, 0.75, 1.0]
    apps = 30 if setup.quick else 120
    runs = [setup.run([{"cluster": "sim-256", "workload": "synthetic", "policy": p,
                        "workload_knobs": {"apps": apps, "network_fraction": f, "kind": "successive_halving",
                                           "load": 1.5}} for p in setup.policies], f"fig13 {f:.0%}")
            for f in fractions]
    xs = [100 * f for f in fractions]
    points = _policy_sweep(setup, xs, runs, xlabel="network-intensive apps (%)", figure="Fig. 13")
    return {"figure": "fig13", "quick": setup.quick, "seeds": setup.seeds, "network_percent": xs, "policies": points}


def fig14(setup: Setup) -> dict[str, Any]:
    """Fig. 14: estimation error 0-20%: every agent misjudges its remaining work and its placement
    slowdowns by one error per app of up to +-X% each (strategy ``misestimate``), which reaches its
    rho reports as well as its bids (paper 6.4; issue 13 item 3)."""
    errors = [0, 10, 20] if setup.quick else [0, 5, 10, 15, 20]
    workload, knobs = _workloads(setup.quick)["workload2"]
    runs = setup.run([{"cluster": "sim-256", "workload": workload, "policy": "themis", "workload_knobs": knobs,
                       "strategy": ("misestimate", float(e), ("*",))} for e in errors], "fig14")
    rows = [{"error_percent": e, **_public(r)} for e, r in zip(errors, runs)]
    line_plot(setup.out / "fig14.png", errors, {"max rho": [r["max_rho"]["mean"] for r in rows],
                                                "mean rho": [r["mean_rho"]["mean"] for r in rows]},
              errors={"max rho": [r["max_rho"]["half"] for r in rows], "mean rho": [r["mean_rho"]["half"] for r in rows]},
              xlabel="bid estimation error (%)", ylabel="finish-time fairness",
              title=f"Fig. 14: estimation error (mean, 95% CI, {len(setup.seeds)} seeds)")
    return {"figure": "fig14", "quick": setup.quick, "seeds": setup.seeds, "points": rows}


def fig15(setup: Setup) -> dict[str, Any]:
    """Fig. 15: one app over-reporting its spread slowdown by X% among 8 identical apps on 64 GPUs."""
    from simulator.strategic import run_strategic

    levels = [0, 25, 50, 100] if setup.quick else [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    trace = _identical_apps_trace(setup.out)
    return {"figure": "fig15", "quick": setup.quick, **run_strategic(
        strategy="overreport-spread", levels=levels, liars=1, cluster=fig15_cluster(setup.out), workload=str(trace),
        seed=setup.seeds[0], out=setup.out, seeds=len(setup.seeds) if setup.quick else max(len(setup.seeds), 10),
        workers=setup.workers)}


def _identical_apps_trace(out: Path) -> Path:
    """8 identical apps arriving together, each one 8-GPU vgg16 job (placement-sensitive): they fill
    the 64 GPUs exactly, so the only thing to compete for is the one consolidated 8-GPU machine."""
    path = out / "identical_apps.csv"
    out.mkdir(parents=True, exist_ok=True)
    rows = ["app,job,arrival_s,gpus,iterations,iter_time_s,model"]
    for a in range(8):
        rows.append(f"app{a},job0,0,8,60000,0.5,vgg16")
    path.write_text("\n".join(rows) + "\n")
    return path


def fig16(setup: Setup) -> dict[str, Any]:
    """Fig. 16: the fairness knob f from 0 to 1 and the lease length."""
    workload, knobs = _workloads(setup.quick)["workload2"]
    knob_values = [0.0, 0.5, 0.8, 0.95] if setup.quick else [0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.95]
    leases = [300.0, 600.0, 1800.0] if setup.quick else [150.0, 300.0, 600.0, 1200.0, 2400.0]
    base = {"cluster": "sim-256", "workload": workload, "policy": "themis", "workload_knobs": knobs}
    by_f = setup.run([{**base, "fairness_knob": f} for f in knob_values], "fig16 f")
    by_lease = setup.run([{**base, "lease": lease} for lease in leases], "fig16 lease")
    for name, xs, runs, xlabel in (("fairness_knob", knob_values, by_f, "fairness knob f"),
                                   ("lease", [lv / 60 for lv in leases], by_lease, "lease length (minutes)")):
        low = min(r["gpu_time"]["mean"] for r in runs)
        line_plot(setup.out / f"{name}.png", xs,
                  {"max rho": [r["max_rho"]["mean"] for r in runs], "Jain's index": [r["jain_rho"]["mean"] for r in runs],
                   "GPU time / min": [r["gpu_time"]["mean"] / low for r in runs]},
                  errors={"max rho": [r["max_rho"]["half"] for r in runs],
                          "Jain's index": [r["jain_rho"]["half"] for r in runs],
                          "GPU time / min": [r["gpu_time"]["half"] / low for r in runs]},
                  xlabel=xlabel, ylabel="value", title=f"Fig. 16: {xlabel} ({len(setup.seeds)} seeds)")
    return {"figure": "fig16", "quick": setup.quick, "seeds": setup.seeds, "fairness_knob": [_public(r) for r in by_f],
            "lease": [_public(r) for r in by_lease]}


EXPERIMENTS: dict[str, Callable[[Setup], dict[str, Any]]] = {
    "fig9": lambda setup: fig9_10_11(setup, "fig9"),
    "fig10": lambda setup: fig9_10_11(setup, "fig10"),
    "fig11": lambda setup: fig9_10_11(setup, "fig11"),
    "fig12": fig12,
    "fig13": fig13,
    "fig14": fig14,
    "fig15": fig15,
    "fig16": fig16,
}


def run_experiment(name: str, out: Path, *, quick: bool = False, seed: int = 0, seeds: int = DEFAULT_SEEDS,
                   workers: int | None = None, policies: Sequence[str] | None = None) -> dict[str, Any]:
    if seeds < 1:
        raise ValueError("--seeds must be at least 1")
    out.mkdir(parents=True, exist_ok=True)
    result = EXPERIMENTS[name](Setup(out, quick, seed, seeds, workers, policies))
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    return result
