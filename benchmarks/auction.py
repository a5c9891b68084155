"""How long one partial-allocation auction takes, and whether its PF allocation is optimal.

The paper (Themis, NSDI'20, section 6.2.3) measures the arbiter's auction with Gurobi at 354 ms
median and 1398 ms p95 per round. ``arbiter.auction.run_auction`` solves the same problem -- one PF
allocation plus one re-solve per winner for the hidden payments -- with open solvers, so this
script measures it in three parts:

* ``grid``: free GPUs {16, 64, 256} x bidders {4, 8, 16, 32} on ``sim-256``, with bid tables built
  by the real bid code (``agent.bidding.make_bid``) for successive-halving apps. The free GPUs are
  fragmented (whole machines mostly free or mostly busy); about half the apps hold GPUs (finite
  rho_old), the rest hold nothing (rho_old = infinity). When the whole cluster is free nobody can
  hold anything, so the 256-GPU cells have only rho_old = infinity bidders. Reports the auction's
  median and p95 time, MILP solves per round, rows per bid, and the time to build one bid table.
  Cells of up to 16 bidders (all cells with ``--plain-all``) are also checked against the plain
  model below, which exercises the Nash-welfare convention over the contenders (D8, D15).
* ``yardstick``: the 60 fixed instances of ``data/auction-instances`` (the shared yardstick) with the default
  solver, against the reference times in that README (a plain PuLP + CBC model on the developers'
  machine). The same plain model is also written here and run in the same process as a same-run
  reference where the README's median is at most 1.3 s (every cell with ``--plain-all``); its
  optimum must equal the PF value of our allocation (within the quantisation of D16), and its
  re-solves give the hidden payments c_i our auction must match. The reference times were measured
  for the mechanism before D15 (log(rho_old / rho) valuations, holders optional); with incremental
  valuations every contender counts under the Nash convention, a harder problem, so "ours /
  README" compares different problems on the same instances. Any difference from the plain model
  is reported loudly (and the exit status is 1).
* ``backends``: the full auction on a few yardstick instances with each MILP backend of
  ``arbiter.auction`` (``highs``, ``pulp-highs``, ``pulp-cbc``), which is what justifies the default.
* ``payments``: the grid's contested cells with exact c_i and with the lottery decided from bounds
  on c_i (D39, the service's setting): CPU time, re-solves skipped, and that the grants are the same.

Run ``python benchmarks/auction.py [--quick] [--parts grid,yardstick,backends,payments] [--plain-all]
[--out FILE]``; results go to ``benchmarks/results/auction.json`` by default.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pulp
from machine import machine_info
from offers import PROFILE_SOURCE, fragmented_free, slowdown_models
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from agent.appsched import SuccessiveHalvingApp
from agent.bidding import make_bid
from agent.placement import Slowdown
from arbiter.auction import (
    DEFAULT_SOLVER,
    QUANTUM,
    SOLVERS,
    AuctionOutcome,
    default_priority,
    row_value,
    run_auction,
)
from arbiter.cluster import Cluster, load_cluster
from protos.messages import BidTable, Offer, Position

Cell = tuple[int, int]  # (free GPUs, bidders)

GRID_FREE = (16, 64, 256)
GRID_BIDDERS = (4, 8, 16, 32)
CLUSTER = "sim-256"
DEFAULT_INSTANCES = Path(__file__).resolve().parents[1] / "data" / "auction-instances" / "instances.json"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "auction.json"

# Median time of a full round (PF solve + one re-solve per winner) with a plain PuLP + CBC model,
# from the table in data/auction-instances/README.md (a copy of the shared yardstick). Cells it does not list have none.
REFERENCE_MEDIAN_S: dict[Cell, float] = {
    (16, 4): 0.16,
    (64, 4): 0.23,
    (64, 8): 0.67,
    (256, 8): 0.82,
    (16, 16): 1.22,
    (256, 16): 3.72,
    (64, 16): 5.37,
}
PLAIN_DEFAULT_LIMIT_S = 1.3  # run the same-run plain model where the README's median is at most this
BACKEND_CELLS: tuple[Cell, ...] = ((16, 4), (64, 4), (64, 8), (16, 16))

# Used when agent/profiles/slowdowns.toml cannot be loaded: a locality-sensitive model (VGG-like),
# an insensitive one (ResNet-like) and one in between; S by D1 level (slot, machine, rack, cluster).

GRID_PLAIN_MAX_BIDDERS = 16  # grid cells checked against the plain model by default
STARVED_C_TOL = 1e-6  # c_i that counts as "keeps nothing" (i's win starves an app holding nothing)


@dataclass(frozen=True)
class Settings:
    quick: bool
    grid_seeds: int
    yardstick_per_cell: int
    backend_per_cell: int
    plain_all: bool


def settings_for(quick: bool, plain_all: bool) -> Settings:
    if quick:
        return Settings(True, 2, 2, 1, plain_all)
    return Settings(False, 5, 5, 2, plain_all)


# ---------------------------------------------------------------------------------------------
# Small statistics


def p95(values: Sequence[float]) -> float:
    return float(np.percentile(values, 95))


def summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "p95": p95(values),
        "max": max(values),
        "mean": statistics.fmean(values),
    }


# ---------------------------------------------------------------------------------------------
# Part A: instances from the real bid code


@dataclass(frozen=True)
class AuctionInstance:
    """One auction's input: the offered GPUs and each bidder's table."""

    free_gpus: int
    bidders: int
    seed: int
    offered: frozenset[str]
    bids: dict[str, BidTable]
    bid_ms: tuple[float, ...] = ()  # time to build each bid table (grid instances only)

    @property
    def cell(self) -> Cell:
        return (self.free_gpus, self.bidders)


def random_app(rng: random.Random, slowdown: Slowdown, now: float) -> SuccessiveHalvingApp:
    """A successive-halving app: 2-16 jobs of up to 8 GPUs each, 1-3 phases."""
    jobs = rng.randint(2, 16)
    phases = rng.randint(1, min(3, jobs.bit_length()))
    base = rng.uniform(0.2, 2.0)
    return SuccessiveHalvingApp(
        iter_times=[base * rng.uniform(0.8, 1.25) for _ in range(jobs)],
        iterations=[rng.choice((500.0, 1000.0, 2000.0)) * 2**p for p in range(phases)],
        job_demand_max=rng.randint(1, 8),
        slowdown=slowdown,
        start_time=now - rng.uniform(0.0, 4 * 3600.0),
    )


def take_held(busy: dict[str, list[str]], k: int, rng: random.Random) -> list[str]:
    """Up to ``k`` busy GPUs for an app to hold, machine by machine from a random start."""
    machines = [m for m, gpus in busy.items() if gpus]
    rng.shuffle(machines)
    held: list[str] = []
    for m in machines:
        while busy[m] and len(held) < k:
            held.append(busy[m].pop())
        if len(held) == k:
            break
    return held


def grid_instance(cluster: Cluster, cell: Cell, seed: int, slowdowns: Sequence[Slowdown]) -> AuctionInstance:
    """A deterministic auction instance for ``cell`` whose bids come from ``make_bid``."""
    n_free, n_bidders = cell
    rng = random.Random(f"grid-{n_free}-{n_bidders}-{seed}")
    free = fragmented_free(cluster, n_free, rng)
    busy = {m: [g for g in gpus if g not in free] for m, gpus in cluster.machines.items()}
    offer_gpus = {g: cluster.position(g) for g in sorted(free)}
    now = 36_000.0
    bids: dict[str, BidTable] = {}
    bid_ms: list[float] = []
    for k in range(n_bidders):
        app = random_app(rng, rng.choice(slowdowns), now)
        demand = app.demand_now()
        held: list[str] = []
        if demand > 1 and rng.random() < 0.5:
            held = take_held(busy, rng.randint(1, min(16, demand - 1)), rng)
        offer = Offer(1, offer_gpus, now, rng.uniform(1.0, 4.0), cluster.size,
                      held={g: cluster.position(g) for g in held})
        start = time.perf_counter()
        bids[f"app{k}"] = make_bid(app, offer)
        bid_ms.append((time.perf_counter() - start) * 1e3)
    return AuctionInstance(n_free, n_bidders, seed, free, bids, tuple(bid_ms))


@dataclass(frozen=True)
class TimedAuction:
    seconds: float
    outcome: AuctionOutcome


def timed_auction(
    inst: AuctionInstance, position: Callable[[str], Position], solver: str = DEFAULT_SOLVER
) -> TimedAuction:
    start = time.perf_counter()
    outcome = run_auction(inst.offered, inst.bids, seed=inst.seed, solver=solver, position=position)
    return TimedAuction(time.perf_counter() - start, outcome)


# ---------------------------------------------------------------------------------------------
# The PF value and the plain PuLP + CBC model


@dataclass(frozen=True)
class PfValue:
    """A PF allocation's value as the Nash-welfare convention (D8, D15) compares it: first how many
    contenders are served, then the sum of log V over them, V = 1/rho - 1/rho_old."""

    served: int
    log_sum: float

    def matches(self, other: PfValue, tol: float) -> bool:
        return self.served == other.served and abs(self.log_sum - other.log_sum) <= tol


def log_value(bid: BidTable, rho: float) -> float:
    """An app's term in ``PfValue.log_sum`` when it gets a row of that rho (D15)."""
    return math.log(row_value(rho, bid.rho_old))


