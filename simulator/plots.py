"""PNG plots of simulation results a person can read (matplotlib, no display needed)."""

from __future__ import annotations

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


def compare_plots(summaries: Sequence[dict[str, Any]], out: Path) -> list[Path]:
    """rho CDF, GPU time bars and placement-score CDF across policies (paper Figs. 9-11)."""
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
    ax.bar(names, [s["gpu_time"] / 3600 for s in summaries], color="tab:blue")
    ax.set_ylabel("total GPU time (GPU-hours)")
    ax.set_title("GPU time (lower is more efficient)")
    paths.append(_save(fig, out / "gpu_time.png"))

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
              title: str) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, ys in series.items():
        ax.plot(x, ys, marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, out)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
