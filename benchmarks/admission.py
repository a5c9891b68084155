"""Which contenders enter the PF allocation: four rules on small auctions, truthfulness against zeros (D25).

The Nash convention of the PF allocation serves as many contenders as it can before it weighs
values (D8), so whoever is let into the PF decides both how often a winner gets c_i = 0 and what a
lie in a bid can buy. This benchmark runs the real auction (``arbiter.auction.run_auction``) with
four admission rules swapped in:

* ``D8``: the first |offered| bidders with a useful row, all in the PF (before session 17);
* ``count``: a contender enters if its smallest useful row fits next to one GPU for each contender
  admitted before it (no bidder's table can move another's admission);
* ``D25``: it enters if its smallest row fits in what the smallest rows of those admitted before it
  leave, and a winner whose big smallest row shut out a contender behind it answers for it
  (``arbiter.auction.admit``, ``_shadow_payments``; the default);
* ``small-first``: D25's budget, filled with the smallest rows first (then rank).

Two sets of instances (the same for every rule):

* ``random``: the property test's instances of ``tests/test_auction.py`` (2-6 GPUs, 1-4 apps, random
  rows) and a random lie by one app (a subset of its rows, every rho scaled by 0.3-3, rho_old
  too); a lie *pays* when the liar's expected value c_i V_i(G_i), in its true values, rises.
* ``realistic``: 2-8 GPUs, 2-5 bidders; starving apps list every GPU as a row (D18) plus bigger
  rows worth less per GPU; holders the same, or (half of them) rows starting at two GPUs (a
  search holding one GPU per job). Counted: winners with c_i = 0, the first-ranked contender
  (starving) zeroed, and the share of the offer the auction keeps in expectation.

    python benchmarks/admission.py [--cases 8000] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from machine import machine_info, write_results
from rich.console import Console
from rich.table import Table

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import arbiter.auction as auction  # noqa: E402
from arbiter.auction import Admission, row_value, run_auction  # noqa: E402
from protos.messages import BidTable  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "admission.json"
GPUS = [f"r{r}-m{r * 2 + m}-g{g}" for r in range(2) for m in range(2) for g in range(2)]
Values = Mapping[str, list[tuple[int, int, int]]]


def _smallest(rows: list[tuple[int, int, int]]) -> int:
    return min(mask.bit_count() for mask, _, _ in rows)


def _field(order: Sequence[str], values: Values, offered: int) -> list[str]:
    return [a for a in order if values.get(a)][:offered]


def d8(order: Sequence[str], values: Values, offered: int, max_contenders: int | None = None) -> Admission:
    field = _field(order, values, offered)
    return Admission(tuple(field), (), tuple(field), {a: _smallest(values[a]) for a in field})


def count(order: Sequence[str], values: Values, offered: int, max_contenders: int | None = None) -> Admission:
    admitted: list[str] = []
    contenders: list[str] = []
    for app in order:
        if not values.get(app):
            continue
        if len(admitted) >= offered:
            break
        contenders.append(app)
        if _smallest(values[app]) + len(admitted) <= offered:
            admitted.append(app)
    return Admission(tuple(admitted), (), tuple(contenders), {a: _smallest(values[a]) for a in contenders})


def small_first(order: Sequence[str], values: Values, offered: int, max_contenders: int | None = None) -> Admission:
    contenders = _field(order, values, offered)
    size = {a: _smallest(values[a]) for a in contenders}
    admitted: set[str] = set()
    shadows: set[str] = set()
    used = 0
    for app in sorted(contenders, key=lambda a: (size[a], contenders.index(a))):
        if size[app] + used <= offered:
            admitted.add(app)
            used += size[app]
        elif size[app] + len(admitted) <= offered:
            shadows.add(app)
    return Admission(tuple(a for a in contenders if a in admitted), tuple(a for a in contenders if a in shadows),
                     tuple(contenders), size)


RULES: dict[str, tuple[Callable[..., Admission], bool]] = {  # rule -> (admission, shadows answered for)
    "D8": (d8, False), "count": (count, False), "D25": (auction.admit, True), "small-first": (small_first, True),
}


@contextmanager
def rule(name: str) -> Iterator[None]:
    admit, shadow = auction.admit, auction._shadow_payments
    auction.admit, charged = RULES[name]
    if not charged:
        auction._shadow_payments = lambda *args, **kw: None
    try:
        yield
    finally:
        auction.admit, auction._shadow_payments = admit, shadow


def random_instance(rng: random.Random) -> tuple[frozenset[str], dict[str, BidTable]]:
    gpus = GPUS[:rng.randint(2, 6)]
    bids = {}
    for a in range(rng.randint(1, 4)):
        rho_old = math.inf if rng.random() < 0.5 else rng.uniform(0.5, 8.0)
        rows = tuple((frozenset(rng.sample(gpus, rng.randint(1, len(gpus)))), rng.uniform(0.1, 10.0))
                     for _ in range(rng.randint(0, 4)))
        bids[f"app{a}"] = BidTable(rho_old, rows)
    return frozenset(gpus), bids


def realistic_instance(rng: random.Random) -> tuple[frozenset[str], dict[str, BidTable]]:
    gpus = GPUS[:rng.randint(2, 8)]
    bids = {}
    for a in range(rng.randint(2, 5)):
        starving = rng.random() < 0.5
        narrow = not starving and rng.random() < 0.5
        rho_old = math.inf if starving else rng.uniform(0.5, 8.0)
        base = rng.uniform(0.3, 3.0) if starving else rho_old * rng.uniform(0.5, 0.95)
        rows = [] if narrow else [(frozenset([g]), base) for g in gpus]
        for _ in range(rng.randint(1, 4)):
            k = rng.randint(2, len(gpus))
            rows.append((frozenset(rng.sample(gpus, k)), base / (1 + 0.5 * (k - 1)) * rng.uniform(0.9, 1.1)))
        bids[f"app{a}"] = BidTable(rho_old, tuple(rows))
    return frozenset(gpus), bids


def a_lie(rng: random.Random, bids: Mapping[str, BidTable]) -> tuple[str, BidTable]:
    liar = rng.choice(sorted(bids))
    bid = bids[liar]
    rows = tuple((g, rho * rng.uniform(0.3, 3.0)) for g, rho in bid.rows if rng.random() < 0.5)
    rho_old = bid.rho_old if math.isinf(bid.rho_old) else bid.rho_old * rng.uniform(0.5, 4.0)
    return liar, BidTable(rho_old, rows)


def expected(outcome: auction.AuctionOutcome, app: str, bids: Mapping[str, BidTable]) -> float:
    """c_i V_i(G_i) in the app's true values (D15)."""
    if app not in outcome.pf:
        return 0.0
    value = max(row_value(rho, bids[app].rho_old) for g, rho in bids[app].rows if frozenset(g) == outcome.pf[app])
    return outcome.hidden_payment[app] * value


