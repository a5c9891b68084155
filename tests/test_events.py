"""The event bus: topic tree, wildcard matching, in-memory delivery, and MQTT against a real Mosquitto broker.

Every MQTT test starts its own broker on a free port (never the system one on 1883). Outages are real: the broker
process is killed, or a TCP relay between the bus and the broker is cut (so the broker and the test's subscriber
stay up while the bus alone loses its connection), or the process running the bus is SIGKILLed.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiomqtt
import pytest

from arbiter.events import (
    BrokerAddress,
    Event,
    MemoryBus,
    MqttBus,
    Subscription,
    app_grants_topic,
    app_leases_topic,
    app_revocations_topic,
    app_rho_topic,
    arbiter_status_topic,
    check_pattern,
    decode,
    encode,
    gpu_lease_topic,
    job_metrics_pattern,
    job_metrics_topic,
    last_round_topic,
    make_bus,
    rounds_topic,
    topic_matches,
)

MOSQUITTO = "/usr/sbin/mosquitto"
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- harness


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Broker:
    """A private Mosquitto on a free port that can be killed and started again on the same port."""

    def __init__(self, workdir: Path) -> None:
        self.port = _free_port()
        self.conf = workdir / "mosquitto.conf"
        self.conf.write_text(f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
        self.log = workdir / "mosquitto.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.conf)], stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 5
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited: {self.log.read_text()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def stop(self) -> None:
        """Kill -9: no goodbye to the clients, and (persistence false) all retained state is gone."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path)
    b.start()
    yield b
    b.stop()


class Gate:
    """A TCP relay in front of the broker; cut() is a network outage for the clients that go through it."""

    def __init__(self, target_port: int, *, delay: float = 0.0) -> None:
        self.target_port = target_port
        self.delay = delay  # added to every chunk in each direction: a distant broker
        self.port = _free_port()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._relays: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    async def open(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port, reuse_address=True)

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()
        if self._relays:
            await asyncio.wait(self._relays, timeout=2)  # let the relays see the abort and end
        self._relays.clear()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._relays.add(asyncio.current_task())  # type: ignore[arg-type]
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}
        pipes = (_pipe(reader, up_writer, self.delay), _pipe(up_reader, writer, self.delay))
        await asyncio.gather(*pipes, return_exceptions=True)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    try:
        while data := await reader.read(65536):
            if delay:
                await asyncio.sleep(delay)
            writer.write(data)
            await writer.drain()
    finally:
        writer.transport.abort()


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def collect(sub: Subscription, until: Callable[[Event], bool], timeout: float = 5.0) -> list[Event]:
    """Events from ``sub`` up to and including the first for which ``until`` holds."""
    events: list[Event] = []

    async def run() -> None:
        async for event in sub:
            events.append(event)
            if until(event):
                return
        raise AssertionError(f"subscription ended early after {events}")

    await asyncio.wait_for(run(), timeout)
    return events


def is_marker(event: Event) -> bool:
    return event.topic == rounds_topic("c") and event.payload == {"marker": True}


async def snapshot(url: str, pattern: str = "themis/c/#") -> dict[str, object]:
    """The retained state a newly connecting subscriber gets (ended by a live marker from another client)."""
    async with MqttBus(url, client_id="snapshot").subscribe(pattern) as sub:
        host, port = url.removeprefix("mqtt://").split(":")
        async with aiomqtt.Client(host, int(port), identifier="marker") as marker:
            await marker.publish(rounds_topic("c"), encode({"marker": True}), qos=1)
        events = await collect(sub, is_marker)
    assert all(e.retained for e in events[:-1]) and not events[-1].retained
    return {e.topic: e.payload for e in events[:-1]}


# ---------------------------------------------------------------------------------------------- topics


