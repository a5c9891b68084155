"""The partial-allocation auction (paper 3.3.1, Pseudocode 1 lines 6-13; mechanism D7, D8).

1. **PF allocation.** Each bidder's valuation of a row is V = 1/rho. Pick at most one row per app,
   each GPU to at most one app, maximising prod V_i (a sum of logs). Zero valuations (rho_old =
   infinity: an app holding nothing) follow the Nash-welfare convention: first maximise how many
   apps get a positive valuation, then the product among them (D8).
2. **Hidden payments.** For each bidder i, re-solve without i and set
   c_i = prod_{j != i} V_j(PF) / prod_{j != i} V_j(PF without i), so 0 < c_i <= 1 -- or c_i = 0
   when i's win leaves another app with a zero valuation that it would not have without i (the
   product's numerator is zero; docs/mechanism.md records this reading of D8).
3. **Randomized rounding.** GPUs are indivisible: i keeps floor(c_i |G_i|) GPUs of its PF row plus
   one more with probability frac(c_i |G_i|) (seeded), the kept GPUs chosen for best locality (D1).
   Everything else is leftover (Pseudocode 1 line 11), for the round engine to hand out (D9).

How it is solved. Each row's weight is its log-valuation gain over the app's empty row,
log(rho_old / rho); for an app with rho_old = infinity the empty row's log-valuation is taken as
-M with M larger than every finite spread in the instance, which turns the Nash-welfare convention
into one sum of weights (an app served is worth more than any product change). The problem then
splits exactly:

* rows no better than the empty row, and rows that contain another row of the same app with no
  better rho, can never be in an optimum and are dropped;
* apps whose rows share no GPU do not interact: the instance splits into connected components,
  each solved alone, and c_i depends only on i's component;
* c_i = 1 without a re-solve when i wins nothing or when no other app bid on any GPU i won;
* small components are solved by exact branch and bound (all weights are positive, so each app
  still to decide can add at most its best row); with the default solver, bigger ones get the
  same search with a node budget of about one MILP solve's time, and only when that runs out a
  MILP -- directly through highspy, with one persistent model per component whose re-solves only
  change column bounds and start from the PF solution minus i -- or through PuLP (CBC or HiGHS).

``solver`` picks the MILP backend: ``"highs"`` (default: search first, then highspy in-process),
``"pulp-highs"`` (PuLP's HiGHS interface), ``"pulp-cbc"`` (PuLP + CBC, a process per solve); the
PuLP backends model every component past the small ones. All are exact (gap 0); docs/auction.md
has the measurements behind the default.
"""

from __future__ import annotations

import math
import os
import random
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from protos.messages import BidTable, Position

MAX_ROWS = 4096
SOLVERS = ("highs", "pulp-highs", "pulp-cbc")
DEFAULT_SOLVER = "highs"
_ENUMERATION_LIMIT = 4096  # components with at most this many row combinations: always searched
_SEARCH_NODES = 5_000  # bigger ones: branch and bound up to about one MILP solve's time, then the MILP
_EPS = 1e-9


class InvalidBid(ValueError):
    """A bid that breaks D7; the message says which app, which row and what is wrong."""

    def __init__(self, app: str, reason: str):
        super().__init__(f"bid from {app!r}: {reason}")
        self.app = app
        self.reason = reason


@dataclass(frozen=True)
class AuctionOutcome:
    """What one auction decided (Pseudocode 1 line 12).

    ``hidden_payment`` maps each bidder to c_i, the fraction of its PF allocation it keeps; the
    hidden payment proper is the other 1 - c_i of it, which goes to ``leftover``.
    """

    pf: Mapping[str, frozenset[str]]
    hidden_payment: Mapping[str, float]
    granted: Mapping[str, frozenset[str]]
    leftover: frozenset[str]
    pf_rho: Mapping[str, float] = field(default_factory=dict)
    solves: int = 0