def contenders(offered: frozenset[str], bids: Mapping[str, BidTable]) -> list[str]:
    """D8: the first |offered| bidders (worst rho_old first, then name) with a row better than
    their rho_old."""
    useful = [a for a in default_priority(bids) if any(row_value(rho, bids[a].rho_old) > 0 for _, rho in bids[a].rows)]
    return useful[: len(offered)]


def pf_value(bids: Mapping[str, BidTable], rho_of: Mapping[str, float], skip: str | None = None) -> PfValue:
    """The value of giving each app in ``rho_of`` (but ``skip``) a row with that rho."""
    apps = [a for a in rho_of if a != skip]
    return PfValue(served=len(apps), log_sum=math.fsum(log_value(bids[a], rho_of[a]) for a in apps))


def big_constant(bids: Mapping[str, BidTable]) -> float:
    """M for the plain model: serving one more contender outweighs any change of the log sum."""
    return 1.0 + 2.0 * sum(
        max((abs(log_value(bid, rho)) for _, rho in bid.rows if row_value(rho, bid.rho_old) > 0), default=0.0)
        for bid in bids.values()
    )


def plain_pf(bids: Mapping[str, BidTable], skip: str | None = None) -> dict[str, float]:
    """The README's straightforward model: a binary per row, one row per app, one constraint per
    GPU, maximise sum (M + log V) over the rows better than rho_old (D8, D15), CBC with gap 0.
    ``bids`` are the contenders'. Returns app -> rho of the row it gets."""
    big = big_constant(bids)
    prob = pulp.LpProblem("plain_pf", pulp.LpMaximize)
    chosen: dict[tuple[str, int], pulp.LpVariable] = {}
    per_gpu: dict[str, list[pulp.LpVariable]] = {}
    terms = []
    for a, app in enumerate(sorted(bids)):
        bid = bids[app]
        if app == skip:
            continue
        own = []
        for r, (gpus, rho) in enumerate(bid.rows):
            if row_value(rho, bid.rho_old) <= 0:
                continue
            x = prob.add_variable(f"x_{a}_{r}", 0, 1, cat=pulp.LpBinary)
            chosen[app, r] = x
            own.append(x)
            terms.append((big + log_value(bid, rho)) * x)
            for g in gpus:
                per_gpu.setdefault(g, []).append(x)
        if own:
            prob += pulp.lpSum(own) <= 1, f"app_{a}"
    if not chosen:
        return {}
    prob += pulp.lpSum(terms)
    for k, (_, xs) in enumerate(sorted(per_gpu.items())):
        prob += pulp.lpSum(xs) <= 1, f"gpu_{k}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # PuLP 3.x: PULP_CBC_CMD is the bundled CBC
        cbc = pulp.PULP_CBC_CMD(msg=False, gapRel=0)
    status = prob.solve(cbc)
    if pulp.LpStatus[status] != "Optimal":
        raise RuntimeError(f"plain model: CBC returned {pulp.LpStatus[status]}")
    return {app: bids[app].rows[r][1] for (app, r), x in chosen.items() if (x.value() or 0.0) > 0.5}