def test_topic_tree() -> None:
    assert gpu_lease_topic("c1", "n0-g3") == "themis/c1/gpus/n0-g3/lease"
    assert app_leases_topic("c1", "app-7") == "themis/c1/apps/app-7/leases"
    assert app_grants_topic("c1", "app-7") == "themis/c1/apps/app-7/grants"
    assert app_revocations_topic("c1", "app-7") == "themis/c1/apps/app-7/revocations"
    assert app_rho_topic("c1", "app-7") == "themis/c1/apps/app-7/rho"
    assert rounds_topic("c1") == "themis/c1/rounds"
    assert last_round_topic("c1") == "themis/c1/rounds/last"
    assert arbiter_status_topic("c1") == "themis/c1/arbiter/status"
    assert job_metrics_topic("c1", "app-7", "j.0") == "themis/c1/apps/app-7/jobs/j.0/metrics"
    assert job_metrics_pattern("c1", "app-7") == "themis/c1/apps/app-7/jobs/+/metrics"
    assert topic_matches(job_metrics_pattern("c1", "a"), job_metrics_topic("c1", "a", "j"))


BUILDERS: list[Callable[[str], str]] = [
    lambda bad: gpu_lease_topic(bad, "g"),
    lambda bad: gpu_lease_topic("c", bad),
    lambda bad: app_leases_topic("c", bad),
    lambda bad: app_grants_topic(bad, "a"),
    lambda bad: app_revocations_topic("c", bad),
    lambda bad: app_rho_topic("c", bad),
    lambda bad: rounds_topic(bad),
    lambda bad: last_round_topic(bad),
    lambda bad: arbiter_status_topic(bad),
    lambda bad: job_metrics_topic(bad, "a", "j"),
    lambda bad: job_metrics_topic("c", bad, "j"),
    lambda bad: job_metrics_topic("c", "a", bad),
    lambda bad: job_metrics_pattern("c", bad),
]


@pytest.mark.parametrize("bad", ["", "a/b", "gpu+1", "#", "all#", "x\x00y", None, 3])
def test_topic_names_are_one_level(bad: object) -> None:
    for build in BUILDERS:
        with pytest.raises(ValueError, match="name"):
            build(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pattern", "topic", "expected"),
    [
        ("themis/c/gpus/+/lease", "themis/c/gpus/g1/lease", True),
        ("themis/c/gpus/+/lease", "themis/c/gpus/g1/x/lease", False),
        ("themis/c/gpus/+/lease", "themis/c/gpus/lease", False),
        ("themis/+/apps/+/rho", "themis/c/apps/a/rho", True),
        ("themis/c/#", "themis/c/apps/a/jobs/j/metrics", True),
        ("themis/c/#", "themis/c", True),  # '#' also matches the parent level
        ("themis/c/#", "themis/d/rounds", False),
        ("themis/c/rounds", "themis/c/rounds/last", False),
        ("themis/c/rounds/#", "themis/c/rounds/last", True),
        ("#", "themis/c/rounds", True),
        ("+", "themis", True),
        ("+", "themis/c", False),
        ("+/+", "/x", True),  # an empty level is still a level
        ("#", "$SYS/broker/uptime", False),  # wildcards at the root skip $-topics
        ("$SYS/#", "$SYS/broker/uptime", True),
        ("a/b", "a/b", True),
        ("a/b", "a/c", False),
    ],
)
def test_topic_matches(pattern: str, topic: str, expected: bool) -> None:
    assert topic_matches(pattern, topic) is expected


@pytest.mark.parametrize("pattern", ["", "a/#/b", "a/b#", "a+/b", "a/\x00"])
def test_bad_filters_are_refused(pattern: str) -> None:
    with pytest.raises(ValueError, match="topic filter"):
        check_pattern(pattern)
    with pytest.raises(ValueError):
        MemoryBus().subscribe(pattern)


def test_payloads_are_compact_sorted_json() -> None:
    assert encode({"b": 1, "a": [1, {"z": 2, "y": None}]}) == b'{"a":[1,{"y":null,"z":2}],"b":1}'
    assert encode(None) == b"" and decode(b"") is None
    assert decode(encode([{"gpu": "g1", "expires_at": 1.5}])) == [{"gpu": "g1", "expires_at": 1.5}]
    with pytest.raises(ValueError):
        encode({"rho": float("inf")})  # not JSON; other languages' parsers would choke


# ---------------------------------------------------------------------------------------------- MemoryBus


