"""The partial-allocation auction (paper 3.3.1, Pseudocode 1 lines 6-13; mechanism D7, D8, D15, D16).

1. **Valuations** (D15). A bidder's value for a row is what the row adds to what it keeps:
   V(G) = 1/rho(held + G) - 1/rho_old, and V(empty) = 0 (for an app holding nothing, 1/rho(G)).
   With V(empty) = 0 the PA fraction c_i of a bundle is worth exactly c_i V(G) under a lottery
   (step 4), which is what makes the hidden payment a real payment for apps that keep GPUs.
2. **Contenders and the PF allocation** (D8, D15). Every bidder needs at least one GPU, so at most
   |offered| can be served: the first that many bidders in the round's priority order (worst rho
   first, D13) contend, the rest wait for leftover GPUs (D9). Among contenders, pick at most one row
   per app, each GPU to at most one app, serving as many contenders as possible and then maximising
   the product of valuations (Nash-welfare convention for zero valuations).
3. **Hidden payments.** For each winner i, re-solve without i and set c_i = prod_{j != i} V_j(PF) /
   prod_{j != i} V_j(PF without i). When every contender can be served (the usual case) 0 < c_i <= 1.
   Optionally (D39) the re-solve waits for the draw: bounds that cost no re-solve often decide it.
   Only when i's row leaves another contender with nothing that would be served without i (a table
   too narrow for the offer, e.g. a liar's that hides its small rows) is c_i = 0: the Nash product's
   numerator has a zero valuation.
4. **All-or-nothing lottery** (D15). A winner receives its whole PF row with probability c_i (one
   draw per app, spread evenly around one shared draw, D38), else nothing; what is not received
   is leftover (Pseudocode 1 line 11) for the round engine to hand out (D9). Expected value of what i receives: exactly c_i V_i(G_i).

Deterministic outcomes (D16). Weights are integers: L = round(QUANTUM * log V), so rows whose values
differ by less than about 0.1% tie, and among optimal allocations the auction always returns the
*canonical* one: the first optimum of a depth-first search that decides apps by descending best row
(then name) and tries each app's rows fewest GPUs first, then by descending weight, then by GPU
ids, "no row" last. The exact
branch and bound returns that allocation by construction (it replaces its incumbent only on strict
improvement); when a MILP solver found the optimum instead, a second depth-first search with the
optimum as its target finds the canonical allocation. No solver version can change the outcome.

How it is solved. Serving one more contender is worth M more than any change of the product (a
large integer), so one maximisation of sum(M + L) over rows does both steps of the convention. The
problem splits exactly:

* rows no better than rho_old, and rows that contain another row of the same app with no better
  value, can never be in an optimum and are dropped;
* apps whose rows share no GPU do not interact: the instance splits into connected components,
  each solved alone, and c_i depends only on i's component;
* c_i = 1 without a re-solve when nobody else bid on i's GPUs, and c_i = 0 without a re-solve when
  an unserved contender has a row inside i's GPUs and the idle ones;
* small components are solved by exact branch and bound (all weights are positive, so each app
  still to decide can add at most its best row); with the default solver, bigger ones get the same
  search with a node budget of about one MILP solve's time, and only when that runs out a MILP --
  directly through highspy, with one persistent model per component whose re-solves only change
  column bounds -- or through PuLP (CBC or HiGHS).

``solver`` picks the MILP backend: ``"highs"`` (default: search first, then highspy in-process),
``"pulp-highs"`` (PuLP's HiGHS interface), ``"pulp-cbc"`` (PuLP + CBC, a process per solve). All are
exact on the integer weights; docs/auction.md has the measurements behind the default.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from arbiter.lottery import auction_draws
from protos.messages import BidTable, Position

MAX_ROWS = 4096
RHO_MIN, RHO_MAX = 1e-9, 1e9  # D7: rho outside this is no estimate (and 1/rho would overflow)
SOLVERS = ("highs", "pulp-highs", "pulp-cbc")
DEFAULT_SOLVER = "highs"
QUANTUM = 1024  # D16: a weight is round(QUANTUM * log V)
_ENUMERATION_LIMIT = 4096  # components with at most this many row combinations: always searched
_SEARCH_NODES = 5_000  # bigger ones: branch and bound up to about one MILP solve's time, then the MILP
_CANONICAL_NODES = 100_000  # the target search after a MILP (D16); past it, fixing app by app
_CANONICAL_FIXING_NODES = 2_000  # ... with at most this many MILP nodes in all; past it the MILP's optimum is kept


class InvalidBid(ValueError):
    """A bid that breaks D7; the message says which app, which row and what is wrong."""

    def __init__(self, app: str, reason: str):
        super().__init__(f"bid from {app!r}: {reason}")
        self.app = app
        self.reason = reason


@dataclass(frozen=True)
class AuctionOutcome:
    """What one auction decided (Pseudocode 1 line 12).

    ``hidden_payment`` maps each bidder to c_i, the probability that it receives its PF row (the
    hidden payment proper is the other 1 - c_i), but for the winners in ``payment_bounds`` (D39);
    ``granted`` is what the lottery gave. ``contenders``
    are the bidders that took part in the PF allocation, in priority order; bidders beyond them, and
    contenders the PF left out, were not served. ``canonical`` is False only if both ways to find the
    canonical allocation after a MILP ran out of budget and the MILP's own optimum was kept (D16).
    """

    pf: Mapping[str, frozenset[str]]
    hidden_payment: Mapping[str, float]
    granted: Mapping[str, frozenset[str]]
    leftover: frozenset[str]
    pf_rho: Mapping[str, float] = field(default_factory=dict)
    solves: int = 0
    contenders: tuple[str, ...] = ()
    canonical: bool = True
    shadows: tuple[str, ...] = ()  # contenders shut out by the big smallest rows of those before them (D25)
    admitted: tuple[str, ...] = ()  # the contenders that took part in the PF allocation (D25)
    draws: Mapping[str, float] = field(default_factory=dict)  # each PF winner's lottery draw: kept iff < c_i (D15)
    # D39: (lo, hi) around c_i for the winners whose lottery its bounds decided (no exact c_i; they
    # are not in ``hidden_payment``); empty unless the auction ran with exact_payments=False
    payment_bounds: Mapping[str, tuple[float, float]] = field(default_factory=dict)


def validate_bid(app: str, bid: BidTable, offered: frozenset[str], max_rows: int = MAX_ROWS) -> None:
    """D7: every GPU offered and listed once per row, rho within [RHO_MIN, RHO_MAX] (rho_old may be
    infinite), at most ``max_rows`` rows. Raises :class:`InvalidBid` naming the first fault."""
    if not isinstance(bid, BidTable):
        raise InvalidBid(app, f"expected a BidTable, got {type(bid).__name__}")
    if not isinstance(bid.rho_old, (int, float)) or math.isnan(bid.rho_old) or not bid.rho_old > 0:
        raise InvalidBid(app, f"rho_old must be > 0 (or infinity), got {bid.rho_old!r}")
    if math.isfinite(bid.rho_old) and not RHO_MIN <= bid.rho_old <= RHO_MAX:
        raise InvalidBid(app, f"rho_old must be within [{RHO_MIN:g}, {RHO_MAX:g}] (or infinity), got {bid.rho_old!r}")
    if not isinstance(bid.rows, (list, tuple)):
        raise InvalidBid(app, f"rows must be a list of (gpus, rho) pairs, got {type(bid.rows).__name__}")
    if len(bid.rows) > max_rows:
        raise InvalidBid(app, f"{len(bid.rows)} rows, more than the limit of {max_rows}")
    for k, row in enumerate(bid.rows):
        if not isinstance(row, tuple) or len(row) != 2:
            raise InvalidBid(app, f"row {k} must be a (gpus, rho) pair")
        gpus, rho = row
        if isinstance(gpus, (str, bytes)) or not hasattr(gpus, "__iter__"):
            raise InvalidBid(app, f"row {k}: gpus must be a set of GPU ids")
        listed = list(gpus)
        if not all(isinstance(g, str) for g in listed):
            raise InvalidBid(app, f"row {k}: GPU ids must be strings")
        if not listed:
            raise InvalidBid(app, f"row {k} is empty (the empty row is rho_old)")
        if len(set(listed)) != len(listed):
            raise InvalidBid(app, f"row {k} lists a GPU twice")
        stray = [g for g in listed if g not in offered]
        if stray:
            shown = [g if len(g) <= 64 else g[:64] + "..." for g in sorted(map(str, stray))[:5]]
            raise InvalidBid(app, f"row {k} asks for GPUs not offered: {shown}")
        if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not math.isfinite(rho) or rho <= 0:
            raise InvalidBid(app, f"row {k}: rho must be finite and > 0, got {rho!r}")
        if not RHO_MIN <= rho <= RHO_MAX:
            raise InvalidBid(app, f"row {k}: rho must be within [{RHO_MIN:g}, {RHO_MAX:g}], got {rho!r}")


def row_value(rho: float, rho_old: float) -> float:
    """D15: what a row adds, 1/rho - 1/rho_old (<= 0 for a row no better than the empty one)."""
    return 1.0 / rho - (0.0 if math.isinf(rho_old) else 1.0 / rho_old)


# ---------------------------------------------------------------------------------------------
# The weighted set-packing problem behind the PF allocation

Row = tuple[int, int, int, int]  # (GPU bitmask, weight M + L, L = round(QUANTUM log V), index in the bid)


@dataclass
class _Component:
    apps: list[str]
    rows: list[list[Row]]  # per app, in canonical order (``_undominated``)


def _log_values(bids: Mapping[str, BidTable], gpu_bit: Mapping[str, int],
                harm: Mapping[str, Sequence[float]] | None = None) -> dict[str, list[tuple[int, int, int]]]:
    """(mask, L, row index) of every useful row, per app (D15, D16); apps with none are left out.
    With ``harm`` (D36: per app, per row, the factor in (0, 1] by which the row slows the jobs
    already running next to it), a row's value in the Nash product is V x h: the incumbents are
    passive participants whose values the arbiter knows."""
    out = {}
    for app, bid in bids.items():
        rows = []
        hurt = harm.get(app) if harm else None
        for k, (gpus, rho) in enumerate(bid.rows):
            value = row_value(rho, bid.rho_old)
            if value <= 0:
                continue
            if hurt is not None:
                value *= hurt[k]
            mask = 0
            for g in gpus:
                mask |= gpu_bit[g]
            rows.append((mask, round(QUANTUM * math.log(value)), k))
        if rows:
            out[app] = rows
    return out


def _weighted(values: Mapping[str, list[tuple[int, int, int]]]) -> dict[str, list[Row]]:
    """Rows with weight M + L > 0, where M exceeds what serving one more app could cost the others
    (so the maximum of the sum serves the most apps, then has the largest product), dominated rows
    dropped."""
    # Serving k + 1 apps must beat serving k whatever the values: M > sum over apps of the most one
    # app's L can add (max(0, max L)) plus the most it can take away (max(0, -min L)); M + L > 0.
    big_m = 1 + sum(max(0, max(L for _, L, _ in rows)) + max(0, -min(L for _, L, _ in rows))
                    for rows in values.values())
    return {app: _undominated([(m, big_m + L, L, k) for m, L, k in rows]) for app, rows in values.items()}


def _undominated(rows: list[Row]) -> list[Row]:
    """Drop rows that contain another row of the same app whose weight is at least as high; what is
    left is in canonical order: fewest GPUs first, then weight descending, then mask (D16). Small
    rows first lets the search reach allocations that serve many apps -- what the Nash convention
    asks first -- before it tries the big ones."""
    keep: list[Row] = []
    for row in sorted(rows, key=lambda r: (-r[1], r[0].bit_count(), r[0])):
        mask, w = row[0], row[1]
        if any(w <= kw and (km & ~mask) == 0 for km, kw, _, _ in keep):
            continue
        keep.append(row)
    keep.sort(key=lambda r: (r[0].bit_count(), -r[1], r[0]))
    return keep


def _components(rows: Mapping[str, list[Row]]) -> list[_Component]:
    """Apps linked by rows that share a GPU, as connected components (apps in name order)."""
    apps = sorted(rows)
    parent = {a: a for a in apps}

    def find(a: str) -> str:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    owner: dict[int, str] = {}
    for a in apps:
        footprint = 0
        for m, _, _, _ in rows[a]:
            footprint |= m
        while footprint:
            low = footprint & -footprint
            footprint ^= low
            b = owner.setdefault(low, a)
            if b != a:
                parent[find(a)] = find(b)
    groups: dict[str, list[str]] = {}
    for a in apps:
        groups.setdefault(find(a), []).append(a)
    return [_Component(g, [rows[a] for a in g]) for g in groups.values()]


def _priced(mask: int, price: Mapping[int, int]) -> int:
    """The sum of the GPU prices (by GPU bit) over ``mask``: the Lagrangian bound's unit."""
    total = 0
    while mask:
        low = mask & -mask
        mask ^= low
        total += price.get(low, 0)
    return total


