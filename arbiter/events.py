"""The arbiter's event stream: grants, lease expiries, revocations and round results as JSON over MQTT.

Why a bus: agents, dashboards and job profilers want to *watch* the arbiter without polling its gRPC API, and
MQTT retained messages hand a late joiner the current state (who holds which GPU) for free. The arbiter, not the
broker, is the source of truth, so scheduling must never block or fail because the broker is slow or down:
``publish`` only records the message in memory and a background task does all network work. The bus keeps the
retained state itself and republishes all of it on every (re)connection, so a broker that restarted without
persistence is repaired without the scheduler noticing. With no broker configured, :class:`MemoryBus` gives the
same semantics in process (tests, the simulator, a single-machine arbiter).

Topic tree. ``<cluster>``, ``<app>``, ``<gpu>`` and ``<job>`` are each exactly one topic level: names that are
empty or contain ``/``, ``+``, ``#`` or NUL are rejected with ValueError (they come from users, and would move a
message elsewhere in the tree or turn it into a wildcard)::

    themis/<cluster>/gpus/<gpu>/lease                retained  {"app", "expires_at", "round_id"}; cleared when free
    themis/<cluster>/apps/<app>/leases               retained  [{"gpu", "expires_at"}, ...]
    themis/<cluster>/apps/<app>/grants               event     a grant to the app
    themis/<cluster>/apps/<app>/revocations          event     GPUs taken back from the app
    themis/<cluster>/apps/<app>/rho                  retained  the app's last reported rho
    themis/<cluster>/apps/<app>/jobs/<job>/metrics   event     from jobs: iteration time, loss, GPU set
                                                               (the agent's profiler subscribes to .../jobs/+/metrics)
    themis/<cluster>/apps/<app>/jobs/<job>/contention retained  D35 (serve --contention): the job's class, GPUs,
                                                               machines, the table's ratio and the measured one
    themis/<cluster>/rounds                          event     the result of each auction round
    themis/<cluster>/rounds/last                     retained  the result of the latest round
    themis/<cluster>/arbiter/status                  retained  {"online": true|false}; the MQTT last will says false

Payloads are compact JSON with sorted keys (identical state gives identical bytes) and must be valid JSON:
NaN and infinities are refused, so publish them as null or a string. The empty payload means "no value": it
clears a retained topic and decodes to None. Everything goes out with QoS 1 (at least once).

``publish`` must be called from the thread running the event loop (it is synchronous and never awaits).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import secrets
import ssl
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, TypeVar
from urllib.parse import unquote, urlsplit

import aiomqtt

__all__ = [
    "BrokerAddress",
    "Event",
    "EventBus",
    "MemoryBus",
    "MqttBus",
    "Subscription",
    "app_grants_topic",
    "app_leases_topic",
    "app_revocations_topic",
    "app_rho_topic",
    "arbiter_status_topic",
    "check_pattern",
    "check_segment",
    "check_topic",
    "decode",
    "encode",
    "gpu_lease_topic",
    "job_metrics_pattern",
    "job_contention_topic",
    "job_metrics_topic",
    "last_round_topic",
    "make_bus",
    "parse_url",
    "rounds_topic",
    "topic_matches",
]

log = logging.getLogger("themis.events")

T = TypeVar("T")
Payload = dict[str, Any] | list[Any] | None

PREFIX: Final = "themis"
QOS: Final = 1
BACKOFF_MIN: Final = 0.1  # first reconnect delay (s); doubles on every failure ...
BACKOFF_MAX: Final = 5.0  # ... up to this, so a long outage costs one connection attempt per 5 s
FLUSH_TIMEOUT: Final = 2.0  # stop() spends at most this long sending what is still queued
OPERATION_TIMEOUT: Final = 5.0  # a CONNACK/PUBACK/SUBACK slower than this means the connection is broken
WINDOW: Final = 32  # publishes awaiting their PUBACK at once
KEEPALIVE: Final = 20  # s; the broker fires the last will ~1.5x this after the arbiter's host vanishes
DEFAULT_MAX_QUEUE: Final = 10_000
ONLINE: Final = {"online": True}
OFFLINE: Final = {"online": False}
DEFAULT_PORTS: Final = {"mqtt": 1883, "mqtts": 8883}
_FORBIDDEN: Final = ("/", "+", "#", "\x00")


# ---------------------------------------------------------------------------------------------- topics


def check_segment(kind: str, name: object) -> str:
    """Return ``name`` if it can be one topic level, else raise ValueError naming ``kind`` (cluster, app, ...)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name must be a non-empty string, got {name!r}")
    bad = [c for c in _FORBIDDEN if c in name]
    if bad:
        raise ValueError(f"{kind} name {name!r} cannot be an MQTT topic level: it contains {', '.join(map(repr, bad))}")
    return name


