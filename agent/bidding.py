"""Offer -> bid table (paper 4.2.2 step 3, 4.3; mechanism D7).

The paper's agents compute rho for "all possible subsets" of the offer; that is 2^n rows. We build
the rows an app would actually want instead. For each useful GPU count k up to the app's remaining
demand and for each locality level (D1) we take the best-placed k GPUs inside each container of
that level -- one slot, one machine, one rack, the whole offer -- filling the fullest slots (then
machines, then racks) first, so every candidate has the best locality its container allows.

Rows with the same shape (``agent.placement.canonical_shape`` of held + won GPUs) have the same rho,
so rho is computed once per shape. Of the same-count, same-level candidates we keep up to
``alternatives`` in distinct containers: the best one (next to GPUs the app already holds, then the
tightest fit, against fragmentation), then the others next to held GPUs, then the rest in an order
of the app's own (``salt``, the app's name) whatever their fit. Apps that want the same thing thus
list different containers, so their bids cover the offer and the auction can give each its own
machine instead of all naming the same few (D7, D19).
Rack and spread candidates come twice: fullest machines first, and once more from only the machines
too small to host k alone, so an app can say what it would do with the fragments and leave a
consolidated machine to an app that needs it more. Rows no better than ``rho_old`` are dropped:
the auction could never pick them. A GPU count whose best conceivable placement (every job at its
least slowdown, no restart) is no better than ``rho_old`` is skipped before its candidates are
built: on a 1,024-GPU, 150-app run 81% of the rows computed lay in such counts.

In an offer of at most ``SINGLE_ROWS`` (32) GPUs, every GPU is also a 1-GPU row of its own (D18).
The containers above always start with their lowest-numbered GPU, so before that every app's 1-GPU
rows named the same first GPU of each slot: on testbed-64/4, 8 free GPUs in 4 slots gave all
bidders the same 4 single GPUs, six starving apps could not all be served, and D8's zero hidden
payment starved the worst-off one. With every GPU named, any contenders that value one more GPU
can all be served (Hall's condition). Bigger offers get no extra rows: 32 single GPUs per bidder
made the service benchmark's 500-app rounds about 2.5 times slower (D18).

Size bound: counts are 1..min(remaining demand, offered) when that is at most 16, else 1..8 and
then every power of two and 1.5 times a power of two, plus the full remaining demand (at most 18
counts for any demand up to 256 GPUs). Per count there are at most ``alternatives`` rows for each
of the slot and machine levels, 2 x ``alternatives`` rack rows, 2 spread rows and one row of the
app's previous GPUs: with the default 3, at most 15 rows per count, plus up to 32 single GPUs
in a small offer, plus the app's previous GPUs as a row when their number is not a useful count
(D10, D17): at most 272 rows for a demand of 16 and 303 for any demand up to 256.
"""

from __future__ import annotations

import bisect
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from agent.appsched import AppScheduler
from agent.contention_pricing import ContentionPricing, current_jobs, quiet_sets
from agent.fairness import TimeLeftCache, finish_time_fairness, ideal_times, least_time_left
from agent.placement import Position
from protos.messages import BidTable, Offer

DEFAULT_ALTERNATIVES = 3
SINGLE_ROWS = 32  # D18: offers of at most this many GPUs list each GPU as a 1-GPU row