def test_memory_bus_delivers_matching_events() -> None:
    async def scenario() -> None:
        bus = MemoryBus()
        await bus.start()
        grants = bus.subscribe("themis/c/apps/+/grants")
        everything = bus.subscribe("#")
        payload = {"gpus": ["g1", "g2"], "round_id": 4}
        bus.publish(app_grants_topic("c", "a"), payload)
        payload["gpus"].append("g3")  # the caller's later changes must not reach subscribers
        bus.publish(app_revocations_topic("c", "a"), {"gpus": ["g9"]})
        bus.publish(app_grants_topic("c", "b"), {"gpus": [], "round_id": 4})
        bus.publish(app_grants_topic("other", "a"), {"gpus": []})
        got = [await grants.get(1) for _ in range(2)]
        assert got == [
            Event("themis/c/apps/a/grants", {"gpus": ["g1", "g2"], "round_id": 4}),
            Event("themis/c/apps/b/grants", {"gpus": [], "round_id": 4}),
        ]
        seen = [(await everything.get(1)).topic for _ in range(4)]  # type: ignore[union-attr]
        assert seen == [
            "themis/c/apps/a/grants",
            "themis/c/apps/a/revocations",
            "themis/c/apps/b/grants",
            "themis/other/apps/a/grants",
        ]
        assert bus.published == 4 and bus.dropped == 0
        await grants.close()
        bus.publish(app_grants_topic("c", "a"), {"gpus": ["g4"]})
        assert await grants.get(1) is None  # closed: nothing more arrives
        assert await everything.get(1) == Event("themis/c/apps/a/grants", {"gpus": ["g4"]})
        with pytest.raises(TimeoutError):
            await everything.get(0.05)

    asyncio.run(scenario())


def test_memory_bus_gives_late_subscribers_the_retained_state() -> None:
    async def scenario() -> None:
        status = arbiter_status_topic("c")
        bus = MemoryBus(will_topic=status)
        await bus.start()
        bus.publish(gpu_lease_topic("c", "g1"), {"app": "a", "expires_at": 10.0, "round_id": 1}, retain=True)
        bus.publish(gpu_lease_topic("c", "g2"), {"app": "b", "expires_at": 11.0, "round_id": 1}, retain=True)
        bus.publish(gpu_lease_topic("c", "g2"), None, retain=True)  # g2 is free again
        bus.publish(rounds_topic("c"), {"round_id": 1})  # an event: not kept
        assert bus.retained == {
            status: {"online": True},
            gpu_lease_topic("c", "g1"): {"app": "a", "expires_at": 10.0, "round_id": 1},
        }
        late = bus.subscribe("themis/c/#")
        first = [await late.get(1) for _ in range(2)]
        assert first == [
            Event(status, {"online": True}, retained=True),
            Event(gpu_lease_topic("c", "g1"), {"app": "a", "expires_at": 10.0, "round_id": 1}, retained=True),
        ]
        bus.publish(gpu_lease_topic("c", "g1"), None, retain=True)
        assert await late.get(1) == Event(gpu_lease_topic("c", "g1"), None)  # live clears reach subscribers
        await bus.stop()
        assert await late.get(1) == Event(status, {"online": False})
        assert await late.get(1) is None  # stop ends subscriptions
        again = bus.subscribe("themis/c/gpus/#")
        with pytest.raises(TimeoutError):
            await again.get(0.05)  # no lease is retained any more

    asyncio.run(scenario())


def test_publish_never_raises() -> None:
    async def scenario() -> None:
        for bus in (MemoryBus(), MqttBus("mqtt://127.0.0.1:1", client_id="never-started")):
            bus.publish(app_rho_topic("c", "a"), {"rho": 1.5}, retain=True)
            bus.publish(app_rho_topic("c", "a"), {"rho": float("nan")}, retain=True)  # not JSON
            bus.publish(app_rho_topic("c", "a"), {"rho": object()}, retain=True)  # type: ignore[dict-item]
            bus.publish("themis/c/apps/+/rho", {"rho": 2.0}, retain=True)  # a wildcard cannot be published to
            bus.publish("", {"rho": 2.0})
            assert bus.dropped == 4
            assert bus.retained == {app_rho_topic("c", "a"): {"rho": 1.5}}  # the bad updates changed nothing

    asyncio.run(scenario())