def _topic(cluster: str, *levels: str) -> str:
    return "/".join((PREFIX, check_segment("cluster", cluster), *levels))


def gpu_lease_topic(cluster: str, gpu: str) -> str:
    """``themis/<cluster>/gpus/<gpu>/lease``: retained {"app", "expires_at", "round_id"}, cleared when free."""
    return _topic(cluster, "gpus", check_segment("gpu", gpu), "lease")


def app_leases_topic(cluster: str, app: str) -> str:
    """``themis/<cluster>/apps/<app>/leases``: retained list of {"gpu", "expires_at"}."""
    return _topic(cluster, "apps", check_segment("app", app), "leases")


def app_grants_topic(cluster: str, app: str) -> str:
    """``themis/<cluster>/apps/<app>/grants``: one event per grant."""
    return _topic(cluster, "apps", check_segment("app", app), "grants")


def app_revocations_topic(cluster: str, app: str) -> str:
    """``themis/<cluster>/apps/<app>/revocations``: one event per revocation."""
    return _topic(cluster, "apps", check_segment("app", app), "revocations")


def app_rho_topic(cluster: str, app: str) -> str:
    """``themis/<cluster>/apps/<app>/rho``: retained, the app's last reported rho."""
    return _topic(cluster, "apps", check_segment("app", app), "rho")


def rounds_topic(cluster: str) -> str:
    """``themis/<cluster>/rounds``: one event per auction round."""
    return _topic(cluster, "rounds")


def last_round_topic(cluster: str) -> str:
    """``themis/<cluster>/rounds/last``: retained result of the latest round."""
    return _topic(cluster, "rounds", "last")


def arbiter_status_topic(cluster: str) -> str:
    """``themis/<cluster>/arbiter/status``: retained {"online": bool}; the arbiter's MQTT last will."""
    return _topic(cluster, "arbiter", "status")


def job_metrics_topic(cluster: str, app: str, job: str) -> str:
    """``themis/<cluster>/apps/<app>/jobs/<job>/metrics``: a job's iteration time, loss and GPU set."""
    return _topic(cluster, "apps", check_segment("app", app), "jobs", check_segment("job", job), "metrics")


def job_contention_topic(cluster: str, app: str, job: str) -> str:
    """``themis/<cluster>/apps/<app>/jobs/<job>/contention``: the arbiter's view of the job's network
    contention (D35), next to the metrics the job publishes itself."""
    return _topic(cluster, "apps", check_segment("app", app), "jobs", check_segment("job", job), "contention")


def job_metrics_pattern(cluster: str, app: str) -> str:
    """``themis/<cluster>/apps/<app>/jobs/+/metrics``: what an agent's profiler subscribes to."""
    return _topic(cluster, "apps", check_segment("app", app), "jobs", "+", "metrics")


def check_topic(topic: object) -> str:
    """Return ``topic`` if one may publish to it (non-empty, no wildcard, no NUL), else raise ValueError."""
    if not isinstance(topic, str) or not topic or any(c in topic for c in "+#\x00"):
        raise ValueError(f"cannot publish to topic {topic!r}: it must be non-empty, without '+', '#' or NUL")
    return topic