class _SearchTooLong(Exception):
    pass


def _search(
    comp: _Component,
    skip: int | None,
    start: Sequence[int] | None = None,
    node_limit: int | None = None,
    target: int | None = None,
    prices: Mapping[int, int] | None = None,
) -> tuple[int, list[int]] | None:
    """Exact optimum by depth-first branch and bound; choice[i] = row position or -1.

    Apps are decided by descending best weight (then name), each trying its rows in canonical order
    (``_undominated``) and "no row" last. Branches that cannot beat the incumbent are cut, and the incumbent changes
    only on strict improvement, so without ``start`` the result is the first optimum in this order:
    the canonical allocation (D16), whatever bound does the cutting. With ``start`` (a feasible
    choice, such as the PF solution minus the skipped app) the value is exact but the choice may be
    another optimum. With ``target`` (a known optimum) the search returns the first allocation
    reaching it. Returns None when ``node_limit`` nodes did not finish (the caller then solves the
    MILP).

    The bound is Lagrangian: with a price p_g >= 0 on each GPU (``prices``, by GPU bit; 0 when not
    given), the apps still to decide can add at most the prices of the GPUs still free plus, per
    app, its best row still disjoint from the GPUs taken, valued at its weight minus the prices of
    its GPUs (and never below 0). Any prices give a valid bound; the LP relaxation's duals give
    about the tightest (``_lp_prices``).
    """
    n = len(comp.apps)
    order = _search_order(comp, skip)
    price = prices or {}
    rows = [[(mask, w, r, _priced(mask, price)) for r, (mask, w, _, _) in enumerate(comp.rows[i])] for i in order]
    # Per app, its rows by reduced weight (weight minus prices), best first, for the bound.
    reduced = [sorted(((w - priced, mask) for mask, w, _, priced in app_rows), reverse=True) for app_rows in rows]
    everything = 0
    for app_rows in rows:
        for mask, _, _, _ in app_rows:
            everything |= mask
    priced_total = _priced(everything, price)
    if target is not None:
        best_value, best_choice = target - 1, None
    elif start is not None:
        best_choice = [c if i != skip else -1 for i, c in enumerate(start)]
        best_value = sum(comp.rows[i][c][1] for i, c in enumerate(best_choice) if c >= 0)
    else:
        # A greedy allocation's value minus one: any incumbent below the optimum leaves the first
        # optimum in search order to be found (D16), and a good one cuts most branches early.
        taken, greedy = 0, 0
        for app_rows in rows:
            for mask, w, _, _ in app_rows:
                if not mask & taken:
                    taken |= mask
                    greedy += w
                    break
        best_value, best_choice = greedy - 1, None
    choice = [-1] * n
    budget = math.inf if node_limit is None else node_limit
    depth = len(order)

    def bound(k: int, used: int, priced_used: int) -> int:
        total = priced_total - priced_used
        for app_rows in reduced[k:]:
            for gain, mask in app_rows:
                if gain <= 0:
                    break
                if not mask & used:
                    total += gain
                    break
        return total

    class _Found(Exception):
        pass

    def walk(k: int, used: int, priced_used: int, value: int) -> None:
        nonlocal best_value, best_choice, budget
        budget -= 1
        if budget < 0:
            raise _SearchTooLong
        if k == depth:
            if value > best_value:
                best_value, best_choice = value, choice.copy()
                if target is not None:
                    raise _Found
            return
        if value + bound(k, used, priced_used) <= best_value:
            return
        i = order[k]
        for mask, w, r, priced in rows[k]:
            if not mask & used:
                choice[i] = r
                walk(k + 1, used | mask, priced_used + priced, value + w)
        choice[i] = -1
        walk(k + 1, used, priced_used, value)

    try:
        walk(0, 0, 0, 0)
    except _Found:
        pass
    except (_SearchTooLong, RecursionError):  # one level per app: huge components go to the MILP
        return None
    if best_choice is None:
        return None
    return best_value, best_choice