def study(name: str, cases: int) -> dict[str, Any]:
    out: dict[str, Any] = {"rule": name}
    with rule(name):
        rng = random.Random("admission:random")
        pays, gains = 0, []
        for _ in range(cases):
            offered, bids = random_instance(rng)
            liar, lie = a_lie(rng, bids)
            order = sorted(bids)
            truth = expected(run_auction(offered, bids, seed=0, priority=order), liar, bids)
            lied = expected(run_auction(offered, {**bids, liar: lie}, seed=0, priority=order), liar, bids)
            if lied > truth * math.exp(4 * len(bids) / auction.QUANTUM) + 1e-12:
                pays += 1
                gains.append((lied - truth) / truth if truth else math.inf)
        out |= {"random_cases": cases, "lies_pay": pays, "max_gain": max(gains, default=0.0)}
        rng = random.Random("admission:realistic")
        winners = zeros = firsts = first_zeroed = 0
        kept = 0.0
        for _ in range(cases):
            offered, bids = realistic_instance(rng)
            order = sorted(bids, key=lambda a: (-bids[a].rho_old, rng.random()))
            outcome = run_auction(offered, bids, seed=0, priority=order)
            winners += len(outcome.pf)
            zeros += sum(1 for a in outcome.pf if outcome.hidden_payment[a] == 0.0)
            kept += sum(outcome.hidden_payment[a] * len(g) for a, g in outcome.pf.items()) / len(offered)
            first = outcome.contenders[0] if outcome.contenders else None
            if first is not None and math.isinf(bids[first].rho_old):
                firsts += 1
                first_zeroed += first in outcome.pf and outcome.hidden_payment[first] == 0.0
        out |= {"realistic_cases": cases, "winners": winners, "zeroed": zeros, "first_starving": firsts,
                "first_zeroed": first_zeroed, "kept": kept / cases}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=8000, help="instances of each kind, per rule")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = []
    for name in RULES:
        rows.append(study(name, args.cases))
        Console(stderr=True).print(f"{name}: done")
    table = Table(title=f"Who enters the PF: {args.cases} random lies and {args.cases} realistic auctions per rule")
    for col in ("rule", "lies that pay", "max gain", "winners zeroed", "first-ranked starving zeroed",
                "auction keeps"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["rule"], f"{r['lies_pay']} of {r['random_cases']}", f"{r['max_gain']:+.1%}",
                      f"{r['zeroed']} of {r['winners']}", f"{r['first_zeroed']} of {r['first_starving']}",
                      f"{r['kept']:.1%}")
    Console(width=140).print(table)
    result = {"machine": machine_info(), "cases": args.cases, "wall_seconds": time.perf_counter() - started,
              "rules": rows}
    write_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