@dataclass(frozen=True)
class PlainRound:
    """A full round of the plain model: the PF solve, then a re-solve without each winner."""

    seconds: float
    pf_rho: dict[str, float]
    without: dict[str, PfValue]  # winner -> optimum of the re-solve without it


def plain_round(offered: frozenset[str], bids: Mapping[str, BidTable]) -> PlainRound:
    start = time.perf_counter()
    field = {a: bids[a] for a in contenders(offered, bids)}
    pf_rho = plain_pf(field)
    without = {app: pf_value(field, plain_pf(field, skip=app)) for app in sorted(pf_rho)}
    return PlainRound(time.perf_counter() - start, pf_rho, without)


def expected_hidden_payment(inst: AuctionInstance, ours: AuctionOutcome, app: str, without: PfValue) -> float:
    """c_i from our PF allocation and the plain optimum without i (D8). When dropping i lets more
    contenders be served, a zero valuation is in the numerator and c_i = 0; otherwise the M terms
    cancel and c_i is the ratio of the products."""
    with_i = pf_value(inst.bids, ours.pf_rho, skip=app)
    if without.served > with_i.served:
        return 0.0
    return math.exp(min(0.0, with_i.log_sum - without.log_sum))


def tolerance(inst: AuctionInstance) -> float:
    """How far our log sum may be from the exact one: half a quantum per app (D16), twice over."""
    return len(inst.bids) / QUANTUM + 1e-9