def _search_order(comp: _Component, skip: int | None = None) -> list[int]:
    """The order in which the search decides apps: descending best weight, then name (D16)."""
    heaviest = [max((row[1] for row in rows), default=0) for rows in comp.rows]
    return sorted((i for i in range(len(comp.apps)) if i != skip and comp.rows[i]), key=lambda i: (-heaviest[i], i))


def _packing(comp: _Component) -> tuple[list[tuple[int, int]], dict[int, list[int]], dict[int, list[int]]]:
    """The set-packing model of a component for HiGHS: one 0/1 column per (app, row), and per app
    and per GPU bit the columns that use it (at most one of each may be chosen)."""
    cols = [(i, r) for i, rows in enumerate(comp.rows) for r in range(len(rows))]
    by_app: dict[int, list[int]] = {}
    by_gpu: dict[int, list[int]] = {}
    for c, (i, r) in enumerate(cols):
        by_app.setdefault(i, []).append(c)
        m = comp.rows[i][r][0]
        while m:
            low = m & -m
            m ^= low
            by_gpu.setdefault(low, []).append(c)
    return cols, by_app, by_gpu


def _add_at_most_one(h: Any, np: Any, groups: Sequence[list[int]]) -> None:
    """One row "sum of these columns <= 1" per group."""
    if not groups:
        return
    starts = np.cumsum([0] + [len(v) for v in groups[:-1]]).astype(np.int32)
    index = np.array([c for v in groups for c in v], dtype=np.int32)
    h.addRows(len(groups), np.full(len(groups), -np.inf), np.ones(len(groups)), len(index), starts, index,
              np.ones(len(index)))


_banner_lock = threading.Lock()
_banner_shown = False


def _new_highs() -> Any:
    """A HiGHS instance with its output off. highspy 1.16 prints a licence banner on stdout while
    the first instance of a process is constructed, before any option can be set (issue 11: the
    main job's table started with it); that one construction runs with file descriptor 1 on
    /dev/null."""
    global _banner_shown
    import highspy

    with _banner_lock:
        if _banner_shown:
            h = highspy.Highs()
        else:
            import sys

            sys.stdout.flush()
            saved = os.dup(1)
            try:
                with open(os.devnull, "w") as null:
                    os.dup2(null.fileno(), 1)
                    h = highspy.Highs()
            finally:
                os.dup2(saved, 1)
                os.close(saved)
            _banner_shown = True
    h.setOptionValue("output_flag", False)
    return h


def _canonical_by_fixing(
    comp: _Component, value: int, node_budget: int, incumbent: Sequence[int], prices: Mapping[int, int] | None,
) -> list[int] | None:
    """The canonical allocation (D16) when the target search runs out of nodes: in the search's app
    order, fix each app to the first of its rows (canonical order, "no row" last) with which an
    allocation worth ``value`` (the optimum) still exists. That least position is unique, so the
    result does not depend on the solver.

    ``incumbent`` is an allocation worth ``value``; it meets every fix made so far, so its position
    for the next app is an upper bound on the least one. Earlier positions whose rows cannot reach
    ``value`` by the Lagrangian bound (``prices``, as in ``_search``) are ruled out at once; only
    when one is left does the step solve a small MILP (highspy) for the least position, whose
    solution becomes the incumbent. The bound only decides which steps need a MILP, never what a
    step returns. None when the MILPs need more than ``node_budget`` branch-and-bound nodes in all: a
    count of work, not of seconds, so whether the fallback succeeds does not depend on how busy the
    machine is (a 2 s wall-clock budget did, D16)."""
    import highspy
    import numpy as np

    price = prices or {}
    # Per app, (reduced weight, mask) best first: the bound's best row still disjoint from what is taken.
    reduced = [sorted(((w - _priced(mask, price), mask) for mask, w, _, _ in rows), reverse=True)
               for rows in comp.rows]
    footprint = [0] * len(comp.rows)
    for i, rows in enumerate(comp.rows):
        for mask, _, _, _ in rows:
            footprint[i] |= mask

    def may_reach(rest: Sequence[int], taken: int, so_far: int) -> bool:
        """Whether an allocation of ``rest`` disjoint from ``taken`` can add ``value - so_far``."""
        free = 0
        for j in rest:
            free |= footprint[j]
        total = so_far + _priced(free & ~taken, price)
        for j in rest:
            for gain, mask in reduced[j]:
                if gain <= 0:
                    break
                if not mask & taken:
                    total += gain
                    break
        return total >= value

    left = node_budget
    h = None
    lp: _Relaxation | None = None
    current = list(incumbent)
    choice = [-1] * len(comp.apps)
    order = _search_order(comp)
    taken = fixed_value = 0
    for k, i in enumerate(order):
        rest = order[k + 1:]
        rows = comp.rows[i]
        upper = current[i] if current[i] >= 0 else len(rows)
        open_ = [r for r in range(upper)
                 if not rows[r][0] & taken and may_reach(rest, taken | rows[r][0], fixed_value + rows[r][1])]
        if open_:
            if lp is None:  # the first step with rows left open builds the relaxation, with the fixes so far
                lp = _Relaxation(comp)
                for j in order[:k]:
                    _fix(lp.set_bounds, np, lp.by_app[j], choice[j])
            settled = _least_by_relaxation(lp, i, open_, value, current)
            if settled is not None:
                current = settled
                open_ = []
        if open_:
            assert lp is not None
            cols, by_app, n = lp.cols, lp.by_app, lp.n
            if h is None:  # the first step that needs a MILP builds it, with the fixes so far
                h = _new_highs()
                h.setOptionValue("threads", 1)
                h.setOptionValue("mip_rel_gap", 0.0)
                h.addCols(n, np.zeros(n), np.zeros(n), np.ones(n), 0, np.array([], dtype=np.int32),
                          np.array([], dtype=np.int32), np.array([], dtype=np.float64))
                h.changeColsIntegrality(n, np.arange(n, dtype=np.int32),
                                        np.array([highspy.HighsVarType.kInteger] * n))
                _add_at_most_one(h, np, list(by_app.values()) + list(lp.by_gpu.values()))
                weights = np.array([float(comp.rows[a][r][1]) for a, r in cols])
                h.addRow(value - 0.5, np.inf, n, np.arange(n, dtype=np.int32), weights)  # worth the optimum
                for j in order[:k]:
                    _fix(h.changeColsBounds, np, by_app[j], choice[j])
            mine = by_app[i]
            none = len(mine)
            # minimise the position of i's row: sum_r r x_r + none (1 - sum_r x_r)
            objective = np.zeros(n)
            for r, c in enumerate(mine):
                objective[c] = r - none
            h.changeColsCost(n, np.arange(n, dtype=np.int32), objective)
            if left <= 0:
                return None
            h.setOptionValue("mip_max_nodes", left)
            h.run()
            if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
                return None
            left -= max(1, int(h.getInfo().mip_node_count))
            values = h.getSolution().col_value
            current = [-1] * len(comp.apps)
            for c, (a, r) in enumerate(cols):
                if values[c] > 0.5:
                    current[a] = r
        choice[i] = current[i]
        if choice[i] >= 0:
            taken |= rows[choice[i]][0]
            fixed_value += rows[choice[i]][1]
        if lp is not None:
            _fix(lp.set_bounds, np, lp.by_app[i], choice[i])
            if h is not None:
                _fix(h.changeColsBounds, np, lp.by_app[i], choice[i])
    return choice


def _least_by_relaxation(
    lp: _Relaxation, i: int, open_: Sequence[int], value: int, incumbent: list[int],
) -> list[int] | None:
    """One fixing step (D16) by LP relaxations alone. App ``i``'s rows ``open_`` (the positions
    before the ``incumbent``'s that the Lagrangian bound left open, in order) are fixed in turn: a
    relaxation worth less than ``value`` rules the row out, and an integral one worth ``value`` is an
    allocation with i's least position, all earlier rows being ruled out. With every row ruled out,
    the incumbent's position is the least, and the incumbent is returned. None when a relaxation is
    fractional yet reaches ``value``: that step needs its MILP."""
    np = lp.np
    mine = lp.by_app[i]
    try:
        for r in open_:
            _fix(lp.set_bounds, np, mine, r)
            bound, choice = lp.solve()
            if bound < value - 0.5:
                continue
            if choice is None or _value(lp.comp, choice) != value:
                return None
            return choice
        return incumbent
    finally:
        lp.set_bounds(len(mine), np.array(mine, dtype=np.int32), np.zeros(len(mine)), np.ones(len(mine)))


