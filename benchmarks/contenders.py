"""Who contends, and how often the auction zeroes a winner (D8, D18, D25).

The Nash convention serves as many contenders as it can before it weighs values, so a winner whose
row leaves another contender with nothing, while that one would be served without it, has c_i = 0:
the auction grants it nothing and its GPUs go down the rank. Each case here is one realistic Themis
round on ``sim-256``: 8-64 fragmented free GPUs, and 0.75-1x as many apps as free GPUs wanting
more, every one a bidder (f = 0), with the shipped models' slowdowns; half of them hold GPUs
(successive-halving searches holding one GPU per job, whose smallest useful row is two GPUs), the
others hold nothing (starving). The agents bid with the real code (``agent.agent.Agent``) and the
round runs through the real engine and policy.

Every case is run under three rules and the same seeds:

* ``D8``: the first |offered| bidders with a useful row all enter the PF (before D25);
* ``D25``: a contender enters the PF only when its smallest useful row fits next to one GPU for
  each contender admitted before it (``arbiter.auction.admit``);
* ``D25, every GPU a row``: D25, and every offered GPU a 1-GPU row at any offer size (D18 lists
  them only up to ``agent.bidding.SINGLE_ROWS`` = 32 GPUs).

It reports, per offer size: winners with c_i = 0 (all, and the first-ranked contender), the share of
the offer the auction keeps in expectation (sum of c_i |G_i| / offered), and the auction's time.

    python benchmarks/contenders.py [--cases 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from machine import machine_info, write_results
from offers import fragmented_free
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

# Run as a script, this folder comes first on sys.path, and its simulator.py would hide the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import agent.bidding as bidding  # noqa: E402
import arbiter.auction as auction  # noqa: E402
from agent.agent import Agent  # noqa: E402
from agent.appsched import SuccessiveHalvingApp  # noqa: E402
from agent.placement import load_profiles  # noqa: E402
from arbiter.cluster import load_cluster  # noqa: E402
from arbiter.policies import make_policy  # noqa: E402
from arbiter.rounds import RoundEngine  # noqa: E402

CLUSTER = "sim-256"
OFFERS = (8, 16, 32, 48, 64)
RULES = ("D8", "D25", "D25, every GPU a row")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "contenders.json"


def _old_admit(order, values, offered, max_contenders=None):
    """D8 before D25: the first |offered| (or max_contenders) bidders with a useful row, all in the PF."""
    limit = offered if max_contenders is None else min(offered, max_contenders)
    field = [a for a in order if values.get(a)][:limit]
    return field, tuple(field)


@contextmanager
def rule(name: str) -> Iterator[None]:
    admit, single = auction.admit, bidding.SINGLE_ROWS
    if name == "D8":
        auction.admit = _old_admit
    elif name == "D25, every GPU a row":
        bidding.SINGLE_ROWS = 1 << 30
    try:
        yield
    finally:
        auction.admit, bidding.SINGLE_ROWS = admit, single


def one_round(offered: int, seed: int, rule_name: str) -> dict[str, Any]:
    rng = random.Random(f"contenders:{offered}:{seed}")
    cluster = load_cluster(CLUSTER)
    profiles = load_profiles()
    models = sorted(profiles)
    free = fragmented_free(cluster, offered, rng)
    busy = [g for g in sorted(cluster.gpu_ids) if g not in free]
    rng.shuffle(busy)
    engine = RoundEngine(cluster, make_policy("themis", fairness_knob=0.0), lease_s=600, coalesce_s=0,
                         expiry_window_s=0, seed=seed, reclaim=False)
    engine.add_app("busy", 0.0)
    engine.set_demand("busy", 0, 0.0)
    agents: dict[str, Agent] = {}
    held: dict[str, list[str]] = {}
    for k in range(max(2, round(rng.uniform(0.75, 1.0) * offered))):
        name = f"app{k:02d}"
        model = profiles[rng.choice(models)].slowdown
        jobs = rng.choice([2, 4])
        app = SuccessiveHalvingApp([rng.uniform(0.2, 2.0) * (1 + 0.1 * j) for j in range(jobs)],
                                   [rng.uniform(2_000, 20_000)], job_demand_max=4, slowdown=model)
        if rng.random() < 0.5 and len(busy) >= jobs:
            held[name], busy = busy[:jobs], busy[jobs:]  # one GPU per job: one more is worth nothing
        engine.add_app(name, 0.0, slowdown=model)
        agents[name] = Agent(app, name=name)
    for name, gpus in held.items():
        engine.leases.grant(name, gpus, now=0.0, expires_at=1e9, round_id=0)
    engine.leases.grant("busy", [g for g in cluster.gpu_ids if g not in free and engine.leases.holder(g) is None],
                        now=0.0, expires_at=1e9, round_id=0)
    with rule(rule_name):
        started = time.perf_counter()
        result = engine.run_round(3600.0, {**agents})
        seconds = time.perf_counter() - started
    out = result.decision.auction if result.decision else None
    if out is None:
        return {"winners": 0, "zeros": 0, "first_zero": False, "kept": 0.0, "seconds": seconds, "first": None}
    first = out.contenders[0] if out.contenders else None
    zeros = [a for a in out.pf if out.hidden_payment[a] == 0.0]
    kept = sum(out.hidden_payment[a] * len(g) for a, g in out.pf.items()) / offered
    return {"winners": len(out.pf), "zeros": len(zeros), "first_zero": first in zeros,
            "first_starving": first is not None and first not in held, "kept": kept, "seconds": seconds,
            "contenders": len(out.contenders), "admitted": len(out.pf) + sum(
                1 for a in out.contenders if a not in out.pf)}


def study(args: tuple[int, int]) -> list[dict[str, Any]]:
    offered, seed = args
    return [{"offered": offered, "seed": seed, "rule": r, **one_round(offered, seed, r)} for r in RULES]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=20, help="rounds per offer size")
    parser.add_argument("--offers", default=",".join(map(str, OFFERS)))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    offers = [int(x) for x in args.offers.split(",")]
    jobs = [(n, seed) for n in offers for seed in range(args.cases)]
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    with Progress(TextColumn("rounds"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("rounds", total=len(jobs))
        for job in jobs:
            rows.extend(study(job))
            bar.advance(task)
    table = Table(title=f"Zeroed winners: {args.cases} Themis rounds per offer size on {CLUSTER}, "
                        "0.75-1x as many bidders as GPUs, half holding one GPU per job")
    for col in ("offered", "rule", "winners", "c_i = 0", "first-ranked c_i = 0", "of them starving",
                "auction keeps", "median s", "max s"):
        table.add_column(col, justify="right")
    summary: dict[str, Any] = {}
    for n in offers:
        for r in RULES:
            mine = [x for x in rows if x["offered"] == n and x["rule"] == r]
            winners = sum(x["winners"] for x in mine)
            zeros = sum(x["zeros"] for x in mine)
            first = sum(1 for x in mine if x["first_zero"])
            starving = sum(1 for x in mine if x["first_zero"] and x.get("first_starving"))
            kept = statistics.fmean(x["kept"] for x in mine)
            secs = [x["seconds"] for x in mine]
            summary[f"{n}/{r}"] = {"offered": n, "rule": r, "rounds": len(mine), "winners": winners, "zeros": zeros,
                                   "first_zero": first, "first_zero_starving": starving, "kept": kept,
                                   "median_s": statistics.median(secs), "max_s": max(secs)}
            table.add_row(str(n), r, str(winners), f"{zeros} ({zeros / max(1, winners):.0%})", str(first),
                          str(starving), f"{kept:.0%}", f"{statistics.median(secs):.2f}", f"{max(secs):.2f}")
    Console(width=160).print(table)
    result = {"machine": machine_info(), "cases": args.cases, "wall_seconds": time.perf_counter() - started,
              "summary": summary, "rows": rows}
    write_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