def payments_agree(ours: float, expected: float, tol: float) -> bool:
    if expected == 0.0:
        return ours <= STARVED_C_TOL
    return ours > 0.0 and abs(math.log(ours) - math.log(expected)) <= 2 * tol


def check_against_plain(inst: AuctionInstance, ours: AuctionOutcome, plain: PlainRound) -> list[str]:
    """Differences between our auction and the plain model: the PF value, then (when the PF values
    agree) the hidden payment c_i of every app that won in both."""
    where = f"{cell_name(inst.cell)} seed {inst.seed}"
    tol = tolerance(inst)
    if list(ours.contenders) != contenders(inst.offered, inst.bids):
        return [f"{where}: contenders ours {ours.contenders} != plain"]
    our_value = pf_value(inst.bids, ours.pf_rho)
    plain_value = pf_value(inst.bids, plain.pf_rho)
    if not our_value.matches(plain_value, tol):
        return [f"{where}: PF value ours {our_value} != plain {plain_value}"]
    problems = []
    for app, without in plain.without.items():
        if app not in ours.pf_rho:
            continue
        expected = expected_hidden_payment(inst, ours, app, without)
        if not payments_agree(ours.hidden_payment[app], expected, tol):
            problems.append(f"{where}: c[{app}] ours {ours.hidden_payment[app]:.9g} != plain {expected:.9g}")
    return problems


# ---------------------------------------------------------------------------------------------
# Part B: the yardstick instances


def load_yardstick(path: Path) -> list[AuctionInstance]:
    out = []
    for item in json.loads(path.read_text()):
        bids = {
            app: BidTable(float(b["rho_old"]), tuple((frozenset(gpus), float(rho)) for gpus, rho in b["rows"]))
            for app, b in item["bids"].items()
        }
        offered = frozenset(item["offered"])
        out.append(AuctionInstance(item["free_gpus"], item["bidders"], item["seed"], offered, bids))
    return out


