"""PNG plots of simulation results a person can read (matplotlib, no display needed)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def cdf(ax, values: Sequence[float], label: str) -> None:
    xs = sorted(values)
    ys = [(k + 1) / len(xs) for k in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def seeds_text(seeds: Sequence[Any]) -> str:
    """'seed 4', 'seeds 0-2' (a run of seeds) or 'seeds 0, 2, 5': which seeds a plot or table shows."""
    xs = sorted(int(s) for s in seeds if s is not None)
    if not xs:
        return "seed ?"
    if len(xs) == 1:
        return f"seed {xs[0]}"
    if xs == list(range(xs[0], xs[-1] + 1)):
        return f"seeds {xs[0]}-{xs[-1]}"
    return "seeds " + ", ".join(map(str, xs))


#: The worst-rho metrics of max_rho.png: label, summary key.
WORST_RHO = (("max rho", "max_rho"), ("max rho (T_id >= 10 min)", "max_rho_floor"), ("p99 rho", "p99_rho"))


def _same_stat(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> bool:
    """Two metrics with the same value in every seed of every policy (bars that would be drawn twice)."""
    def values(stat: dict[str, Any]) -> list[float]:
        return list(stat.get("values") or [stat["mean"]])

    return all(len(values(x)) == len(values(y)) and all(math.isclose(u, v, rel_tol=1e-9, abs_tol=1e-12)
                                                      for u, v in zip(values(x), values(y)))
               for x, y in zip(a, b))


def worst_rho_groups(aggregated: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """The bars of max_rho.png: each metric of WORST_RHO once, a metric equal to an earlier one in
    every seed of every policy folded into that one's label ('max rho = p99 rho')."""
    groups: list[tuple[list[str], str]] = []
    for label, key in WORST_RHO:
        if not all(isinstance(a.get(key), dict) for a in aggregated):
            continue
        twin = next((g for g in groups if _same_stat([a[g[1]] for a in aggregated], [a[key] for a in aggregated])),
                    None)
        if twin is None:
            groups.append(([label], key))
        else:
            twin[0].append(label)
    return [(" = ".join(labels), key) for labels, key in groups]


def compare_plots(summaries: Sequence[dict[str, Any]], out: Path,
                  aggregated: Sequence[dict[str, Any]] | None = None) -> list[Path]:
    """rho CDF, GPU time bars and placement-score CDF across policies (paper Figs. 9-11). The CDFs
    are of the first seed's run, and say so (the table's numbers are means over seeds); with
    ``aggregated`` (one multi-seed aggregate per policy, ``simulator.seeds.aggregate``) the bars carry
    95% intervals and their titles name the seeds, and max_rho.png draws each worst-rho metric once
    (issue 36 item 5: max rho, its value above the floor and p99 were often the same numbers)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    seed = seeds_text([summaries[0].get("seed")])
    pooled = seeds_text(aggregated[0].get("seeds") or []) if aggregated else seed
    where = f"{summaries[0]['workload']} on {summaries[0]['cluster']}"
    of_seeds = f" (the table: means over {pooled})" if aggregated and pooled != seed else ""
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in summaries:
        cdf(ax, [a["rho"] for a in s["apps"]], f"{s['policy']}: max {s['max_rho']:.2f} ({seeds_text([s.get('seed')])})")
    ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)
    if max(s["max_rho"] for s in summaries) > 5:
        ax.set_xscale("log")  # one starving policy would squeeze every other curve against 0
    ax.set_xlabel("finish-time fairness rho")
    ax.set_ylabel("fraction of apps")
    ax.set_title(f"rho CDF: {where}, {seed}{of_seeds}")
    ax.legend()
    paths.append(_save(fig, out / "rho_cdf.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    names = [s["policy"] for s in summaries]
    if aggregated:
        means = [a["gpu_time"]["mean"] / 3600 for a in aggregated]
        halves = [a["gpu_time"]["half"] / 3600 for a in aggregated]
        ax.bar(names, means, yerr=halves, capsize=4, color="tab:blue")
        ax.set_title(f"GPU time (lower is more efficient): {where}, mean and 95% interval over {pooled}")
    else:
        ax.bar(names, [s["gpu_time"] / 3600 for s in summaries], color="tab:blue")
        ax.set_title(f"GPU time (lower is more efficient): {where}, {seed}")
    ax.set_ylabel("total GPU time (GPU-hours)")
    paths.append(_save(fig, out / "gpu_time.png"))
    if aggregated:
        fig, ax = plt.subplots(figsize=(6, 4))
        groups = worst_rho_groups(aggregated)
        width = 0.75 / len(groups)
        for k, (label, key) in enumerate(groups):
            xs = [i + (k - (len(groups) - 1) / 2) * width for i in range(len(names))]
            ax.bar(xs, [a[key]["mean"] for a in aggregated], width=width, label=label,
                   yerr=[a[key]["half"] for a in aggregated], capsize=3)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("finish-time fairness rho")
        ax.set_title(f"worst rho: {where}, mean and 95% interval over {pooled}")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.2)  # room for the legend above the error bars
        ax.legend(loc="upper left", fontsize="small")
        paths.append(_save(fig, out / "max_rho.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in summaries:
        cdf(ax, [a["placement_score"] for a in s["apps"]], s["policy"])
    ax.set_xlabel("placement score (1 / slowdown, GPU-time weighted)")
    ax.set_ylabel("fraction of apps")
    ax.set_title(f"placement score CDF: {where}, {seed}{of_seeds}")
    ax.legend()
    paths.append(_save(fig, out / "placement_cdf.png"))
    return paths


def line_plot(out: Path, x: Sequence[float], series: dict[str, Sequence[float]], *, xlabel: str, ylabel: str,
              title: str, errors: dict[str, Sequence[float]] | None = None, log_y: bool = False) -> Path:
    """One line per series; ``errors`` (half-widths of 95% intervals, by series) draws error bars."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, ys in series.items():
        if errors and label in errors:
            ax.errorbar(x, ys, yerr=errors[label], marker="o", capsize=3, label=label)
        else:
            ax.plot(x, ys, marker="o", label=label)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, out)


def fit_titles(fig, width: int = 58) -> None:
    """Wrap each axes title to ``width`` characters: an experiment's titles name the figure, the
    workload, the cluster, the metric and the seeds, and on one line they ran off both edges."""
    for ax in fig.axes:
        title = ax.get_title()
        if len(title) > width:
            ax.set_title(textwrap.fill(title, width), fontsize=10)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fit_titles(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
