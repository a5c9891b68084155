"""The dashboard's view values: what a person sees of the cluster, the apps, every round and the
events, as frozen dataclasses that turn into JSON (the versioned API, ``/api/v1``) and back (a
recorded run, ``arbiter.dashboard.recording``).

Nothing here reads an engine: :mod:`arbiter.dashboard.views` builds these values from the round
engine's (``RoundResult``, ``AuctionOutcome``, the lease table), so a live arbiter and a simulated
run show the same thing. JSON has no infinity, and rho is infinite for an app that holds nothing
(D13): an infinite number is written as the string ``"inf"``, NaN as ``null``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

API_VERSION = 1
INF = "inf"

#: event kinds (``EventView.kind``): what happened to whom
EVENT_KINDS = ("grant", "expiry", "revocation", "refusal", "release", "arrival", "departure", "connect",
               "disconnect", "admission")

#: how a round's GPUs were placed (``arbiter.rounds.Grant.source``): the auction's lottery (D8, D15), the
#: unserved bidders' own rows in rank order (D9's first tier, D14), the rest in rank order (D9, D26),
#: or a baseline policy's own order
TIERS = ("auction", "queue", "leftover", "policy")


@dataclass(frozen=True, slots=True)
class GpuPlace:
    """A GPU of the layout: where it sits (D1)."""

    id: str
    rack: str
    machine: str
    slot: str


@dataclass(frozen=True, slots=True)
class ClusterLayout:
    """The cluster's shape, racks then machines then GPUs, in the cluster file's order."""

    name: str
    gpus: tuple[GpuPlace, ...]
    drained: tuple[str, ...] = ()  # machines that get no new grants

    @property
    def size(self) -> int:
        return len(self.gpus)


@dataclass(frozen=True, slots=True)
class LeaseView:
    """Who holds a GPU, since which round, until when (D10)."""

    app: str
    expires_at: float
    granted_at: float = 0.0
    round_id: int = 0


@dataclass(frozen=True, slots=True)
class GpuView:
    id: str
    rack: str
    machine: str
    slot: str
    holder: str | None
    lease_end: float | None
    round_id: int | None = None  # the round that granted the lease
    drained: bool = False


@dataclass(frozen=True, slots=True)
class ClusterView:
    """The map: every GPU with its holder and lease end, as of ``now`` (after round ``at`` when a
    time was asked for)."""

    name: str
    now: float
    at: int | None
    lease_s: float | None
    gpus: tuple[GpuView, ...]
    racks: tuple[tuple[str, tuple[str, ...]], ...]  # (rack, its machines) in order


@dataclass(frozen=True, slots=True)
class AppView:
    """An app as the arbiter sees it. ``rho`` is its latest reported (or, ranked by measured
    slowdowns, computed) rho, infinite while it holds nothing (D13); ``rho_wait`` the waiting rho that
    orders the apps holding nothing (D13), when known; ``state`` is ``active``, ``waiting`` (not
    admitted yet, D33), ``idle`` (no agent and nothing held for a while) or ``gone`` (it left)."""

    app: str
    model: str | None = None
    bound_model: str | None = None  # the model an admin bound it to, whose slowdowns rank it (D21)
    demand: int | None = None
    held: int = 0
    rho: float | None = None
    rho_wait: float | None = None
    connected: bool = True
    state: str = "active"
    arrived: float | None = None
    rho_history: tuple[tuple[float, float], ...] = ()  # (time, rho), oldest first (filled when served)


@dataclass(frozen=True, slots=True)
class AppsView:
    now: float
    at: int | None
    apps: tuple[AppView, ...]


@dataclass(frozen=True, slots=True)
class Ranked:
    """An app that reported in a round, in the round's rank order (D13): the offered apps in the
    order they were offered (worst off first), then the others by rho."""

    app: str
    rho: float
    rho_wait: float | None = None
    unmet: int = 0  # GPUs it wanted beyond what it held as the round opened
    offered: bool = False
    bid: bool = False  # offered, and sent a bid that was valid (D7)


@dataclass(frozen=True, slots=True)
class Contender:
    """A bidder that took part in the auction (D8, D25): its PF row, c_i (the probability it keeps
    the row; 1 - c_i is its hidden payment), its lottery draw and whether the draw won (draw < c_i,
    D15). ``admitted``: it entered the PF allocation; ``shadow``: shut out by the big smallest rows of
    contenders ranked before it (D25)."""

    app: str
    admitted: bool
    shadow: bool = False
    pf_row: tuple[str, ...] = ()
    pf_rho: float | None = None
    c: float | None = None
    draw: float | None = None
    won: bool = False
    c_bounds: tuple[float, float] | None = None  # D39: lo <= c_i <= hi where the lottery did not need c_i


@dataclass(frozen=True, slots=True)
class Placed:
    """GPUs a round gave an app, and how (``TIERS``)."""

    app: str
    tier: str
    gpus: tuple[str, ...]
    expires_at: float | None = None


@dataclass(frozen=True, slots=True)
class RoundView:
    """One round, everything a person needs to see why an app got what it got: the trigger, the
    offer, the apps in rank order with rho, the contenders with PF rows, c_i and draws, what the
    auction left and who took it, what ran out. ``seed`` is revealed once the round has closed and
    hashes to ``commitment`` (D24)."""

    round_id: int
    now: float
    trigger: str = ""
    policy: str = ""
    offered: tuple[str, ...] = ()
    ranked: tuple[Ranked, ...] = ()
    contenders: tuple[Contender, ...] = ()
    placed: tuple[Placed, ...] = ()
    auction_left: tuple[str, ...] = ()  # what the auction did not grant: D9's tiers hand it out
    idle: tuple[str, ...] = ()
    expired: tuple[tuple[str, str], ...] = ()  # (gpu, app) whose lease ran out as the round opened
    reclaimed: tuple[tuple[str, str], ...] = ()  # (gpu, app) ended early for apps holding nothing (D27)
    waiting: tuple[str, ...] = ()  # not admitted yet (D33)
    refused: Mapping[str, str] = field(default_factory=dict)  # app -> why its report or bid was refused (D7)
    seed: str = ""
    commitment: str = ""
    canonical: bool = True  # D16

    @property
    def bidders(self) -> tuple[str, ...]:
        return tuple(r.app for r in self.ranked if r.offered)


@dataclass(frozen=True, slots=True)
class RoundBrief:
    """A line of the rounds list."""

    round_id: int
    now: float
    trigger: str
    offered: int
    bidders: int
    contenders: int
    granted: int
    idle: int
    worst: str | None  # the first app in rank order
    winners: tuple[str, ...]  # contenders whose draw won


def brief(view: RoundView) -> RoundBrief:
    ranked = view.ranked
    return RoundBrief(view.round_id, view.now, view.trigger, len(view.offered), sum(r.offered for r in ranked),
                      len(view.contenders), sum(len(p.gpus) for p in view.placed), len(view.idle),
                      ranked[0].app if ranked else None, tuple(c.app for c in view.contenders if c.won))


@dataclass(frozen=True, slots=True)
class AppRound:
    """One round as one app lived it: its place in the rank (1 = worst off, D13) among ``ranked``
    apps, whether it got the offer and bid, its auction (c_i, draw, won) and what it was given."""

    round_id: int
    now: float
    trigger: str
    rank: int | None
    ranked: int
    rho: float | None
    rho_wait: float | None
    offered: bool
    bid: bool
    contender: Contender | None
    got: tuple[Placed, ...]
    refused: str | None


def app_round(view: RoundView, app: str) -> AppRound | None:
    """``app``'s part in the round, or None when it took no part (did not report, was not refused,
    got nothing)."""
    mine = next(((k, r) for k, r in enumerate(view.ranked, start=1) if r.app == app), None)
    got = tuple(p for p in view.placed if p.app == app)
    refused = view.refused.get(app)
    if mine is None and not got and refused is None:
        return None
    rank, ranked = mine if mine else (None, None)
    return AppRound(view.round_id, view.now, view.trigger, rank, len(view.ranked),
                    ranked.rho if ranked else None, ranked.rho_wait if ranked else None,
                    bool(ranked and ranked.offered), bool(ranked and ranked.bid),
                    next((c for c in view.contenders if c.app == app), None), got, refused)


@dataclass(frozen=True, slots=True)
class EventView:
    """Something that happened to an app: a grant, a lease that ran out, a revocation, a refused
    report or bid (with the reason), a release, an arrival or departure."""

    seq: int
    t: float
    kind: str
    app: str
    round_id: int | None = None
    gpus: tuple[str, ...] = ()
    reason: str = ""


@dataclass(frozen=True, slots=True)
class FairnessPoint:
    """The cluster's fairness after one round: over the apps' latest rho (apps holding nothing, at
    infinity, are counted in ``starving`` and left out of the rest), and the GPUs each app held."""

    round_id: int
    t: float
    max_rho: float | None
    p99_rho: float | None
    jain: float | None
    starving: int
    utilisation: float
    gpus: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class FairnessSeries:
    """Column-wise series for the charts; ``gpus`` per app for the ``apps`` that held the most GPU
    time, the rest summed as ``others``."""

    round_id: tuple[int, ...]
    t: tuple[float, ...]
    max_rho: tuple[float | None, ...]
    p99_rho: tuple[float | None, ...]
    jain: tuple[float | None, ...]
    starving: tuple[int, ...]
    utilisation: tuple[float, ...]
    apps: tuple[str, ...]
    gpus: tuple[tuple[int, ...], ...]  # one row per app of ``apps``, then ``others``


@dataclass(frozen=True, slots=True)
class Timeline:
    """The rounds a time slider can go to: ``(round_id, time)``, oldest first."""

    rounds: tuple[tuple[int, float], ...]


# -- JSON -----------------------------------------------------------------------------------------


def to_json(value: Any) -> Any:
    """A view value as plain JSON data: dataclasses as objects, tuples as arrays, infinities as
    ``"inf"`` / ``"-inf"``, NaN as null."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return None if math.isnan(value) else (INF if value > 0 else "-" + INF)
    if value is None or isinstance(value, (str, int)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: to_json(getattr(value, name)) for name in _field_names(type(value))}
    if isinstance(value, Mapping):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (tuple, list, frozenset, set)):
        return [to_json(v) for v in value]
    raise TypeError(f"cannot write {type(value).__name__} as JSON: {value!r}")


