"""The service's one event stream: a typed event for each change, emitted once, and the sinks that consume it.

Every change to what the journal keeps goes through one commit step (``ServiceCore.commit``): the
journal is written, then each event describing the change is emitted here, once, to every sink in
order -- the agents' streams (grants, revocations, rejections), MQTT (``arbiter.events``' topic
tree), Prometheus (``arbiter.service_metrics``) and :class:`EventLog` (the latest events in memory
and live followers, for a dashboard). So what agents, the broker and an operator see is never ahead
of the journal, and a new sink is one more consumer of the same values, not another copy of the
"journal, publish, wake" lines. Events that record no change -- a refused message, a stream that
connected or ended, a round that failed -- are emitted without a journal write.

Events are frozen dataclasses whose fields are plain values (names, GPU ids, numbers, and the
round engine's own frozen :class:`~arbiter.rounds.RoundResult`): a sink reads nothing from the
live engine, so every sink sees the same thing whenever it looks.

The MQTT sink keeps the topics and payloads as they were (docs/service.md); events MQTT never
carried (a settings change, a round opening, a refusal, ...) reach the other sinks only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from arbiter.events import (
    EventBus,
    app_grants_topic,
    app_leases_topic,
    app_revocations_topic,
    app_rho_topic,
    arbiter_status_topic,
    gpu_lease_topic,
    job_contention_topic,
    last_round_topic,
    rounds_topic,
)
from arbiter.rounds import RoundResult
from arbiter.service_contention import JobContention
from arbiter.service_metrics import ServiceMetrics

log = logging.getLogger("themis.arbiter")

RECENT_EVENTS = 1000  # events EventLog keeps in memory, and queues for each live follower


def json_num(x: float) -> float | None:
    """A number as JSON carries it: infinity (an app that holds nothing, D13) and NaN as null."""
    return None if math.isinf(x) or math.isnan(x) else x


# -- values the events carry ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GpuLease:
    """One GPU's lease as a change left it; ``app`` None: the GPU is free."""

    gpu: str
    app: str | None = None
    expires_at: float | None = None
    round_id: int | None = None


@dataclass(frozen=True, slots=True)
class AppLeases:
    """An app's leases as a change left them, (gpu, expires_at) by GPU; ``gone``: the app has left."""

    app: str
    leases: tuple[tuple[str, float], ...] = ()
    gone: bool = False


@dataclass(frozen=True, slots=True)
class Standing:
    """An app after a round: its rho on what it then holds (infinity: nothing, D13) and its GPUs."""

    app: str
    rho: float
    held: int


@dataclass(frozen=True, slots=True)
class Bidder:
    """An app that got the round's offer, in the policy's order (Themis: worst rho first, D6, D13)."""

    app: str
    rank: int  # 1: first in the offer's order
    rho: float  # what it was ranked by: its report, or its measured rho (D21)


@dataclass(frozen=True, slots=True)
class Contender:
    """A bidder that took part in the round's auction (D8, D20, D25)."""

    app: str
    admitted: bool  # took part in the PF allocation (D25)
    shadow: bool  # shut out by the big smallest rows of contenders admitted before it (D25)
    pf: tuple[str, ...]  # its row of the PF allocation (empty: none)
    pf_rho: float | None  # its rho on that row
    c: float | None  # c_i: the chance it receives its PF row; the hidden payment is 1 - c_i (D15)
    won: bool | None  # its lottery draw (D15, D24): won, lost, or None with no PF row to draw for
    c_bounds: tuple[float, float] | None = None  # D39: (lo, hi) around c_i where c is None but the draw was decided


@dataclass(frozen=True, slots=True)
class Take:
    """GPUs an app took in a round, and how: won in the ``auction``, taken by bid in rank order
    after it (``queue``, D9's first tier and D14's reserve), handed out as ``leftover`` (D9, D26),
    or a baseline's own order (``policy``)."""

    app: str
    gpus: tuple[str, ...]
    tier: str


# -- the events -----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ServiceEvent:
    """Something that happened in the service at ``now`` (the service's clock, Unix seconds)."""

    now: float