def validate_bid(app: str, bid: BidTable, offered: frozenset[str], max_rows: int = MAX_ROWS) -> None:
    """D7: every GPU offered and listed once per row, rho finite and > 0 (rho_old may be
    infinite), at most ``max_rows`` rows. Raises :class:`InvalidBid` naming the first fault."""
    if not isinstance(bid, BidTable):
        raise InvalidBid(app, f"expected a BidTable, got {type(bid).__name__}")
    if not isinstance(bid.rho_old, (int, float)) or math.isnan(bid.rho_old) or not bid.rho_old > 0:
        raise InvalidBid(app, f"rho_old must be > 0 (or infinity), got {bid.rho_old!r}")
    if len(bid.rows) > max_rows:
        raise InvalidBid(app, f"{len(bid.rows)} rows, more than the limit of {max_rows}")
    for k, row in enumerate(bid.rows):
        if not isinstance(row, tuple) or len(row) != 2:
            raise InvalidBid(app, f"row {k} must be a (gpus, rho) pair")
        gpus, rho = row
        if isinstance(gpus, (str, bytes)) or not hasattr(gpus, "__iter__"):
            raise InvalidBid(app, f"row {k}: gpus must be a set of GPU ids")
        listed = list(gpus)
        if not listed:
            raise InvalidBid(app, f"row {k} is empty (the empty row is rho_old)")
        if len(set(listed)) != len(listed):
            raise InvalidBid(app, f"row {k} lists a GPU twice")
        stray = [g for g in listed if g not in offered]
        if stray:
            raise InvalidBid(app, f"row {k} asks for GPUs not offered: {sorted(map(str, stray))[:5]}")
        if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not math.isfinite(rho) or rho <= 0:
            raise InvalidBid(app, f"row {k}: rho must be finite and > 0, got {rho!r}")


# ---------------------------------------------------------------------------------------------
# The weighted set-packing problem behind the PF allocation


@dataclass
class _Component:
    apps: list[str]
    rows: list[list[tuple[int, float, int]]]  # per app: (gpu bitmask, weight, original row index)
    starving: frozenset[str] = frozenset()  # apps with rho_old = infinity


def _weights(bids: Mapping[str, BidTable], gpu_bit: Mapping[str, int]) -> dict[str, list[tuple[int, float, int]]]:
    """Row weights relative to each app's empty row (see module docstring), useless rows dropped."""
    finite: dict[str, list[tuple[int, float, int]]] = {}
    spread = 0.0
    largest = 0.0
    for app, bid in bids.items():
        rows = []
        for k, (gpus, rho) in enumerate(bid.rows):
            mask = 0
            for g in gpus:
                mask |= gpu_bit[g]
            if math.isinf(bid.rho_old):
                rows.append((mask, -math.log(rho), k))
            elif rho < bid.rho_old:
                rows.append((mask, math.log(bid.rho_old / rho), k))
        if rows:
            hi = max(w for _, w, _ in rows)
            lo = min(0.0, min(w for _, w, _ in rows))
            spread += max(0.0, hi) - lo
            largest = max(largest, max(abs(w) for _, w, _ in rows))
            finite[app] = rows
    # Serving one more starving app gains at least M - largest and costs the others at most
    # ``spread``, so this M makes the sum of weights order solutions as the Nash convention does.
    big_m = spread + largest + 1.0
    out = {}
    for app, rows in finite.items():
        if math.isinf(bids[app].rho_old):
            rows = [(m, w + big_m, k) for m, w, k in rows]
        out[app] = _undominated(rows)
    return out


def _undominated(rows: list[tuple[int, float, int]]) -> list[tuple[int, float, int]]:
    """Drop rows that contain another row of the same app whose weight is at least as high."""
    keep: list[tuple[int, float, int]] = []
    for mask, w, k in sorted(rows, key=lambda r: (-r[1], r[0].bit_count(), r[2])):
        if any(w <= kw + _EPS and (km & ~mask) == 0 for km, kw, _ in keep):
            continue
        keep.append((mask, w, k))
    return keep


def _components(rows: Mapping[str, list[tuple[int, float, int]]], starving: frozenset[str]) -> list[_Component]:
    """Apps linked by rows that share a GPU, as connected components."""
    apps = sorted(rows)
    parent = {a: a for a in apps}

    def find(a: str) -> str:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    footprint = {a: 0 for a in apps}
    for a in apps:
        for m, _, _ in rows[a]:
            footprint[a] |= m
    owner: dict[int, str] = {}
    for a in apps:
        m = footprint[a]
        while m:
            low = m & -m
            m ^= low
            b = owner.setdefault(low, a)
            if b != a:
                parent[find(a)] = find(b)
    groups: dict[str, list[str]] = {}
    for a in apps:
        groups.setdefault(find(a), []).append(a)
    return [_Component(g, [rows[a] for a in g], starving & frozenset(g)) for g in groups.values()]


class _SearchTooLong(Exception):
    pass