def check_pattern(pattern: object) -> str:
    """Return ``pattern`` if it is a valid MQTT topic filter, else raise ValueError.

    '+' and '#' must fill a whole level and '#' must be the last level, as brokers require.
    """
    if not isinstance(pattern, str) or not pattern or "\x00" in pattern:
        raise ValueError(f"bad topic filter {pattern!r}: it must be a non-empty string without NUL")
    levels = pattern.split("/")
    for i, level in enumerate(levels):
        if level == "#" and i != len(levels) - 1:
            raise ValueError(f"bad topic filter {pattern!r}: '#' must be the last level")
        if level not in ("+", "#") and ("+" in level or "#" in level):
            raise ValueError(f"bad topic filter {pattern!r}: a wildcard must be a whole level")
    return pattern


def topic_matches(pattern: str, topic: str) -> bool:
    """Whether ``topic`` matches the MQTT filter ``pattern`` ('+' = one level, '#' = this level and below).

    As in MQTT, wildcards in the first level do not match topics starting with '$' (broker internals).
    """
    want, have = check_pattern(pattern).split("/"), topic.split("/")
    if have[0].startswith("$") and want[0] in ("+", "#"):
        return False
    for i, level in enumerate(want):
        if level == "#":
            return True  # also matches the parent: 'a/#' matches 'a'
        if i >= len(have) or (level != "+" and level != have[i]):
            return False
    return len(want) == len(have)


# ---------------------------------------------------------------------------------------------- payloads


def encode(payload: Payload) -> bytes:
    """Compact, key-sorted JSON; None becomes the empty payload (MQTT's "no retained value")."""
    if payload is None:
        return b""
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def decode(data: bytes | bytearray | str | None) -> Any:
    """Inverse of :func:`encode`: the empty payload is None. Raises ValueError on bad JSON."""
    if not data:
        return None
    return json.loads(data)


@dataclass(frozen=True, slots=True)
class Event:
    """One delivered message. ``retained`` is True when it came from retained state at subscribe time."""

    topic: str
    payload: Any
    retained: bool = False


# ---------------------------------------------------------------------------------------------- broker address


@dataclass(frozen=True)
class BrokerAddress:
    """Where the broker is, parsed from ``mqtt://[user:pass@]host[:port]`` or ``mqtts://`` (TLS)."""

    host: str
    port: int
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # kept out of logs and reprs
    tls: bool = False

    @property
    def display(self) -> str:
        """The URL without the password, for logs."""
        user = f"{self.username}@" if self.username else ""
        return f"{'mqtts' if self.tls else 'mqtt'}://{user}{self.host}:{self.port}"

    def client(self, identifier: str, *, will: aiomqtt.Will | None = None) -> aiomqtt.Client:
        """A fresh aiomqtt client (one per connection attempt, so no paho state leaks between attempts)."""
        client = aiomqtt.Client(
            self.host,
            self.port,
            username=self.username,
            password=self.password,
            identifier=identifier,
            will=will,
            tls_context=ssl.create_default_context() if self.tls else None,
            timeout=OPERATION_TIMEOUT,
            keepalive=KEEPALIVE,
            max_inflight_messages=WINDOW,
        )
        client.pending_calls_threshold = 2 * WINDOW  # aiomqtt warns above this; a full window is normal for us
        return client


def _redact(url: str) -> str:
    return re.sub(r"(//[^/@:]*:)[^/@]*@", r"\1***@", url)