@dataclass(frozen=True, kw_only=True)
class ArbiterOnline(ServiceEvent):
    """The arbiter started (or restated its retained state for late subscribers)."""


@dataclass(frozen=True, kw_only=True)
class LeasesChanged(ServiceEvent):
    """GPUs whose lease changed and apps whose lease list did, as the change left them."""

    cause: str  # "round", "release", "app left", "machine added", "start"
    gpus: tuple[GpuLease, ...] = ()
    apps: tuple[AppLeases, ...] = ()


@dataclass(frozen=True, kw_only=True)
class RoundOpened(ServiceEvent):
    """A round opened (D10): leases that ran out are back in the pool and rho requests go out."""

    round_id: int
    trigger: str  # "expiry", "reclaim" (D27) or "change" (D10's resource-available event)
    free: tuple[str, ...]  # the GPUs the round may hand out
    asked: tuple[str, ...]  # the apps asked for rho (D6)
    expired: tuple[GpuLease, ...]  # the leases that ran out as it opened, reclaimed ones included
    reclaimed: tuple[str, ...]  # of those, GPUs taken back beyond a fair share (D27)
    waiting: tuple[str, ...]  # apps the admission policy has not let in yet (D33)
    commitment: str  # SHA-256 of the round's seed (D24)


@dataclass(frozen=True, kw_only=True)
class RhoUpdated(ServiceEvent):
    """An app's rho on what it holds after a round; ``exact`` False when it is a bound or an
    estimate, None for an app that holds nothing (its rho is then infinity, D13)."""

    round_id: int
    app: str
    rho: float
    gpus: tuple[str, ...]
    exact: bool | None = None


@dataclass(frozen=True, kw_only=True)
class Revoked(ServiceEvent):
    """GPUs taken back from an app as a round opened: its lease expired, or was reclaimed (D27)."""

    round_id: int
    app: str
    gpus: tuple[str, ...]
    reason: str
    reclaimed: bool = False


@dataclass(frozen=True, kw_only=True)
class Granted(ServiceEvent):
    """A lease on ``gpus`` to ``app`` until ``expires_at``, and which tier it came from."""

    round_id: int
    app: str
    gpus: tuple[str, ...]
    expires_at: float
    source: str


@dataclass(frozen=True, kw_only=True)
class RoundClosed(ServiceEvent):
    """A round closed and its outcome is journaled. ``result`` is the engine's own record of it;
    ``summary`` is the round as the journal keeps it and RoundHistory and MQTT serve it. The views
    below are what a person asks of a round: who was offered what in which order, who contended,
    their PF rows, c_i and draws, and where every GPU went."""

    result: RoundResult
    trigger: str
    policy: str
    latency_s: float
    standing: tuple[Standing, ...]  # every app staying after the round
    leases: int  # GPUs under lease after it
    connected: int  # agents with an open stream
    summary: Mapping[str, Any]

    @property
    def round_id(self) -> int:
        return self.result.round_id

    def bidders(self) -> tuple[Bidder, ...]:
        rho = self.result.rho
        return tuple(Bidder(app, k, rho.get(app, math.inf)) for k, app in enumerate(self.result.bidders, 1))

    def contenders(self) -> tuple[Contender, ...]:
        decision = self.result.decision
        auction = decision.auction if decision is not None else None
        if auction is None:
            return ()
        admitted, shadows = set(auction.admitted), set(auction.shadows)
        out = []
        for app in auction.contenders:
            pf = auction.pf.get(app, frozenset())
            out.append(Contender(app, app in admitted, app in shadows, tuple(sorted(pf)), auction.pf_rho.get(app),
                                 auction.hidden_payment.get(app), (app in auction.granted) if pf else None,
                                 auction.payment_bounds.get(app)))
        return tuple(out)

    def taken(self) -> tuple[Take, ...]:
        """Every GPU granted, by tier, in the tiers' order (auction, queue, leftover, policy)."""
        decision = self.result.decision
        if decision is None:
            return ()
        tiers = {"auction": decision.auction.granted if decision.auction else {},
                 "queue": decision.queue_granted, "leftover": decision.leftover_granted}
        out = [Take(app, tuple(sorted(gpus)), tier) for tier, part in tiers.items()
               for app, gpus in sorted(part.items()) if gpus]
        for app, gpus in sorted(decision.granted.items()):
            rest = frozenset(gpus).difference(*(part.get(app, ()) for part in tiers.values()))
            if rest:
                out.append(Take(app, tuple(sorted(rest)), "policy"))
        return tuple(out)