class BadView(ValueError):
    """JSON that is not the view it should be (a recorded run from another version, a damaged file)."""


def from_json(cls: type, data: Any, where: str = "") -> Any:
    """The view of type ``cls`` that :func:`to_json` wrote as ``data``; :class:`BadView` names the
    first field that does not fit."""
    try:
        return _decoder(cls)(data)
    except _Misfit as exc:
        path = "".join(reversed(exc.path))
        raise BadView(f"{where or cls.__name__}{path}: {exc.args[0]}") from None


class _Misfit(Exception):
    """A value that does not fit, with the path to it collected on the way out."""

    def __init__(self, message: str):
        super().__init__(message)
        self.path: list[str] = []


@cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _number(data: Any) -> float:
    if type(data) is float:
        return data
    if type(data) is int:
        return float(data)
    if data == INF:
        return math.inf
    if data == "-" + INF:
        return -math.inf
    raise _Misfit(f"expected a number, got {data!r}")


def _integer(data: Any) -> int:
    if type(data) is int:
        return data
    raise _Misfit(f"expected an integer, got {data!r}")


def _string(data: Any) -> str:
    if type(data) is str:
        # names (GPUs, apps) repeat in every round of a recorded run: one copy of each
        return sys.intern(data) if len(data) <= 64 else data
    raise _Misfit(f"expected a string, got {data!r}")