def per_cell(instances: Sequence[AuctionInstance], limit: int) -> dict[Cell, list[AuctionInstance]]:
    """The first ``limit`` instances (by seed) of each cell, cells in (free, bidders) order."""
    cells: dict[Cell, list[AuctionInstance]] = {}
    for inst in sorted(instances, key=lambda i: (i.cell, i.seed)):
        group = cells.setdefault(inst.cell, [])
        if len(group) < limit:
            group.append(inst)
    return cells


def runs_plain(cell: Cell, settings: Settings) -> bool:
    ref = REFERENCE_MEDIAN_S.get(cell)
    return settings.plain_all or (ref is not None and ref <= PLAIN_DEFAULT_LIMIT_S)


# ---------------------------------------------------------------------------------------------
# Output


def cell_name(cell: Cell) -> str:
    return f"{cell[0]}x{cell[1]}"


def fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


@contextmanager
def progress_bar(console: Console, label: str, total: int) -> Iterator[Callable[[], None]]:
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(label, total=total)
        yield lambda: progress.advance(task)


def warm_up(cluster: Cluster) -> None:
    """Import and initialise every backend once so the first timed auction pays no set-up."""
    slowdowns = slowdown_models()
    inst = grid_instance(cluster, (16, 4), 0, slowdowns)
    for solver in SOLVERS:
        timed_auction(inst, cluster.position, solver)


def grid_cell(
    cluster: Cluster, cell: Cell, settings: Settings, slowdowns: Sequence[Slowdown], advance: Callable[[], None]
) -> tuple[dict[str, Any], list[str]]:
    """Time every seed of one grid cell, checking against the plain model where it runs."""
    times, plain, solves, rows_per_bid, bid_ms, inf_share = [], [], [], [], [], []
    mismatches: list[str] = []
    for seed in range(settings.grid_seeds):
        inst = grid_instance(cluster, cell, seed, slowdowns)
        run = timed_auction(inst, cluster.position)
        times.append(run.seconds)
        solves.append(run.outcome.solves)
        rows_per_bid.extend(len(b.rows) for b in inst.bids.values())
        bid_ms.extend(inst.bid_ms)
        inf_share.append(sum(math.isinf(b.rho_old) for b in inst.bids.values()) / len(inst.bids))
        if settings.plain_all or cell[1] <= GRID_PLAIN_MAX_BIDDERS:
            reference = plain_round(inst.offered, inst.bids)
            plain.append(reference.seconds)
            mismatches.extend(check_against_plain(inst, run.outcome, reference))
        advance()
    row = {
        "cell": cell_name(cell),
        "instances": len(times),
        "seeds": list(range(settings.grid_seeds)),
        "seconds": summary(times),
        "times_s": times,
        "solves_mean": statistics.fmean(solves),
        "rows_per_bid_mean": statistics.fmean(rows_per_bid),
        "rows_per_bid_max": max(rows_per_bid),
        "bid_ms": summary(bid_ms),
        "bid_times_ms": bid_ms,
        "inf_rho_old_share": statistics.fmean(inf_share),
        "plain_same_run_median_s": statistics.median(plain) if plain else None,
        "plain_times_s": plain,
    }
    return row, mismatches


