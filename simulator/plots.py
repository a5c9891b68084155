"""PNG plots of simulation results a person can read (matplotlib, no display needed)."""

from __future__ import annotations

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


def compare_plots(summaries: Sequence[dict[str, Any]], out: Path,
                  aggregated: Sequence[dict[str, Any]] | None = None) -> list[Path]:
    """rho CDF, GPU time bars and placement-score CDF across policies (paper Figs. 9-11). The CDFs
    are of the first seed's run; with ``aggregated`` (one multi-seed aggregate per policy,
    ``simulator.seeds.aggregate``) the bars carry 95% intervals."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in summaries:
        cdf(ax, [a["rho"] for a in s["apps"]], f"{s['policy']} (max {s['max_rho']:.2f})")
    ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)
    if max(s["max_rho"] for s in summaries) > 5:
        ax.set_xscale("log")  # one starving policy would squeeze every other curve against 0
    ax.set_xlabel("finish-time fairness rho")
    ax.set_ylabel("fraction of apps")
    ax.set_title(f"rho CDF: {summaries[0]['workload']} on {summaries[0]['cluster']}")
    ax.legend()
    paths.append(_save(fig, out / "rho_cdf.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    names = [s["policy"] for s in summaries]
    if aggregated:
        means = [a["gpu_time"]["mean"] / 3600 for a in aggregated]
        halves = [a["gpu_time"]["half"] / 3600 for a in aggregated]
        ax.bar(names, means, yerr=halves, capsize=4, color="tab:blue")
        ax.set_title(f"GPU time, mean and 95% interval over {len(aggregated[0]['seeds'])} seeds")
    else:
        ax.bar(names, [s["gpu_time"] / 3600 for s in summaries], color="tab:blue")
        ax.set_title("GPU time (lower is more efficient)")
    ax.set_ylabel("total GPU time (GPU-hours)")
    paths.append(_save(fig, out / "gpu_time.png"))
    if aggregated:
        fig, ax = plt.subplots(figsize=(6, 4))
        for k, (key, label) in enumerate((("max_rho", "max rho"), ("max_rho_floor", "max rho, T_id >= 10 min"),
                                          ("p99_rho", "p99 rho"))):
            xs = [i + (k - 1) * 0.25 for i in range(len(names))]
            ax.bar(xs, [a[key]["mean"] for a in aggregated], width=0.25, label=label,
                   yerr=[a[key]["half"] for a in aggregated], capsize=3)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("finish-time fairness rho")
        ax.set_title("worst rho, mean and 95% interval over seeds")
        ax.legend()
        paths.append(_save(fig, out / "max_rho.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in summaries:
        cdf(ax, [a["placement_score"] for a in s["apps"]], s["policy"])
    ax.set_xlabel("placement score (1 / slowdown, GPU-time weighted)")
    ax.set_ylabel("fraction of apps")
    ax.set_title("placement score CDF")
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