def _search(
    comp: _Component, skip: int | None, start: Sequence[int] | None = None, node_limit: int | None = None
) -> tuple[float, list[int]] | None:
    """Exact optimum by depth-first branch and bound; choice[i] = row position or -1.

    Every weight is positive, so a partial choice can gain at most the best row of each app still
    to decide; branches that cannot beat the best solution found so far (at first ``start``, a
    feasible choice such as the PF solution minus the skipped app) are cut. Apps with the heaviest
    rows are decided first, each trying its rows heaviest first. Returns None when ``node_limit``
    nodes did not finish the search (the caller then solves the MILP).
    """
    n = len(comp.apps)
    order = sorted(
        (i for i in range(n) if i != skip and comp.rows[i]), key=lambda i: (-max(w for _, w, _ in comp.rows[i]), i)
    )
    rows = [
        sorted(((mask, w, r) for r, (mask, w, _) in enumerate(comp.rows[i])), key=lambda row: (-row[1], row[2]))
        for i in order
    ]
    suffix = [0.0] * (len(order) + 1)
    for k in range(len(order) - 1, -1, -1):
        suffix[k] = suffix[k + 1] + rows[k][0][1]
    best_value, best_choice = 0.0, [-1] * n
    if start is not None:
        best_choice = [c if i != skip else -1 for i, c in enumerate(start)]
        best_value = sum(comp.rows[i][c][1] for i, c in enumerate(best_choice) if c >= 0)
    choice = [-1] * n
    budget = math.inf if node_limit is None else node_limit

    def walk(k: int, used: int, value: float) -> None:
        nonlocal best_value, best_choice, budget
        budget -= 1
        if budget < 0:
            raise _SearchTooLong
        if k == len(order):
            if value > best_value + _EPS:
                best_value, best_choice = value, choice.copy()
            return
        if value + suffix[k] <= best_value + _EPS:
            return
        i, rest = order[k], suffix[k + 1]
        for mask, w, r in rows[k]:
            if value + w + rest <= best_value + _EPS:
                break
            if not mask & used:
                choice[i] = r
                walk(k + 1, used | mask, value + w)
        choice[i] = -1
        walk(k + 1, used, value)

    try:
        walk(0, 0, 0.0)
    except (_SearchTooLong, RecursionError):  # one level per app: huge components go to the MILP
        return None
    return best_value, best_choice


class _HighsModel:
    """One persistent highspy model per component; re-solves change bounds and warm-start."""

    def __init__(self, comp: _Component):
        import highspy
        import numpy as np

        self.np = np
        self.h = highspy.Highs()
        h = self.h
        h.setOptionValue("output_flag", False)
        h.setOptionValue("mip_rel_gap", 0.0)
        h.setOptionValue("mip_abs_gap", 1e-9)
        h.setOptionValue("threads", 1)
        # Measured on the 60 yardstick instances (docs/auction.md): restarts and the RINS/RENS
        # sub-MIPs cost more than they save on these set-packing models.
        h.setOptionValue("mip_allow_restart", False)
        h.setOptionValue("mip_heuristic_run_rins", False)
        h.setOptionValue("mip_heuristic_run_rens", False)
        self.cols: list[tuple[int, int]] = []
        costs = []
        for i, rows in enumerate(comp.rows):
            for r, (_, w, _) in enumerate(rows):
                self.cols.append((i, r))
                costs.append(w)
        n = len(self.cols)
        self.n = n
        h.addCols(n, np.array(costs), np.zeros(n), np.ones(n), 0, np.array([], dtype=np.int32),
                  np.array([], dtype=np.int32), np.array([], dtype=np.float64))
        h.changeColsIntegrality(n, np.arange(n, dtype=np.int32),
                                np.array([highspy.HighsVarType.kInteger] * n))
        h.changeObjectiveSense(highspy.ObjSense.kMaximize)
        rows_idx: list[list[int]] = []
        by_app: dict[int, list[int]] = {}
        by_gpu: dict[int, list[int]] = {}
        for c, (i, r) in enumerate(self.cols):
            by_app.setdefault(i, []).append(c)
            m = comp.rows[i][r][0]
            while m:
                low = m & -m
                m ^= low
                by_gpu.setdefault(low, []).append(c)
        rows_idx.extend(v for v in by_app.values() if len(v) > 1)
        rows_idx.extend(v for v in by_gpu.values() if len(v) > 1)
        if rows_idx:
            starts = np.cumsum([0] + [len(v) for v in rows_idx[:-1]]).astype(np.int32)
            index = np.array([c for v in rows_idx for c in v], dtype=np.int32)
            h.addRows(len(rows_idx), np.full(len(rows_idx), -np.inf), np.ones(len(rows_idx)),
                      len(index), starts, index, np.ones(len(index)))
        self.app_cols = by_app

    def solve(self, skip: int | None, start: list[int] | None) -> tuple[float, list[int]]:
        np, h = self.np, self.h
        if skip is not None and skip in self.app_cols:
            idx = np.array(self.app_cols[skip], dtype=np.int32)
            h.changeColsBounds(len(idx), idx, np.zeros(len(idx)), np.zeros(len(idx)))
        if start is not None:
            x = np.zeros(self.n)
            for c, (i, r) in enumerate(self.cols):
                if start[i] == r:
                    x[c] = 1.0
            h.setSolution(self.n, np.arange(self.n, dtype=np.int32), x)
        h.run()
        values = h.getSolution().col_value
        value = h.getInfo().objective_function_value
        if skip is not None and skip in self.app_cols:
            idx = np.array(self.app_cols[skip], dtype=np.int32)
            h.changeColsBounds(len(idx), idx, np.zeros(len(idx)), np.ones(len(idx)))
        choice = [-1] * (max(i for i, _ in self.cols) + 1)
        for c, (i, r) in enumerate(self.cols):
            if values[c] > 0.5:
                choice[i] = r
        return value, choice