def _fix(set_bounds: Callable[..., Any], np: Any, mine: list[int], picked: int) -> None:
    """Fix an app's columns (in the fixing MILP or a relaxation, by its ``changeColsBounds``): row
    ``picked`` chosen (or none when -1)."""
    lo = np.zeros(len(mine))
    hi = np.zeros(len(mine))
    if picked >= 0:
        lo[picked] = hi[picked] = 1.0
    set_bounds(len(mine), np.array(mine, dtype=np.int32), lo, hi)


def _lp_prices(comp: _Component) -> tuple[dict[int, int], list[int] | None]:
    """GPU prices for the search's bound: the duals of the GPU constraints in the PF problem's LP
    relaxation (highspy), rounded to integers >= 0. They only decide how fast the search cuts, never
    what it returns (D16). Also that relaxation's solution when it is integral and reaches the LP
    bound (within half a weight unit): then it is a PF optimum, found without a search or a MILP."""
    import highspy
    import numpy as np

    # Its own model, not a _Relaxation: with presolve and every GPU's row, as the prices were
    # measured (duals of a degenerate LP are not unique, and the prices steer the search's budget).
    h = _new_highs()
    h.setOptionValue("threads", 1)
    cols, by_app, by_gpu = _packing(comp)
    n = len(cols)
    h.addCols(n, np.array([float(comp.rows[i][r][1]) for i, r in cols]), np.zeros(n), np.ones(n), 0,
              np.array([], dtype=np.int32), np.array([], dtype=np.int32), np.array([], dtype=np.float64))
    h.changeObjectiveSense(highspy.ObjSense.kMaximize)
    _add_at_most_one(h, np, list(by_app.values()) + list(by_gpu.values()))
    h.run()
    solution = h.getSolution()
    duals = solution.row_dual
    out = {}
    for k, gpu in enumerate(by_gpu, start=len(by_app)):
        p = round(abs(duals[k]))
        if p > 0:
            out[gpu] = p
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return out, None
    return out, _integral_optimum(comp, cols, solution.col_value, h.getInfo().objective_function_value)


def _integral_optimum(comp: _Component, cols: Sequence[tuple[int, int]], values: Sequence[float],
                      bound: float) -> list[int] | None:
    """An LP relaxation's solution as a choice, if it is integral, an allocation, and worth the LP
    optimum ``bound`` within half a weight unit: then it is a MILP optimum (the weights are integers
    and ``bound`` is an upper bound on every allocation). Else None."""
    if any(1e-6 < v < 1 - 1e-6 for v in values):
        return None
    choice = [-1] * len(comp.apps)
    used = 0
    for c, (i, r) in enumerate(cols):
        if values[c] > 0.5:
            mask = comp.rows[i][r][0]
            if mask & used or choice[i] >= 0:
                return None
            choice[i] = r
            used |= mask
    if abs(_value(comp, choice) - bound) > 0.5:
        return None
    return choice


class _Relaxation:
    """The PF problem's LP relaxation for one component (highspy, continuous columns), kept across
    solves: bounds change between them and each solve starts from the previous basis (no presolve,
    which would discard it).

    The LP optimum bounds the MILP's from above, so (the weights being integers) a relaxation worth
    less than ``value - 0.5`` proves no allocation reaches ``value``, and an integral solution that
    reaches the LP optimum within half a weight unit is a MILP optimum. These two facts let the
    re-solves for c_i (``_HighsModel``) and D16's fixing steps skip most MILPs: on the service's
    16-contender rounds 69 of 80 re-solves had integral relaxations, each about a fiftieth of a
    MILP's time (mostly its presolve).
    """

    def __init__(self, comp: _Component):
        import highspy
        import numpy as np

        self.np = np
        self.comp = comp
        self.cols, self.by_app, self.by_gpu = _packing(comp)
        n = self.n = len(self.cols)
        self.costs = np.array([float(comp.rows[i][r][1]) for i, r in self.cols])
        self.groups = [v for v in (*self.by_app.values(), *self.by_gpu.values()) if len(v) > 1]
        # the GPU bit of each GPU row among ``groups`` (0 for an app's row), for ``lagrangian``
        self.group_gpu = [0 for v in self.by_app.values() if len(v) > 1] + \
            [gpu for gpu, v in self.by_gpu.items() if len(v) > 1]
        self.h = self.model()
        self.h.setOptionValue("presolve", "off")
        self.ok = highspy.HighsModelStatus.kOptimal
        self.lower, self.upper = np.zeros(n), np.ones(n)

    def set_bounds(self, count: int, idx: Any, lower: Any, upper: Any) -> None:
        """highspy's ``changeColsBounds``, remembered: ``rounded`` must keep within them."""
        self.lower[idx], self.upper[idx] = lower, upper
        self.h.changeColsBounds(count, idx, lower, upper)

    def model(self) -> Any:
        """A fresh highspy model of the packing with the PF weights (continuous columns)."""
        import highspy

        np, n = self.np, self.n
        h = _new_highs()
        h.setOptionValue("threads", 1)
        h.addCols(n, self.costs, np.zeros(n), np.ones(n), 0, np.array([], dtype=np.int32),
                  np.array([], dtype=np.int32), np.array([], dtype=np.float64))
        h.changeObjectiveSense(highspy.ObjSense.kMaximize)
        _add_at_most_one(h, np, self.groups)
        return h

    def choice(self, values: Sequence[float]) -> list[int]:
        choice = [-1] * len(self.comp.apps)
        for c, (i, r) in enumerate(self.cols):
            if values[c] > 0.5:
                choice[i] = r
        return choice

    def solve(self) -> tuple[float, list[int] | None]:
        """(the LP optimum, its solution as a choice when integral and provably a MILP optimum)."""
        h = self.h
        h.run()
        if h.getModelStatus() != self.ok:
            return math.inf, None
        bound = h.getInfo().objective_function_value
        return bound, _integral_optimum(self.comp, self.cols, h.getSolution().col_value, bound)

    def lagrangian(self, skip: int | None) -> int:
        """An upper bound on every allocation without ``skip`` within the bounds, in exact integers
        (D39): the last solution's GPU duals, rounded to integers >= 0, as prices (``_search``'s
        bound). Any prices give a valid bound and the duals about the tightest, so it is about the LP
        optimum without trusting the LP's last digits."""
        np = self.np
        duals = self.h.getSolution().row_dual
        price = np.zeros(self.n, dtype=np.int64)
        total = 0
        for k, gpu in enumerate(self.group_gpu):
            p = round(abs(duals[k])) if gpu else 0
            if p > 0:
                total += p
                price[self.by_gpu[gpu]] += p
        reduced = self.costs.astype(np.int64) - price
        for i, cols in self.by_app.items():
            if i != skip:
                total += max(0, max((int(reduced[c]) for c in cols if self.upper[c] > 0.5), default=0))
        return total

    def rounded(self) -> list[int]:
        """An allocation near the last (fractional) solution, within the current bounds: rows by
        descending LP value (then weight), each taken if its app has none yet and its GPUs are free.
        Its value is the floor of ``_HighsModel.solve``'s reduced-cost fixing."""
        values = self.h.getSolution().col_value
        choice = [-1] * len(self.comp.apps)
        used = 0
        allowed = [c for c in range(self.n) if self.upper[c] > 0.5]
        for c in sorted(allowed, key=lambda c: (-self.lower[c], -round(values[c], 6), -self.costs[c], c)):
            i, r = self.cols[c]
            mask = self.comp.rows[i][r][0]
            if choice[i] < 0 and not mask & used:
                choice[i] = r
                used |= mask
        return choice