def useful_counts(remaining: int) -> list[int]:
    """GPU counts worth a row (see the module docstring for the bound)."""
    if remaining <= 16:
        return list(range(1, remaining + 1))
    counts = set(range(1, 9))
    p = 8
    while p <= remaining:
        counts.update(c for c in (p, p + p // 2) if c <= remaining)
        p *= 2
    counts.add(remaining)
    return sorted(counts)


def _take(groups: Sequence[list[str]], k: int) -> list[str]:
    """k GPUs from ``groups`` (lists of GPU ids), biggest groups first."""
    out: list[str] = []
    for g in sorted(groups, key=len, reverse=True):
        out.extend(g[: k - len(out)])
        if len(out) == k:
            break
    return out


class _OfferShape:
    """The offer's free GPUs grouped by slot, machine and rack, with picking helpers.

    A pick depends only on the offer, not on the app, so each is made once per round and shared by
    every bidder (the shape itself is shared, ``_offer_shape``)."""

    def __init__(self, gpus: Mapping[str, Position]):
        self.slots: dict[tuple[str, str, str], list[str]] = {}
        for gid in sorted(gpus):
            self.slots.setdefault(gpus[gid], []).append(gid)
        self.machines: dict[tuple[str, str], list[tuple[str, str, str]]] = {}
        for slot in self.slots:
            self.machines.setdefault(slot[:2], []).append(slot)
        self.racks: dict[str, list[tuple[str, str]]] = {}
        for machine in self.machines:
            self.racks.setdefault(machine[0], []).append(machine)
        self.slot_free = {s: len(g) for s, g in self.slots.items()}
        self.machine_free = {m: sum(len(self.slots[s]) for s in ss) for m, ss in self.machines.items()}
        self.rack_free = {r: sum(self.machine_free[m] for m in ms) for r, ms in self.racks.items()}
        self._picks: dict[tuple, tuple[str, ...]] = {}
        self._containers: dict[str, _Containers] = {}

    def pick_machine(self, machine: tuple[str, str], k: int) -> tuple[str, ...]:
        key = ("machine", machine, k)
        got = self._picks.get(key)
        if got is None:
            got = self._picks[key] = tuple(_take([self.slots[s] for s in self.machines[machine]], k))
        return got

    def pick_rack(self, rack: str, k: int, below: int | None = None) -> tuple[str, ...]:
        """k GPUs of the rack, fullest machines first; with ``below``, only from machines with
        fewer than ``below`` free GPUs (leaving the machines that could host k alone to others)."""
        key = ("rack", rack, k, below)
        got = self._picks.get(key)
        if got is None:
            out: list[str] = []
            machines = [m for m in self.racks[rack] if below is None or self.machine_free[m] < below]
            for m in sorted(machines, key=lambda m: -self.machine_free[m]):
                out.extend(self.pick_machine(m, min(k - len(out), self.machine_free[m])))
                if len(out) == k:
                    break
            got = self._picks[key] = tuple(out)
        return got

    def pick_spread(self, k: int, below: int | None = None) -> tuple[str, ...]:
        key = ("spread", k, below)
        got = self._picks.get(key)
        if got is None:
            out: list[str] = []
            for r in sorted(self.racks, key=lambda r: -self.rack_free[r]):
                out.extend(self.pick_rack(r, k - len(out), below))
                if len(out) == k:
                    break
            got = self._picks[key] = tuple(out)
        return got

    def level(self, name: str, near: frozenset, salt: str) -> _Level:
        """The ``name`` level's containers ("slot", "machine" or "rack") in one app's order (D19)."""
        containers = self._containers.get(name)
        if containers is None:
            free = {"slot": self.slot_free, "machine": self.machine_free, "rack": self.rack_free}[name]
            containers = self._containers[name] = _Containers(free)
        return _Level(containers, near, salt)


_last_shape: tuple = (None, None)  # (the offer's read-only GPU mapping, its _OfferShape)


def _offer_shape(gpus: Mapping[str, Position]) -> _OfferShape:
    """The offer's shape, built once per round: a round hands every bidder the same read-only
    mapping of its free GPUs (``types.MappingProxyType``), so the shape built for one bidder serves
    the others. A mutable mapping could change between calls and is shaped each time."""
    global _last_shape
    if not isinstance(gpus, MappingProxyType):
        return _OfferShape(gpus)
    last = _last_shape
    if last[0] is gpus:
        return last[1]
    shape = _OfferShape(gpus)
    _last_shape = (gpus, shape)
    return shape


class _Level:
    """One level's containers (slots, machines or racks of the offer) ranked for one app (D7, D19).

    For a GPU count ``need``, ``ranked`` gives up to ``alternatives`` containers with room for it:
    the best one -- next to held GPUs, then the tightest fit -- and after it the others next to
    held GPUs, then the rest in the app's own order, whatever their fit. The app's order is the
    crc32 of "<salt>|<container>", ties (which a crc can have) by the container. Ranking every
    alternative by fit made all apps name the same few containers whenever one fit was tighter than
    the rest (D19). Containers are numbered in their sorted order (``_Containers``, shared by the
    round's bidders), so the order is one sort of integers per level and bid, and each GPU count
    walks it instead of filtering and ranking every container again for each of up to 18 counts."""

    def __init__(self, level: _Containers, near: frozenset, salt: str):
        if salt:
            start = zlib.crc32(f"{salt}|".encode())
            self.hash = [zlib.crc32(label, start) for label in level.labels]
            order = sorted(range(len(self.hash)), key=self.hash.__getitem__)
        else:
            self.hash = [0] * len(level.labels)
            order = list(range(len(self.hash)))
        self.level = level
        self.near_set = frozenset(level.index[c] for c in near)
        self.near = [i for i in order if i in self.near_set] if near else []
        self.far = [i for i in order if i not in self.near_set] if near else order
        self._far_first: dict[int, int | None] = {}

    def _best(self, need: int) -> int | None:
        free, hash_ = self.level.free, self.hash
        near = [i for i in self.near if free[i] >= need]
        if near:
            return min(near, key=lambda i: (free[i], hash_[i], i))
        sizes = self.level.sizes
        for size in sizes[bisect.bisect_left(sizes, need):]:
            if size not in self._far_first:
                same = self.level.by_size[size]
                if self.near_set:
                    same = [i for i in same if i not in self.near_set]
                self._far_first[size] = min(same, key=hash_.__getitem__) if same else None
            first = self._far_first[size]
            if first is not None:
                return first
        return None

    def ranked(self, need: int, alternatives: int = 1) -> list:
        best = self._best(need) if alternatives >= 1 else None
        if best is None:
            return []
        out, free = [best], self.level.free
        for group in (self.near, self.far):
            for i in group:
                if len(out) == alternatives:
                    break
                if free[i] >= need and i != best:
                    out.append(i)
        return [self.level.containers[i] for i in out]


class _Containers:
    """One level of the offer's containers, numbered in sorted order, with their free GPUs and the
    bytes each app's hash reads (D19); built once per round."""

    def __init__(self, free: Mapping):
        self.containers = sorted(free)
        self.index = {c: i for i, c in enumerate(self.containers)}
        self.free = [free[c] for c in self.containers]
        self.labels = [f"{c}".encode() for c in self.containers]
        self.by_size: dict[int, list[int]] = {}
        for i, n in enumerate(self.free):
            self.by_size.setdefault(n, []).append(i)
        self.sizes = sorted(self.by_size)


def candidate_sets(
    offer_gpus: Mapping[str, Position],
    held: Mapping[str, Position],
    counts: Sequence[int],
    alternatives: int = DEFAULT_ALTERNATIVES,
    previous: Mapping[str, Position] | None = None,
    salt: str = "",
    single_rows: int | None = None,
) -> list[frozenset[str]]:
    """The GPU subsets worth bidding on, best locality first within each container (D1, D7).

    ``previous`` are the app's GPUs whose lease ran out at this round: winning them back keeps its
    jobs running without a restart (D10, D11), so for each count they come first, as a candidate of
    their own, and their machines and racks count as near."""
    shape = _offer_shape(offer_gpus)
    mine = {g: p for g, p in (previous or {}).items() if g in offer_gpus}
    near_machines = {p[:2] for p in held.values()} | {p[:2] for p in mine.values()}
    near_racks = {p[0] for p in held.values()} | {p[0] for p in mine.values()}
    mine_shape = _OfferShape(mine) if mine else None
    seen: set[frozenset[str]] = set()
    out: list[frozenset[str]] = []

    def add(gids: Sequence[str]) -> None:
        fs = frozenset(gids)
        if fs not in seen:
            seen.add(fs)
            out.append(fs)

    slots = shape.level("slot", frozenset(s for m in near_machines for s in shape.machines.get(m, ())), salt)
    machines = shape.level("machine", frozenset(m for m in near_machines if m in shape.machine_free), salt)
    racks = shape.level("rack", frozenset(r for r in near_racks if r in shape.rack_free), salt)
    total = len(offer_gpus)
    if single_rows is None:
        single_rows = SINGLE_ROWS
    for k in counts:
        if k > total:
            break
        if mine_shape is not None and k <= len(mine):
            add(mine_shape.pick_spread(k))
        for s in slots.ranked(k, alternatives):
            add(shape.slots[s][:k])
        for m in machines.ranked(k, alternatives):
            add(shape.pick_machine(m, k))
        for r in racks.ranked(k, alternatives):
            add(shape.pick_rack(r, k))
            fragments = shape.pick_rack(r, k, below=k)
            if len(fragments) == k:
                add(fragments)
        add(shape.pick_spread(k))
        fragments = shape.pick_spread(k, below=k)
        if len(fragments) == k:
            add(fragments)
        if k == 1 and total <= single_rows:
            for g in sorted(offer_gpus):
                add([g])
    return out


def make_bid(
    app: AppScheduler,
    offer: Offer,
    held: Mapping[str, Position] | None = None,
    *,
    alternatives: int = DEFAULT_ALTERNATIVES,
    time_left: Callable[[Sequence[Position]], float] | None = None,
    salt: str = "",
    restart_s: float = 0.0,
    contention: ContentionPricing | None = None,
) -> BidTable:
    """The app's bid table for ``offer`` (D7): rho_old plus one row per useful candidate subset.

    ``time_left`` gives the app's remaining time under an allocation; an agent passes its
    ``TimeLeftCache`` so rounds reuse what is unchanged (``AppScheduler.version``). ``salt`` (the
    app's name) orders equally good containers the app's own way. ``restart_s`` is what a restart
    costs the app (D11, D17): an allocation other than the GPUs it runs on now (what it holds plus
    its GPUs whose lease just ran out) moves its jobs, so that allocation's rho carries one restart;
    winning back exactly what it runs on carries none. With ``contention`` (D36), each allocation's
    time left is divided by the lowest contention ratio its jobs would run at there, next to the
    offer's neighbourhood and each other (``agent.contention_pricing``)."""
    held = dict(offer.held if held is None else held)
    held_positions = list(held.values())
    left_of = time_left or TimeLeftCache(app)
    running = frozenset(held) | frozenset(offer.previous)

    pricing = contention
    t_id = ideal_times(app, n_avg=offer.n_avg, cluster_size=offer.cluster_size)
    jobs = current_jobs(app, held_positions) if pricing is not None else []

    left_on_top = left_of.on_top(held_positions) if isinstance(left_of, TimeLeftCache) else None

    def rho(extra: list[Position], gpus: frozenset[str]) -> float:
        """rho of holding the held GPUs plus ``extra`` (``gpus`` by id)."""
        left = left_on_top(extra) if left_on_top is not None else left_of(held_positions + extra)
        if pricing is not None:
            left = pricing.time_left(left, jobs, held_positions + extra, offer.neighbourhood)
        if restart_s and running and gpus != running:
            left += restart_s
        return finish_time_fairness(  # with ``left`` given, the positions are not read
            app, (), now=offer.now, n_avg=offer.n_avg, cluster_size=offer.cluster_size, left=left, t_id=t_id
        )

    rho_old = rho([], frozenset(held))
    remaining = app.demand_now() - len(held)
    if remaining <= 0 or not offer.gpus:
        return BidTable(rho_old, ())
    rows: list[tuple[frozenset[str], float]] = []
    counts = useful_counts(min(remaining, len(offer.gpus)))
    if rho_old != math.inf and not app.work_depends_on_allocation:  # against infinity every count may win
        least_of = left_of.least if isinstance(left_of, TimeLeftCache) else (lambda n: least_time_left(app, n))

        def may_beat_rho_old(k: int) -> bool:
            best = finish_time_fairness(app, (), now=offer.now, n_avg=offer.n_avg, cluster_size=offer.cluster_size,
                                        left=least_of(len(held) + k), t_id=t_id)
            return best < rho_old

        counts = [k for k in counts if may_beat_rho_old(k)]
        if not counts:
            return BidTable(rho_old, ())
    candidates = candidate_sets(offer.gpus, held, counts, alternatives, offer.previous, salt)
    if pricing is not None:
        known = set(candidates)
        candidates += [c for c in quiet_sets(offer.gpus, offer.neighbourhood, counts) if c not in known]
    mine = frozenset(g for g in offer.previous if g in offer.gpus)
    if mine and len(mine) <= remaining and len(mine) not in counts:
        # D10, D17: winning back exactly what it runs on is the one row without a restart, whatever
        # its size; useful_counts skips sizes above 16 (10, 13, 20, ...), so it is added here
        candidates.append(mine)
    for gids in candidates:
        value = rho([offer.gpus[g] for g in gids], frozenset(held) | gids)
        if value < rho_old:
            rows.append((gids, value))
    return BidTable(rho_old, tuple(rows))
