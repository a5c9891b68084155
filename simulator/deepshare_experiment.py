"""``themis-sim experiment deepshare``: DeepShare's setting (seeds/002, section VI) in our simulator.

Its 4 x 8-GPU cluster (``deepshare-4x8``), its evaluation trace (real0: 256 jobs queued at 0,
``--workload deepshare``), its 300-second rounds (leases of 300 s, every job re-placed when its
lease ends), no restart cost (its simulator charges none) and its measured contention (D35, the
shipped table) on for every policy: DeepShare's two baselines as its simulator runs them
(``deepshare-las``, ``deepshare-srtf``), the textbook LAS and SRTF placed the same way (``las``,
``srtf``), the project's Tiresias and Optimus (consolidated placement) and Themis, unaware of
contention (``themis``) and aware of it (``themis-aware``, D36: bids price the contention they
would suffer, the auction charges the slowdown a row does to the jobs already running). ``--policies`` picks others, ``--quick`` a slice of 48 jobs, ``--contention FILE``
another table, ``--preempt-at 0.6`` DeepShare's preemption for every policy.

Per policy: average, p90 and max JCT under both definitions -- from submission (ours; every job
is submitted at 0, so its finish time) and DeepShare's (rounds a job was scheduled x 300 s: the
time it held GPUs rounded up to whole rounds, queueing left out, as DeepShare's simulator counts
and as its job can end only at a round's end) --, makespan, GPU utilisation, the mean contention
ratio, and max rho, p99 rho and Jain's index. A policy that draws nothing at random (every one here
but Themis: ties fall to arrival and name) is run at the first seed only and says so; Themis at
every seed. JSON (``deepshare.json``) and PNGs: JCT CDFs (both definitions), the CDF of the apps'
contention ratios, and average JCT against utilisation (the trade-off of DeepShare's Fig. 8).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from arbiter.contention import SHIPPED, shipped_path
from simulator.runs import run_seeds
from simulator.seeds import aggregate
from simulator.workloads.deepshare import DEFAULT_TRACE

POLICIES = ["deepshare-las", "deepshare-srtf", "las", "srtf", "tiresias", "optimus", "themis", "themis-aware"]
#: Policies whose runs draw nothing at random on this workload (one seed says all).
DETERMINISTIC = frozenset({"deepshare-las", "deepshare-srtf", "las", "srtf", "tiresias", "optimus", "fifo",
                           "gandiva", "drf", "deepshare-rl", "deepshare-rl-hybrid"})
ROUND_S = 300.0  # DeepShare's round
QUICK_JOBS = 48
SETTINGS = {"cluster": "deepshare-4x8", "lease": ROUND_S, "restart": 0.0}
METRICS = ("avg_jct_s", "p90_jct_s", "max_jct_s", "deepshare_avg_jct_s", "deepshare_p90_jct_s",
           "deepshare_max_jct_s", "makespan", "utilization", "mean_contention_ratio", "max_rho", "p99_rho",
           "jain_rho", "restarts", "wall_seconds")
JCT_DEFINITIONS = {
    "from_submission": "finish - submission (every job is submitted at 0): queueing, running and restarts "
                       "(avg_jct_s, p90_jct_s, max_jct_s)",
    "deepshare": "rounds the job was scheduled x 300 s: the time it held GPUs rounded up to whole rounds, "
                 "queueing left out, as DeepShare's simulator reports JCT (deepshare_avg_jct_s, ...)",
}
#: DeepShare's published results (seeds/002, section VI; its "normal" trace, branch B) for the table.
PAPER = {
    "rl_vs_srtf_avg_jct": -0.154, "rl_vs_las_avg_jct": -0.182,
    "rl_hybrid_vs_srtf_avg_jct": -0.121, "rl_hybrid_vs_las_avg_jct": -0.151,
    "rl_vs_srtf_p90_jct": -0.164, "rl_vs_las_p90_jct": -0.207,
    "note": "RL-base and RL-Hybrid against DeepShare's own SRTF and LAS, JCT as its simulator counts it "
            "(rounds scheduled x 300 s); the paper gives no absolute JCTs",
}


def deepshare_jct(running_s: float | None) -> float:
    """DeepShare's JCT of one job: the rounds it was scheduled x 300 s."""
    if running_s is None:
        return math.nan
    return math.ceil(running_s / ROUND_S - 1e-9) * ROUND_S