@dataclass(frozen=True, kw_only=True)
class RoundFailed(ServiceEvent):
    """A round failed with an internal error, or its outcome could not be journaled."""

    round_id: int | None
    reason: str


@dataclass(frozen=True, kw_only=True)
class Refused(ServiceEvent):
    """A message from an agent was refused with a reason (its stream stays open)."""

    app: str
    what: str  # "report", "bid", "release", "demand", "done", "hello", "message"
    code: int  # the gRPC status code's number
    reason: str
    round_id: int = 0
    active: bool = True  # the app is one the engine runs (a departed app's counts stay dropped)


@dataclass(frozen=True, kw_only=True)
class StreamRefused(ServiceEvent):
    """An agent's stream was ended before its Welcome."""

    code: str  # the gRPC status code's name
    reason: str


@dataclass(frozen=True, kw_only=True)
class AgentConnected(ServiceEvent):
    app: str
    took_over: bool
    connected: int  # agents with an open stream, this one included


@dataclass(frozen=True, kw_only=True)
class AgentDisconnected(ServiceEvent):
    app: str
    why: str | None  # the arbiter's reason (StreamEnd.why), None when the agent closed its side
    connected: int


@dataclass(frozen=True, kw_only=True)
class AppArrived(ServiceEvent):
    app: str


@dataclass(frozen=True, kw_only=True)
class DemandChanged(ServiceEvent):
    app: str
    demand: int


@dataclass(frozen=True, kw_only=True)
class AppIdle(ServiceEvent):
    """An app went idle (its agent away and nothing held: out of N_avg), or came back."""

    app: str
    idle: bool


@dataclass(frozen=True, kw_only=True)
class Released(ServiceEvent):
    app: str
    gpus: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class AppLeft(ServiceEvent):
    """An app left: it said it was done, or an admin removed it; its leases ended."""

    app: str
    why: str
    arrived: float
    last_rho: float
    gpu_seconds: float


@dataclass(frozen=True, kw_only=True)
class JobsContention(ServiceEvent):
    """D35 (``serve --contention``): an app's jobs with their contention ratios, the table's and the
    measured one, after its agent reported them or a neighbour moved; ``gone``: its jobs no longer
    running (their retained topics and series are cleared)."""

    app: str
    jobs: tuple[JobContention, ...]
    gone: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class SettingsChanged(ServiceEvent):
    """The settings in force from the next round (``arbiter.settings.Settings`` as a mapping)."""

    settings: Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class MachineAdded(ServiceEvent):
    machine: str
    rack: str
    gpus: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class MachineDrained(ServiceEvent):
    """A machine was drained (its GPUs are offered no more), or resumed (``drained`` False)."""

    machine: str
    drained: bool


# -- fanning out ----------------------------------------------------------------------------------


class Sink(Protocol):
    def consume(self, event: ServiceEvent) -> None: ...


class Publisher:
    """Hands each event to every sink, in the order they were attached. A sink that raises is
    logged and skipped for that event: the broker, the metrics and the dashboard are never on the
    scheduling path, and one of them failing must not keep the others (or the agents) uninformed."""

    def __init__(self, *sinks: Sink):
        self.sinks: list[Sink] = list(sinks)

    def attach(self, *sinks: Sink) -> None:
        self.sinks.extend(sinks)

    def emit(self, *events: ServiceEvent) -> None:
        for event in events:
            for sink in self.sinks:
                try:
                    sink.consume(event)
                except Exception:
                    log.exception("event sink %s failed on %s", type(sink).__name__, type(event).__name__)


# -- the sinks ------------------------------------------------------------------------------------