def parse_url(url: str) -> BrokerAddress:
    """Parse a broker URL; ValueError naming the URL (password hidden) when it is not a usable one."""

    def bad(why: str) -> ValueError:
        return ValueError(f"bad MQTT broker URL {_redact(str(url))!r}: {why}")

    if not isinstance(url, str):
        raise bad("it must be a string")
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise bad(str(exc)) from None
    if parts.scheme not in DEFAULT_PORTS:
        raise bad("the scheme must be mqtt:// or mqtts://")
    if not parts.hostname:
        raise bad("it names no host")
    if port == 0:
        raise bad("port 0 is not a broker port")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise bad("it must be scheme://[user:pass@]host[:port] with nothing after the port")
    return BrokerAddress(
        host=parts.hostname,
        port=port or DEFAULT_PORTS[parts.scheme],
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password is not None else None,
        tls=parts.scheme == "mqtts",
    )


# ---------------------------------------------------------------------------------------------- subscriptions


class Subscription:
    """Async iterator over the events matching ``pattern``.

    Use ``async with bus.subscribe(p) as sub: async for event in sub: ...``; entering waits until the subscription
    is active, so whatever is published afterwards arrives. Events are buffered (at most ``max_queue``, the oldest
    dropped beyond that and counted in ``dropped``) so a slow reader never slows down the publisher.
    """

    def __init__(
        self,
        pattern: str,
        *,
        max_queue: int = DEFAULT_MAX_QUEUE,
        on_close: Callable[[Subscription], None] | None = None,
    ) -> None:
        self.pattern = check_pattern(pattern)
        self.max_queue = max_queue
        self.dropped = 0
        self._buffer: deque[Event] = deque()
        self._arrived = asyncio.Event()
        self._closed = False
        self._on_close = on_close

    def _push(self, event: Event) -> None:
        if self._closed:
            return
        self._buffer.append(event)
        if len(self._buffer) > self.max_queue:
            self._buffer.popleft()
            self.dropped += 1
        self._arrived.set()

    async def ready(self, timeout: float = OPERATION_TIMEOUT) -> None:
        """Return once the subscription is active; TimeoutError if that takes longer than ``timeout`` s."""

    async def get(self, timeout: float | None = None) -> Event | None:
        """The next event (None once closed and drained); TimeoutError after ``timeout`` s without one."""
        return await asyncio.wait_for(self._next(), timeout)

    async def _next(self) -> Event | None:
        while not self._buffer:
            if self._closed:
                return None
            self._arrived.clear()
            await self._arrived.wait()
        return self._buffer.popleft()

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Event:
        event = await self._next()
        if event is None:
            raise StopAsyncIteration
        return event

    async def close(self) -> None:
        """Stop receiving; iteration ends once the events already received are consumed."""
        if self._closed:
            return
        self._closed = True
        self._arrived.set()
        if self._on_close is not None:
            self._on_close(self)

    async def __aenter__(self) -> Subscription:
        await self.ready()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class _MqttSubscription(Subscription):
    """A subscription with its own MQTT connection (own client id), reconnecting with backoff like the bus."""

    def __init__(self, pattern: str, broker: BrokerAddress, client_id: str) -> None:
        super().__init__(pattern)
        self._broker = broker
        self._client_id = client_id
        self._active = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def _ensure_running(self) -> None:
        if self._task is None and not self._closed:
            self._task = asyncio.create_task(self._run(), name=f"themis-events-sub-{self._client_id}")

    async def ready(self, timeout: float = OPERATION_TIMEOUT) -> None:
        self._ensure_running()
        await asyncio.wait_for(self._active.wait(), timeout)

    async def _next(self) -> Event | None:
        self._ensure_running()
        return await super()._next()

    async def _run(self) -> None:
        delay, failures = BACKOFF_MIN, 0
        while True:
            try:
                async with self._broker.client(self._client_id) as client:
                    await _subscribe(client, self.pattern)
                    delay, failures = BACKOFF_MIN, 0
                    self._active.set()
                    async for message in client.messages:
                        self._receive(message)
            except Exception as exc:  # any failure means: reconnect later
                failures += 1
                _log_failure(f"subscription {self.pattern!r} to {self._broker.display}", exc, failures)
            await asyncio.sleep(delay)
            delay = min(2 * delay, BACKOFF_MAX)

    def _receive(self, message: aiomqtt.Message) -> None:
        topic = message.topic.value
        try:
            payload = decode(message.payload)  # type: ignore[arg-type]
        except ValueError:
            log.warning("ignoring a payload on %s that is not JSON: %.80r", topic, message.payload)
            return
        self._push(Event(topic, payload, bool(message.retain)))

    async def close(self) -> None:
        await super().close()
        if self._task is not None:
            await _finish(self._task, grace=0.0)


