"""The lottery's swings on small clusters: independent draws against D38's one shared draw (D15, D38).

Each setup is a few searches (``synthetic``: 2-4 fixed or successive-halving apps of 2-4 jobs at 1-2
GPUs each, arriving close together) on a 4- or 8-GPU cluster (machines of ``testbed-64``), run
through the real simulator (``simulator.engine.Simulation``: agents, round engine, Themis policy)
at D6's default f = 0.8, at f = 0.8 with D41's option of at least two bidders (D38's lottery only),
and at f = 0 (every app bids), over ``--seeds`` seeds, once with each lottery:

* ``independent``: each PF winner its own draw (before D38, ``arbiter.lottery.independent_draws``);
* ``rotated``: one shared draw u, winner k of n drawing (u + k/n) mod 1 (D38, the default).

Counted after every round, for each app that wanted GPUs as the round opened: the GPUs it holds
(``held``: its variance over its rounds, averaged over apps), whether it holds none (``starved``),
the auctions whose lottery had a c_i strictly between 0 and 1 (``lotteries``), of them those
that kept no row (``kept none``), the share of the PF rows' GPUs each kept (mean and standard
deviation); and the run's Themis summary (mean and max rho, makespan).

    python benchmarks/lottery_swing.py [--seeds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from machine import machine_info
from rich.console import Console
from rich.table import Table

# Run as a script, this folder comes first on sys.path, and its simulator.py would hide the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import arbiter.auction as auction  # noqa: E402
from arbiter import lottery  # noqa: E402
from arbiter.cluster import load_cluster  # noqa: E402
from arbiter.policies import make_policy  # noqa: E402
from simulator.engine import Simulation  # noqa: E402
from simulator.metrics import summarize  # noqa: E402
from simulator.workloads.synthetic import synthetic  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "lottery_swing.json"
MACHINES = {4: ["r0-m4"], 8: ["r0-m4", "r0-m5"]}
LOTTERIES = {"independent": lottery.independent_draws, "rotated": lottery.auction_draws}


@contextmanager
def lottery_of(name: str) -> Iterator[None]:
    """The auction's draws made by ``name``'s lottery for the runs inside."""
    original = auction.auction_draws
    auction.auction_draws = LOTTERIES[name]
    try:
        yield
    finally:
        auction.auction_draws = original


def run(gpus: int, apps: int, knob: float, seed: int, name: str, min_bidders: int = 1) -> dict[str, Any]:
    cluster = load_cluster("testbed-64").subcluster(MACHINES[gpus])
    workload = synthetic(seed=seed, apps=apps, app_size=(2, 4), kind=("fixed", "successive_halving"), load=3.0,
                         cluster_gpus=gpus, gpus=(1, 2), job_duration_s=(600.0, 3600.0))
    sim = Simulation(cluster, workload, make_policy("themis", fairness_knob=knob, min_bidders=min_bidders), seed=seed)
    held: dict[str, list[int]] = {}
    lotteries = kept_none = 0
    shares: list[float] = []
    auctions: list[dict[str, tuple[float, int]]] = []

    def record(result) -> None:
        nonlocal lotteries, kept_none
        outcome = result.decision.auction if result.decision is not None else None
        if outcome is not None and any(0 < outcome.hidden_payment[a] < 1 for a in outcome.pf):
            lotteries += 1
            kept_none += not outcome.granted
            won = sum(len(outcome.pf[a]) for a in outcome.pf)
            shares.append(sum(len(g) for g in outcome.granted.values()) / won)
            auctions.append({a: (outcome.hidden_payment[a], len(outcome.pf[a])) for a in outcome.pf})
        for app, want in result.unmet.items():
            if want > 0 and app in sim.engine.apps:
                held.setdefault(app, []).append(len(sim.engine.held(app)))

    sim.on_round = record
    with lottery_of(name):
        summary = summarize(sim.run())
    counts = [n for series in held.values() for n in series]
    return {"variance": statistics.fmean(statistics.pvariance(s) for s in held.values()) if held else 0.0,
            "starved": sum(1 for n in counts if n == 0), "wanting": len(counts),
            "lotteries": lotteries, "kept_none": kept_none, "kept_shares": shares,
            "exact": [exact(a) for a in auctions],
            "mean_rho": summary["mean_rho"], "max_rho": summary["max_rho"], "makespan_h": summary["makespan"] / 3600}


def outcomes(name: str, c: dict[str, float]) -> list[tuple[frozenset[str], float]]:
    """Every set of rows a lottery can keep, with its probability, exactly: ``independent`` over the
    2^n outcomes of n draws, ``rotated`` over D38's pieces of u, ``systematic`` (an alternative:
    arcs of length c_i laid end to end in name order, kept where u falls) over its pieces."""
    apps = sorted(c)
    if name == "independent":
        out = []
        for mask in range(1 << len(apps)):
            kept = frozenset(a for k, a in enumerate(apps) if mask >> k & 1)
            p = math.prod(c[a] if a in kept else 1 - c[a] for a in apps)
            out.append((kept, p))
        return out
    if name == "rotated":
        return [(frozenset(a for a, d in lottery.rotated_draws(u, c).items() if d < c[a]), w)
                for u, w in lottery.cells(c)]
    starts = dict(zip(apps, itertools.accumulate([0.0] + [c[a] for a in apps])))
    cuts = sorted({0.0, 1.0} | {x % 1.0 for a in apps for x in (starts[a], starts[a] + c[a])})
    return [(frozenset(a for a in apps if (u - starts[a]) % 1.0 < c[a]), hi - lo)
            for lo, hi in zip(cuts, cuts[1:]) if hi > lo for u in [(lo + hi) / 2]]


def exact(auction_: dict[str, tuple[float, int]]) -> dict[str, tuple[float, float, float]]:
    """Per lottery: the exact chance that no row is kept, and the mean and standard deviation of
    the share of the PF rows' GPUs kept, for one auction's (c_i, |row|)."""
    c = {a: ci for a, (ci, _) in auction_.items()}
    total = sum(n for _, n in auction_.values())
    out = {}
    for name in ("independent", "rotated", "systematic"):
        dist = outcomes(name, c)
        share = [(sum(auction_[a][1] for a in kept) / total, p) for kept, p in dist]
        mean = sum(x * p for x, p in share)
        out[name] = (sum(p for kept, p in dist if not kept), mean,
                     math.sqrt(max(0.0, sum(p * (x - mean) ** 2 for x, p in share))))
    return out


def kept_share(shares: list[float]) -> str:
    """The mean share of the PF rows' GPUs the lottery kept, and its standard deviation."""
    if not shares:
        return "-"
    return f"{statistics.fmean(shares):.2f} ({statistics.pstdev(shares):.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = []
    for knob, least, lotteries in ((0.8, 1, LOTTERIES), (0.8, 2, ["rotated"]), (0.0, 1, LOTTERIES)):
        for gpus in (4, 8):
            for apps in (2, 3, 4):
                for name in lotteries:
                    runs = [run(gpus, apps, knob, seed, name, least) for seed in range(args.seeds)]
                    rows.append({"f": knob, "min_bidders": least, "gpus": gpus, "apps": apps, "lottery": name,
                                 "runs": runs})
    table = Table(title=f"The lottery on small clusters, {args.seeds} seeds each (sums over seeds; rho and "
                        "makespan: means)")
    for col in ("f", "min bidders", "GPUs", "apps", "lottery", "held variance", "starved", "lotteries", "kept none",
                "kept share (sd)", "mean rho", "max rho", "makespan h"):
        table.add_column(col, justify="right")
    for row in rows:
        runs = row["runs"]
        table.add_row(f"{row['f']:g}", str(row["min_bidders"]), str(row["gpus"]), str(row["apps"]), row["lottery"],
                      f"{statistics.fmean(r['variance'] for r in runs):.3f}",
                      f"{sum(r['starved'] for r in runs)}/{sum(r['wanting'] for r in runs)}",
                      str(sum(r["lotteries"] for r in runs)), str(sum(r["kept_none"] for r in runs)),
                      kept_share([s for r in runs for s in r["kept_shares"]]),
                      f"{statistics.fmean(r['mean_rho'] for r in runs):.3f}",
                      f"{statistics.fmean(r['max_rho'] for r in runs):.3f}",
                      f"{statistics.fmean(r['makespan_h'] for r in runs):.3f}")
    Console(width=160).print(table)
    exact_table = Table(title="Exact over each lottery auction of the rotated runs (f = 0): the chance that no row is "
                              "kept, and the standard deviation of the share of GPUs kept (means over auctions)")
    for col in ("GPUs", "apps", "auctions", "none kept: independent", "rotated (D38)", "systematic",
                "sd kept: independent", "rotated (D38)", "systematic"):
        exact_table.add_column(col, justify="right")
    for row in rows:
        if row["lottery"] != "rotated" or row["f"] != 0.0:
            continue
        found = [e for r in row["runs"] for e in r["exact"]]
        if not found:
            continue
        names = ("independent", "rotated", "systematic")
        exact_table.add_row(str(row["gpus"]), str(row["apps"]), str(len(found)),
                            *[f"{statistics.fmean(e[n][0] for e in found):.3f}" for n in names],
                            *[f"{statistics.fmean(e[n][2] for e in found):.3f}" for n in names])
    Console(width=160).print(exact_table)
    result = {"machine": machine_info(), "seeds": args.seeds, "wall_seconds": time.perf_counter() - started,
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    Console(stderr=True).print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