class MqttSink:
    """Events as ``arbiter.events``' topic tree: retained leases and rho, grants, revocations and
    round results, with the payloads they always had. Also clears what an earlier arbiter left
    retained under this cluster's prefix (:meth:`sweep_retained`).

    ``owns(kind, name)`` says whether the service knows an app (``kind`` "apps") or a GPU ("gpus")
    *now*: a retained topic of one it does not know is stale."""

    def __init__(self, bus: EventBus, cluster: str, owns: Callable[[str, str], bool]):
        self.bus, self.cluster, self.owns = bus, cluster, owns

    def consume(self, event: ServiceEvent) -> None:
        bus, cluster = self.bus, self.cluster
        match event:
            case ArbiterOnline():
                bus.publish(arbiter_status_topic(cluster), {"online": True}, retain=True)
            case LeasesChanged(gpus=gpus, apps=apps):
                for g in gpus:
                    payload = None if g.app is None else {"app": g.app, "expires_at": g.expires_at,
                                                          "round_id": g.round_id}
                    bus.publish(gpu_lease_topic(cluster, g.gpu), payload, retain=True)
                for a in apps:
                    leases = None if a.gone else [{"gpu": gpu, "expires_at": end} for gpu, end in a.leases]
                    bus.publish(app_leases_topic(cluster, a.app), leases, retain=True)
            case RhoUpdated():
                payload = {"rho": json_num(event.rho), "round_id": event.round_id, "now": event.now,
                           "gpus": list(event.gpus)}
                if event.exact is not None:
                    payload["exact"] = event.exact
                bus.publish(app_rho_topic(cluster, event.app), payload, retain=True)
            case Revoked():
                bus.publish(app_revocations_topic(cluster, event.app),
                            {"gpus": list(event.gpus), "reason": event.reason, "round_id": event.round_id})
            case Granted():
                bus.publish(app_grants_topic(cluster, event.app),
                            {"gpus": list(event.gpus), "expires_at": event.expires_at, "source": event.source,
                             "round_id": event.round_id})
            case RoundClosed():
                summary = dict(event.summary)
                bus.publish(rounds_topic(cluster), summary)
                bus.publish(last_round_topic(cluster), summary, retain=True)
            case AppLeft():  # gone: no rho to show (its leases were cleared by LeasesChanged)
                bus.publish(app_rho_topic(cluster, event.app), None, retain=True)
            case JobsContention():
                for job in event.gone:
                    bus.publish(job_contention_topic(cluster, event.app, job), None, retain=True)
                for j in event.jobs:
                    bus.publish(job_contention_topic(cluster, event.app, j.job),
                                {"cls": j.cls, "gpus": list(j.gpus), "machines": j.machines,
                                 "expected": j.expected, "measured": j.measured, "now": event.now}, retain=True)

    async def sweep_retained(self, window_s: float = 2.0) -> list[str]:
        """Clear retained topics the journal does not know: an app's leases and rho from an app
        that is gone, a GPU's lease on a GPU the cluster no longer has -- left on the broker by an
        earlier arbiter (another journal, a lost journal). Reads what the broker retains for
        ``window_s`` s after subscribing and clears each topic as it arrives, if it is unknown at
        that moment (:meth:`clear_unknown`); returns the topics cleared. Clearing only once the
        window had passed left an earlier arbiter's lease lists beside this one's for the first
        rounds, overlapping on the same GPUs."""
        cleared: list[str] = []
        try:
            await self.read_retained(window_s, on_retained=lambda topic: cleared.extend(self.clear_unknown([topic])))
        except Exception as exc:  # the broker is never on the scheduling path; try again at the next start
            log.warning("could not read the broker's retained state",
                        extra={"fields": {"error": f"{type(exc).__name__}: {exc}"}})
        return cleared

    async def read_retained(self, window_s: float, on_retained: Callable[[str], Any] | None = None) -> set[str]:
        """The topics under this cluster's prefix that the broker holds a retained value for, as
        a new subscriber gets them within ``window_s`` s (MQTT marks no end of the retained state);
        ``on_retained(topic)`` is called for each as it arrives."""
        prefix = f"themis/{self.cluster}/"
        seen: set[str] = set()
        async with self.bus.subscribe(prefix + "#") as sub:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + window_s
            while (left := deadline - loop.time()) > 0:
                try:
                    event = await sub.get(timeout=left)
                except TimeoutError:
                    break
                if event is None:
                    break
                if event.retained and event.payload is not None:
                    seen.add(event.topic)
                    if on_retained is not None:
                        on_retained(event.topic)
                else:
                    seen.discard(event.topic)  # changed since: whoever changed it owns it now
        return seen

    def clear_unknown(self, topics) -> list[str]:
        """Clear those of ``topics`` that belong to no app and no GPU the service knows *now*.

        Decided here, not when the topic was read: the read takes seconds, and an app that
        connected (or a machine that was added) meanwhile owns its topics. A topic this service
        has published a retained value on is never cleared either (the bus holds it in
        ``retained``); the check and the clears run without an await, so nothing the service
        publishes can slip in between. Returns the topics cleared."""
        stale = sorted(t for t in topics if t not in self.bus.retained and self._unknown_topic(t))
        for topic in stale:
            self.bus.publish(topic, None, retain=True)
        if stale:
            log.info("cleared stale retained topics", extra={"fields": {"topics": len(stale)}})
        return stale

    def _unknown_topic(self, topic: str) -> bool:
        """An app's leases or rho of an app the service does not have, or a GPU's lease on a GPU the
        cluster does not have; any other topic (rounds, arbiter status, jobs' metrics) is left."""
        prefix = f"themis/{self.cluster}/"
        if not topic.startswith(prefix):
            return False
        levels = topic[len(prefix):].split("/")
        if len(levels) != 3:
            return False
        kind, name, leaf = levels
        if (kind, leaf) in (("apps", "leases"), ("apps", "rho"), ("gpus", "lease")):
            return not self.owns(kind, name)
        return False


