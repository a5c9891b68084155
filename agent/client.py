"""The agent's side of the wire: one outgoing gRPC stream to the arbiter (paper Figure 7).

:class:`AgentClient` connects (the agent dials out), says Hello, answers rho requests and offers
with the real fairness and bidding code (``agent.agent.Agent``), keeps the app's leases from grants,
revocations and the Welcome a (re)connection brings, and sends releases and demand updates. When
the stream breaks -- the arbiter restarted, the network blinked -- it reconnects with exponential
backoff and jitter, and the Welcome tells it which leases it still holds: jobs on those GPUs go on.

Callbacks (``on_grant``, ``on_revoke``) let the app's job runner start and stop jobs; the client
itself never blocks the event loop for longer than one report or bid computation.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from agent.agent import Agent
from protos import themis_pb2 as pb
from protos import themis_pb2_grpc as pb_grpc
from protos import wire
from protos.messages import Position

log = logging.getLogger("themis.agent")


@dataclass(frozen=True)
class HeldGpu:
    gpu: str
    position: Position
    expires_at: float


def channel(target: str, tls_ca: bytes | None = None) -> grpc.aio.Channel:
    options = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
               ("grpc.keepalive_permit_without_calls", 1)]
    if tls_ca is not None:
        return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(tls_ca), options=options)
    return grpc.aio.insecure_channel(target, options=options)


async def register(target: str, app: str, token: str, *, tls_ca: bytes | None = None) -> str:
    """Trade an admin-issued registration token for the app's credential."""
    async with channel(target, tls_ca) as ch:
        reply = await pb_grpc.ArbiterStub(ch).Register(
            pb.RegisterRequest(app=app), metadata=[("authorization", f"Bearer {token}")], timeout=10)
    return reply.credential


async def issue_token(target: str, app: str, admin_token: str, *, tls_ca: bytes | None = None) -> str:
    async with channel(target, tls_ca) as ch:
        reply = await pb_grpc.ArbiterStub(ch).IssueToken(
            pb.IssueTokenRequest(app=app), metadata=[("authorization", f"Bearer {admin_token}")], timeout=10)
    return reply.token


