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
the auction could never pick them.

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
in a small offer: at most 272 rows for a demand of 16 and 302 for any demand up to 256.
"""

from __future__ import annotations

import functools
import heapq
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType

from agent.appsched import AppScheduler
from agent.fairness import TimeLeftCache, finish_time_fairness
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
    """The offer's free GPUs grouped by slot, machine and rack, with picking helpers."""

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
        self.machine_free = {m: sum(len(self.slots[s]) for s in ss) for m, ss in self.machines.items()}
        self.rack_free = {r: sum(self.machine_free[m] for m in ms) for r, ms in self.racks.items()}

    def pick_machine(self, machine: tuple[str, str], k: int) -> list[str]:
        return _take([self.slots[s] for s in self.machines[machine]], k)

    def pick_rack(self, rack: str, k: int, below: int | None = None) -> list[str]:
        """k GPUs of the rack, fullest machines first; with ``below``, only from machines with
        fewer than ``below`` free GPUs (leaving the machines that could host k alone to others)."""
        out: list[str] = []
        machines = [m for m in self.racks[rack] if below is None or self.machine_free[m] < below]
        for m in sorted(machines, key=lambda m: -self.machine_free[m]):
            out.extend(self.pick_machine(m, min(k - len(out), self.machine_free[m])))
            if len(out) == k:
                break
        return out

    def pick_spread(self, k: int, below: int | None = None) -> list[str]:
        out: list[str] = []
        for r in sorted(self.racks, key=lambda r: -self.rack_free[r]):
            out.extend(self.pick_rack(r, k - len(out), below))
            if len(out) == k:
                break
        return out


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


def _ranked(containers: Mapping, need: int, rank: Mapping, alternatives: int = 1) -> list:
    """Up to ``alternatives`` containers with room for ``need`` (D7, D19): the best one -- next to
    held GPUs, then the tightest fit -- and after it the others next to held GPUs, then the rest in
    the app's own order, whatever their fit. ``rank`` gives each container (not near, the app's
    hash of it, the container): ``_rank``. Ranking every alternative by fit made all apps name the
    same few containers whenever one fit was tighter than the rest (D19)."""
    fits = [c for c, free in containers.items() if free >= need]
    if not fits or alternatives < 1:
        return []
    best = min(fits, key=lambda c: (rank[c][0], containers[c], rank[c][1], c))
    if alternatives == 1:
        return [best]
    rest = heapq.nsmallest(alternatives - 1, (c for c in fits if c != best), key=rank.__getitem__)
    return [best, *rest]


def _rank(containers: Iterable, near: set, key_of: Callable, salt: str) -> dict:
    """Each container's place in the app's own order (D19): (not next to held GPUs, a hash of the
    salt and the container, the container). Computed once per level and bid, not per GPU count."""
    start = zlib.crc32(f"{salt}|".encode()) if salt else None
    return {c: (key_of(c) not in near, 0 if start is None else zlib.crc32(_label(c), start), c) for c in containers}


@functools.lru_cache(maxsize=65536)
def _label(container) -> bytes:
    """A container's bytes in D19's hash, crc32 of "<salt>|<container>", which ``_rank`` continues
    from the crc of "<salt>|" so the salt is hashed once per bid."""
    return f"{container}".encode()


def candidate_sets(
    offer_gpus: Mapping[str, Position],
    held: Mapping[str, Position],
    counts: Sequence[int],
    alternatives: int = DEFAULT_ALTERNATIVES,
    previous: Mapping[str, Position] | None = None,
    salt: str = "",
    single_rows: int = SINGLE_ROWS,
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
    slot_free = {s: len(g) for s, g in shape.slots.items()}
    seen: set[frozenset[str]] = set()
    out: list[frozenset[str]] = []

    def add(gids: list[str]) -> None:
        fs = frozenset(gids)
        if fs not in seen:
            seen.add(fs)
            out.append(fs)

    slot_rank = _rank(slot_free, near_machines, lambda s: s[:2], salt)
    machine_rank = _rank(shape.machine_free, near_machines, lambda m: m, salt)
    rack_rank = _rank(shape.rack_free, near_racks, lambda r: r, salt)
    total = len(offer_gpus)
    for k in counts:
        if k > total:
            break
        if mine_shape is not None and k <= len(mine):
            add(mine_shape.pick_spread(k))
        for s in _ranked(slot_free, k, slot_rank, alternatives):
            add(shape.slots[s][:k])
        for m in _ranked(shape.machine_free, k, machine_rank, alternatives):
            add(shape.pick_machine(m, k))
        for r in _ranked(shape.rack_free, k, rack_rank, alternatives):
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
) -> BidTable:
    """The app's bid table for ``offer`` (D7): rho_old plus one row per useful candidate subset.

    ``time_left`` gives the app's remaining time under an allocation; an agent passes its
    ``TimeLeftCache`` so rounds reuse what is unchanged (``AppScheduler.version``). ``salt`` (the
    app's name) orders equally good containers the app's own way. ``restart_s`` is what a restart
    costs the app (D11, D17): an allocation other than the GPUs it runs on now (what it holds plus
    its GPUs whose lease just ran out) moves its jobs, so that allocation's rho carries one restart;
    winning back exactly what it runs on carries none."""
    held = dict(offer.held if held is None else held)
    held_positions = list(held.values())
    left_of = time_left or TimeLeftCache(app)
    running = frozenset(held) | frozenset(offer.previous)

    def rho(positions: list[Position], gpus: frozenset[str]) -> float:
        left = left_of(positions)
        if restart_s and running and gpus != running:
            left += restart_s
        return finish_time_fairness(
            app, positions, now=offer.now, n_avg=offer.n_avg, cluster_size=offer.cluster_size, left=left
        )

    rho_old = rho(held_positions, frozenset(held))
    remaining = app.demand_now() - len(held)
    if remaining <= 0 or not offer.gpus:
        return BidTable(rho_old, ())
    rows: list[tuple[frozenset[str], float]] = []
    counts = useful_counts(min(remaining, len(offer.gpus)))
    for gids in candidate_sets(offer.gpus, held, counts, alternatives, offer.previous, salt):
        value = rho(held_positions + [offer.gpus[g] for g in gids], frozenset(held) | gids)
        if value < rho_old:
            rows.append((gids, value))
    return BidTable(rho_old, tuple(rows))
