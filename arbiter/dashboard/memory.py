"""An in-memory dashboard source: a feed that a round driver pushes into (the live arbiter, a
recorded run replayed from its file) and a source the page reads.

It keeps the current state (leases, apps), the latest rounds and events, the fairness point of every
round, each app's rho over time, and a timeline that can give back the map as it was after any kept
round (the time slider): each round's changes are stored, with a full copy every ``keyframe_every``
rounds, so going to round r costs at most that many rounds of changes.

Every change is written once as JSON and handed to each live subscriber; a subscriber that falls
more than ``queue_max`` changes behind is told to read everything again (``resync``) instead of
holding the arbiter's memory.
"""

from __future__ import annotations

import asyncio
import bisect
import json
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from arbiter.dashboard.model import (
    AppRound,
    AppsView,
    AppView,
    ClusterLayout,
    ClusterView,
    EventView,
    FairnessPoint,
    FairnessSeries,
    GpuView,
    LeaseView,
    RoundBrief,
    RoundView,
    Timeline,
    app_round,
    brief,
    to_json,
)
from arbiter.dashboard.source import Change, NotKept
from arbiter.dashboard.views import fairness_point, fairness_series

#: settings whose names hold one of these are never shown: the page shows no credential
SECRET_WORDS = ("token", "secret", "password", "credential", "key")