def _boolean(data: Any) -> bool:
    if type(data) is bool:
        return data
    raise _Misfit(f"expected true or false, got {data!r}")


def _names(data: Any) -> tuple[str, ...]:
    if type(data) is list and all(type(x) is str and len(x) <= 64 for x in data):
        return tuple(map(sys.intern, data))
    if type(data) is not list:
        raise _Misfit(f"expected an array, got {type(data).__name__}")
    return tuple(map(_string, data))


@cache
def _decoder(tp: Any) -> Any:
    """A function reading JSON data as ``tp``, made once per type: a recorded run has tens of
    thousands of rounds to read."""
    simple = {float: _number, int: _integer, str: _string, bool: _boolean}
    if tp in simple:
        return simple[tp]
    if tp is Any:
        return lambda data: data
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        options = [_decoder(a) for a in args if a is not type(None)]
        nullable = type(None) in args

        def union(data: Any) -> Any:
            if data is None and nullable:
                return None
            last = None
            for option in options:
                try:
                    return option(data)
                except _Misfit as exc:
                    last = exc
            raise last or _Misfit("no value")

        return union
    if origin is tuple:
        if args == (str, Ellipsis):  # GPU ids: most of a recorded run
            return _names
        if len(args) == 2 and args[1] is Ellipsis:
            item = _decoder(args[0])

            def many(data: Any) -> tuple:
                if type(data) is not list:
                    raise _Misfit(f"expected an array, got {type(data).__name__}")
                out = []
                for k, v in enumerate(data):
                    try:
                        out.append(item(v))
                    except _Misfit as exc:
                        exc.path.append(f"[{k}]")
                        raise
                return tuple(out)

            return many
        items = [_decoder(a) for a in args]

        def fixed(data: Any) -> tuple:
            if type(data) is not list or len(data) != len(items):
                raise _Misfit(f"expected an array of {len(items)}, got {data!r}")
            return tuple(f(v) for f, v in zip(items, data))

        return fixed
    if origin in (Mapping, dict) or tp is Mapping:
        value = _decoder(args[1]) if args else (lambda data: data)

        def mapping(data: Any) -> dict:
            if type(data) is not dict:
                raise _Misfit(f"expected an object, got {type(data).__name__}")
            out = {}
            for k, v in data.items():
                try:
                    out[k] = value(v)
                except _Misfit as exc:
                    exc.path.append(f".{k}")
                    raise
            return out

        return mapping
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        fields = [(f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                  for f in dataclasses.fields(tp)]
        readers = {name: _decoder(hints[name]) for name, _ in fields}
        required = [name for name, needed in fields if needed]

        def record(data: Any) -> Any:
            if type(data) is not dict:
                raise _Misfit(f"expected an object for {tp.__name__}, got {type(data).__name__}")
            values = {}
            for name, raw in data.items():
                reader = readers.get(name)
                if reader is None:
                    continue
                try:
                    values[name] = reader(raw)
                except _Misfit as exc:
                    exc.path.append(f".{name}")
                    raise
            for name in required:
                if name not in values:
                    raise _Misfit(f"missing {name!r}")
            return tp(**values)

        return record
    raise TypeError(f"no JSON reading for {tp!r}")
