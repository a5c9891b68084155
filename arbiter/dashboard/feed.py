"""A round engine, seen by the dashboard: :class:`EngineFeed` reads a ``RoundEngine``'s leases and
apps after each change and each round, and pushes what changed into a :class:`~arbiter.dashboard.source.Feed`
(a ``MemorySource`` the page reads, a ``RecordingWriter`` that keeps a simulated run).

The live arbiter and the simulator drive the same engine, so both feed the page the same way: the
service calls :meth:`EngineFeed.sync` after each committed change and :meth:`EngineFeed.after_round`
after each round; the simulator (``simulator.recording``) calls ``after_round`` after each of its
rounds. Only the changes are pushed: a 1,024-GPU cluster costs one pass over its leases per call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from arbiter.dashboard.model import AppView, EventView, LeaseView
from arbiter.dashboard.source import Feed
from arbiter.dashboard.views import layout_of, lease_view, natural, round_events, round_view
from arbiter.leases import Lease
from arbiter.rounds import RoundEngine, RoundResult


def _always(_: str) -> bool:
    return True


def _nothing(_: str) -> str | None:
    return None


class EngineFeed:
    """Pushes ``engine``'s state into ``feed``. ``model_of`` names an app's model where known;
    ``bound_model_of`` the model an admin bound it to, whose slowdowns rank it (D21); ``connected``
    whether its agent is connected (the service; True in a simulation)."""

    def __init__(self, feed: Feed, engine: RoundEngine, *, model_of: Callable[[str], str | None] = _nothing,
                 bound_model_of: Callable[[str], str | None] = _nothing,
                 connected: Callable[[str], bool] = _always):
        self.feed = feed
        self.engine = engine
        self.model_of = model_of
        self.bound_model_of = bound_model_of
        self.connected = connected
        self._leases: dict[str, Lease] = {}
        self._apps: dict[str, AppView] = {}
        self._rho: dict[str, float] = {}
        self._wait: dict[str, float] = {}
        self._layout = None

    def start(self, settings: Mapping[str, Any]) -> None:
        """The cluster's layout and the settings, then the state as it is."""
        self.layout_changed()
        self.feed.set_settings(settings)
        self.sync(self.engine.clock)

    def layout_changed(self) -> None:
        """The cluster grew or a machine was drained or resumed."""
        self._layout = layout_of(self.engine.cluster, self.engine.drained)
        self.feed.set_layout(self._layout)

    def sync(self, now: float, *, events: bool = True) -> tuple[list[str], list[str], dict[str, list[str]]]:
        """Push what changed since the last call; returns the apps that arrived, those that left and
        the GPUs each app gave back (with ``events``, pushed as events too)."""
        engine = self.engine
        if self._layout is None or self._layout.size != engine.cluster.size \
                or set(self._layout.drained) != set(engine.drained):
            self.layout_changed()
        leases = {lease.gpu: lease for lease in engine.leases}
        old = self._leases
        lease_changes: dict[str, LeaseView | None] = {
            g: lease_view(x) for g, x in leases.items() if old.get(g) is not x and old.get(g) != x}
        lease_changes.update({g: None for g in old if g not in leases})
        held: dict[str, int] = {}
        for lease in leases.values():
            held[lease.app] = held.get(lease.app, 0) + 1
        apps = {name: self._app_view(name, held.get(name, 0)) for name in engine.apps}
        app_changes: dict[str, AppView | None] = {a: v for a, v in apps.items() if self._apps.get(a) != v}
        app_changes.update({a: None for a in self._apps if a not in apps})
        arrived = sorted(a for a in apps if a not in self._apps)
        left = sorted(a for a in self._apps if a not in apps)
        gave_back: dict[str, list[str]] = {}
        for gpu, old in self._leases.items():
            new = leases.get(gpu)
            if new is None or new.app != old.app:
                gave_back.setdefault(old.app, []).append(gpu)
        self._leases, self._apps = leases, apps
        for app in left:
            self._rho.pop(app, None)
            self._wait.pop(app, None)
        if lease_changes or app_changes:
            self.feed.apply(now, lease_changes, app_changes)
        if events:
            self._state_events(now, arrived, left, gave_back)
        return arrived, left, gave_back

    def _app_view(self, name: str, held: int) -> AppView:
        engine = self.engine
        record = engine.apps[name]
        state = "waiting" if name in engine.waiting else "idle" if name in engine.idle else "active"
        rho = self._rho.get(name)
        return AppView(name, self.model_of(name), self.bound_model_of(name), record.demand, held, rho,
                       self._wait.get(name) if rho is not None and math.isinf(rho) else None,
                       self.connected(name), state, record.arrived)

    def _state_events(self, now: float, arrived: list[str], left: list[str], gave_back: Mapping[str, list[str]],
                      round_id: int | None = None) -> None:
        for app in arrived:
            self.feed.push_event(EventView(0, self.engine.apps[app].arrived, "arrival", app, None))
        for app in left:
            gpus = tuple(sorted(gave_back.get(app, ()), key=natural))
            self.feed.push_event(EventView(0, now, "departure", app, None, gpus,
                                           "left the rounds (finished or removed); its GPUs went back"))
        for app, gpus in sorted(gave_back.items()):
            if app not in left and gpus:
                self.feed.push_event(EventView(0, now, "release", app, round_id, tuple(sorted(gpus, key=natural)),
                                               "given back before the lease ended"))

    def after_round(self, result: RoundResult, *, trigger: str | None = None,
                    rho_wait: Mapping[str, float] | None = None) -> None:
        """A closed round: the state after it, the round's view, its events. Call right after
        ``OpenRound.close`` (the engine's ``silent`` then says who was offered and did not bid, D22).
        ``trigger`` says what started the round (by default: what changed since the last call);
        ``rho_wait`` the waiting rho of the apps that reported infinity (D13), when known."""
        for app, rho in result.rho.items():
            self._rho[app] = rho
            if rho_wait and app in rho_wait:
                self._wait[app] = rho_wait[app]
        expired = {lease.gpu for lease in result.expired}
        arrived, left, gave_back = self.sync(result.now, events=False)
        # what went back between the rounds: not a lease the round ended (expiry, D27)
        released = {a: [g for g in gpus if g not in expired] for a, gpus in gave_back.items() if a not in left}
        released = {a: g for a, g in released.items() if g}
        if trigger is None:
            trigger = _trigger(result, arrived, left, released)
        self._state_events(result.now, arrived, left, released, result.round_id)
        view = round_view(result, trigger=trigger, policy=self.engine.policy.name, silent=self.engine.silent,
                          rho_wait=rho_wait)
        self.feed.push_round(view)
        for event in round_events(view):
            self.feed.push_event(event)


def _trigger(result: RoundResult, arrived: list[str], left: list[str], released: Mapping[str, list[str]]) -> str:
    """What a round followed, in words (D10): leases that ran out, leases ended for starving apps
    (D27), arrivals, departures, GPUs given back; else a change of demand, a reconnection or free
    GPUs left from the round before."""
    parts = []
    reclaimed = {lease.gpu for lease in result.reclaimed}
    ran_out = sum(1 for lease in result.expired if lease.gpu not in reclaimed)
    if ran_out:
        parts.append(f"{ran_out} lease{'s' * (ran_out != 1)} ran out")
    if reclaimed:
        parts.append(f"{len(reclaimed)} GPU{'s' * (len(reclaimed) != 1)} reclaimed (D27)")
    if arrived:
        parts.append("arrival of " + _some(arrived))
    if left:
        parts.append("departure of " + _some(left))
    given = sum(len(g) for g in released.values())
    if given:
        parts.append(f"{given} GPU{'s' * (given != 1)} given back")
    return "; ".join(parts) or "free GPUs and unmet demand"


def _some(apps: list[str]) -> str:
    return ", ".join(apps[:3]) + (f" and {len(apps) - 3} more" if len(apps) > 3 else "")
