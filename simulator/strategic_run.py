"""Paper Fig. 15 as a command (``themis-sim strategic``): whole runs with some apps lying, against
the same apps truthful, over seeds; the lies themselves are ``simulator.strategic``'s. Apart from it
so that the strategies import nothing that runs simulations (``simulator.runs`` imports them)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from arbiter.rank import check_rank
from arbiter.rounds import DEFAULT_COALESCE_S
from simulator.engine import DEFAULT_RESTART_S
from simulator.strategic import make_strategy


def run_strategic(*, strategy: str, levels: Sequence[float], liars: int | Sequence[str], cluster: str,
                  workload: str, seed: int, out: Path, fairness_knob: float = 0.8, lease: float = 600.0,
                  seeds: int = 5, workers: int | None = None, policy: str = "themis",
                  workload_knobs: dict[str, Any] | None = None, rank: str = "reported",
                  max_contenders: int | None = None, store: Any = None, restart: float = DEFAULT_RESTART_S,
                  coalesce: float = DEFAULT_COALESCE_S, expiry_window: float | None = None,
                  resplit: str = "now", reclaim: bool = True, min_bidders: int = 1) -> dict[str, Any]:
    """Paper Fig. 15: per lie level, the liars' completion time and rho against the same apps
    truthful (level 0 with the same seed), and the truthful apps' average; over ``seeds`` seeds
    (seed, seed + 1, ...) run in parallel processes, each reported as a mean with a 95% interval,
    the per-seed values, the share of seeds in which the liars finished sooner, and the liars'
    hidden payments (1 - c_i over their auction wins, D8). ``liars`` is how many of the workload's
    first apps lie, or their ids; ``policy`` is the arbiter's policy (lies only matter to Themis);
    ``rank`` is where the rho that ranks the liars comes from (D21); ``store`` (a
    ``simulator.run_store.RunStore``) keeps the runs, as an experiment's do."""
    from simulator.plots import line_plot
    from simulator.runs import run_seeds
    from simulator.seeds import interval
    from simulator.workloads import load_workload

    for level in (0, *levels):  # every level checked before anything runs
        make_strategy(strategy, level)
    check_rank(rank)
    apps = [a.app_id for a in load_workload(workload, seed=seed, **(workload_knobs or {})).apps]
    if isinstance(liars, int):
        if not 1 <= liars < len(apps):
            raise ValueError(f"--liars must be between 1 and {len(apps) - 1} for this workload")
        chosen = set(apps[:liars])
    else:
        chosen = set(liars)
        unknown = sorted(chosen - set(apps))
        if unknown or not chosen or chosen == set(apps):
            raise ValueError(f"liars must be some but not all of the workload's apps; unknown: {unknown[:5]}")
    all_levels = [0.0, *[lv for lv in levels if lv != 0]]
    runs = [{"cluster": cluster, "workload": workload, "policy": policy, "fairness_knob": fairness_knob,
             "lease": lease, "strategy": (strategy, level, tuple(sorted(chosen))),
             "workload_knobs": workload_knobs, "rank": rank, "max_contenders": max_contenders,
             "restart": restart, "coalesce": coalesce, "expiry_window": expiry_window}
            | ({"resplit": resplit} if resplit != "now" else {}) | ({} if reclaim else {"reclaim": False})
            | ({"min_bidders": min_bidders} if min_bidders != 1 else {})
            for level in all_levels]
    seed_list = list(range(seed, seed + seeds))
    per_level_runs = run_seeds(runs, seed_list, workers, f"{strategy}: {len(all_levels)} levels x {seeds} seeds",
                               store)

    def measure(summary: dict[str, Any]) -> dict[str, float]:
        lied = [a for a in summary["apps"] if a["app"] in chosen]
        honest = [a for a in summary["apps"] if a["app"] not in chosen]
        wins = sum(a["auction_wins"] for a in lied)
        return {
            "liar_jct_s": statistics.fmean(a["jct_s"] for a in lied),
            "liar_rho": statistics.fmean(a["rho"] for a in lied),
            "liar_hidden_payment": (sum(a["mean_hidden_payment"] * a["auction_wins"] for a in lied) / wins
                                    if wins else 0.0),
            "liar_auction_wins": float(wins),
            "truthful_jct_s": statistics.fmean(a["jct_s"] for a in honest),
            "truthful_rho": statistics.fmean(a["rho"] for a in honest),
            "max_rho": summary["max_rho"],
            "gpu_time": summary["gpu_time"],
        }

    measured = [[measure(s) for s in level_runs] for level_runs in per_level_runs]
    base = measured[0]
    points = []
    for level, rows in zip(all_levels, measured):
        ratio = [r["liar_jct_s"] / b["liar_jct_s"] for r, b in zip(rows, base)]
        others = [r["truthful_jct_s"] / b["truthful_jct_s"] for r, b in zip(rows, base)]
        point: dict[str, Any] = {"level": level, "seeds": len(rows)}
        for key in rows[0]:
            point[key] = interval([r[key] for r in rows])
        point["liar_jct_vs_truthful"] = interval(ratio)
        point["others_jct_vs_truthful"] = interval(others)
        point["liar_faster_in"] = sum(x < 1 - 1e-9 for x in ratio)
        point["liar_slower_in"] = sum(x > 1 + 1e-9 for x in ratio)
        point["share_seeds_liar_gained"] = point["liar_faster_in"] / len(rows)
        points.append(point)
    points.sort(key=lambda p: p["level"])
    result = {"strategy": strategy, "policy": policy, "rank": rank, "liars": sorted(chosen), "cluster": cluster,
              "workload": workload, "seeds": seed_list, "points": points}
    out.mkdir(parents=True, exist_ok=True)
    (out / "strategic.json").write_text(json.dumps(result, indent=1))
    xs = [p["level"] for p in points]
    line_plot(out / "strategic.png", xs,
              {"liar JCT / truthful": [p["liar_jct_vs_truthful"]["mean"] for p in points],
               "other apps' JCT / truthful": [p["others_jct_vs_truthful"]["mean"] for p in points]},
              errors={"liar JCT / truthful": [p["liar_jct_vs_truthful"]["half"] for p in points],
                      "other apps' JCT / truthful": [p["others_jct_vs_truthful"]["half"] for p in points]},
              xlabel=f"lie size X (%) -- {strategy}", ylabel="completion time relative to X = 0",
              title=f"Strategic bidding: {len(chosen)} liar(s) on {cluster}, {policy}, {rank} rank, {seeds} seeds")
    print_strategic(result)
    return result


