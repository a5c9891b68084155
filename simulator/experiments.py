"""The paper's simulator experiments (Themis section 6), each one command writing JSON and a PNG.

    themis-sim experiment fig9 --out results/fig9 [--quick]

``--quick`` swaps the two-week Philly workloads for smaller ones (the bundled ``small`` workload or
a small synthetic one) so that every experiment runs in a minute or two; docs/reproduction.md says
which numbers came from which mode. Nothing here tunes the mechanism: every run is
``simulator.cli.simulate`` with the defaults of the mechanism (D1-D12) unless the figure varies a
knob.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from arbiter.cluster import load_cluster
from simulator.cli import simulate
from simulator.plots import compare_plots, line_plot
from simulator.strategic import liar_factory

POLICIES = ["themis", "gandiva", "tiresias", "optimus", "slaq"]


def _headline(s: dict[str, Any]) -> dict[str, Any]:
    keep = ("policy", "workload", "cluster", "max_rho", "mean_rho", "median_rho", "p95_rho", "jain_rho",
            "share_rho_le_1", "gpu_time", "avg_jct", "p95_jct", "makespan", "utilization",
            "mean_placement_score", "restarts", "rounds", "auctions", "wall_seconds", "fairness_knob", "lease_s")
    return {k: s.get(k) for k in keep}


def _workloads(quick: bool) -> dict[str, tuple[str, dict[str, Any]]]:
    if quick:
        return {"workload1": ("synthetic", {"apps": 30, "kind": "fixed", "load": 1.5}),
                "workload2": ("synthetic", {"apps": 30, "kind": "successive_halving", "load": 1.5})}
    return {"workload1": ("workload1", {}), "workload2": ("workload2", {})}


def shrunk(fraction: int) -> str:
    """sim-256 with 1/fraction of its machines (every fraction-th machine of each kind), written to
    a temporary TOML file so the run's summary names it (paper Fig. 12's contention)."""
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
    path = Path(__file__).resolve().parent.parent / "results" / "clusters" / f"sim-256-div{fraction}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f'name = "sim-256/{fraction}"']
    for rack, machines in racks.items():
        specs = ", ".join(f"{{ gpus = {m['gpus']}, slots = {m['slots']} }}" for m in machines)
        lines.append(f'[[racks]]\nname = "{rack}"\nmachines = [{specs}]')
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def fig15_cluster() -> str:
    """Paper 6.3: 64 GPUs, one 8-GPU machine and the rest 2-GPU machines, in one rack."""
    path = Path(__file__).resolve().parent.parent / "results" / "clusters" / "fig15-64.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('name = "fig15-64"\n[[racks]]\nname = "r0"\n'
                    'machines = [{ gpus = 8, slots = 4 }, { gpus = 2, slots = 1, count = 28 }]\n')
    return str(path)


def _policy_runs(workload: str, knobs: dict[str, Any], seed: int, cluster: str = "sim-256") -> list[dict[str, Any]]:
    return [simulate(cluster=cluster, workload=workload, policy=policy, seed=seed, workload_knobs=knobs)
            for policy in POLICIES]


def fig9_10_11(out: Path, quick: bool, seed: int, which: str) -> dict[str, Any]:
    """Figs. 9-11: rho CDF and max rho, GPU time, placement scores; all policies, both workloads."""
    result: dict[str, Any] = {"figure": which, "quick": quick, "workloads": {}}
    for label, (workload, knobs) in _workloads(quick).items():
        runs = _policy_runs(workload, knobs, seed)
        compare_plots(runs, out / label)
        result["workloads"][label] = {
            "runs": [_headline(s) for s in runs],
            "rho": {s["policy"]: [a["rho"] for a in s["apps"]] for s in runs},
            "placement": {s["policy"]: [a["placement_score"] for a in s["apps"]] for s in runs},
        }
    return result


def _policy_sweep(out: Path, xs: list[float], runs: list[list[dict[str, Any]]], *, xlabel: str,
                  figure: str) -> dict[str, dict[str, list[float]]]:
    """Max rho, GPU time and placement score per policy along a swept parameter, with two plots."""
    points: dict[str, dict[str, list[float]]] = {}
    for at_x in runs:
        for s in at_x:
            p = points.setdefault(s["policy"], {"max_rho": [], "gpu_time": [], "placement": []})
            p["max_rho"].append(s["max_rho"])
            p["gpu_time"].append(s["gpu_time"])
            p["placement"].append(s["mean_placement_score"])
    line_plot(out / "max_rho.png", xs, {k: v["max_rho"] for k, v in points.items()},
              xlabel=xlabel, ylabel="max rho", title=f"{figure}: max finish-time fairness")
    line_plot(out / "gpu_time.png", xs, {k: [g / 3600 for g in v["gpu_time"]] for k, v in points.items()},
              xlabel=xlabel, ylabel="GPU time (GPU-hours)", title=f"{figure}: GPU time")
    return points


def fig12(out: Path, quick: bool, seed: int) -> dict[str, Any]:
    """Fig. 12: contention 1x, 2x, 4x (the same workload on sim-256 shrunk to 1/2 and 1/4)."""
    workload, knobs = _workloads(quick)["workload2"]
    levels = [1, 2, 4]
    runs = [_policy_runs(workload, knobs, seed, cluster=shrunk(level)) for level in levels]
    points = _policy_sweep(out, levels, runs, xlabel="contention (x)", figure="Fig. 12")
    return {"figure": "fig12", "quick": quick, "contention": levels, "policies": points}


def fig13(out: Path, quick: bool, seed: int) -> dict[str, Any]:
    """Fig. 13: 0-100% network-intensive apps (synthetic workload)."""
    fractions = [0.0, 0.5, 1.0] if quick else [0.0, 0.25, 0.5, 0.75, 1.0]
    apps = 30 if quick else 120
    runs = [_policy_runs("synthetic", {"apps": apps, "network_fraction": f, "kind": "successive_halving",
                                       "load": 1.5}, seed) for f in fractions]
    xs = [100 * f for f in fractions]
    points = _policy_sweep(out, xs, runs, xlabel="network-intensive apps (%)", figure="Fig. 13")
    return {"figure": "fig13", "quick": quick, "network_percent": xs, "policies": points}


def fig14(out: Path, quick: bool, seed: int) -> dict[str, Any]:
    """Fig. 14: bid estimation error 0-20% (every agent's rho values off by up to +-X%)."""
    errors = [0, 10, 20] if quick else [0, 5, 10, 15, 20]
    workload, knobs = _workloads(quick)["workload2"]
    rows = []
    for e in errors:
        from simulator.workloads import load_workload

        everyone = {a.app_id for a in load_workload(workload, seed=seed, **knobs).apps}
        s = simulate(cluster="sim-256", workload=workload, policy="themis", seed=seed, workload_knobs=knobs,
                     agent_factory=liar_factory(everyone, "noisy", e, seed))
        rows.append({"error_percent": e, **_headline(s)})
    line_plot(out / "fig14.png", errors, {"max rho": [r["max_rho"] for r in rows],
                                          "mean rho": [r["mean_rho"] for r in rows]},
              xlabel="bid estimation error (%)", ylabel="finish-time fairness", title="Fig. 14: estimation error")
    return {"figure": "fig14", "quick": quick, "points": rows}


def fig15(out: Path, quick: bool, seed: int) -> dict[str, Any]:
    """Fig. 15: one app over-reporting its spread slowdown by X% among 8 identical apps on 64 GPUs."""
    from simulator.strategic import run_strategic

    levels = [0, 25, 50, 100] if quick else [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    trace = _identical_apps_trace(out)
    return {"figure": "fig15", "quick": quick, **run_strategic(
        strategy="overreport-spread", levels=levels, liars=1, cluster=fig15_cluster(), workload=str(trace),
        seed=seed, out=out, seeds=3 if quick else 10)}


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


def fig16(out: Path, quick: bool, seed: int) -> dict[str, Any]:
    """Fig. 16: the fairness knob f from 0 to 1 and the lease length."""
    workload, knobs = _workloads(quick)["workload2"]
    knob_values = [0.0, 0.5, 0.8, 0.95] if quick else [0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.95]
    leases = [300.0, 600.0, 1800.0] if quick else [150.0, 300.0, 600.0, 1200.0, 2400.0]
    by_f = [simulate(cluster="sim-256", workload=workload, policy="themis", fairness_knob=f, seed=seed,
                     workload_knobs=knobs) for f in knob_values]
    by_lease = [simulate(cluster="sim-256", workload=workload, policy="themis", lease=lease, seed=seed,
                         workload_knobs=knobs) for lease in leases]
    line_plot(out / "fairness_knob.png", knob_values,
              {"max rho": [s["max_rho"] for s in by_f], "GPU time / min": _relative([s["gpu_time"] for s in by_f])},
              xlabel="fairness knob f", ylabel="value", title="Fig. 16a: fairness knob")
    line_plot(out / "lease.png", [lv / 60 for lv in leases],
              {"max rho": [s["max_rho"] for s in by_lease],
               "GPU time / min": _relative([s["gpu_time"] for s in by_lease])},
              xlabel="lease length (minutes)", ylabel="value", title="Fig. 16b: lease length")
    return {"figure": "fig16", "quick": quick, "fairness_knob": [_headline(s) for s in by_f],
            "lease": [_headline(s) for s in by_lease]}


def _relative(values: list[float]) -> list[float]:
    low = min(values)
    return [v / low for v in values]


EXPERIMENTS: dict[str, Callable[[Path, bool, int], dict[str, Any]]] = {
    "fig9": lambda out, quick, seed: fig9_10_11(out, quick, seed, "fig9"),
    "fig10": lambda out, quick, seed: fig9_10_11(out, quick, seed, "fig10"),
    "fig11": lambda out, quick, seed: fig9_10_11(out, quick, seed, "fig11"),
    "fig12": fig12,
    "fig13": fig13,
    "fig14": fig14,
    "fig15": fig15,
    "fig16": fig16,
}


def run_experiment(name: str, out: Path, *, quick: bool = False, seed: int = 0) -> dict[str, Any]:
    result = EXPERIMENTS[name](out, quick, seed)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    return result