async def _subscribe(client: aiomqtt.Client, pattern: str) -> None:
    codes = await client.subscribe(pattern, qos=QOS)
    if any(int(getattr(code, "value", code)) >= 0x80 for code in codes):
        raise aiomqtt.MqttError(f"the broker refused the subscription to {pattern!r}: {codes}")


# ---------------------------------------------------------------------------------------------- buses


class EventBus(ABC):
    """Where the arbiter publishes; ``publish`` is synchronous, never blocks and never raises.

    ``retained`` is the retained state the bus holds (topic -> decoded payload); ``published`` counts messages
    delivered (in process) or acknowledged by the broker, ``dropped`` those lost (bad payload, queue overflow).
    """

    def __init__(self) -> None:
        self.retained: dict[str, Any] = {}
        self.published = 0
        self.dropped = 0

    @abstractmethod
    async def start(self) -> None:
        """Begin delivering; returns at once (never waits for a broker)."""

    @abstractmethod
    async def stop(self) -> None:
        """Flush best-effort (bounded in time), disconnect and end background tasks."""

    @property
    @abstractmethod
    def connected(self) -> bool:
        """Whether messages currently reach their destination."""

    @abstractmethod
    def subscribe(self, pattern: str) -> Subscription:
        """Events on topics matching the MQTT filter ``pattern``, starting with the matching retained state."""

    @abstractmethod
    async def wait_flushed(self, timeout: float) -> bool:
        """Wait until everything published so far has been delivered; False if ``timeout`` s pass first."""

    @abstractmethod
    def _deliver(self, topic: str, data: bytes, retain: bool) -> None:
        """Hand an encoded message on (must not block or raise)."""

    def publish(self, topic: str, payload: Payload, *, retain: bool = False) -> None:
        """Publish ``payload`` as JSON; with ``retain`` it becomes the topic's state (None clears it).

        Never raises: a payload that is not JSON (or a topic with wildcards) is logged and counted in ``dropped``,
        because a bug in an event must not take scheduling down with it.
        """
        try:
            check_topic(topic)
            data = encode(payload)
            if retain:
                self._remember(topic, data)
            self._deliver(topic, data, retain)
        except Exception as exc:  # see the docstring
            self.dropped += 1
            log.error("dropped an event for %r: %s", topic, exc)

    def _remember(self, topic: str, data: bytes) -> None:
        if data:
            self.retained[topic] = decode(data)  # a copy: later changes to the caller's dict do not leak in
        else:
            self.retained.pop(topic, None)