def verdict(point: dict[str, Any], strategy: str, liars: int = 1) -> str:
    """Whether lying paid at one lie size, from the point's numbers: the liars' completion time
    against the same apps truthful (mean and 95% interval over seeds) and in how many seeds they
    finished sooner or later. It paid when the whole interval is below 1 (with one seed: when the
    liars finished sooner); a mean below 1 whose interval reaches 1 did not clearly pay."""
    ratio, n = point["liar_jct_vs_truthful"], point["seeds"]
    mean = ratio["mean"]
    lo, hi = ratio.get("ci95", [mean, mean])
    if n > 1:
        said = "lying paid" if hi < 1 else "lying did not clearly pay" if mean < 1 else "lying did not pay"
        spread = f"95% CI {lo:.3f}-{hi:.3f}"
    else:
        said = "lying paid" if mean < 1 - 1e-9 else "lying did not pay"
        spread = "one seed, no interval"
    who = "the liars finish" if liars > 1 else "the liar finishes"
    whose = "their" if liars > 1 else "its"
    sooner, later = point["liar_faster_in"], point["liar_slower_in"]
    seeds = f"{n} seed{'s' if n > 1 else ''}"
    tally = (f"the same time in {'all ' if n > 1 else 'the '}{seeds}" if not sooner and not later else
             f"sooner in {sooner} of {seeds}" + (f", later in {later}" if later else ""))
    return (f"{strategy}, X = {point['level']:g}%: {said}: {who} at {mean:.3f} of {whose} truthful time "
            f"({spread}), {tally}")


def print_strategic(result: dict[str, Any], console: Any = None) -> None:
    """The study's table (one row per lie size) and a verdict line per lie size above 0."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from simulator.seeds import fmt

    console = console or Console()
    points, liars = result["points"], result["liars"]
    table = Table(title=f"{result['strategy']}: liar(s) {', '.join(liars)[:60]}, {result['workload']} on "
                        f"{result['cluster']}, {result['policy']}, {result['rank']} rank, {len(result['seeds'])} "
                        "seeds (mean ± 95% CI)",
                  box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0), title_justify="left")
    for col in ("X %", "liar JCT (h)", "liar JCT / truthful", "sooner in", "later in", "liar hidden payment",
                "others JCT / truthful"):
        table.add_column(col, justify="right")
    for p in points:
        table.add_row(f"{p['level']:.0f}", fmt(p["liar_jct_s"], "{:.2f}", 3600.0), fmt(p["liar_jct_vs_truthful"], "{:.3f}"),
                      f"{p['liar_faster_in']} of {p['seeds']}", f"{p['liar_slower_in']} of {p['seeds']}",
                      fmt(p["liar_hidden_payment"], "{:.3f}"), fmt(p["others_jct_vs_truthful"], "{:.3f}"))
    console.print(table)
    for p in points:
        if p["level"] != 0:
            console.print(verdict(p, result["strategy"], len(liars)), highlight=False)