def run_grid(cluster: Cluster, settings: Settings, console: Console) -> tuple[dict[str, Any], list[str]]:
    slowdowns, source = slowdown_models(), PROFILE_SOURCE
    cells = [(f, b) for f in GRID_FREE for b in GRID_BIDDERS]
    rows: list[dict[str, Any]] = []
    mismatches: list[str] = []
    with progress_bar(console, "grid", len(cells) * settings.grid_seeds) as advance:
        for cell in cells:
            row, found = grid_cell(cluster, cell, settings, slowdowns, advance)
            rows.append(row)
            mismatches.extend(found)
    table = Table(title=f"Part A: auction on sim-256 with real bid tables (default solver {DEFAULT_SOLVER!r})")
    columns = ("cell", "n", "median", "p95", "solves/round", "rows/bid", "bid median", "bid p95",
               "rho_old=inf", "plain same run")
    for col in columns:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["cell"], str(r["instances"]), fmt_s(r["seconds"]["median"]), fmt_s(r["seconds"]["p95"]),
            f"{r['solves_mean']:.1f}", f"{r['rows_per_bid_mean']:.0f}",
            f"{r['bid_ms']['median']:.2f} ms", f"{r['bid_ms']['p95']:.2f} ms", f"{r['inf_rho_old_share']:.0%}",
            fmt_s(r["plain_same_run_median_s"]),
        )
    console.print(table)
    all_times = [t for r in rows for t in r["times_s"]]
    all_bids = [t for r in rows for t in r["bid_times_ms"]]
    console.print(
        f"all grid auctions: median {fmt_s(statistics.median(all_times))}, p95 {fmt_s(p95(all_times))} "
        f"(paper 6.2.3 with Gurobi: 354 ms median, 1398 ms p95)\n"
        f"all bid tables: median {statistics.median(all_bids):.2f} ms, p95 {p95(all_bids):.2f} ms per app "
        f"(goal <= 5 ms; the paper's agents: 29 ms median, 334 ms p95)\n"
        f"slowdowns from {source}"
    )
    return {"slowdown_source": source, "cells": rows}, mismatches


def run_yardstick(
    cluster: Cluster, instances: Sequence[AuctionInstance], settings: Settings, console: Console
) -> tuple[dict[str, Any], list[str]]:
    cells = per_cell(instances, settings.yardstick_per_cell)
    mismatches: list[str] = []
    rows: list[dict[str, Any]] = []
    total = sum(len(group) for group in cells.values())
    with progress_bar(console, "yardstick", total) as advance:
        for cell, group in cells.items():
            ours, plain, checked = [], [], 0
            for inst in group:
                run = timed_auction(inst, cluster.position)
                ours.append(run.seconds)
                if runs_plain(cell, settings):
                    reference = plain_round(inst.offered, inst.bids)
                    plain.append(reference.seconds)
                    mismatches.extend(check_against_plain(inst, run.outcome, reference))
                    checked += 1
                advance()
            ref = REFERENCE_MEDIAN_S.get(cell)
            median = statistics.median(ours)
            plain_median = statistics.median(plain) if plain else None
            rows.append({
                "cell": cell_name(cell),
                "instances": len(ours),
                "seeds": [inst.seed for inst in group],
                "seconds": summary(ours),
                "times_s": ours,
                "readme_reference_median_s": ref,
                "ratio_to_readme": median / ref if ref else None,
                "plain_same_run_median_s": plain_median,
                "plain_times_s": plain,
                "ratio_to_plain_same_run": median / plain_median if plain_median else None,
                "checked_against_plain": checked,
            })
    table = Table(title=f"Part B: yardstick instances (default solver {DEFAULT_SOLVER!r})")
    columns = ("cell", "n", "median", "max", "README ref", "ours/README", "plain same run", "ours/plain", "checked")
    for col in columns:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["cell"], str(r["instances"]), fmt_s(r["seconds"]["median"]), fmt_s(r["seconds"]["max"]),
            fmt_s(r["readme_reference_median_s"]), fmt_ratio(r["ratio_to_readme"]),
            fmt_s(r["plain_same_run_median_s"]), fmt_ratio(r["ratio_to_plain_same_run"]),
            str(r["checked_against_plain"]),
        )
    console.print(table)
    return {"cells": rows, "plain_limit_s": None if settings.plain_all else PLAIN_DEFAULT_LIMIT_S}, mismatches