class _HighsModel:
    """One persistent highspy model per component; re-solves change column bounds. Each solve tries
    the LP relaxation first (``_Relaxation``) and solves the MILP, built when first needed, only when
    the relaxation is fractional; the value, the only thing a re-solve contributes, is the same
    either way (optimal values are unique, allocations need not be: D16 picks among them
    afterwards)."""

    def __init__(self, comp: _Component):
        self.lp = _Relaxation(comp)
        self.np = self.lp.np
        self.h: Any = None

    def _milp(self) -> Any:
        import highspy

        if self.h is None:
            np, n = self.np, self.lp.n
            self.h = h = self.lp.model()
            h.setOptionValue("mip_rel_gap", 0.0)
            # Tight, not 0.5: HiGHS measures the gap on its scaled objective, and a "gap below one
            # weight unit" there let 1.15 and 1.16 stop at different re-solve values (c_i 0.958 vs
            # 1.0, D16).
            h.setOptionValue("mip_abs_gap", 1e-9)
            # Measured on the 60 yardstick instances (docs/auction.md): restarts and the RINS/RENS
            # sub-MIPs cost more than they save on these set-packing models.
            h.setOptionValue("mip_allow_restart", False)
            h.setOptionValue("mip_heuristic_run_rins", False)
            h.setOptionValue("mip_heuristic_run_rens", False)
            h.changeColsIntegrality(n, np.arange(n, dtype=np.int32),
                                    np.array([highspy.HighsVarType.kInteger] * n))
        return self.h

    def solve(self, skip: int | None, floor: int | None = None, start: Sequence[int] | None = None) -> list[int]:
        """An optimum with app ``skip``'s rows fixed to 0: the LP relaxation's when integral, the
        better of ``start`` (worth ``floor``) and the rounded LP solution when it reaches the exact
        Lagrangian bound (``_Relaxation.lagrangian``, D39), else the MILP's. The MILP leaves out every row whose LP reduced cost proves it in no allocation
        worth ``floor`` (reduced-cost fixing): with LP optimum z and reduced cost d <= 0 of a row
        at 0, any allocation using the row is worth at most z + d. ``floor`` is the better of a
        known allocation's value (the PF solution minus ``skip``, when given) and the rounded LP
        solution's. On the service's rounds this left out about 80% of the rows of a fractional
        re-solve and made it about 6x faster.

        No MILP warm start: highspy 1.16.0, given the PF solution minus i as a starting solution,
        returned it as optimal on a Workload 2 round where a better one exists (found without the
        hint, and by 1.15.1 either way)."""
        np = self.np
        with self._without(skip) as skipped:
            bound, choice = self.lp.solve()
            if choice is not None:
                return choice
            out = skipped
            if bound < math.inf:
                rounded = self.lp.rounded()
                floor = max(_value(self.lp.comp, rounded), floor or 0)
                if floor >= self.lp.lagrangian(skip):
                    if _value(self.lp.comp, rounded) == floor:
                        return rounded
                    if start is not None and _value(self.lp.comp, start, skip) == floor:
                        return [r if i != skip else -1 for i, r in enumerate(start)]
                reduced = np.minimum(np.asarray(self.lp.h.getSolution().col_dual), 0.0)
                out = np.union1d(skipped, np.flatnonzero(bound + reduced < floor - 0.5)).astype(np.int32)
            h = self._milp()
            h.changeColsBounds(len(out), out, np.zeros(len(out)), np.zeros(len(out)))
            try:
                h.run()
                return self.lp.choice(h.getSolution().col_value)
            finally:
                h.changeColsBounds(len(out), out, np.zeros(len(out)), np.ones(len(out)))

    @contextlib.contextmanager
    def _without(self, skip: int | None):
        """App ``skip``'s columns fixed to 0 in the LP for the ``with`` block (their indices), then
        freed again."""
        np = self.np
        skipped = np.array(self.lp.by_app.get(skip, []), dtype=np.int32)
        self.lp.set_bounds(len(skipped), skipped, np.zeros(len(skipped)), np.zeros(len(skipped)))
        try:
            yield skipped
        finally:
            self.lp.set_bounds(len(skipped), skipped, np.zeros(len(skipped)), np.ones(len(skipped)))

    def relaxed(self, skip: int) -> tuple[float, list[int] | None, list[int] | None]:
        """The LP relaxation with app ``skip``'s rows fixed to 0 (D39): (an upper bound on every
        allocation without it, its solution when integral and provably optimal, else its rounded
        solution). The bound is the exact Lagrangian one; infinite when the LP did not solve."""
        with self._without(skip):
            bound, choice = self.lp.solve()
            if choice is not None:
                return _value(self.lp.comp, choice), choice, None
            if bound == math.inf:
                return math.inf, None, None
            return self.lp.lagrangian(skip), None, self.lp.rounded()


def _pulp_solve(comp: _Component, skip: int | None, backend: str) -> list[int]:
    import pulp

    prob = pulp.LpProblem("pf_allocation", pulp.LpMaximize)
    x: dict[tuple[int, int], pulp.LpVariable] = {}
    by_gpu: dict[int, list[pulp.LpVariable]] = {}
    for i, rows in enumerate(comp.rows):
        if i == skip:
            continue
        for r, row in enumerate(rows):
            v = prob.add_variable(f"x_{i}_{r}", 0, 1, cat=pulp.LpBinary)
            x[i, r] = v
            m = row[0]
            while m:
                low = m & -m
                m ^= low
                by_gpu.setdefault(low, []).append(v)
    if not x:
        return [-1] * len(comp.apps)
    prob += pulp.lpSum(comp.rows[i][r][1] * v for (i, r), v in x.items())
    for i in range(len(comp.rows)):
        own = [v for (a, _), v in x.items() if a == i]
        if len(own) > 1:
            prob += pulp.lpSum(own) <= 1, f"one_row_{i}"
    for k, vs in enumerate(by_gpu.values()):
        if len(vs) > 1:
            prob += pulp.lpSum(vs) <= 1, f"gpu_{k}"
    if backend == "pulp-cbc":
        # PuLP 3.x bundles CBC as PULP_CBC_CMD; the pyproject pin (< 4) keeps it there.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            solver = pulp.PULP_CBC_CMD(msg=False, gapRel=0, gapAbs=1e-9)
    else:
        solver = pulp.HiGHS(msg=False, gapRel=0, gapAbs=1e-9, threads=1)
    status = prob.solve(solver)
    if pulp.LpStatus[status] != "Optimal":
        raise RuntimeError(f"PuLP ({backend}) did not solve the PF allocation: {pulp.LpStatus[status]}")
    choice = [-1] * len(comp.apps)
    for (i, r), v in x.items():
        if (v.value() or 0) > 0.5:
            choice[i] = r
    return choice


def _value(comp: _Component, choice: Sequence[int], skip: int | None = None) -> int:
    return sum(comp.rows[i][r][1] for i, r in enumerate(choice) if r >= 0 and i != skip)