def with_deepshare_jct(summary: dict[str, Any]) -> dict[str, Any]:
    """``summary`` plus DeepShare's JCT per app and its average, p90 and max."""
    from simulator.metrics import percentile

    apps = summary["apps"]
    for a in apps:
        a["deepshare_jct_s"] = deepshare_jct(a.get("running_s"))
    values = [a["deepshare_jct_s"] for a in apps]
    return {**summary, "deepshare_avg_jct_s": math.fsum(values) / len(values) if values else 0.0,
            "deepshare_p90_jct_s": percentile(values, 90), "deepshare_max_jct_s": max(values, default=0.0)}


def deepshare(setup: Any, policies: Sequence[str] | None = None) -> dict[str, Any]:
    """The experiment (module docstring) for a ``simulator.experiments.Setup`` (not imported: that
    module imports this one); ``policies`` None: :data:`POLICIES`."""
    policies = list(policies or POLICIES)
    knobs: dict[str, Any] = {"path": str(DEFAULT_TRACE), **({"jobs": QUICK_JOBS} if setup.quick else {})}
    table = setup.run_options.get("contention") or str(shipped_path("deepshare"))
    base = {**SETTINGS, "workload": "deepshare", "workload_knobs": knobs,
            **setup.run_options, "contention": table}
    rows: dict[str, Any] = {}
    firsts: dict[str, dict[str, Any]] = {}
    for policy in policies:
        seeds = setup.seeds[:1] if policy in DETERMINISTIC else setup.seeds
        summaries = [with_deepshare_jct(s) for s in
                     run_seeds([{**base, "policy": policy}], seeds, setup.workers, f"deepshare {policy}", setup.store)[0]]
        agg = aggregate(summaries, METRICS)
        rows[policy] = {"seeds": seeds, "deterministic": policy in DETERMINISTIC,
                        **{k: agg[k] for k in METRICS if k in agg},
                        "per_seed": [{k: s.get(k) for k in ("seed", *METRICS)} for s in summaries]}
        firsts[policy] = summaries[0]
    plots(setup.out, firsts, rows)
    result = {**setup.header("deepshare"), "cluster": SETTINGS["cluster"], "workload": "deepshare",
            "workload_knobs": knobs, "workload_source": next(iter(firsts.values()))["workload_source"],
            "settings": {**SETTINGS, "contention": table if table not in SHIPPED else str(shipped_path(table)),
                         **{k: v for k, v in setup.run_options.items() if k != "contention"}},
            "jct_definitions": JCT_DEFINITIONS, "paper": PAPER, "policies": rows,
            "relative": relative(rows), "apps": {p: _apps(s) for p, s in firsts.items()}}
    from simulator.runs import console

    for line in table_lines(result):
        console.print(line, highlight=False)
    return result


def _mean(row: dict[str, Any], key: str) -> float:
    value = row[key]
    return value["mean"] if isinstance(value, dict) else float(value)