def shown_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings without anything that looks like a credential."""
    return {k: v for k, v in settings.items() if not any(w in k.lower() for w in SECRET_WORDS)}


@dataclass(frozen=True)
class _Frame:
    round_id: int
    now: float
    leases: Mapping[str, LeaseView | None]  # changes since the frame before
    apps: Mapping[str, AppView | None]


class _Timeline:
    """The state after each kept round, as changes with a full copy every ``every`` frames."""

    def __init__(self, every: int, kept: int | None):
        self.every = every
        self.kept = kept
        self.frames: list[_Frame] = []
        self.ids: list[int] = []
        self.first = 0  # absolute number of frames[0]
        self.keys: dict[int, tuple[dict[str, LeaseView], dict[str, AppView]]] = {}  # absolute number -> copy

    def add(self, frame: _Frame, leases: Mapping[str, LeaseView], apps: Mapping[str, AppView]) -> None:
        if self.ids and frame.round_id <= self.ids[-1]:
            raise ValueError(f"round {frame.round_id} after round {self.ids[-1]}: rounds must be pushed in order")
        n = self.first + len(self.frames)
        self.frames.append(frame)
        self.ids.append(frame.round_id)
        if n % self.every == 0:
            self.keys[n] = (dict(leases), dict(apps))
        if self.kept is not None and len(self.frames) > self.kept + self.every:
            drop = self.every  # whole blocks, so the first frame kept always has a full copy
            for k in range(self.first, self.first + drop):
                self.keys.pop(k, None)
            del self.frames[:drop], self.ids[:drop]
            self.first += drop

    def at(self, round_id: int) -> tuple[_Frame, dict[str, LeaseView], dict[str, AppView]]:
        i = bisect.bisect_left(self.ids, round_id)
        if i == len(self.ids) or self.ids[i] != round_id:
            span = f"rounds {self.ids[0]}-{self.ids[-1]}" if self.ids else "no rounds"
            raise NotKept(f"round {round_id} is not in the history ({span} kept)")
        n = self.first + i
        base = n - n % self.every  # trimming drops whole blocks, so every kept block has its copy
        leases, apps = (dict(x) for x in self.keys[base])
        for frame in self.frames[base - self.first + 1: i + 1]:
            _patch(leases, frame.leases)
            _patch(apps, frame.apps)
        return self.frames[i], leases, apps

    def rounds(self) -> tuple[tuple[int, float], ...]:
        return tuple((f.round_id, f.now) for f in self.frames)


def _patch(state: dict, changes: Mapping) -> None:
    for k, v in changes.items():
        if v is None:
            state.pop(k, None)
        else:
            state[k] = v


class _Subscriber:
    def __init__(self, source: MemorySource, queue_max: int):
        self._source = source
        self._queue: asyncio.Queue[Change] = asyncio.Queue()
        self._max = queue_max
        self._behind = False

    def put(self, change: Change) -> None:
        if self._behind:
            return
        if self._queue.qsize() >= self._max:
            self._behind = True
            while not self._queue.empty():
                self._queue.get_nowait()
            self._queue.put_nowait(Change("resync", "{}"))
            return
        self._queue.put_nowait(change)

    async def get(self) -> Change:
        change = await self._queue.get()
        if change.kind == "resync":
            self._behind = False
        return change

    def close(self) -> None:
        self._source._subscribers.discard(self)


class MemorySource:
    """Feed it (``set_layout``, ``set_settings``, ``apply``, ``push_round``, ``push_event``) and
    serve it (``arbiter.dashboard.server.start``). ``None`` for a ``*_kept`` keeps everything (a
    recorded run); the latest ``gone_kept`` apps that left stay readable (``app``, ``app_rounds``)."""

    def __init__(self, *, title: str = "Themis", mode: str = "live", meta: Mapping[str, Any] | None = None,
                 rounds_kept: int | None = 2000,
                 events_kept: int | None = 10_000, history_kept: int = 512, gone_kept: int = 1000,
                 keyframe_every: int = 64,
                 queue_max: int = 1000):
        if keyframe_every < 1:
            raise ValueError(f"keyframe_every must be at least 1, got {keyframe_every}")
        self.title = title
        self.mode = mode
        self.meta = shown_settings(meta or {})
        self.layout = ClusterLayout("", ())
        self._settings: dict[str, Any] = {}
        self.now = 0.0
        self._leases: dict[str, LeaseView] = {}
        self._apps: dict[str, AppView] = {}
        self._rho: dict[str, float] = {}
        self._history: dict[str, deque[tuple[float, float]]] = {}
        self._history_kept = history_kept
        self._gone: OrderedDict[str, AppView] = OrderedDict()  # apps that left, latest last, with their history
        self._gone_kept = gone_kept
        self._rounds: dict[int, RoundView] = {}
        self._round_ids: deque[int] = deque()
        self._rounds_kept = rounds_kept
        self._events: deque[EventView] = deque(maxlen=events_kept)
        self._seq = 0
        self._points: deque[FairnessPoint] = deque(maxlen=rounds_kept)
        self._timeline = _Timeline(keyframe_every, rounds_kept)
        self._pending_leases: dict[str, LeaseView | None] = {}
        self._pending_apps: dict[str, AppView | None] = {}
        self._subscribers: set[_Subscriber] = set()
        self._queue_max = queue_max

    # -- the feed ---------------------------------------------------------------------------

    def set_layout(self, layout: ClusterLayout) -> None:
        self.layout = layout
        self._publish("layout", {})

    def set_settings(self, settings: Mapping[str, Any]) -> None:
        self._settings = shown_settings(settings)
        self._publish("settings", {})

    def apply(self, now: float, leases: Mapping[str, LeaseView | None], apps: Mapping[str, AppView | None]) -> None:
        self.now = max(self.now, now)
        for app, view in apps.items():
            old = self._apps.get(app)
            if view is None and old is not None:
                self._rho.pop(app, None)
                self._gone[app] = replace(old, state="gone", connected=False, held=0)
                while len(self._gone) > self._gone_kept:
                    self._history.pop(self._gone.popitem(last=False)[0], None)
            elif view is not None:
                self._gone.pop(app, None)
        _patch(self._leases, leases)
        _patch(self._apps, apps)
        self._pending_leases.update(leases)
        self._pending_apps.update(apps)
        if leases or apps:
            self._publish("state", {"now": now, "leases": leases, "apps": apps})

    def push_round(self, view: RoundView) -> None:
        self.now = max(self.now, view.now)
        for r in view.ranked:
            if r.app in self._apps:
                self._rho[r.app] = r.rho
                self._history.setdefault(r.app, deque(maxlen=self._history_kept)).append((view.now, r.rho))
        self._rounds[view.round_id] = view
        self._round_ids.append(view.round_id)
        if self._rounds_kept is not None:
            while len(self._round_ids) > self._rounds_kept:
                self._rounds.pop(self._round_ids.popleft(), None)
        held: dict[str, int] = {}
        for lease in self._leases.values():
            held[lease.app] = held.get(lease.app, 0) + 1
        rho = {a: r for a, r in self._rho.items() if a in self._apps}
        self._points.append(fairness_point(view.round_id, view.now, rho, held, self.layout.size))
        self._timeline.add(_Frame(view.round_id, view.now, self._pending_leases, self._pending_apps),
                           self._leases, self._apps)
        self._pending_leases, self._pending_apps = {}, {}
        self._publish("round", brief(view))

    def push_event(self, event: EventView) -> None:
        self._seq += 1
        event = replace(event, seq=self._seq)
        self._events.append(event)
        self._publish("event", event)

    # -- live changes -----------------------------------------------------------------------

    def subscribe(self) -> _Subscriber:
        sub = _Subscriber(self, self._queue_max)
        self._subscribers.add(sub)
        return sub

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def _publish(self, kind: str, payload: Any) -> None:
        if not self._subscribers:
            return
        change = Change(kind, json.dumps(to_json(payload), separators=(",", ":")))
        for sub in list(self._subscribers):
            sub.put(change)

    # -- the source -------------------------------------------------------------------------

    def about(self) -> Mapping[str, Any]:
        return {"title": self.title, "mode": self.mode, "meta": self.meta}

    def cluster(self, at: int | None = None) -> ClusterView:
        now, leases = self.now, self._leases
        if at is not None:
            frame, leases, _ = self._timeline.at(at)
            now = frame.now
        drained = set(self.layout.drained)
        racks: dict[str, dict[str, None]] = {}
        gpus = []
        for g in self.layout.gpus:
            racks.setdefault(g.rack, {})[g.machine] = None
            lease = leases.get(g.id)
            gpus.append(GpuView(g.id, g.rack, g.machine, g.slot, lease.app if lease else None,
                                lease.expires_at if lease else None, lease.round_id if lease else None,
                                g.machine in drained))
        lease_s = self._settings.get("lease_s")
        return ClusterView(self.layout.name, now, at, float(lease_s) if isinstance(lease_s, (int, float)) else None,
                           tuple(gpus), tuple((r, tuple(m)) for r, m in racks.items()))

    def apps(self, at: int | None = None, history: int = 32) -> AppsView:
        if at is not None:
            frame, _, apps = self._timeline.at(at)
            return AppsView(frame.now, at, tuple(apps[a] for a in sorted(apps)))
        out = []
        for name in sorted(self._apps):
            past = self._history.get(name, ())
            points = tuple(list(past)[-history:]) if history > 0 else ()
            out.append(replace(self._apps[name], rho_history=points))
        return AppsView(self.now, None, tuple(out))

    def app(self, name: str, history: int = 100_000) -> AppView:
        view = self._apps.get(name) or self._gone.get(name)
        if view is None:
            raise NotKept(f"no app {name!r} is known")
        past = list(self._history.get(name, ()))
        return replace(view, rho_history=tuple(past[-history:]) if history > 0 else ())

    def app_rounds(self, name: str, limit: int = 50, before: int | None = None) -> tuple[AppRound, ...]:
        out: list[AppRound] = []
        for rid in reversed(self._round_ids):
            if len(out) >= limit:
                break
            if before is not None and rid >= before:
                continue
            mine = app_round(self._rounds[rid], name)
            if mine is not None:
                out.append(mine)
        return tuple(out)

    def rounds(self, limit: int = 50, before: int | None = None, app: str | None = None) -> tuple[RoundBrief, ...]:
        out: list[RoundBrief] = []
        for rid in reversed(self._round_ids):
            if len(out) >= limit:
                break
            if before is not None and rid >= before:
                continue
            view = self._rounds[rid]
            if app is not None and not any(r.app == app for r in view.ranked) \
                    and not any(p.app == app for p in view.placed):
                continue
            out.append(brief(view))
        return tuple(out)

    def round(self, round_id: int) -> RoundView:
        view = self._rounds.get(round_id)
        if view is None:
            span = f"rounds {self._round_ids[0]}-{self._round_ids[-1]}" if self._round_ids else "no rounds"
            raise NotKept(f"round {round_id} is not kept ({span} are)")
        return view

    def fairness(self, points: int = 2000) -> FairnessSeries:
        return fairness_series(list(self._points), points)

    def events(self, limit: int = 100, before: int | None = None, kinds: frozenset[str] | None = None,
               app: str | None = None) -> tuple[EventView, ...]:
        out: list[EventView] = []
        for event in reversed(self._events):
            if len(out) >= limit:
                break
            if (before is not None and event.seq >= before) or (kinds and event.kind not in kinds) \
                    or (app is not None and event.app != app):
                continue
            out.append(event)
        return tuple(out)

    def settings(self) -> Mapping[str, Any]:
        return dict(self._settings)

    def timeline(self) -> Timeline:
        return Timeline(self._timeline.rounds())