class MemoryBus(EventBus):
    """In-process bus with MQTT semantics (wildcards, retained state for late subscribers); never disconnected."""

    def __init__(self, *, will_topic: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE) -> None:
        super().__init__()
        self.will_topic = check_topic(will_topic) if will_topic is not None else None
        self.max_queue = max_queue
        self._subscriptions: list[Subscription] = []
        self._running = False

    async def start(self) -> None:
        self._running = True
        if self.will_topic is not None:
            self.publish(self.will_topic, ONLINE, retain=True)

    async def stop(self) -> None:
        """Mark the arbiter offline (as the last will would) and end every subscription."""
        if self.will_topic is not None:
            self.publish(self.will_topic, OFFLINE, retain=True)
        self._running = False
        for subscription in list(self._subscriptions):
            await subscription.close()

    @property
    def connected(self) -> bool:
        return self._running

    def subscribe(self, pattern: str) -> Subscription:
        subscription = Subscription(pattern, max_queue=self.max_queue, on_close=self._subscriptions.remove)
        for topic in sorted(self.retained):
            if topic_matches(pattern, topic):
                subscription._push(Event(topic, decode(encode(self.retained[topic])), retained=True))
        self._subscriptions.append(subscription)
        return subscription

    async def wait_flushed(self, timeout: float) -> bool:
        return True  # delivery is synchronous

    def _deliver(self, topic: str, data: bytes, retain: bool) -> None:
        for subscription in self._subscriptions:
            if topic_matches(subscription.pattern, topic):
                subscription._push(Event(topic, decode(data)))  # decoded per subscriber: no shared dicts
        self.published += 1


@dataclass(frozen=True, slots=True)
class _Pending:
    seq: int  # publish order, shared by events and retained updates so the drain keeps the caller's order
    topic: str
    data: bytes
    retain: bool = False