class MetricsSink:
    """Events as Prometheus metrics (``arbiter.service_metrics``). Per-app series are dropped when
    the app leaves, so their number stays bounded by the apps the arbiter runs."""

    def __init__(self, metrics: ServiceMetrics):
        self.metrics = metrics

    def consume(self, event: ServiceEvent) -> None:
        m = self.metrics
        match event:
            case RoundClosed():
                m.observe_round(event.result, event.latency_s, leases=event.leases, connected=event.connected)
                m.observe_apps({s.app: (s.rho, s.held) for s in event.standing}, event.result)
            case RoundFailed():
                m.round_failures.inc()
            case Refused():
                m.rejected.labels(what=event.what).inc()
                if event.active:
                    m.app_rejections.labels(app=event.app).inc()
            case StreamRefused():
                m.refused.labels(code=event.code).inc()
            case AgentConnected() | AgentDisconnected():
                m.connected.set(event.connected)
            case AppLeft():
                m.forget_app(event.app)
            case JobsContention():
                m.observe_jobs(event.app, {j.job: (j.expected, j.measured) for j in event.jobs}, event.gone)


class EventLog:
    """The latest events in memory, and live followers of new ones: what a dashboard reads.

    A follower gets a bounded queue; one that does not keep up loses its oldest events, counted in
    ``lost``, never slowing the service."""

    def __init__(self, keep: int = RECENT_EVENTS):
        self.recent: deque[ServiceEvent] = deque(maxlen=keep)
        self._followers: list[asyncio.Queue[ServiceEvent]] = []
        self.lost = 0

    def consume(self, event: ServiceEvent) -> None:
        self.recent.append(event)
        for queue in self._followers:
            if queue.full():
                queue.get_nowait()
                self.lost += 1
            queue.put_nowait(event)

    @contextlib.contextmanager
    def follow(self, limit: int = RECENT_EVENTS) -> Iterator[asyncio.Queue[ServiceEvent]]:
        """A queue that receives every event from now on, until the block ends."""
        queue: asyncio.Queue[ServiceEvent] = asyncio.Queue(maxsize=limit)
        self._followers.append(queue)
        try:
            yield queue
        finally:
            self._followers.remove(queue)
