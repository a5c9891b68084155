"""The paper's simulator experiments (Themis section 6), each one command writing JSON and PNGs.

    themis-sim experiment fig9 --out results/fig9 [--quick] [--seeds 5] [--policies themis,tiresias]
    themis-sim experiment fig12 --setup paper --out results/fig12-testbed

Two setups (``--setup``): ``sim`` (the default, as before) runs every figure on the simulated
``sim-256``, Fig. 12 with Workload 2; ``paper`` runs Figs. 9-12 as the paper did (section 6.1-6.2:
"[Testbed]" figures): on ``testbed-64``, Fig. 12 with Workload 1 and its 2x / 4x contention made by
shrinking testbed-64 to 1/2 and 1/4 of its machines of each kind. Figs. 13-16 are simulator
figures in the paper too, so ``paper`` is refused for them (``sim`` is already their setup).
A Philly workload run on a cluster of G GPUs other than 256 is scaled with it
(:func:`scaled_workload_knobs`): round(300 G / 256) apps at sim-256's arrival scale, so its offered
load per GPU -- the contention at 1x -- is the same as Workload 1's on sim-256.

Every point of every figure is run at ``--seeds`` seeds (default 5) in parallel processes and
reported as its mean with a 95% interval; the JSON keeps every seed's value and the plots draw
error bars (``simulator.seeds``). ``--quick`` swaps the two-week Philly workloads for smaller
synthetic ones and uses fewer points; docs/reproduction.md says which numbers came from which
mode. Nothing here tunes the mechanism: every run is ``simulator.runs.simulate`` with the defaults
of the mechanism (D1-D17) unless the figure varies a knob. Cluster files an experiment makes (Fig.
12's smaller clusters, Fig. 15's) are written into its ``--out`` folder.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from arbiter.cluster import load_cluster
from arbiter.policies.themis import DEFAULT_FAIRNESS_KNOB
from arbiter.rounds import DEFAULT_LEASE_S
from simulator.plots import compare_plots, line_plot
from simulator.run_store import RunStore
from simulator.runs import console, run_seeds
from simulator.seeds import aggregate

POLICIES = ["themis", "gandiva", "tiresias", "optimus", "slaq"]
DEFAULT_SEEDS = 5

#: ``--setup`` values: the cluster of Figs. 9-12 and the workload of Fig. 12 in each.
SETUPS: dict[str, dict[str, str]] = {
    "sim": {"cluster": "sim-256", "fig12_workload": "workload2"},
    "paper": {"cluster": "testbed-64", "fig12_workload": "workload1"},
}
#: The figures ``--setup paper`` changes (the paper's "[Testbed]" figures, section 6.2).
PAPER_SETUP_FIGURES = ("fig9", "fig10", "fig11", "fig12")
#: Workload 1's size and the cluster it was scaled for (simulator/workloads/philly.py, step 5).
W1_APPS, W1_GPUS = 300, 256

#: What quick mode does not reproduce, said in every quick result (``quick_does_not_reproduce``).
QUICK_CAVEATS = (
    "the paper's workloads: 30 synthetic apps (fixed-length jobs for 'workload1', successive halving for "
    "'workload2') stand in for the Philly trace's 300 (sim-256) or 75 (testbed-64) apps, so rho stays low "
    "and the policies' tails barely differ",
    "the paper's job sizes: Workload 1's jobs are 98% one-GPU; the synthetic apps draw 1-8 GPU jobs",
    "the finer sweeps (3 points instead of 5-11) where a figure sweeps a knob",
)


class Setup:
    """What every experiment gets: where to write, the mode, the seeds, the processes, the policies,
    and the setup (``sim`` or ``paper``: which cluster Figs. 9-12 run on, which workload Fig. 12 uses)."""

    def __init__(self, out: Path, quick: bool, seed: int, seeds: int, workers: int | None,
                 policies: Sequence[str] | None, setup: str = "sim", reuse: bool = True):
        if setup not in SETUPS:
            raise ValueError(f"unknown setup {setup!r}; choose from {', '.join(SETUPS)}")
        self.out, self.quick, self.workers, self.name = out, quick, workers, setup
        self.seeds = list(range(seed, seed + seeds))
        self.policies = list(policies or POLICIES)
        self.cluster = SETUPS[setup]["cluster"]
        self.gpus = load_cluster(self.cluster).size
        self.fig12_workload = SETUPS[setup]["fig12_workload"]
        self.store = RunStore(out / "runs", reuse=reuse)
        #: ``simulate`` settings every run of the experiment shares (``--contention``, D35)
        self.run_options: dict[str, Any] = {}

    def header(self, figure: str) -> dict[str, Any]:
        """What every result starts with: the figure, mode, seeds, setup and cluster (and, in quick
        mode, what it does not reproduce)."""
        out = {"figure": figure, "quick": self.quick, "seeds": self.seeds, "setup": self.name, "cluster": self.cluster}
        if self.quick:
            out["quick_does_not_reproduce"] = list(QUICK_CAVEATS)
        return out

    def run(self, runs: Sequence[dict[str, Any]], label: str) -> list[dict[str, Any]]:
        """Each run (``simulate`` keyword arguments) at every seed -> its multi-seed aggregate."""
        per_run = run_seeds([{**r, **self.run_options} for r in runs], self.seeds, self.workers, label, self.store)
        return [{**aggregate(summaries), "per_seed": [_headline(s) for s in summaries], "first": summaries[0]}
                for summaries in per_run]


def _headline(s: dict[str, Any]) -> dict[str, Any]:
    keep = ("policy", "workload", "cluster", "seed", "max_rho", "max_rho_floor", "p99_rho", "mean_rho",
            "median_rho", "p95_rho", "jain_rho", "share_rho_le_1", "max_rho_share", "mean_rho_share",
            "share_rho_share_gt_1", "gpu_time", "avg_jct", "p95_jct", "makespan", "utilization",
            "mean_placement_score", "restarts", "restarts_per_job", "rounds", "auctions", "noncanonical_auctions",
            "zeroed_auctions", "zeroed_first", "reclaimed_leases", "share_auction", "share_queue", "share_leftover", "wall_seconds", "fairness_knob", "lease_s")
    return {k: s.get(k) for k in keep}


def _public(agg: dict[str, Any]) -> dict[str, Any]:
    """An aggregate without the first run's per-app rows (kept apart, they are large)."""
    return {k: v for k, v in agg.items() if k != "first"}


