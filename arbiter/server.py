"""Assembling a running arbiter: journal, round engine, event bus, gRPC server, health, metrics.

:class:`ArbiterServer` is what ``themis-arbiter serve`` runs and what the integration tests start
on loopback. On start it reopens the journal: a restarted arbiter restores every app, every lease
with its expiry, the round counter and the contention history behind N_avg, then lets agents
reconnect. Settings come from, in order: what the command line gives, what the journal recorded
(an admin may have changed them at run time), the defaults.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from arbiter.admission import make_admission
from arbiter.cluster import load_cluster
from arbiter.events import arbiter_status_topic, make_bus
from arbiter.limits import Limits
from arbiter.profiles import model_slowdowns
from arbiter.rounds import RoundEngine
from arbiter.service import ArbiterService, ParseGuard, Settings, new_secret
from arbiter.service_contention import ServiceContention
from arbiter.service_metrics import ServiceMetrics
from arbiter.store import Store, lock_journal
from protos import themis_pb2_grpc as pb_grpc

log = logging.getLogger("themis.arbiter")

#: A port is this arbiter's alone: with SO_REUSEPORT (grpc's default on Linux) a second arbiter on
#: the same port started fine and the kernel split the agents between the two.
NO_PORT_SHARING = [("grpc.so_reuseport", 0)]
KEEPALIVE = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # The largest message an agent sends is a bid: at most 303 rows (MAX_BID_ROWS), a few hundred KB
    # on a 256-GPU cluster and about 1 MB if every row named 256 GPUs; 4 MB leaves room for bigger
    # clusters and halves what each stream without a credential can make the arbiter read (issue 32).
    ("grpc.max_receive_message_length", 4 * 2**20),
    # HTTP/2 flow control at its 64 KB window per stream (no window growth from bandwidth probes):
    # what a client sends that the arbiter has not read -- a stream refused unread -- stays in the
    # client, not in the arbiter's memory (issue 32); agents' messages are a few hundred KB at most.
    ("grpc.http2.bdp_probe", 0),
]
HEALTH_TICK_S = 0.25  # the loop watch's timer ...
STALL_S = 1.0  # ... running this much late is a stalled loop: NOT_SERVING ...
STALL_HOLD_S = 5.0  # ... for this long after the stall, so a prober polling every few seconds sees it
HEALTH_NAMES = ("", "themis.v1.Arbiter")


@dataclass
class ServerConfig:
    cluster: str
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port
    db: Path = Path("themis-arbiter.db")
    mqtt: str | None = None
    admin_token: str | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"  # the metrics need no token: loopback unless the operator says otherwise
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # None: the journal's value, else the default of arbiter.service.Settings
    policy: str | None = None
    fairness_knob: float | None = None
    lease_s: float | None = None
    coalesce_s: float | None = None
    expiry_window_s: float | None = None
    report_timeout_s: float | None = None
    bid_timeout_s: float | None = None
    heartbeat_s: float | None = None
    max_contenders: int | None = None
    min_bidders: int | None = None
    rank: str | None = None
    reclaim: bool | None = None
    idle_s: float | None = None
    # D33: the admission policy in front of the policy, NAME[:ARG] (None: accept-all); given at each
    # start, not journaled (the apps waiting are)
    admission: str | None = None
    # slowdown tables added to the shipped one (agent/profiles/slowdowns.toml's form): the models
    # IssueToken may bind an app to (D21)
    profiles: tuple[Path, ...] = ()
    limits: Limits = field(default_factory=Limits)  # bounds before and around authentication (issue 32)
    # the web dashboard and its JSON API (arbiter.dashboard), "HOST:PORT"; None: not served. Off
    # loopback it asks for viewer tokens, and it speaks TLS when the gRPC side does
    http: str | None = None
    # D35: a contention table (``deepshare`` or a CSV file of its form): agents report their running
    # jobs, offers carry who runs on their machines, measured ratios are published; None: off
    contention: str | None = None


def admin_token_for(config: ServerConfig) -> str:
    """The admin token: given, from THEMIS_ADMIN_TOKEN, or kept next to the journal (mode 0600)."""
    token = config.admin_token or os.environ.get("THEMIS_ADMIN_TOKEN")
    if token:
        return token
    path = Path(f"{config.db}.admin-token")
    if path.exists():
        return path.read_text().strip()
    token = new_secret("admin")
    path.touch(mode=0o600)
    path.write_text(token + "\n")
    log.info("admin token written", extra={"fields": {"path": str(path)}})
    return token


class ArbiterServer:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.port: int | None = None
        self.service: ArbiterService | None = None
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task] = []
        self._metrics_http = None
        self.dashboard = None  # arbiter.dashboard.server.Dashboard, with ServerConfig.http
        self._lock: int | None = None  # the journal's lock (arbiter.store.lock_journal)

    async def start(self) -> int:
        config = self.config
        if not 0 <= config.port <= 65535:
            raise ValueError(f"port must be within 0-65535 (0: any free port), got {config.port}")
        cluster = load_cluster(config.cluster)
        tls = _tls_pair(config.tls_cert, config.tls_key) if config.tls_cert and config.tls_key else None
        self._lock = lock_journal(config.db)
        try:
            return await self._start(config, cluster, tls)
        except BaseException:
            with contextlib.suppress(Exception):  # what started is stopped; the lock is let go
                await self.stop(grace=0)
            raise

    async def _start(self, config: ServerConfig, cluster, tls: tuple[bytes, bytes] | None) -> int:
        store = Store(config.db)
        store.bind_cluster(cluster.name)
        loaded = store.load()
        journaled = loaded[1] if loaded else {}
        settings = Settings()
        for f in fields(Settings):
            given = getattr(config, f.name, None)
            value = given if given is not None else journaled.get(f.name, getattr(settings, f.name))
            setattr(settings, f.name, value)
        settings.check()
        engine = RoundEngine(cluster, settings.policy_object(), lease_s=settings.lease_s,
                             coalesce_s=settings.coalesce_s, expiry_window_s=settings.expiry_window_s,
                             rank=settings.rank, secret=store.lottery_secret(), reclaim=settings.reclaim,
                             admission=make_admission(config.admission))
        if loaded is not None:
            engine.restore(loaded[0])
            log.info("journal restored", extra={"fields": {
                "apps": len(engine.apps), "leases": len(engine.leases), "round_id": engine.round_id}})
        bus = make_bus(config.mqtt, client_id=f"themis-arbiter-{cluster.name}-{os.getpid()}",
                       will_topic=arbiter_status_topic(cluster.name))
        metrics = ServiceMetrics()
        metrics.bind_bus(lambda: bus.connected, lambda: getattr(bus, "pending", 0), lambda: bus.dropped)
        service = ArbiterService(engine, store, bus, settings=settings, admin_token=admin_token_for(config),
                                 metrics=metrics, profiles=model_slowdowns(config.profiles), limits=config.limits)
        self.service = service
        if config.contention:
            service.contention = ServiceContention.load(config.contention, engine, service.models)
        service.journal()
        await bus.start()
        service.republish_state()

        server = grpc.aio.server(options=KEEPALIVE + NO_PORT_SHARING, interceptors=[ParseGuard()])
        self._server = server
        pb_grpc.add_ArbiterServicer_to_server(service, server)
        health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        address = f"{config.host}:{config.port}"
        try:
            if tls is not None:
                self.port = server.add_secure_port(address, grpc.ssl_server_credentials([tls]))
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc says only "Failed to bind to address"
            raise OSError(f"cannot listen on {address}: the port is taken or the host is not an address "
                          f"of this machine ({exc})") from None
        if not self.port:
            raise OSError(f"cannot listen on {address}")
        await server.start()
        for name in HEALTH_NAMES:
            await _set_serving(health_servicer, name)
        metrics.serving.set(1)
        if config.metrics_port is not None:
            self._metrics_http = metrics.serve(config.metrics_port, config.metrics_host,
                                               tls=(config.tls_cert, config.tls_key) if tls else None)
        if config.http is not None:
            self.dashboard = await self._serve_dashboard(config, service, settings)
        self._tasks = [asyncio.create_task(service.run_rounds()), asyncio.create_task(service.heartbeats()),
                       asyncio.create_task(self._watch_health(health_servicer))]
        if config.mqtt:
            self._tasks.append(asyncio.create_task(service.sweep_retained()))
        log.info("serving", extra={"fields": {"address": f"{config.host}:{self.port}", "cluster": cluster.name,
                                              "gpus": cluster.size, "db": str(config.db),
                                              "mqtt": config.mqtt or "in-memory", **asdict(settings),
                                              "admission": engine.admission.spec()}})
        return self.port

    async def _serve_dashboard(self, config: ServerConfig, service: ArbiterService, settings: Settings):
        """The page and its API in this event loop, fed by a sink of the service's events."""
        from arbiter.dashboard.access import store_verifier, tls_context
        from arbiter.dashboard.live import DashboardSink
        from arbiter.dashboard.server import start

        host, port = split_http(config.http)
        sink = DashboardSink(service.engine, asdict(settings), title=f"Themis: {service.cluster}",
                             bound_model_of=service.models.get, connected=lambda app: app in service.conns)
        service.publisher.attach(sink)
        tls = tls_context(config.tls_cert, config.tls_key) if config.tls_cert and config.tls_key else None
        dashboard = await start(host, port, sink.source, verify=store_verifier(service.store), ssl_context=tls)
        log.info("dashboard", extra={"fields": {"url": dashboard.url}})
        return dashboard

    async def _watch_health(self, servicer) -> None:
        """Health follows the service (issue 12, item 5): NOT_SERVING while the journal fails, and
        for a while after the event loop stalled (a timer ran more than STALL_S late)."""
        loop = asyncio.get_running_loop()
        service, metrics = self.service, self.service.metrics
        serving, stalled_until = True, 0.0
        while True:
            started = loop.time()
            await asyncio.sleep(HEALTH_TICK_S)
            lag = max(0.0, loop.time() - started - HEALTH_TICK_S)
            metrics.loop_lag.set(lag)
            if lag > STALL_S:
                service.problems["loop"] = f"the event loop stalled for {lag:.1f} s"
                stalled_until = loop.time() + STALL_HOLD_S
            elif "loop" in service.problems and loop.time() > stalled_until:
                del service.problems["loop"]
            ok = not service.problems
            if ok != serving:
                serving = ok
                status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
                for name in HEALTH_NAMES:
                    await _set_serving(servicer, name, status)
                metrics.serving.set(1 if ok else 0)
                log.warning("health", extra={"fields": {"serving": ok, "problems": dict(service.problems)}})

    async def stop(self, grace: float = 1.0, why: str | None = None) -> None:
        """Stop serving: every stream gets its Goodbye (``shutting_down``), the journal is closed.
        With ``why`` (the signal, for ``serve``), its last log line says what the journal keeps:
        "arbiter stopped (SIGTERM): N apps, M leases journaled" (issue 36, item 5)."""
        said = self._stopping_line(why) if why is not None and self.port is not None else None
        if self.service is not None:
            self.service.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.stop(grace)
        if self._metrics_http is not None:
            self._metrics_http[0].shutdown()
        if self.dashboard is not None:
            await self.dashboard.stop()
            self.dashboard = None
        if self.service is not None:
            await self.service.bus.stop()
            self.service.store.close()
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
        if said is not None:
            log.log(said[0], said[1], extra={"fields": said[2]})

    def _stopping_line(self, why: str) -> tuple[int, str, dict]:
        """What the stop line says, read before the engine is let go: apps and leases (all journaled at
        every change, so a restart on the same --db restores them), or that the journal is failing."""
        service = self.service
        if service is None:
            return logging.INFO, f"arbiter stopped ({why})", {"signal": why}
        apps, leases = len(service.engine.apps), len(service.engine.leases)
        fields = {"signal": why, "apps": apps, "leases": leases, "round_id": service.engine.round_id,
                  "db": str(self.config.db)}
        failing = service.problems.get("journal")
        if failing:
            return (logging.ERROR, f"arbiter stopped ({why}): {apps} apps, {leases} leases; NOT all journaled "
                                   f"({failing}): a restart loses the changes since the last write", fields)
        return (logging.INFO, f"arbiter stopped ({why}): {apps} app{'' if apps == 1 else 's'}, {leases} "
                              f"lease{'' if leases == 1 else 's'} journaled in {self.config.db}", fields)

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


def split_http(spec: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8080`` for IPv6) of ``serve --http``, checked."""
    host, sep, port = spec.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--http {spec!r}: expected HOST:PORT, e.g. 127.0.0.1:8080 (port 0-65535)")
    return host.strip("[]"), int(port)


def _tls_pair(cert: Path, key: Path) -> tuple[bytes, bytes]:
    """(key, chain) read and checked before binding: a file that is not PEM made grpc fail with
    "Failed to bind to address", which sent operators after the port."""
    out = []
    for flag, path, marker in (("--tls-key", key, b"PRIVATE KEY-----"),
                               ("--tls-cert", cert, b"-----BEGIN CERTIFICATE-----")):
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ValueError(f"{flag} {path}: {exc.strerror}") from None
        if marker not in data:
            raise ValueError(f"{flag} {path}: not a PEM {'private key' if flag == '--tls-key' else 'certificate'}")
        out.append(data)
    return out[0], out[1]


async def _set_serving(servicer, name: str, status=health_pb2.HealthCheckResponse.SERVING) -> None:
    result = servicer.set(name, status)
    if asyncio.iscoroutine(result):
        await result