def run_backends(
    cluster: Cluster, instances: Sequence[AuctionInstance], settings: Settings, console: Console
) -> tuple[dict[str, Any], list[str]]:
    cells = {c: g for c, g in per_cell(instances, settings.backend_per_cell).items() if c in BACKEND_CELLS}
    times: dict[str, dict[Cell, list[float]]] = {s: {c: [] for c in cells} for s in SOLVERS}
    mismatches: list[str] = []
    total = len(SOLVERS) * sum(len(g) for g in cells.values())
    with progress_bar(console, "backends", total) as advance:
        for cell, group in cells.items():
            for inst in group:
                values: dict[str, PfValue] = {}
                for solver in SOLVERS:
                    run = timed_auction(inst, cluster.position, solver)
                    times[solver][cell].append(run.seconds)
                    values[solver] = pf_value(inst.bids, run.outcome.pf_rho)
                    advance()
                base = values[DEFAULT_SOLVER]
                mismatches.extend(
                    f"{cell_name(cell)} seed {inst.seed}: PF value {s} {v} != {DEFAULT_SOLVER} {base}"
                    for s, v in values.items() if not v.matches(base, tolerance(inst))
                )
    table = Table(title="Part C: full auction per MILP backend (median)")
    table.add_column("cell", justify="right")
    for solver in SOLVERS:
        table.add_column(solver, justify="right")
    for cell in cells:
        table.add_row(cell_name(cell), *(fmt_s(statistics.median(times[s][cell])) for s in SOLVERS))
    overall = {s: statistics.median([t for ts in times[s].values() for t in ts]) for s in SOLVERS}
    table.add_row("all", *(fmt_s(overall[s]) for s in SOLVERS), style="bold")
    console.print(table)
    result = {
        "cells": {
            cell_name(c): {"seeds": [inst.seed for inst in group]}
            | {s: {"median_s": statistics.median(times[s][c]), "times_s": times[s][c]} for s in SOLVERS}
            for c, group in cells.items()
        },
        "overall_median_s": overall,
    }
    return result, mismatches


PAYMENT_CELLS: tuple[Cell, ...] = ((64, 16), (64, 32), (256, 32))  # contested winners, as in the service's rounds
PAYMENT_DRAWS = 4  # lottery seeds per instance: which winners need their exact c_i depends on the draws