@functools.cache
def _w1_candidates() -> int:
    """How many search apps Workload 1's default window holds (1,040 in the shipped trace)."""
    from simulator.workloads.philly import PhillyOptions, select_apps

    return select_apps(PhillyOptions(), random.Random("0:sample")).candidates


def scaled_workload_knobs(gpus: int) -> dict[str, Any]:
    """Knobs that size Workload 1 (and Workload 2, which forwards them) for a cluster of ``gpus``.

    Workload 1 is 300 of the trace's 1,040 search apps with arrivals x 300/1,040, an offered load of
    about 0.6 on sim-256's 256 GPUs. On a cluster of G GPUs we draw round(300 G / 256) apps (75 on
    testbed-64) at the same arrival scale: the same arrival rate per GPU over the same ~4 days, so
    the offered load per GPU, the contention at 1x, is Workload 1's on sim-256. Unscaled, 300 apps on
    64 GPUs would start at 4x sim-256's contention and Fig. 12's 4x would be 16x. The paper scales
    its trace down for the testbed without saying by how much (section 6.1); this is our rule.
    256 GPUs -> no knobs (Workload 1 as it is)."""
    if gpus < 1:
        raise ValueError("a cluster needs at least one GPU")
    if gpus == W1_GPUS:
        return {}
    return {"max_apps": max(1, round(W1_APPS * gpus / W1_GPUS)), "arrival_scale": W1_APPS / _w1_candidates()}