def relative(rows: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each policy's average and p90 JCT (both definitions) relative to DeepShare's two baselines,
    the numbers the paper gives for its RL policy: (policy - baseline) / baseline."""
    out: dict[str, dict[str, float]] = {}
    for base in ("deepshare-srtf", "deepshare-las"):
        if base not in rows:
            continue
        for policy, row in rows.items():
            if policy == base:
                continue
            for key in ("avg_jct_s", "p90_jct_s", "deepshare_avg_jct_s", "deepshare_p90_jct_s"):
                b = _mean(rows[base], key)
                out.setdefault(policy, {})[f"{key}_vs_{base}"] = (_mean(row, key) - b) / b if b else math.nan
    return out


def _apps(summary: dict[str, Any]) -> list[dict[str, Any]]:
    keep = ("app", "model", "jct_s", "deepshare_jct_s", "running_s", "mean_ratio", "rho", "preempted")
    return [{k: a.get(k) for k in keep} for a in summary["apps"]]


def plots(out: Path, firsts: dict[str, dict[str, Any]], rows: dict[str, Any]) -> list[Path]:
    """jct_cdf.png (both definitions), ratio_cdf.png and tradeoff.png (DeepShare's Fig. 8)."""
    import matplotlib.pyplot as plt

    from simulator.plots import cdf

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, key, title in ((axes[0], "jct_s", "JCT from submission"),
                           (axes[1], "deepshare_jct_s", "DeepShare's JCT (rounds scheduled x 300 s)")):
        for policy, s in firsts.items():
            cdf(ax, [a[key] / 3600 for a in s["apps"]], policy)
        ax.set_xlabel("hours")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of jobs")
    axes[1].legend(fontsize=8)
    fig.suptitle("DeepShare's trace on deepshare-4x8, contention on (first seed)")
    fig.tight_layout()
    paths.append(out / "jct_cdf.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, s in firsts.items():
        cdf(ax, [a["mean_ratio"] for a in s["apps"]], f"{policy}: mean {s['mean_contention_ratio']:.3f}")
    ax.set_xlabel("job's contention ratio (throughput / alone, over its run)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title("Contention ratio per job (first seed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "ratio_cdf.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, key, title in ((axes[0], "avg_jct_s", "JCT from submission"),
                           (axes[1], "deepshare_avg_jct_s", "DeepShare's JCT")):
        for policy, row in rows.items():
            x, y = row[key], row["utilization"]
            ax.errorbar(_mean(row, key) / 3600, _mean(row, "utilization"),
                        xerr=(x.get("half", 0.0) / 3600) if isinstance(x, dict) else 0.0,
                        yerr=y.get("half", 0.0) if isinstance(y, dict) else 0.0, fmt="o", capsize=3)
            ax.annotate(policy, (_mean(row, key) / 3600, _mean(row, "utilization")), fontsize=8,
                        xytext=(4, 4), textcoords="offset points")
        ax.set_xlabel("average JCT (hours)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GPU utilisation")
    fig.suptitle("Average JCT vs utilisation (DeepShare Fig. 8; mean and 95% CI over seeds)")
    fig.tight_layout()
    paths.append(out / "tradeoff.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def table_lines(result: dict[str, Any]) -> Sequence[str]:
    """The result as text lines (what the command prints)."""
    lines = [f"{'policy':16} {'avg JCT h':>10} {'p90 h':>7} {'max h':>7} {'DS avg h':>9} {'DS p90 h':>9} "
             f"{'makespan h':>11} {'util':>6} {'ratio':>6} {'max rho':>8} {'p99':>6} {'Jain':>6}"]
    for policy, row in result["policies"].items():
        m = {k: _mean(row, k) for k in METRICS if k in row}
        lines.append(f"{policy:16} {m['avg_jct_s'] / 3600:10.2f} {m['p90_jct_s'] / 3600:7.2f} {m['max_jct_s'] / 3600:7.2f} "
                     f"{m['deepshare_avg_jct_s'] / 3600:9.2f} {m['deepshare_p90_jct_s'] / 3600:9.2f} "
                     f"{m['makespan'] / 3600:11.2f} {m['utilization']:6.3f} {m['mean_contention_ratio']:6.3f} "
                     f"{m['max_rho']:8.2f} {m['p99_rho']:6.2f} {m['jain_rho']:6.3f}")
    return lines