def run_payments(cluster: Cluster, settings: Settings, console: Console) -> tuple[dict[str, Any], list[str]]:
    """D39: each grid instance of ``PAYMENT_CELLS`` with exact c_i and with the lottery decided from
    bounds (``exact_payments=False``), for ``PAYMENT_DRAWS`` lottery seeds each: CPU time of the
    auction (``time.process_time``: its re-solve threads included), re-solves skipped (winners left
    as bounds) and MILP solves. Any difference in the PF, the grants, or an exact c_i is a mismatch."""
    slowdowns = slowdown_models()
    rows, mismatches = [], []
    with progress_bar(console, "payments", len(PAYMENT_CELLS) * settings.grid_seeds * PAYMENT_DRAWS) as advance:
        for cell in PAYMENT_CELLS:
            cpu = {"exact": 0.0, "bounded": 0.0}
            solves = {"exact": 0, "bounded": 0}
            contested = skipped = 0
            for seed in range(settings.grid_seeds):
                inst = grid_instance(cluster, cell, seed, slowdowns)
                for draw in range(PAYMENT_DRAWS):
                    out = {}
                    for mode in ("exact", "bounded"):
                        start = time.process_time()
                        out[mode] = run_auction(inst.offered, inst.bids, seed=draw, exact_payments=mode == "exact")
                        cpu[mode] += time.process_time() - start
                        solves[mode] += out[mode].solves
                    exact, bounded = out["exact"], out["bounded"]
                    where = f"{cell_name(cell)} seed {seed} draw {draw}"
                    if (bounded.pf, bounded.granted) != (exact.pf, exact.granted):
                        mismatches.append(f"{where}: the bounded lottery's PF or grants differ from the exact one's")
                    mismatches.extend(f"{where}: c[{a}] bounded {c} != exact {exact.hidden_payment[a]}"
                                      for a, c in bounded.hidden_payment.items() if c != exact.hidden_payment[a])
                    mismatches.extend(f"{where}: c[{a}] = {exact.hidden_payment[a]} outside its bounds {lo}, {hi}"
                                      for a, (lo, hi) in bounded.payment_bounds.items()
                                      if not lo <= exact.hidden_payment[a] <= hi)
                    contested += sum(1 for a in exact.pf if exact.hidden_payment[a] not in (0.0, 1.0))
                    skipped += len(bounded.payment_bounds)
                    advance()
            runs = settings.grid_seeds * PAYMENT_DRAWS
            rows.append({"cell": cell_name(cell), "auctions": runs, "exact_cpu_s": cpu["exact"],
                         "bounded_cpu_s": cpu["bounded"], "exact_solves_mean": solves["exact"] / runs,
                         "bounded_solves_mean": solves["bounded"] / runs, "contested_winners_mean": contested / runs,
                         "skipped_mean": skipped / runs})
    table = Table(title="Part D: the lottery from bounds on c_i (D39): CPU per auction, exact / bounded")
    for name in ("cell", "auctions", "exact", "bounded", "MILP solves exact / bounded", "0 < c_i < 1", "re-solves skipped"):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(r["cell"], str(r["auctions"]), fmt_s(r["exact_cpu_s"] / r["auctions"]),
                      fmt_s(r["bounded_cpu_s"] / r["auctions"]),
                      f"{r['exact_solves_mean']:.1f} / {r['bounded_solves_mean']:.1f}",
                      f"{r['contested_winners_mean']:.1f}", f"{r['skipped_mean']:.1f}")
    console.print(table)
    return {"cells": rows, "draws": PAYMENT_DRAWS}, mismatches


# ---------------------------------------------------------------------------------------------
# Command line

PARTS = ("grid", "yardstick", "backends", "payments")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 instances per cell, 1 per backend cell (under a minute)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    parser.add_argument("--instances", type=Path, default=DEFAULT_INSTANCES, help="yardstick instances.json")
    parser.add_argument("--plain-all", action="store_true",
                        help=f"run the same-run plain model on every yardstick cell, not only those whose "
                             f"README median is <= {PLAIN_DEFAULT_LIMIT_S} s")
    args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown or not args.parts:
        parser.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    return args


def report_mismatches(console: Console, mismatches: Sequence[str]) -> None:
    if not mismatches:
        console.print("[green]No mismatch between our auction and the plain model / other backends.[/green]")
        return
    console.rule(f"[bold red]{len(mismatches)} MISMATCH(ES)[/bold red]")
    for line in mismatches:
        console.print(f"[bold red]MISMATCH[/bold red] {line}")
    console.rule(style="red")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = settings_for(args.quick, args.plain_all)
    console = Console()
    if not console.is_terminal:  # a log file: wide enough for the tables
        console = Console(width=160)
    cluster = load_cluster(CLUSTER)
    results: dict[str, Any] = {"machine": machine_info(), "settings": vars(settings) | {"parts": args.parts}}
    console.print(f"machine: {results['machine']}")
    mismatches: list[str] = []
    yardstick = load_yardstick(args.instances) if {"yardstick", "backends"} & set(args.parts) else []
    warm_up(cluster)
    if "grid" in args.parts:
        results["grid"], found = run_grid(cluster, settings, console)
        mismatches.extend(found)
    if "yardstick" in args.parts:
        results["yardstick"], found = run_yardstick(cluster, yardstick, settings, console)
        mismatches.extend(found)
    if "backends" in args.parts:
        results["backends"], found = run_backends(cluster, yardstick, settings, console)
        mismatches.extend(found)
    if "payments" in args.parts:
        results["payments"], found = run_payments(cluster, settings, console)
        mismatches.extend(found)
    results["mismatches"] = mismatches
    report_mismatches(console, mismatches)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"results written to {args.out}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