@dataclass
class AgentClient:
    agent: Agent
    app: str
    target: str
    credential: str
    tls_ca: bytes | None = None
    on_grant: Callable[[dict[str, HeldGpu]], None] | None = None
    on_revoke: Callable[[list[str], str], None] | None = None
    backoff_s: tuple[float, float] = (0.2, 10.0)
    held: dict[str, HeldGpu] = field(default_factory=dict)
    rejections: list[pb.Rejection] = field(default_factory=list)
    connects: int = 0
    rounds_answered: int = 0

    def __post_init__(self) -> None:
        self._out: asyncio.Queue | None = None
        self._stop = asyncio.Event()
        self.welcomed = asyncio.Event()
        self.finished = False
        self.cluster = ""  # the arbiter's cluster name, from the Welcome
        self._released: set[str] = set()

    # -- what the app does -----------------------------------------------------------------------

    def _put(self, message: pb.AgentMessage) -> None:
        if self._out is not None:
            self._out.put_nowait(message)

    def release(self, gpus) -> None:
        """Give GPUs back before their leases end (the jobs on them finished)."""
        gpus = sorted(set(gpus) & set(self.held))
        if gpus:
            for g in gpus:
                del self.held[g]
            self._released |= set(gpus)  # sent again after a reconnect if the Welcome still lists them
            self._put(pb.AgentMessage(release=pb.Release(app=self.app, gpus=gpus)))

    def set_demand(self, demand: int) -> None:
        self._put(pb.AgentMessage(demand=pb.DemandUpdate(app=self.app, demand=demand)))

    def done(self) -> None:
        """The app finished: its leases end and it leaves the rounds; the client then stops."""
        self.finished = True
        self._put(pb.AgentMessage(done=pb.Done(app=self.app)))

    def stop(self) -> None:
        self._stop.set()
        self._put(None)  # type: ignore[arg-type]

    # -- the connection --------------------------------------------------------------------------

    async def run(self) -> None:
        """Stay connected until :meth:`stop` (or the app is done): reconnect with backoff."""
        delay = self.backoff_s[0]
        while not self._stop.is_set():
            try:
                await self._session()
                delay = self.backoff_s[0]
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    log.error("arbiter refused %s: %s", self.app, exc.details())
                    raise
                log.info("stream to %s lost (%s); retrying in %.1f s", self.target, exc.code().name, delay)
            if self.finished or self._stop.is_set():
                break
            self.welcomed.clear()
            try:
                await asyncio.wait_for(self._stop.wait(), delay * random.uniform(0.8, 1.2))
            except TimeoutError:
                pass
            delay = min(self.backoff_s[1], delay * 2)

    async def _session(self) -> None:
        self._out = asyncio.Queue()
        self._put(pb.AgentMessage(hello=pb.Hello(app=self.app, demand=self.agent.app.demand_now())))
        if self.finished:  # Done was said while the stream was down: say it again
            self._put(pb.AgentMessage(done=pb.Done(app=self.app)))

        async def outgoing():
            while True:
                msg = await self._out.get()
                if msg is None:
                    return
                yield msg
                if msg.WhichOneof("kind") == "done":
                    return

        async with channel(self.target, self.tls_ca) as ch:
            call = pb_grpc.ArbiterStub(ch).Connect(outgoing(), metadata=[("authorization", f"Bearer {self.credential}")])
            self.connects += 1
            async for msg in call:
                self._handle(msg)
                if self._stop.is_set():
                    call.cancel()
                    break

    def _handle(self, msg: pb.ArbiterMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "welcome":
            now_held = {x.gpu: x for x in msg.welcome.leases}
            where = wire.positions(msg.welcome.places)
            self.cluster = msg.welcome.cluster
            again = sorted(self._released & set(now_held))  # released while the stream was down
            self._released = set()
            for g in again:
                del now_held[g]
            if again:
                self._put(pb.AgentMessage(release=pb.Release(app=self.app, gpus=again)))
                self._released = set(again)
            lost = sorted(set(self.held) - set(now_held))
            self.held = {g: HeldGpu(g, where.get(g, ("", "", "")), x.expires_at) for g, x in now_held.items()}
            if lost and self.on_revoke:
                self.on_revoke(lost, "not held after reconnecting")
            self.welcomed.set()
        elif kind == "rho_request":
            request = wire.rho_request(msg.rho_request, self.app)
            self._refresh_positions(request.held)
            report = self.agent.report(request)
            self._put(pb.AgentMessage(report=wire.report_pb(report, request.round_id, self.app)))
        elif kind == "offer":
            offer = wire.offer(msg.offer)
            self._refresh_positions(offer.held)
            table = self.agent.bid(offer)
            self._put(pb.AgentMessage(bid=wire.bid_pb(table, offer.round_id, self.app)))
            self.rounds_answered += 1
        elif kind == "grant":
            got = {p.gpu: HeldGpu(p.gpu, (p.rack, p.machine, p.slot), msg.grant.expires_at) for p in msg.grant.gpus}
            self.held.update(got)
            if self.on_grant:
                self.on_grant(got)
        elif kind == "revocation":
            gone = [g for g in msg.revocation.gpus if g in self.held]
            for g in gone:
                del self.held[g]
            if self.on_revoke:
                self.on_revoke(list(msg.revocation.gpus), msg.revocation.reason)
        elif kind == "rejection":
            self.rejections.append(msg.rejection)
            log.warning("arbiter rejected %s's %s: %s", self.app, msg.rejection.what, msg.rejection.reason)

    def _refresh_positions(self, held: dict[str, Position]) -> None:
        for g, p in held.items():
            if g in self.held and self.held[g].position != p:
                self.held[g] = HeldGpu(g, p, self.held[g].expires_at)

    def positions(self) -> list[Position]:
        return [h.position for h in self.held.values()]
