"""The live arbiter's dashboard: a sink of the service's events (``arbiter.publisher``) that keeps a
:class:`~arbiter.dashboard.memory.MemorySource` up to date, which the page reads and follows.

The service commits every change once (journal, then events, then the round loop), so the sink sees
only what is durable and in the order it happened. Rounds go through
:meth:`~arbiter.dashboard.feed.EngineFeed.after_round` when they close -- the grants, expiries and
revocations a round makes are read from its ``RoundResult`` there, not as they are emitted one by
one, so a lease that ran out is not shown as given back. Changes between rounds (an app arriving,
a release, a drained machine, an agent connecting) are synchronised from the engine; refusals and
connections are events of their own. The sink never raises into the service: the publisher logs
and skips a sink that fails.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from arbiter.dashboard.feed import EngineFeed
from arbiter.dashboard.memory import MemorySource, shown_settings
from arbiter.dashboard.model import EventView
from arbiter.publisher import (
    AgentConnected,
    AgentDisconnected,
    AppArrived,
    AppIdle,
    AppLeft,
    DemandChanged,
    LeasesChanged,
    MachineAdded,
    MachineDrained,
    Refused,
    Released,
    RoundClosed,
    RoundFailed,
    ServiceEvent,
    SettingsChanged,
    StreamRefused,
)
from arbiter.rounds import RoundEngine

_BETWEEN_ROUNDS = (AppArrived, AppIdle, AppLeft, DemandChanged, MachineAdded, MachineDrained, Released)


class DashboardSink:
    """Feeds ``source`` from the service's events. ``model_of`` and ``bound_model_of`` name an
    app's model (D21); ``connected`` says whether its agent has an open stream."""

    def __init__(self, engine: RoundEngine, settings: Mapping[str, Any], *, title: str,
                 bound_model_of: Callable[[str], str | None], connected: Callable[[str], bool],
                 source: MemorySource | None = None):
        self.source = source or MemorySource(title=title, mode="live")
        self.feed = EngineFeed(self.source, engine, model_of=bound_model_of, bound_model_of=bound_model_of,
                               connected=connected)
        self.feed.start(shown_settings(settings))

    def consume(self, event: ServiceEvent) -> None:
        if isinstance(event, RoundClosed):
            self.feed.after_round(event.result, trigger=event.trigger)
        elif isinstance(event, SettingsChanged):
            self.source.set_settings(shown_settings(event.settings))
        elif isinstance(event, LeasesChanged):
            if event.cause != "round":  # a round's own changes come with its RoundClosed
                self.feed.sync(event.now)
        elif isinstance(event, _BETWEEN_ROUNDS):
            self.feed.sync(event.now)
        elif isinstance(event, AgentConnected):
            self.feed.sync(event.now, events=False)
            self._event(event.now, "connected", event.app,
                        "took over from an earlier stream" if event.took_over else "")
        elif isinstance(event, AgentDisconnected):
            self.feed.sync(event.now, events=False)
            self._event(event.now, "disconnected", event.app, event.why or "the agent closed its stream")
        elif isinstance(event, Refused):
            self._event(event.now, "refused", event.app, f"{event.what}: {event.reason}", event.round_id or None)
        elif isinstance(event, StreamRefused):
            self._event(event.now, "refused", "", f"stream ({event.code}): {event.reason}")
        elif isinstance(event, RoundFailed):
            self._event(event.now, "round failed", "", event.reason, event.round_id)

    def _event(self, t: float, kind: str, app: str, reason: str, round_id: int | None = None) -> None:
        self.source.push_event(EventView(0, t if math.isfinite(t) else 0.0, kind, app, round_id, (), reason))