class MqttBus(EventBus):
    """Publishes to an MQTT broker from a background task, so the broker's state never touches scheduling.

    Pending publishes live in two structures ordered by one sequence number: a deque of events (non-retained;
    at most ``max_queue``, the oldest dropped and counted beyond that) and the retained topics whose latest
    change the broker has not acknowledged yet (one entry per topic, sent with its latest value, so retained
    updates never need dropping). On every (re)connection the bus first republishes all of ``retained``, then
    drains the rest.
    """

    def __init__(
        self,
        url: str,
        *,
        client_id: str,
        will_topic: str | None = None,
        max_queue: int = DEFAULT_MAX_QUEUE,
        flush_timeout: float = FLUSH_TIMEOUT,
    ) -> None:
        super().__init__()
        self.broker = parse_url(url)
        if not isinstance(client_id, str) or not client_id:
            raise ValueError(f"an MQTT client id must be a non-empty string, got {client_id!r}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        self.client_id = client_id
        self.will_topic = check_topic(will_topic) if will_topic is not None else None
        self.max_queue = max_queue
        self.flush_timeout = flush_timeout
        self._events: deque[_Pending] = deque()
        self._dirty: dict[str, int] = {}  # retained topic -> seq of its latest change not yet acknowledged
        self._sending: set[tuple[str, int]] = set()  # (retained topic, seq) published, awaiting the PUBACK
        self._seq = 0
        self._wakeup = asyncio.Event()  # something was published
        self._idle = asyncio.Event()  # connected and nothing pending
        self._closing = asyncio.Event()
        self._connected = False
        self._failures = 0
        self._task: asyncio.Task[None] | None = None

    # -- public ---------------------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def pending(self) -> int:
        """Messages waiting to be sent: queued events plus retained topics with unacknowledged changes.

        Events already on the wire (at most WINDOW) are not counted; they return to the queue if the connection
        fails before their PUBACK.
        """
        return len(self._events) + len(self._dirty)

    async def start(self) -> None:
        if self._task is not None:
            return
        self._closing.clear()
        if self.will_topic is not None:
            self.publish(self.will_topic, ONLINE, retain=True)  # kept in `retained`: resent on every reconnection
        self._task = asyncio.create_task(self._run(), name=f"themis-events-{self.client_id}")

    async def stop(self) -> None:
        """Say offline, send what is queued for at most ``flush_timeout`` s, then disconnect cleanly."""
        task, self._task = self._task, None
        if task is None:
            return
        if self.will_topic is not None:
            self.publish(self.will_topic, OFFLINE, retain=True)  # a clean disconnect does not fire the will
        self._closing.set()
        self._wakeup.set()
        await _finish(task, grace=self.flush_timeout + 1.0)

    def subscribe(self, pattern: str) -> Subscription:
        """A subscription on its own connection (client id ``<client_id>-sub-<random>``); needs no ``start``."""
        return _MqttSubscription(pattern, self.broker, f"{self.client_id}-sub-{secrets.token_hex(4)}")

    async def wait_flushed(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    # -- queueing (synchronous, called by publish) ----------------------------------------------------------

    def _deliver(self, topic: str, data: bytes, retain: bool) -> None:
        self._seq += 1
        if retain:
            self._dirty.pop(topic, None)  # re-insert: the dict's order is the order of latest changes
            self._dirty[topic] = self._seq
        else:
            self._events.append(_Pending(self._seq, topic, data))
            self._trim()
        self._idle.clear()
        self._wakeup.set()

    def _trim(self) -> None:
        while len(self._events) > self.max_queue:
            lost = self._events.popleft()
            self.dropped += 1
            level = logging.WARNING if self.dropped == 1 or self.dropped % 1000 == 0 else logging.DEBUG
            log.log(
                level,
                "event queue full (%d): dropped the oldest event, on %s (%d dropped so far)",
                self.max_queue,
                lost.topic,
                self.dropped,
            )

    def _take(self) -> _Pending | None:
        """The oldest pending message not already on its way.

        Events leave the deque now; a retained topic stays dirty until the broker acknowledged its latest value.
        """
        head = self._events[0] if self._events else None
        first = next((entry for entry in self._dirty.items() if entry not in self._sending), None)
        if first is not None and (head is None or first[1] < head.seq):
            topic, seq = first
            return _Pending(seq, topic, encode(self.retained.get(topic)), retain=True)
        return self._events.popleft() if head is not None else None

    def _republication(self) -> deque[_Pending]:
        """Every retained topic with its current value, to send before anything else on a new connection."""
        return deque(
            _Pending(self._dirty.get(topic, -1), topic, encode(payload), retain=True)
            for topic, payload in self.retained.items()
        )

    def _send(self, client: aiomqtt.Client, item: _Pending) -> asyncio.Task[None]:
        if item.retain:
            self._sending.add((item.topic, item.seq))
        publish = client.publish(item.topic, item.data, qos=QOS, retain=item.retain, timeout=math.inf)
        return asyncio.ensure_future(publish)  # tasks start in creation order: the wire keeps ours

    def _sent(self, item: _Pending) -> None:
        self.published += 1
        if item.retain:
            self._sending.discard((item.topic, item.seq))
            if self._dirty.get(item.topic) == item.seq:
                del self._dirty[item.topic]  # unless it changed again meanwhile

    def _unsent(self, item: _Pending) -> None:
        if item.retain:
            self._sending.discard((item.topic, item.seq))  # still dirty (or in `retained`): sent next time
        else:
            self._events.appendleft(item)
            self._trim()

    # -- the background task --------------------------------------------------------------------------------

    async def _run(self) -> None:
        """Connect, republish, drain; on any failure wait (0.1 s doubling to 5 s) and start over."""
        delay = BACKOFF_MIN
        while not self._closing.is_set():
            try:
                async with self.broker.client(self.client_id, will=self._will()) as client:
                    self._on_connect()
                    delay = BACKOFF_MIN
                    await self._session(client)
            except Exception as exc:  # whatever the broker did, try again later
                self._failures += 1
                _log_failure(f"event bus {self.client_id!r} to {self.broker.display}", exc, self._failures)
            finally:
                self._connected = False
                self._idle.clear()
            if self._closing.is_set():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), delay)
            delay = min(2 * delay, BACKOFF_MAX)

    def _will(self) -> aiomqtt.Will | None:
        if self.will_topic is None:
            return None
        return aiomqtt.Will(self.will_topic, encode(OFFLINE), qos=QOS, retain=True)

    def _on_connect(self) -> None:
        self._connected = True
        if self._failures:
            log.info("event bus %r reconnected to %s", self.client_id, self.broker.display)
        else:
            log.info("event bus %r connected to %s", self.client_id, self.broker.display)
        self._failures = 0

    async def _session(self, client: aiomqtt.Client) -> None:
        """One connection's life: republish all retained state, then send whatever comes, until closing or lost.

        Up to WINDOW publishes await their PUBACK at once (a round trip per message would cap a distant broker at
        a few dozen messages a second); they settle in order, and whatever is unacknowledged when the connection
        fails goes back to the queue for the next one.
        """
        lost = asyncio.create_task(_until_disconnected(client))
        loop = asyncio.get_running_loop()
        backlog = self._republication()
        inflight: deque[tuple[_Pending, asyncio.Task[None]]] = deque()
        deadline: float | None = None
        try:
            while True:
                if self._closing.is_set():
                    if deadline is None:
                        deadline = loop.time() + self.flush_timeout
                    if loop.time() >= deadline:
                        log.warning("event bus %r stopped with %d messages unsent", self.client_id, self.pending)
                        return
                while len(inflight) < WINDOW and (item := backlog.popleft() if backlog else self._take()):
                    inflight.append((item, self._send(client, item)))
                if not inflight:
                    self._idle.set()
                    if self._closing.is_set():
                        return
                    self._wakeup.clear()
                    await _race(self._wakeup.wait(), lost, None)
                    continue
                item, publish = inflight[0]
                timeout = OPERATION_TIMEOUT if deadline is None else max(0.0, deadline - loop.time())
                await _race(publish, lost, timeout)
                inflight.popleft()
                self._sent(item)
        finally:
            for item, publish in reversed(inflight):
                publish.cancel()
                self._unsent(item)
            await _finish(lost, grace=0.0)


