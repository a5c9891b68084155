"""Where the dashboard's data comes from, and how it is fed.

The web side (``arbiter.dashboard.server``) reads one :class:`DashboardSource`: snapshots of the
cluster and the apps (now, or as of an earlier round for the time slider), the rounds, the fairness
series, the events, the settings, and a live subscription to changes. It never touches an engine,
a journal or a socket of the arbiter, so the same page serves a live arbiter and a recorded
simulated run.

The other side is a :class:`Feed`: what a round driver (the service's, or the simulator's) pushes
in. ``arbiter.dashboard.memory.MemorySource`` is both; ``arbiter.dashboard.recording.RecordingWriter``
is a feed that writes to a file; ``arbiter.dashboard.feed.EngineFeed`` turns a ``RoundEngine``'s
state and round results into feed calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from arbiter.dashboard.model import (
    AppRound,
    AppsView,
    AppView,
    ClusterLayout,
    ClusterView,
    EventView,
    FairnessSeries,
    LeaseView,
    RoundBrief,
    RoundView,
    Timeline,
)


class NotKept(LookupError):
    """A round or a time the source does not have (never seen, or past its history)."""


@dataclass(frozen=True)
class Change:
    """One message of the live stream: ``kind`` is ``state`` (leases and apps that changed),
    ``round`` (a round closed: its brief), ``event``, ``settings`` or ``layout`` (read them again),
    ``resync`` (this subscriber fell behind: read everything again); ``data`` is its JSON text,
    written once for every subscriber."""

    kind: str
    data: str


class Subscription(Protocol):
    async def get(self) -> Change:
        """The next change (waits for one)."""

    def close(self) -> None:
        """Stop receiving; the source forgets this subscriber."""


@runtime_checkable
class DashboardSource(Protocol):
    def about(self) -> Mapping[str, Any]:
        """What is shown: ``title`` and ``mode`` (``live`` or ``recorded``)."""

    def cluster(self, at: int | None = None) -> ClusterView:
        """Every GPU with its holder and lease end: now, or just after round ``at`` (NotKept when
        that round is not in the history)."""

    def apps(self, at: int | None = None, history: int = 32) -> AppsView:
        """Every app, with the last ``history`` points of its rho (now only)."""

    def app(self, name: str, history: int = 100_000) -> AppView:
        """One app with up to ``history`` points of its rho (NotKept when there is no such app)."""

    def app_rounds(self, name: str, limit: int = 50, before: int | None = None) -> tuple[AppRound, ...]:
        """The latest kept rounds ``name`` took part in, newest first."""

    def rounds(self, limit: int = 50, before: int | None = None, app: str | None = None) -> tuple[RoundBrief, ...]:
        """The latest rounds (older than ``before``; those ``app`` reported in), newest first."""

    def round(self, round_id: int) -> RoundView:
        """One round in full (NotKept when it is not kept)."""

    def fairness(self, points: int = 2000) -> FairnessSeries:
        """The fairness series, at most ``points`` points (evenly thinned; the latest always in)."""

    def events(self, limit: int = 100, before: int | None = None, kinds: frozenset[str] | None = None,
               app: str | None = None) -> tuple[EventView, ...]:
        """The latest events (``seq`` below ``before``, of ``kinds``, of ``app``), newest first."""

    def settings(self) -> Mapping[str, Any]:
        """The settings in force (never a credential)."""

    def timeline(self) -> Timeline:
        """The rounds a time slider can show."""

    def subscribe(self) -> Subscription:
        """Live changes from now on (call in the event loop that serves the page)."""


class Feed(Protocol):
    """What a round driver pushes in, in order. Call from the event loop's thread."""

    def set_layout(self, layout: ClusterLayout) -> None: ...

    def set_settings(self, settings: Mapping[str, Any]) -> None: ...

    def apply(self, now: float, leases: Mapping[str, LeaseView | None], apps: Mapping[str, AppView | None]) -> None:
        """Leases and apps that changed (None: gone) at ``now``. A round's own changes come before
        its :meth:`push_round`, so the state after round r is what the map shows for it."""

    def push_round(self, view: RoundView) -> None: ...

    def push_event(self, event: EventView) -> None:
        """An event; the source numbers it (``seq``)."""