def _workloads(quick: bool, gpus: int = W1_GPUS) -> dict[str, tuple[str, dict[str, Any]]]:
    """The two workloads of Figs. 9-12, sized for a cluster of ``gpus`` (its 1x)."""
    if quick:
        size = {} if gpus == W1_GPUS else {"cluster_gpus": gpus}
        return {"workload1": ("synthetic", {"apps": 30, "kind": "fixed", "load": 1.5, **size}),
                "workload2": ("synthetic", {"apps": 30, "kind": "successive_halving", "load": 1.5, **size})}
    knobs = scaled_workload_knobs(gpus)
    return {"workload1": ("workload1", dict(knobs)), "workload2": ("workload2", dict(knobs))}


def shrunk(fraction: int, folder: Path, cluster: str = "sim-256") -> str:
    """``cluster`` with 1/fraction of its machines (every fraction-th machine of each kind, so every
    kind stays), written as a TOML file into ``folder`` so the run's summary names it (paper Fig.
    12's contention). Refused (ValueError) when that cannot give exactly 1/fraction of its GPUs."""
    if isinstance(fraction, bool) or not isinstance(fraction, int) or fraction < 1:
        raise ValueError(f"a contention level must be a whole number >= 1, got {fraction!r}")
    if fraction == 1:
        return cluster
    full = load_cluster(cluster)
    kinds: dict[int, list[str]] = {}
    for m, gpus in full.machines.items():
        kinds.setdefault(len(gpus), []).append(m)
    keep = [m for ms in kinds.values() for m in ms[::fraction]]
    if full.size % fraction or sum(len(full.machines[m]) for m in keep) != full.size // fraction:
        counts = ", ".join(f"{len(ms)} x {n}-GPU" for n, ms in kinds.items())
        raise ValueError(f"cannot shrink {full.name} ({counts}) to 1/{fraction} of its {full.size} GPUs "
                         "keeping every machine kind")
    racks: dict[str, list[dict[str, int]]] = {}
    for m in keep:
        n = len(full.machines[m])
        slots = len({full.gpus[g].slot for g in full.machines[m]})
        racks.setdefault(full.gpus[full.machines[m][0]].rack, []).append({"gpus": n, "slots": slots})
    stem = full.name.replace("/", "-")
    path = folder / "clusters" / f"{stem}-div{fraction}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f'name = "{full.name}/{fraction}"']
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
    """Figs. 9-11: rho CDF and max rho, GPU time, placement scores; all policies, both workloads, on
    the setup's cluster (testbed-64 in the paper)."""
    result: dict[str, Any] = {**setup.header(which), "workloads": {}}
    for label, (workload, knobs) in _workloads(setup.quick, setup.gpus).items():
        runs = setup.run([{"cluster": setup.cluster, "workload": workload, "policy": p, "workload_knobs": knobs}
                          for p in setup.policies], f"{which} {label}")
        compare_plots([r["first"] for r in runs], setup.out / label, aggregated=runs)
        result["workloads"][label] = {
            "workload": workload, "workload_knobs": knobs,
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
    sweep_plots(setup.out, xs, points, xlabel=xlabel, figure=figure, n_seeds=len(setup.seeds))
    return points


def sweep_plots(out: Path, xs: Sequence[float], points: dict[str, dict[str, Any]], *, xlabel: str, figure: str,
                n_seeds: int) -> None:
    """A policy sweep's plots (Figs. 12 and 13) from its points, also those of a saved result."""
    for key, ylabel, scale in (("max_rho", "max rho", 1.0), ("max_rho_floor", "max rho, T_id >= 10 min", 1.0),
                               ("jain_rho", "Jain's index of rho", 1.0), ("gpu_time", "GPU time (GPU-hours)", 3600.0)):
        means = {k: [pt["mean"] / scale for pt in v[key]] for k, v in points.items()}
        halves = {k: [pt["half"] / scale for pt in v[key]] for k, v in points.items()}
        log = key.startswith("max_rho") and max(max(m) for m in means.values()) > 20 * min(min(m) for m in means.values())
        line_plot(out / f"{key}.png", xs, means, errors=halves, xlabel=xlabel, ylabel=ylabel, log_y=log,
                  title=f"{figure}: {ylabel} (mean, 95% CI, {n_seeds} seeds)")


def fig12(setup: Setup) -> dict[str, Any]:
    """Fig. 12: contention 1x, 2x, 4x: the same workload, sized for the setup's cluster, on that
    cluster shrunk to 1/2 and 1/4 (sim: Workload 2 on sim-256; paper: Workload 1 on testbed-64)."""
    workload, knobs = _workloads(setup.quick, setup.gpus)[setup.fig12_workload]
    levels = [1, 2, 4]
    clusters = [shrunk(level, setup.out, setup.cluster) for level in levels]
    runs = [setup.run([{"cluster": cluster, "workload": workload, "policy": p, "workload_knobs": knobs}
                       for p in setup.policies], f"fig12 {level}x") for level, cluster in zip(levels, clusters)]
    points = _policy_sweep(setup, levels, runs, xlabel="contention (x)",
                           figure=f"Fig. 12, {setup.fig12_workload} on {setup.cluster}")
    return {**setup.header("fig12"), "workload": setup.fig12_workload, "workload_knobs": knobs,
            "clusters": [load_cluster(c).name for c in clusters], "gpus": [load_cluster(c).size for c in clusters],
            "contention": levels, "policies": points, "runs": [[_public(r) for r in at] for at in runs]}


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
    fig14_plot(setup.out, rows, len(setup.seeds))
    return {"figure": "fig14", "quick": setup.quick, "seeds": setup.seeds, "points": rows}


def fig14_plot(out: Path, rows: Sequence[dict[str, Any]], n_seeds: int) -> None:
    """Fig. 14's plot from its points (also those of a saved ``fig14.json``)."""
    errors = [r["error_percent"] for r in rows]
    line_plot(out / "fig14.png", errors, {"max rho": [r["max_rho"]["mean"] for r in rows],
                                          "mean rho": [r["mean_rho"]["mean"] for r in rows]},
              errors={"max rho": [r["max_rho"]["half"] for r in rows], "mean rho": [r["mean_rho"]["half"] for r in rows]},
              xlabel="bid estimation error (%)", ylabel="finish-time fairness",
              title=f"Fig. 14: estimation error (mean, 95% CI, {n_seeds} seeds)")


def fig15(setup: Setup) -> dict[str, Any]:
    """Fig. 15: one app over-reporting its spread slowdown by X% among 8 identical apps on 64 GPUs,
    ranked by its reported rho (the paper's rank, the top level of the result) and by the rho the
    arbiter computes with measured slowdowns (``measured_rank``, D21, the service's rank for an app
    bound to a model; ``rank-measured/``)."""
    from arbiter.rank import RANKS
    from simulator.strategic_run import run_strategic

    levels = [0, 25, 50, 100] if setup.quick else [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    trace = _identical_apps_trace(setup.out)
    cluster = fig15_cluster(setup.out)
    seeds = len(setup.seeds) if setup.quick else max(len(setup.seeds), 10)
    runs = {rank: run_strategic(strategy="overreport-spread", levels=levels, liars=1, cluster=cluster,
                                workload=str(trace), seed=setup.seeds[0], seeds=seeds, workers=setup.workers,
                                out=setup.out if rank == "reported" else setup.out / "rank-measured", rank=rank,
                                store=setup.store)
            for rank in RANKS}
    # The lies a measured rank still takes on the app's word (D21, D28): its work left, its total
    # work B, its demand_max and its demand, whole runs under the service's rank.
    other = {name: run_strategic(strategy=name, levels=lv[:2] if setup.quick else lv, liars=1, cluster=cluster,
                                 workload=str(trace), seed=setup.seeds[0], seeds=seeds, workers=setup.workers,
                                 out=setup.out / f"lie-{name}", rank="measured", store=setup.store)
             for name, lv in FIG15_OTHER_LIES.items()}
    return {"figure": "fig15", "quick": setup.quick, **runs["reported"], "measured_rank": runs["measured"],
            "other_lies_measured_rank": other}


#: Fig. 15's other lies (issue 31): what a measured rank still takes from the app, at these sizes (%).
FIG15_OTHER_LIES = {"misreport-work": [25, 50, 90], "understate-budget": [50, 90], "understate-work": [50, 90],
                    "overstate-demand-max": [100, 300], "overstate-demand": [100, 300]}


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


def fig16_plots(out: Path, knob_values: Sequence[float], leases: Sequence[float], by_f: Sequence[dict],
                by_lease: Sequence[dict], n_seeds: int) -> None:
    """Fig. 16's two plots from the sweeps' aggregates (also those of a saved ``fig16.json``). The
    max rho plotted is over apps with an ideal time of at least 10 minutes: the plain max is set by
    one small app at nearly every point (docs/reproduction.md) and would hide the knob."""
    for name, xs, runs, xlabel in (("fairness_knob", list(knob_values), by_f, "fairness knob f"),
                                   ("lease", [lv / 60 for lv in leases], by_lease, "lease length (minutes)")):
        low = min(r["gpu_time"]["mean"] for r in runs)
        series = {"max rho, T_id >= 10 min": ("max_rho_floor", 1.0), "p99 rho": ("p99_rho", 1.0),
                  "Jain's index": ("jain_rho", 1.0), "GPU time / least": ("gpu_time", low)}
        line_plot(out / f"{name}.png", xs, {k: [r[m]["mean"] / d for r in runs] for k, (m, d) in series.items()},
                  errors={k: [(r[m]["half"] or 0.0) / d for r in runs] for k, (m, d) in series.items()},
                  xlabel=xlabel, ylabel="value", title=f"Fig. 16: {xlabel} ({n_seeds} seeds, 95% intervals)")


def fig16(setup: Setup) -> dict[str, Any]:
    """Fig. 16: the fairness knob f from 0 to 1 and the lease length.

    The two sweeps meet at the defaults (f = 0.8, 10-minute leases): that setting is run once and
    both sweeps are run in one pool, so the workers stay busy to the end."""
    workload, knobs = _workloads(setup.quick)["workload2"]
    knob_values = [0.0, 0.5, 0.8, 0.95] if setup.quick else [0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.95]
    leases = [300.0, 600.0, 1800.0] if setup.quick else [150.0, 300.0, 600.0, 1200.0, 2400.0]
    base = {"cluster": "sim-256", "workload": workload, "policy": "themis", "workload_knobs": knobs}
    points = [(f, DEFAULT_LEASE_S) for f in knob_values] + [(DEFAULT_FAIRNESS_KNOB, lease) for lease in leases]
    distinct = list(dict.fromkeys(points))
    done = dict(zip(distinct, setup.run([{**base, "fairness_knob": f, "lease": lease} for f, lease in distinct],
                                        f"fig16 ({len(distinct)} settings)")))
    by_f = [done[p] for p in points[:len(knob_values)]]
    by_lease = [done[p] for p in points[len(knob_values):]]
    fig16_plots(setup.out, knob_values, leases, by_f, by_lease, len(setup.seeds))
    return {"figure": "fig16", "quick": setup.quick, "seeds": setup.seeds, "fairness_knob": [_public(r) for r in by_f],
            "lease": [_public(r) for r in by_lease]}


def _deepshare(setup: Setup) -> dict[str, Any]:
    """DeepShare's setting and its baselines beside Themis (``simulator.deepshare_experiment``)."""
    from simulator.deepshare_experiment import deepshare

    return deepshare(setup, None if setup.policies == list(POLICIES) else setup.policies)  # --policies given


def _blox_admission(setup: Setup) -> dict[str, Any]:
    """Blox's Figs. 12-13: FIFO admission in front of LAS, then Themis (``simulator.blox_experiment``)."""
    from simulator.blox_experiment import blox_admission

    return blox_admission(setup, policies=None if setup.policies == POLICIES else setup.policies)


EXPERIMENTS: dict[str, Callable[[Setup], dict[str, Any]]] = {
    "fig9": lambda setup: fig9_10_11(setup, "fig9"),
    "fig10": lambda setup: fig9_10_11(setup, "fig10"),
    "fig11": lambda setup: fig9_10_11(setup, "fig11"),
    "fig12": fig12,
    "fig13": fig13,
    "fig14": fig14,
    "fig15": fig15,
    "fig16": fig16,
    "deepshare": _deepshare,
    "blox-admission": _blox_admission,
}


def check_setup(name: str, setup: str) -> None:
    """ValueError unless ``setup`` is known and applies to experiment ``name``."""
    if setup not in SETUPS:
        raise ValueError(f"unknown setup {setup!r}; choose from {', '.join(SETUPS)}")
    if setup == "paper" and name not in PAPER_SETUP_FIGURES:
        raise ValueError(f"--setup paper applies to {', '.join(PAPER_SETUP_FIGURES)} (the paper's testbed figures); "
                         f"{name} is a simulator figure in the paper, run it with --setup sim")


def run_experiment(name: str, out: Path, *, quick: bool = False, seed: int = 0, seeds: int = DEFAULT_SEEDS,
                   workers: int | None = None, policies: Sequence[str] | None = None,
                   setup: str = "sim", reuse: bool = True, contention: str | None = None,
                   preempt_at: float | None = None, admission: str | None = None,
                   convergence: str | None = None, payments: str = "exact") -> dict[str, Any]:
    """Run experiment ``name`` into ``out``. Finished runs are kept in ``out/runs``
    (``simulator.run_store``): with ``reuse`` (the default) a run kept there for the same
    arguments and code is not simulated again, so more seeds, or a re-run after an interruption,
    cost only the missing runs. The result says how many runs it reused and simulated. ``payments``
    "bounds" lets bounds on c_i decide Themis's lotteries (D42; ``simulate``)."""
    if seeds < 1:
        raise ValueError("--seeds must be at least 1")
    check_setup(name, setup)
    out.mkdir(parents=True, exist_ok=True)
    if quick and name != "blox-admission":  # its own caveats are in its result (simulator.blox_experiment)
        console.print(f"[yellow]{name} --quick does not reproduce:[/] " + "; ".join(QUICK_CAVEATS))
    the_setup = Setup(out, quick, seed, seeds, workers, policies, setup, reuse=reuse)
    if contention is not None:  # D35 in every run of the figure
        the_setup.run_options = {"contention": contention}
    if preempt_at is not None:  # with contention (given, or turned on by the experiment itself)
        the_setup.run_options["preempt_at"] = preempt_at
    if admission is not None or convergence is not None:  # D33, D34 in every run of the figure
        if name == "blox-admission" and admission is not None:
            raise ValueError("blox-admission sweeps the admission policy itself; run it without --admission")
        the_setup.run_options.update({k: v for k, v in (("admission", admission), ("convergence", convergence))
                                      if v is not None})
    if payments != "exact":  # D42 in every Themis run of the figure (Fig. 15 reports c_i: exact there)
        the_setup.run_options["payments"] = payments
    result = EXPERIMENTS[name](the_setup)
    store = the_setup.store
    result["runs_reused"], result["runs_simulated"] = store.reused, store.simulated
    if store.reused:
        console.print(f"{name}: {store.tally()}")
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    _print_sweep(result)
    plots = sorted(p.name for p in out.glob("*.png"))
    console.print(f"wrote {out / (name + '.json')}" + (f" and {', '.join(plots)}" if plots else ""))
    return result


def _print_sweep(result: dict[str, Any]) -> None:
    """Mean max rho and Jain's index per policy and point, for the sweeps (Figs. 12, 13)."""
    axis = next((k for k in ("contention", "network_percent") if k in result), None)
    policies = result.get("policies")
    if axis is None or not isinstance(policies, dict):
        return
    from rich.table import Table

    table = Table(title=f"{result['figure']}: max rho / Jain's index, mean over {len(result['seeds'])} seed(s)")
    table.add_column("policy")
    for x in result[axis]:
        table.add_column(f"{axis} {x}", justify="right")
    for policy, metrics in policies.items():
        cells = [f"{m['mean']:.2f} / {j['mean']:.3f}" for m, j in zip(metrics["max_rho"], metrics["jain_rho"])]
        table.add_row(policy, *cells)
    console.print(table)