# ---------------------------------------------------------------------------------------------- helpers


class _ConnectionLost(Exception):
    """The connection dropped (or stalled) while waiting for the broker."""


async def _until_disconnected(client: aiomqtt.Client) -> None:
    """Finish when the connection ends.

    aiomqtt has no public "disconnected" signal, but its message iterator raises MqttError on disconnection, and a
    client that subscribes to nothing receives no messages: iterating is a pure disconnection watch.
    """
    async for _ in client.messages:
        pass


async def _race(main: Awaitable[T], lost: asyncio.Task[None], timeout: float | None) -> T:
    """Await ``main`` unless the connection is lost or ``timeout`` s pass first (then raise _ConnectionLost)."""
    task = asyncio.ensure_future(main)
    try:
        done, _ = await asyncio.wait({task, lost}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task in done:
        return task.result()
    task.cancel()
    raise _ConnectionLost("connection lost" if lost in done else f"no answer from the broker within {timeout:.1f} s")


async def _finish(task: asyncio.Task[None], *, grace: float) -> None:
    """Let ``task`` end within ``grace`` s, else cancel it (waiting at most 1 s more); never raises its errors."""
    if grace > 0:
        await asyncio.wait({task}, timeout=grace)
    if not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
    if not task.done():
        log.warning("background task %s did not end after cancellation", task.get_name())
    elif not task.cancelled() and task.exception() is not None:
        log.debug("background task %s ended with %r", task.get_name(), task.exception())


def _log_failure(what: str, exc: BaseException, failures: int) -> None:
    """Warn on the first failure of an outage and then every 20th (~ every 100 s at the 5 s backoff ceiling)."""
    level = logging.WARNING if failures == 1 or failures % 20 == 0 else logging.DEBUG
    log.log(level, "%s: %s: %s (attempt %d, retrying)", what, type(exc).__name__, exc, failures)


def make_bus(url: str | None, *, client_id: str, will_topic: str | None = None) -> EventBus:
    """MemoryBus when ``url`` is None/empty, else MqttBus; ValueError naming the URL if it is not usable."""
    if url is None or not url.strip():
        return MemoryBus(will_topic=will_topic)
    return MqttBus(url, client_id=client_id, will_topic=will_topic)