def test_make_bus() -> None:
    assert isinstance(make_bus(None, client_id="x"), MemoryBus)
    assert isinstance(make_bus("", client_id="x"), MemoryBus)
    bus = make_bus("mqtt://arbiter:s%40cret@broker.example:1884", client_id="x", will_topic="themis/c/arbiter/status")
    assert isinstance(bus, MqttBus) and bus.will_topic == "themis/c/arbiter/status"
    assert bus.broker == BrokerAddress("broker.example", 1884, "arbiter", "s@cret", tls=False)
    assert "s@cret" not in repr(bus.broker) and "s@cret" not in bus.broker.display
    tls = make_bus("mqtts://broker.example", client_id="x")
    assert isinstance(tls, MqttBus) and tls.broker == BrokerAddress("broker.example", 8883, tls=True)
    assert make_bus("mqtt://10.0.0.5", client_id="x").broker.port == 1883  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://broker:1883", "scheme"),
        ("broker:1883", "scheme"),
        ("mqtt://:1883", "no host"),
        ("mqtt://", "no host"),
        ("mqtt://broker:notaport", "integer"),
        ("mqtt://broker:70000", "range"),
        ("mqtt://broker:0", "port 0"),
        ("mqtt://broker:1883/themis", "nothing after"),
    ],
)
def test_make_bus_rejects_bad_urls(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as info:
        make_bus(url, client_id="x")
    assert url in str(info.value)


def test_bad_url_errors_hide_the_password() -> None:
    with pytest.raises(ValueError) as info:
        make_bus("mqtt://user:hunter2@broker:99999", client_id="x")
    assert "user:***@broker:99999" in str(info.value) and "hunter2" not in str(info.value)


# ---------------------------------------------------------------------------------------------- MqttBus


def test_mqtt_events_reach_a_subscriber(broker: Broker) -> None:
    async def scenario() -> None:
        bus = MqttBus(broker.url, client_id="arbiter-events")
        await bus.start()
        async with aiomqtt.Client("127.0.0.1", broker.port, identifier="raw") as raw:
            await raw.subscribe("themis/c/apps/+/grants", qos=1)
            async with bus.subscribe("themis/c/apps/+/grants") as sub:
                for i in range(50):
                    bus.publish(app_grants_topic("c", f"app{i % 3}"), {"round_id": i, "gpus": [f"g{i}"]})
                bus.publish(app_revocations_topic("c", "app0"), {"gpus": ["g0"]})  # does not match
                events = await collect(sub, lambda e: e.payload["round_id"] == 49)
            message = await asyncio.wait_for(anext(aiter(raw.messages)), 5)
        assert [e.payload["round_id"] for e in events] == list(range(50))  # all of them, in order
        assert events[7] == Event("themis/c/apps/app1/grants", {"gpus": ["g7"], "round_id": 7})
        assert not any(e.retained for e in events)
        assert message.payload == b'{"gpus":["g0"],"round_id":0}'  # compact, sorted keys on the wire
        assert await bus.wait_flushed(5)
        assert bus.published == 51 and bus.dropped == 0 and bus.connected
        await bus.stop()
        assert not bus.connected

    asyncio.run(scenario())


def test_mqtt_retained_state_reaches_late_subscribers(broker: Broker) -> None:
    async def scenario() -> None:
        bus = MqttBus(broker.url, client_id="arbiter-retained", will_topic=arbiter_status_topic("c"))
        await bus.start()
        bus.publish(gpu_lease_topic("c", "g1"), {"app": "a", "expires_at": 10.0, "round_id": 1}, retain=True)
        bus.publish(gpu_lease_topic("c", "g2"), {"app": "b", "expires_at": 10.0, "round_id": 1}, retain=True)
        bus.publish(app_leases_topic("c", "a"), [{"gpu": "g1", "expires_at": 10.0}], retain=True)
        bus.publish(gpu_lease_topic("c", "g1"), None, retain=True)  # expired
        bus.publish(gpu_lease_topic("c", "g2"), {"app": "b", "expires_at": 20.0, "round_id": 2}, retain=True)
        assert await bus.wait_flushed(5)
        state = await snapshot(broker.url)
        assert state == {
            arbiter_status_topic("c"): {"online": True},
            gpu_lease_topic("c", "g2"): {"app": "b", "expires_at": 20.0, "round_id": 2},
            app_leases_topic("c", "a"): [{"gpu": "g1", "expires_at": 10.0}],
        }
        assert state == bus.retained
        await bus.stop()  # a clean stop says offline itself: the broker does not fire the will then
        assert bus.retained[arbiter_status_topic("c")] == {"online": False}
        assert await snapshot(broker.url) == bus.retained

    asyncio.run(scenario())


def test_start_and_publish_without_a_broker_never_block() -> None:
    async def scenario() -> None:
        bus = MqttBus(f"mqtt://127.0.0.1:{_free_port()}", client_id="arbiter-alone", max_queue=100)
        await asyncio.wait_for(bus.start(), 0.1)  # does not wait for the (absent) broker
        t0 = time.perf_counter()
        for i in range(3000):
            bus.publish(rounds_topic("c"), {"round_id": i})
            bus.publish(gpu_lease_topic("c", f"g{i % 10}"), {"app": "a", "round_id": i}, retain=True)
        assert time.perf_counter() - t0 < 1.0
        await asyncio.sleep(0.3)  # a few failed connection attempts
        assert not bus.connected and not await bus.wait_flushed(0.05)
        assert bus.dropped == 2900 and bus.pending == 100 + 10
        t0 = time.perf_counter()
        await asyncio.wait_for(bus.stop(), 4)
        assert time.perf_counter() - t0 < 0.5  # nothing to flush to: no need to wait out the flush timeout

    asyncio.run(scenario())


def test_broker_restart_gets_the_retained_state_back(broker: Broker) -> None:
    async def scenario() -> None:
        bus = MqttBus(broker.url, client_id="arbiter-restart", will_topic=arbiter_status_topic("c"))
        await bus.start()
        lease = {"app": "a", "expires_at": 10.0, "round_id": 1}
        bus.publish(gpu_lease_topic("c", "g1"), lease, retain=True)
        bus.publish(gpu_lease_topic("c", "g2"), lease, retain=True)
        assert await bus.wait_flushed(5)

        broker.stop()  # the fresh broker started below knows nothing (persistence false)
        await wait_until(lambda: not bus.connected)

        async def burst() -> None:  # what the scheduler does during the outage; no await inside
            for i in range(2000):
                bus.publish(app_grants_topic("c", "a"), {"round_id": i})
                bus.publish(app_rho_topic("c", "a"), {"rho": i / 1000}, retain=True)
            bus.publish(gpu_lease_topic("c", "g2"), None, retain=True)
            bus.publish(gpu_lease_topic("c", "g3"), {"app": "b", "expires_at": 12.0, "round_id": 2}, retain=True)

        t0 = time.perf_counter()
        await asyncio.wait_for(burst(), 2)
        assert time.perf_counter() - t0 < 1.0 and not bus.connected and bus.pending > 0

        broker.start()
        assert await bus.wait_flushed(10)
        assert bus.connected and bus.pending == 0 and bus.dropped == 0
        assert await snapshot(broker.url) == {
            arbiter_status_topic("c"): {"online": True},
            gpu_lease_topic("c", "g1"): lease,
            gpu_lease_topic("c", "g3"): {"app": "b", "expires_at": 12.0, "round_id": 2},
            app_rho_topic("c", "a"): {"rho": 1.999},
        }
        await bus.stop()

    asyncio.run(scenario())


def test_outage_queue_drops_oldest_events_and_keeps_retained_order(broker: Broker) -> None:
    """The bus alone loses its connection (relay cut); the broker keeps its state and our subscriber listens."""

    async def scenario() -> None:
        gate = Gate(broker.port)
        await gate.open()
        bus = MqttBus(gate.url, client_id="arbiter-overflow", max_queue=5)
        await bus.start()
        bus.publish(gpu_lease_topic("c", "g0"), {"app": "a", "expires_at": 5.0, "round_id": 0}, retain=True)
        assert await bus.wait_flushed(5)
        async with MqttBus(broker.url, client_id="watcher").subscribe("themis/c/#") as live:
            assert (await live.get(5)).topic == gpu_lease_topic("c", "g0")

            await gate.cut()
            await wait_until(lambda: not bus.connected)
            for i in range(8):
                bus.publish(rounds_topic("c"), {"round_id": i})
            for i in range(20):  # retained updates are not queued per update, so they never overflow
                bus.publish(app_rho_topic("c", "a"), {"rho": i}, retain=True)
            bus.publish(gpu_lease_topic("c", "g0"), None, retain=True)  # the broker still holds g0: must clear it
            bus.publish(gpu_lease_topic("c", "g1"), {"app": "b", "expires_at": 9.0, "round_id": 8}, retain=True)
            bus.publish(rounds_topic("c"), {"round_id": 8})
            assert bus.dropped == 4 and bus.pending == 5 + 3  # events 0..3 gone; rho, g0, g1 pending

            await gate.open()
            events = await collect(live, lambda e: e.payload == {"round_id": 8})
        assert await bus.wait_flushed(5)
        rounds = [e.payload["round_id"] for e in events if e.topic == rounds_topic("c")]
        assert rounds == [4, 5, 6, 7, 8]  # the oldest four were dropped, the rest arrive in order
        first_round = next(i for i, e in enumerate(events) if e.topic == rounds_topic("c"))
        republished = {e.topic: e.payload for e in events[:first_round]}
        assert republished[app_rho_topic("c", "a")] == {"rho": 19}  # retained state first, latest value only
        assert [e.payload for e in events if e.topic == app_rho_topic("c", "a")] == [{"rho": 19}]
        assert Event(gpu_lease_topic("c", "g0"), None) in events
        assert await snapshot(broker.url) == {
            app_rho_topic("c", "a"): {"rho": 19},
            gpu_lease_topic("c", "g1"): {"app": "b", "expires_at": 9.0, "round_id": 8},
        }
        assert bus.dropped == 4
        await bus.stop()
        await gate.cut()

    asyncio.run(scenario())


def test_a_distant_broker_gets_publishes_pipelined_in_order(broker: Broker) -> None:
    """40 ms per round trip: one PUBACK at a time would need 8 s for 200 events."""

    async def scenario() -> None:
        gate = Gate(broker.port, delay=0.02)
        await gate.open()
        bus = MqttBus(gate.url, client_id="arbiter-far")
        await bus.start()
        assert await bus.wait_flushed(5)
        async with MqttBus(broker.url, client_id="watcher").subscribe(app_grants_topic("c", "a")) as sub:
            for i in range(200):
                bus.publish(app_grants_topic("c", "a"), {"round_id": i})
            assert await bus.wait_flushed(3)
            events = await collect(sub, lambda e: e.payload["round_id"] == 199)
        assert [e.payload["round_id"] for e in events] == list(range(200))
        await bus.stop()
        await gate.cut()

    asyncio.run(scenario())


BUS_PROCESS = """
import asyncio, sys
from arbiter.events import MqttBus

async def main():
    bus = MqttBus(sys.argv[1], client_id="arbiter-doomed", will_topic=sys.argv[2])
    await bus.start()
    print("ready" if await bus.wait_flushed(5) else "no broker", flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def test_last_will_marks_the_arbiter_offline_when_its_process_dies(broker: Broker) -> None:
    async def scenario() -> None:
        status = arbiter_status_topic("c")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", BUS_PROCESS, broker.url, status, cwd=REPO, stdout=subprocess.PIPE
        )
        try:
            assert await asyncio.wait_for(proc.stdout.readline(), 10) == b"ready\n"  # type: ignore[union-attr]
            async with MqttBus(broker.url, client_id="watcher").subscribe(status) as sub:
                assert await sub.get(5) == Event(status, {"online": True}, retained=True)
                proc.kill()  # SIGKILL: no MQTT DISCONNECT, the kernel just closes the socket
                assert await sub.get(5) == Event(status, {"online": False})
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
        assert (await snapshot(broker.url))[status] == {"online": False}

    asyncio.run(scenario())