class _ComponentSolver:
    """Solves one component exactly, with and without each app, counting MILP solves.

    highspy models are not thread-safe, so each worker thread keeps its own persistent model.
    """

    def __init__(self, comp: _Component, backend: str, canonical: bool = True):
        self.comp = comp
        self.backend = backend
        self.settle = canonical
        size = 1
        for rows in comp.rows:
            size *= len(rows) + 1
        self.enumerate = size <= _ENUMERATION_LIMIT
        # highspy's default path searches first; until a search runs out of nodes (then the MILP
        # does every re-solve too). The PuLP backends solve every MILP-sized component with PuLP.
        self.searchable = backend == "highs"
        self.local = threading.local()
        self.solves = 0
        self.canonical = True
        self._lock = threading.Lock()
        self._lagrangian: tuple[list[int], list[int]] | None = None
        self.prices, self.lp_optimum = (None, None) if self.enumerate or len(comp.apps) == 1 else _lp_prices(comp)
        if self.lp_optimum is not None and size > _SEARCH_NODES:
            # The PF relaxation is integral and the search might not finish: the LP (``_HighsModel``)
            # likely settles the re-solves too, at a few milliseconds each.
            self.searchable = False

    def _model(self) -> _HighsModel:
        model = getattr(self.local, "model", None)
        if model is None:
            model = self.local.model = _HighsModel(self.comp)
        return model

    def _milp(self, skip: int | None, floor: int | None = None, start: list[int] | None = None) -> list[int]:
        with self._lock:
            self.solves += 1
        if self.backend == "highs":
            return self._model().solve(skip, floor, start)
        return _pulp_solve(self.comp, skip, self.backend)

    def lagrangian(self) -> tuple[list[int], list[int]]:
        """Per app, its best row's weight less the GPU prices (``prices``; at least 0), and its
        footprint: the parts of the Lagrangian bound without any one app (D39)."""
        if self._lagrangian is None:
            price = self.prices or {}
            best = [max((w - _priced(m, price) for m, w, _, _ in rows), default=0) for rows in self.comp.rows]
            footprints = []
            for rows in self.comp.rows:
                mask = 0
                for row in rows:
                    mask |= row[0]
                footprints.append(mask)
            self._lagrangian = ([max(0, b) for b in best], footprints)
        return self._lagrangian

    def relaxed(self, skip: int) -> tuple[float, list[int] | None, list[int] | None]:
        """``_HighsModel.relaxed`` where the component has an LP model (highspy, past the small
        components); else nothing learnt (an infinite bound)."""
        if self.backend != "highs" or self.enumerate or len(self.comp.apps) == 1:
            return math.inf, None, None
        return self._model().relaxed(skip)

    def solve(self, skip: int | None = None, start: list[int] | None = None) -> tuple[int, list[int]]:
        """(optimal value, a choice reaching it); without ``skip`` and ``start``, the canonical
        choice (D16)."""
        if len(self.comp.apps) == 1 or self.enumerate:
            found = _search(self.comp, skip, start)
            assert found is not None
            return found
        if self.searchable:
            found = _search(self.comp, skip, start, _SEARCH_NODES, prices=self.prices)
            if found is not None:
                return found
            self.searchable = False
        if skip is None and start is None and self.lp_optimum is not None and self.backend == "highs":
            choice = self.lp_optimum
        else:
            choice = self._milp(skip, None if start is None else _value(self.comp, start, skip), start)
        value = _value(self.comp, choice)
        if skip is None and start is None:
            canonical = self._canonical(value, choice) if self.settle else None
            if canonical is not None:
                return value, canonical
            self.canonical = False
        return value, choice

    def _canonical(self, value: int, optimum: list[int]) -> list[int] | None:
        """The canonical allocation worth ``value`` (D16), or None when neither way finds it within
        its budget. The target search and the fixing return the same allocation when they finish
        (the least in search order, which is unique), so the order in which they are tried decides
        only the time: a short target search (most components finish in it), then the fixing, then
        the rest of the target search's budget."""
        for nodes in (_SEARCH_NODES, None, _CANONICAL_NODES):
            if nodes is None:
                fixed = _canonical_by_fixing(self.comp, value, _CANONICAL_FIXING_NODES, optimum, self.prices)
                if fixed is not None and _value(self.comp, fixed) == value and self._feasible(fixed):
                    return fixed
                continue
            found = _search(self.comp, None, None, nodes, target=value, prices=self.prices)
            if found is not None:
                return found[1]
        return None

    def _feasible(self, choice: Sequence[int]) -> bool:
        used = 0
        for i, r in enumerate(choice):
            if r >= 0:
                mask = self.comp.rows[i][r][0]
                if mask & used:
                    return False
                used |= mask
        return True


def _served_and_log(comp: _Component, choice: Sequence[int], skip: int) -> tuple[int, int]:
    """(apps served, sum of L) over all apps but ``skip``."""
    served = sum(1 for i, r in enumerate(choice) if r >= 0 and i != skip)
    return served, sum(comp.rows[i][r][2] for i, r in enumerate(choice) if r >= 0 and i != skip)


def _improved(comp: _Component, choice: Sequence[int], skip: int) -> list[int]:
    """An allocation without app ``skip`` at least as good as the PF allocation minus ``skip``: each
    other app in turn moves to its heaviest row that fits in its own GPUs and those left free, until
    none can. It is the re-solve's starting point: its value is the floor below which the MILP
    leaves rows out (``_HighsModel.solve``), so a higher floor only makes the re-solve faster; the
    value the re-solve returns is the optimum either way (on the service's 500-app rounds the floor
    rose from 100-1,200 weight units below the optimum to 0-200)."""
    out = [c if j != skip else -1 for j, c in enumerate(choice)]
    used = 0
    for j, c in enumerate(out):
        if c >= 0:
            used |= comp.rows[j][c][0]
    moved = True
    while moved:
        moved = False
        for j, rows in enumerate(comp.rows):
            if j == skip:
                continue
            held = rows[out[j]][0] if out[j] >= 0 else 0
            weight = rows[out[j]][1] if out[j] >= 0 else 0
            blocked = used & ~held
            best = -1
            for r, (mask, w, _, _) in enumerate(rows):
                if w > weight and not mask & blocked:
                    best, weight = r, w
            if best >= 0:
                used = blocked | rows[best][0]
                out[j] = best
                moved = True
    return out


_DRAW_MARGIN = 1e-9  # D39: a draw this close (relatively) to a bound of c_i waits for the exact c_i


def _payment(gap: int) -> float:
    """c_i from the gap, in weight units, between the others' best sum of L without i and theirs
    with i (the same apps served): the ratio of the Nash products (D8, D16)."""
    return math.exp(min(0, -gap) / QUANTUM)


@dataclass
class _Bounded:
    """A winner's c_i while only bounds are known (D39). Without app ``i`` the others can do at
    least as well as ``start`` (the PF allocation minus i, improved), so c_i <= ``hi``; an upper
    bound on their best (Lagrangian, or the LP relaxation) gives c_i >= ``lo``, or nothing (lo 0)
    while it cannot rule out serving one more app (then c_i may be 0). ``gap_low`` and
    ``gap_high`` are those bounds as gaps (``_payment``); equal, they are the exact c_i."""

    comp: _Component
    solver: _ComponentSolver
    i: int
    start: list[int]
    served: int  # apps the PF allocation serves besides i
    with_i: int  # their sum of L in it
    gap_low: int
    gap_high: int | None = None

    @property
    def lo(self) -> float:
        return 0.0 if self.gap_high is None else _payment(self.gap_high)

    @property
    def hi(self) -> float:
        return _payment(self.gap_low)

    def exact(self) -> float | None:
        return self.hi if self.gap_high is not None and self.gap_high <= self.gap_low else None

    def decide(self, need: float) -> bool | None:
        """Whether a c_i above ``need`` (the draw, divided by any factor the lottery multiplies c_i
        by) is proven (True), ruled out (False), or open (None). The margin keeps the answer that of
        the exact c_i whatever the last bit of ``exp`` or of that division."""
        if need < self.lo * (1 - _DRAW_MARGIN):
            return True
        if need >= self.hi * (1 + _DRAW_MARGIN):
            return False
        return None

    def cap(self, upper: float) -> None:
        """Tighten ``gap_high`` from ``upper``, an upper bound on the others' best total weight
        without i: an allocation serving one more app would weigh at least (served + 1) M minus
        every app's most negative L, so below that they serve ``served`` and their sum of L is at
        most ``upper - served M``."""
        big_m = self.comp.rows[self.i][0][1] - self.comp.rows[self.i][0][2]
        negative = sum(max(0, -min(row[2] for row in rows)) for j, rows in enumerate(self.comp.rows)
                       if j != self.i and rows)
        if upper < (self.served + 1) * big_m - negative:
            gap = math.floor(upper + 0.5) - self.served * big_m - self.with_i
            self.gap_high = gap if self.gap_high is None else min(self.gap_high, gap)

    def raise_floor(self, alloc: Sequence[int]) -> bool:
        """Take a better allocation without i into ``gap_low``; True when it serves one more app
        (then c_i = 0)."""
        served, log = _served_and_log(self.comp, alloc, self.i)
        if served > self.served:
            return True
        if served == self.served:  # one that serves fewer says nothing of the best that serves as many
            self.gap_low = max(self.gap_low, log - self.with_i)
        return False

    def tighten(self) -> float | None:
        """The LP relaxation without i (D39's second step, a few milliseconds): its value caps the
        others' best, its rounded solution raises the floor. The exact c_i when that settles it."""
        bound, optimum, rounded = self.solver.relaxed(self.i)
        if optimum is not None:
            return 0.0 if self.raise_floor(optimum) else _payment(self.gap_low)
        if rounded is not None and self.raise_floor(rounded):
            return 0.0
        if bound < math.inf:
            self.cap(bound)
        return self.exact()

    def resolve(self) -> float:
        """The exact c_i: the re-solve without i (D8)."""
        _, alt = self.solver.solve(skip=self.i, start=self.start)
        served_without, without_i = _served_and_log(self.comp, alt, skip=self.i)
        if served_without > self.served:
            return 0.0
        return _payment(max(without_i, self.with_i) - self.with_i)