def _pulp_solve(comp: _Component, skip: int | None, backend: str) -> tuple[float, list[int]]:
    import pulp

    prob = pulp.LpProblem("pf_allocation", pulp.LpMaximize)
    x: dict[tuple[int, int], pulp.LpVariable] = {}
    by_gpu: dict[int, list[pulp.LpVariable]] = {}
    for i, rows in enumerate(comp.rows):
        if i == skip:
            continue
        for r, (mask, _, _) in enumerate(rows):
            v = prob.add_variable(f"x_{i}_{r}", 0, 1, cat=pulp.LpBinary)
            x[i, r] = v
            m = mask
            while m:
                low = m & -m
                m ^= low
                by_gpu.setdefault(low, []).append(v)
    if not x:
        return 0.0, [-1] * len(comp.apps)
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
    return float(pulp.value(prob.objective) or 0.0), choice


class _ComponentSolver:
    """Solves one component exactly, with and without each app, counting MILP solves.

    highspy models are not thread-safe, so each worker thread keeps its own persistent model.
    """

    def __init__(self, comp: _Component, backend: str):
        self.comp = comp
        self.backend = backend
        size = 1
        for rows in comp.rows:
            size *= len(rows) + 1
        self.enumerate = size <= _ENUMERATION_LIMIT
        # highspy's default path searches first; until a search runs out of nodes (then the MILP
        # does every re-solve too). The PuLP backends solve every MILP-sized component with PuLP.
        self.searchable = backend == "highs"
        self.local = threading.local()
        self.solves = 0
        self._lock = threading.Lock()

    def solve(self, skip: int | None = None, start: list[int] | None = None) -> tuple[float, list[int]]:
        if len(self.comp.apps) == 1 or self.enumerate:
            return _search(self.comp, skip, start)
        if self.searchable:
            found = _search(self.comp, skip, start, _SEARCH_NODES)
            if found is not None:
                return found
            self.searchable = False
        with self._lock:
            self.solves += 1
        if self.backend == "highs":
            model = getattr(self.local, "model", None)
            if model is None:
                model = self.local.model = _HighsModel(self.comp)
            return model.solve(skip, start)
        return _pulp_solve(self.comp, skip, self.backend)


def _served_and_value(comp: _Component, choice: Sequence[int], skip: int) -> tuple[int, float]:
    """(apps with rho_old = infinity that get a row, total weight) over all apps but ``skip``."""
    served = sum(1 for i, r in enumerate(choice) if r >= 0 and i != skip and comp.apps[i] in comp.starving)
    return served, sum(comp.rows[i][r][1] for i, r in enumerate(choice) if r >= 0 and i != skip)