def _bounded(comp: _Component, solver: _ComponentSolver, choice: list[int], i: int) -> float | _Bounded:
    """c_i, or bounds on it (D39), from what costs no solve: the PF allocation minus i, improved
    (``_improved``: c_i <= hi), and the Lagrangian bound with the component's GPU prices (the
    search's, ``_lp_prices``: c_i >= lo)."""
    start = _improved(comp, choice, i)
    served, with_i = _served_and_log(comp, choice, skip=i)
    out = _Bounded(comp, solver, i, start, served, with_i, 0)
    if out.raise_floor(start):
        return 0.0
    reduced, footprints = solver.lagrangian()
    free = 0
    for j, mask in enumerate(footprints):
        if j != i:
            free |= mask
    out.cap(_priced(free, solver.prices or {}) + sum(r for j, r in enumerate(reduced) if j != i))
    exact = out.exact()
    return out if exact is None else exact


def _resolve_all(todo: Sequence[_Bounded], workers: int) -> list[float]:
    """Exact c_i of ``todo`` (one component's), in threads where the re-solves are MILPs (highspy
    releases the GIL; the search does not)."""
    solver = todo[0].solver if todo else None
    if solver is not None and workers > 1 and len(todo) > 1 and not (solver.enumerate or solver.searchable):
        with ThreadPoolExecutor(min(workers, len(todo))) as pool:
            return list(pool.map(_Bounded.resolve, todo))
    return [b.resolve() for b in todo]


def _hidden_payments(comp: _Component, solver: _ComponentSolver, choice: list[int], workers: int,
                     exact: bool = True) -> tuple[list[float], dict[int, _Bounded]]:
    """c_i for each app of the component (D8), skipping re-solves where the answer is provable.
    With ``exact`` False, the winners whose c_i needs a re-solve are left as bounds (D39, NaN in the
    list) for :func:`_settle` to decide against their draws."""
    out = [1.0] * len(comp.apps)
    todo: list[_Bounded] = []
    used = footprint = 0
    for j, rows in enumerate(comp.rows):
        for row in rows:
            footprint |= row[0]
        if choice[j] >= 0:
            used |= rows[choice[j]][0]
    idle = footprint & ~used
    unserved = [comp.rows[j] for j, r in enumerate(choice) if r < 0]
    for i, r in enumerate(choice):
        if r < 0:
            continue
        won = comp.rows[i][r][0]
        if not any(row[0] & won for j, rows in enumerate(comp.rows) if j != i for row in rows):
            continue
        # Without i, a contender left out could take i's GPUs (and idle ones) while everyone else
        # keeps theirs: more apps served, so c_i = 0 with no re-solve (the same answer, D8).
        room = won | idle
        if any((row[0] & ~room) == 0 for rows in unserved for row in rows):
            out[i] = 0.0
            continue
        bounded = _bounded(comp, solver, choice, i)
        if isinstance(bounded, float):
            out[i] = bounded
        else:
            todo.append(bounded)
    if not exact and not solver.enumerate:  # a small component's re-solves cost less than bounds
        for b in todo:
            out[b.i] = math.nan
        return out, {b.i: b for b in todo}
    for b, ci in zip(todo, _resolve_all(todo, workers)):
        out[b.i] = ci
    return out, {}


def _settle(pending: Mapping[str, _Bounded], c: dict[str, float], need: Mapping[str, float],
            workers: int) -> dict[str, tuple[float, float]]:
    """D39: decide each bounded winner's lottery from its bounds where they suffice. A winner whose
    ``need`` (its draw, divided by any factor its c_i is multiplied by before the draw is compared)
    is below ``lo`` keeps its row and one at or above ``hi`` loses it, whatever the exact c_i; for
    the others the LP relaxation tightens the bounds and, if the draw still falls between them, the
    re-solve gives the exact c_i. Sets ``c`` for every one of them -- the exact c_i, or for a winner
    decided by its bounds the bound that decided it (the draw compares with it as with c_i) -- and
    returns the bounds of the latter. A winner zeroed since (``_shadow_payments``) is exact."""
    decided: dict[str, tuple[float, float]] = {}
    left: dict[int, list[tuple[str, _Bounded]]] = {}
    for app, b in sorted(pending.items()):
        if c[app] == 0.0:
            continue
        won = b.decide(need[app])
        if won is None:
            exact = b.tighten()
            if exact is not None:
                c[app] = exact
                continue
            won = b.decide(need[app])
        if won is None:
            left.setdefault(id(b.solver), []).append((app, b))
            continue
        c[app] = b.lo if won else b.hi
        decided[app] = (b.lo, b.hi)
    for group in left.values():
        for (app, _), ci in zip(group, _resolve_all([b for _, b in group], workers)):
            c[app] = ci
    return decided


def keep_best_locality(gpus: Sequence[str], k: int, position: Callable[[str], Position]) -> frozenset[str]:
    """k of ``gpus`` with the best locality (D1): inside one slot if any slot has k, else one
    machine, else one rack, filling the fullest groups first."""
    if k >= len(gpus):
        return frozenset(gpus)
    if k <= 0:
        return frozenset()
    levels: list[dict[tuple, list[str]]] = [{}, {}, {}]
    for g in sorted(gpus):
        rack, machine, slot = position(g)
        levels[0].setdefault((rack, machine, slot), []).append(g)
        levels[1].setdefault((rack, machine), []).append(g)
        levels[2].setdefault((rack,), []).append(g)

    def densest(members: list[str]) -> list[str]:
        by_slot: dict[tuple, list[str]] = {}
        for g in members:
            by_slot.setdefault(position(g), []).append(g)
        by_machine: dict[tuple, list[list[str]]] = {}
        for pos, gs in by_slot.items():
            by_machine.setdefault(pos[:2], []).append(gs)
        out: list[str] = []
        for slots in sorted(by_machine.values(), key=lambda s: (-sum(map(len, s)), s[0][0])):
            for gs in sorted(slots, key=lambda s: (-len(s), s[0])):
                out.extend(gs)
        return out

    for level in levels:
        fits = [gs for gs in level.values() if len(gs) >= k]
        if fits:
            best = min(fits, key=lambda gs: (len(gs), gs[0]))
            return frozenset(densest(best)[:k])
    by_rack = sorted(levels[2].values(), key=lambda gs: (-len(gs), gs[0]))
    return frozenset(densest([g for gs in by_rack for g in gs])[:k])


def take_gpus(
    pool: Sequence[str], k: int, position: Callable[[str], Position], previous: frozenset[str] = frozenset()
) -> frozenset[str]:
    """k GPUs of ``pool`` for one app: the ones it held until this round first (a GPU won back
    keeps its job running without a restart, D10, D11), then the best-placed of the rest (D1)."""
    mine = [g for g in pool if g in previous]
    if len(mine) >= k:
        return keep_best_locality(mine, k, position)
    rest = [g for g in pool if g not in previous]
    return frozenset(mine) | keep_best_locality(rest, k - len(mine), position)


def position_from_id(gpu_id: str) -> Position:
    """Fallback hierarchy from ids like ``r0-m1-g3``: rack r0, machine r0-m1, the GPU its own slot."""
    parts = gpu_id.split("-")
    if len(parts) >= 3:
        return (parts[0], "-".join(parts[:2]), gpu_id)
    return (gpu_id, gpu_id, gpu_id)


def default_priority(bids: Mapping[str, BidTable]) -> list[str]:
    """Bidders worst first when the caller gives no order: by rho_old (an app holding nothing
    first), then by name."""
    return sorted(bids, key=lambda a: (-bids[a].rho_old, a))


@dataclass(frozen=True)
class Admission:
    """Who contends in a round's auction (D25), each list in priority order.

    ``admitted`` take part in the PF allocation; ``shadows`` contend but were shut out by the big
    smallest rows of contenders admitted before them; ``contenders`` is everyone who contended
    (admitted, shadows, and those whose own smallest row fits next to nobody's)."""

    admitted: tuple[str, ...]
    shadows: tuple[str, ...]
    contenders: tuple[str, ...]
    smallest: Mapping[str, int]  # each contender's smallest useful row, in GPUs