def _hidden_payments(
    comp: _Component, solver: _ComponentSolver, choice: list[int], workers: int
) -> list[float]:
    """c_i for each app of the component (D8), skipping re-solves where c_i = 1 is provable.

    When removing i lets more of the other apps get a positive valuation (i's win leaves another
    app with rho = infinity), the numerator of c_i has a zero valuation and c_i = 0: i keeps
    nothing. Otherwise the served counts agree, the -M terms cancel and c_i is the plain product
    ratio, 0 < c_i <= 1.
    """
    out = [1.0] * len(comp.apps)
    todo = []
    used = footprint = 0
    for j, rows in enumerate(comp.rows):
        for m, _, _ in rows:
            footprint |= m
        if choice[j] >= 0:
            used |= rows[choice[j]][0]
    idle = footprint & ~used
    unserved = [comp.rows[j] for j, r in enumerate(choice) if r < 0 and comp.apps[j] in comp.starving]
    for i, r in enumerate(choice):
        if r < 0:
            continue
        won = comp.rows[i][r][0]
        if not any(m & won for j, rows in enumerate(comp.rows) if j != i for m, _, _ in rows):
            continue
        # Without i, a starving app left out could take i's GPUs (and idle ones) while everyone
        # else keeps theirs: more apps served, so c_i = 0 with no re-solve (same answer, D8).
        room = won | idle
        if any((m & ~room) == 0 for rows in unserved for m, _, _ in rows):
            out[i] = 0.0
            continue
        todo.append(i)

    def resolve(i: int) -> tuple[int, float]:
        start = [c if j != i else -1 for j, c in enumerate(choice)]
        _, alt = solver.solve(skip=i, start=start)
        served_with, with_i = _served_and_value(comp, choice, skip=i)
        served_without, without_i = _served_and_value(comp, alt, skip=i)
        if served_without > served_with:
            return i, 0.0
        return i, math.exp(min(0.0, with_i - max(without_i, with_i)))

    if workers > 1 and len(todo) > 1 and not (solver.enumerate or solver.searchable):
        with ThreadPoolExecutor(min(workers, len(todo))) as pool:
            results = list(pool.map(resolve, todo))
    else:
        results = [resolve(i) for i in todo]
    for i, ci in results:
        out[i] = ci
    return out


def keep_best_locality(gpus: Sequence[str], k: int, position: Callable[[str], Position]) -> frozenset[str]:
    """k of ``gpus`` with the best locality (D1, D8): inside one slot if any slot has k, else one
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


def run_auction(
    offered: frozenset[str],
    bids: Mapping[str, BidTable],
    *,
    seed: int,
    solver: str = DEFAULT_SOLVER,
    position: Callable[[str], Position] | None = None,
    max_rows: int = MAX_ROWS,
    workers: int | None = None,
) -> AuctionOutcome:
    """Run one partial-allocation auction (Pseudocode 1, ``auction``) over ``offered``.

    ``bids`` maps app -> :class:`BidTable`; every bid is validated first (D7) and the first bad one
    raises :class:`InvalidBid`. ``position`` gives each GPU's (rack, machine, slot) for keeping the
    best-placed GPUs when rounding; by default it is read off ids like ``r0-m1-g3``. ``workers``
    threads run the re-solves for c_i (default: the machine's cores, at most 4).
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    offered = frozenset(offered)
    for app, bid in bids.items():
        validate_bid(app, bid, offered, max_rows)
    position = position or position_from_id
    gpu_bit = {g: 1 << k for k, g in enumerate(sorted(offered))}
    weighted = _weights(bids, gpu_bit)
    starving = frozenset(app for app, bid in bids.items() if math.isinf(bid.rho_old))

    pf: dict[str, frozenset[str]] = {}
    pf_rho: dict[str, float] = {}
    c: dict[str, float] = {app: 1.0 for app in bids}
    solves = 0
    n_workers = workers if workers is not None else min(4, os.cpu_count() or 1)
    for comp in _components(weighted, starving):
        solver_ = _ComponentSolver(comp, solver)
        _, choice = solver_.solve()
        for app, rows, r in zip(comp.apps, comp.rows, choice):
            if r >= 0:
                gpus, rho = bids[app].rows[rows[r][2]]
                pf[app] = frozenset(gpus)
                pf_rho[app] = float(rho)
        for app, ci in zip(comp.apps, _hidden_payments(comp, solver_, choice, n_workers)):
            c[app] = ci
        solves += solver_.solves

    rng = random.Random(seed)
    granted: dict[str, frozenset[str]] = {}
    for app in sorted(pf):
        size = len(pf[app]) * c[app]
        keep = math.floor(size + 1e-12)
        if rng.random() < size - keep:
            keep += 1
        kept = keep_best_locality(sorted(pf[app]), keep, position)
        if kept:
            granted[app] = kept
    used = frozenset().union(*granted.values()) if granted else frozenset()
    return AuctionOutcome(
        pf=pf,
        hidden_payment=c,
        granted=granted,
        leftover=offered - used,
        pf_rho=pf_rho,
        solves=solves,
    )