def admit(order: Sequence[str], values: Mapping[str, list[tuple[int, int, int]]], offered: int,
          max_contenders: int | None = None) -> Admission:
    """D25: who contends, and who of them takes part in the PF allocation.

    In priority order, each bidder with a useful row contends until ``max_contenders`` contend (D20)
    or |offered| have been admitted; the bidders after that wait for leftover GPUs (D9's first tier).
    A contender is admitted to the PF when its smallest useful row fits in what the smallest rows
    of those admitted before it leave of the offer: then every admitted contender fits by size, and
    the Nash convention no longer zeroes the winner ranked first for a lower-ranked table whose rows
    start at two GPUs, or for a spoiler's worthless big row (the audit's hand-made rounds). A
    contender that does not fit has had its auction and is not served; it takes no part in D9's
    first tier, so hiding small rows to leave the auction pays nothing.

    Who is to blame for a contender that does not fit is decided by a count a bidder cannot move:
    if its smallest row fits next to one GPU for each contender admitted before it, it was shut
    out by their big smallest rows (a *shadow*: those of them whose smallest row is above one GPU
    are answerable for it in their hidden payment, :func:`_shadow_payments`); otherwise by its own.
    So an app that hides its small rows to shut out the contenders behind it is the one that pays."""
    admitted: list[str] = []
    shadows: list[str] = []
    contenders: list[str] = []
    smallest: dict[str, int] = {}
    used = 0
    cap = math.inf if max_contenders is None else max_contenders
    for app in order:
        rows = values.get(app)
        if not rows:
            continue
        if len(admitted) >= offered or len(contenders) >= cap:
            break
        contenders.append(app)
        size = smallest[app] = min(mask.bit_count() for mask, _, _ in rows)
        if size + used <= offered:
            admitted.append(app)
            used += size
        elif size + len(admitted) <= offered:
            shadows.append(app)
    return Admission(tuple(admitted), tuple(shadows), tuple(contenders), smallest)


def _shadow_payments(admission: Admission, values: Mapping[str, list[tuple[int, int, int]]],
                     pf_masks: Mapping[str, int], footprint: int, c: dict[str, float]) -> None:
    """D25: a winner whose smallest row is above one GPU gets c_i = 0 when a shadow ranked after it
    has a row inside the winner's PF row and the GPUs nobody's PF row took: with the winner's row
    given up, the shadow would be served while every other winner keeps its own, so the winner's
    big minimum is what kept it out -- the zero of D8, charged to the table that caused it."""
    if not admission.shadows:
        return
    place = {a: k for k, a in enumerate(admission.contenders)}
    idle = footprint
    for mask in pf_masks.values():
        idle &= ~mask
    for app, mask in pf_masks.items():
        if admission.smallest.get(app, 1) <= 1 or c.get(app, 0.0) == 0.0:
            continue
        room = mask | idle
        if any(place[k] > place[app] and any((m & ~room) == 0 for m, _, _ in values[k]) for k in admission.shadows):
            c[app] = 0.0


def run_auction(
    offered: frozenset[str],
    bids: Mapping[str, BidTable],
    *,
    seed: int,
    solver: str = DEFAULT_SOLVER,
    position: Callable[[str], Position] | None = None,
    max_rows: int = MAX_ROWS,
    workers: int | None = None,
    priority: Sequence[str] | None = None,
    max_contenders: int | None = None,
    harm: Mapping[str, Sequence[float]] | None = None,
    exact_payments: bool = True,
    canonical: bool = True,
) -> AuctionOutcome:
    """Run one partial-allocation auction (Pseudocode 1, ``auction``) over ``offered``.

    ``bids`` maps app -> :class:`BidTable`; every bid is validated first (D7) and the first bad one
    raises :class:`InvalidBid`. ``priority`` orders the bidders worst first (the round's rho order,
    D13; by default :func:`default_priority`): only the first |offered| bidders with a useful row
    contend, and at most ``max_contenders`` of them (D20; bidders without a useful row take no
    place under the cap). ``position`` is accepted for callers that place GPUs (the lottery keeps
    whole rows).
    ``workers`` threads run the re-solves for c_i (default: the machine's cores, at most 4).
    ``harm`` (D36, contention-aware): per app, one factor in (0, 1] per row of its bid, what the row
    would leave of the running jobs' speed; the PF maximises prod V x h, and a winner keeps its row
    with probability c_i x h_i (its hidden payment includes the harm it does). None: as without.
    ``exact_payments`` False (D39) re-solves for c_i only where the draw falls between the bounds
    that cost no re-solve: the lottery's result is the same, and such winners' c_i are reported as
    bounds (``AuctionOutcome.payment_bounds``) instead of in ``hidden_payment``.
    ``canonical`` False (D40) keeps the first optimal PF allocation a solve finds where D16 would
    search further for the canonical one among the optima (``AuctionOutcome.canonical`` False then):
    every bidder's expected value is the same at every optimum, and repeatability is a simulator's
    need, not a service's.
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    offered = frozenset(offered)
    for app, bid in bids.items():
        validate_bid(app, bid, offered, max_rows)
    order = list(priority) if priority is not None else default_priority(bids)
    strays = sorted(set(order) - set(bids))
    if strays or len(set(order)) != len(order) or set(bids) - set(order):
        raise ValueError(f"priority must list every bidder once, got extras {strays[:5]}")
    gpu_bit = {g: 1 << k for k, g in enumerate(sorted(offered))}
    if harm is not None:
        for app, factors in harm.items():
            if app in bids and (len(factors) != len(bids[app].rows) or not all(0 < h <= 1 for h in factors)):
                raise ValueError(f"harm for {app!r}: one factor in (0, 1] per row of its bid")
    values = _log_values(bids, gpu_bit, harm)
    admission = admit(order, values, len(offered), max_contenders)
    weighted = _weighted({a: values[a] for a in admission.admitted})

    pf: dict[str, frozenset[str]] = {}
    pf_rho: dict[str, float] = {}
    pf_row: dict[str, int] = {}
    c: dict[str, float] = {app: 1.0 for app in bids}
    solves = 0
    all_canonical = True
    n_workers = workers if workers is not None else min(4, os.cpu_count() or 1)
    solvers: list[_ComponentSolver] = []
    pending: dict[str, _Bounded] = {}
    for comp in _components(weighted):
        solver_ = _ComponentSolver(comp, solver, canonical)
        solvers.append(solver_)
        _, choice = solver_.solve()
        for app, rows, r in zip(comp.apps, comp.rows, choice):
            if r >= 0:
                gpus, rho = bids[app].rows[rows[r][3]]
                pf_row[app] = rows[r][3]
                pf[app] = frozenset(gpus)
                pf_rho[app] = float(rho)
        payments, bounded = _hidden_payments(comp, solver_, choice, n_workers, exact_payments)
        for app, ci in zip(comp.apps, payments):
            c[app] = ci
        pending.update((comp.apps[i], b) for i, b in bounded.items())

    footprint = 0
    for app in admission.contenders:
        for mask, _, _ in values[app]:
            footprint |= mask
    _shadow_payments(admission, values, {a: sum(gpu_bit[g] for g in gpus) for a, gpus in pf.items()}, footprint, c)
    draws = auction_draws(seed, pf)  # D38: one shared draw, spread over the winners
    # D39: the lottery compares the draw with c_i times the harm of its row (D36)
    factor = {app: harm[app][pf_row[app]] for app in pf if app in harm} if harm else {}
    bounds = _settle(pending, c, {app: draws[app] / factor.get(app, 1.0) for app in pending}, n_workers)
    for solver_ in solvers:
        solves += solver_.solves
        all_canonical &= solver_.canonical
    if harm:
        # D36: c_i is the others' Nash product with i over without i; the incumbents i's row slows
        # are among the others, so the true c_i is the auction's times the harm of i's own PF row
        for app in pf:
            if app in harm:
                c[app] *= harm[app][pf_row[app]]
    granted = {app: pf[app] for app in sorted(pf) if draws[app] < c[app]}
    used = frozenset().union(*granted.values()) if granted else frozenset()
    return AuctionOutcome(
        pf=pf,
        hidden_payment={app: ci for app, ci in c.items() if app not in bounds},
        granted=granted,
        leftover=offered - used,
        pf_rho=pf_rho,
        solves=solves,
        contenders=admission.contenders,
        canonical=all_canonical,
        shadows=admission.shadows,
        admitted=admission.admitted,
        draws=draws,
        payment_bounds={app: (lo * factor.get(app, 1.0), hi * factor.get(app, 1.0)) for app, (lo, hi) in bounds.items()},
    )
