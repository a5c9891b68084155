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
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from agent.agent import Agent
from agent.contention_pricing import ContentionPricing
from arbiter.contention import ContentionError, load_table
from protos import exits, wire
from protos import themis_pb2 as pb
from protos import themis_pb2_grpc as pb_grpc
from protos.exits import Stopped, rpc_cause
from protos.messages import Neighbour, Position, RunningJob
from protos.rpc import bearer, channel, issue_token, register

__all__ = ["AgentClient", "AgentStopped", "HeldGpu", "NoCredential", "channel", "issue_token", "register",
           "register_or_stop"]

log = logging.getLogger("themis.agent")

FATAL = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.ALREADY_EXISTS)
SILENT_HEARTBEATS = 3  # a stream without any message for this many heartbeat intervals is broken
DONE_RETRY_S = 20.0  # how long a finished agent goes on connecting to say Done until the arbiter acknowledges it
FIRST_NOTICE_S = 5.0  # never welcomed for this long: one warning that the arbiter cannot be reached yet


@dataclass(frozen=True)
class HeldGpu:
    gpu: str
    position: Position
    expires_at: float


#: why the agent stopped -> exit code (protos.exits; docs/agents.md's table)
EXIT_CODES = {"unreachable": exits.UNREACHABLE, "refused": exits.REFUSED, "revoked": exits.REFUSED,
              "no_credential": exits.REFUSED, "removed": exits.REMOVED, "replaced": exits.REPLACED}


class AgentStopped(Stopped):
    """The agent cannot go on (issue 11 item 3, issue 12 item 1, issue 36 item 4): the arbiter
    removed the app, revoked its credential, another agent replaced it, it refused the credential or
    the registration token, or it could not be reached before ``first_connect_timeout_s``. ``why``
    is the Goodbye's (or "refused", "unreachable", "no_credential"); ``reason`` says it for people,
    ``fix`` what to do; ``str()`` is one line, ``exit_code`` what ``themis-agent`` exits with."""

    def __init__(self, why: str, reason: str, fix: str | None = None, exit_code: int | None = None):
        super().__init__(why, reason, fix, EXIT_CODES.get(why, exits.FAILED) if exit_code is None else exit_code)


class NoCredential(AgentStopped, ValueError):
    """Neither a credential (given, or kept in the credential file) nor a registration token."""


def new_token_fix(app: str, credential_file: object = None) -> str:
    """What to do when the app's credential no longer works (revoked, registered again elsewhere)."""
    first = f"delete {credential_file}, then " if credential_file else ""
    return (f"{first}run with a new registration token: themis-arbiter issue-token {app}, given with --token "
            f"(AppRunner: token=)")


async def register_or_stop(target: str, app: str, token: str, *, tls_ca: bytes | None = None) -> str:
    """:func:`register`, with what a refusal or an unreachable arbiter means said in one line
    (:class:`AgentStopped`) instead of gRPC's multi-line error."""
    try:
        return await register(target, app, token, tls_ca=tls_ca)
    except grpc.aio.AioRpcError as exc:
        stopped = exits.rpc_stopped(
            exc, target, what=f"registration token for {app!r}", tls=tls_ca is not None,
            refused_fix=f"a registration token is good for one registration: ask an admin for a new one "
                        f"(themis-arbiter issue-token {app}); later runs use the credential it buys "
                        f"(--credential-file, AppRunner: credential_file=) and need no token")
        raise AgentStopped(stopped.why, stopped.reason, stopped.fix, stopped.exit_code) from None


def _pricing(table: str, cls: str) -> ContentionPricing | None:
    """D36: what the agent prices an offer's neighbourhood with, from the table and class the arbiter
    names; None (it bids unaware) when this machine cannot read that table."""
    try:
        return ContentionPricing(load_table(table), cls)
    except ContentionError as exc:
        log.warning("bids price no contention: %s", exc)
        return None


class _Silent(Exception):
    """No message (not even a heartbeat) for too long: the stream is broken."""


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
    connect_timeout_s: float = 10.0  # one attempt: dial, Hello, Welcome
    take_over: bool = False  # replace a live stream of the app at the first connect (--take-over)
    first_connect_timeout_s: float | None = 120.0  # never welcomed for this long: AgentStopped("unreachable")
    credential_file: object = None  # where the credential came from, named in what to do when it is refused
    #: D35, while the arbiter models contention: its table and this app's class, and the other apps'
    #: jobs on the machines it holds GPUs on (a Neighbourhood message); None / empty otherwise
    contention: tuple[str, str] | None = None
    neighbourhood: dict[str, tuple[Neighbour, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.agent.name:
            # The name orders the app's equally good containers its own way (D7): without it every
            # unnamed agent bid on the same GPUs, and the service's mass-expiry auctions placed none.
            self.agent.name = self.app
        self._out: asyncio.Queue | None = None
        self._stop = asyncio.Event()
        self.welcomed = asyncio.Event()
        self.finished = False
        self.cluster = ""  # the arbiter's cluster name, from the Welcome
        self._released: dict[str, int] = {}  # GPU -> known_round when it was released
        self.known_round = 0  # the latest round whose leases this agent knows of (Grants, the Welcome)
        self.heartbeat_s = 10.0  # from the Welcome
        self.heard_at = -float("inf")  # time.monotonic() of the last message from the arbiter
        self.goodbye: pb.Goodbye | None = None  # the last stream's final message, if the arbiter ended it
        self.ever_welcomed = False
        self._done_at: float | None = None  # time.monotonic() of done()
        self._lost_since: float | None = None  # time.monotonic() the stream was lost after a Welcome, till the next
        self._lost_said = ""  # the cause last warned of while it is lost
        self._jobs: tuple[RunningJob, ...] = ()  # the running jobs last reported (D35)

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
            # sent again after a reconnect if the Welcome still lists the lease let go of (not a later one)
            self._released.update(dict.fromkeys(gpus, self.known_round))
            self._put(pb.AgentMessage(release=pb.Release(app=self.app, gpus=gpus, known_round=self.known_round)))

    def set_demand(self, demand: int) -> None:
        self._put(pb.AgentMessage(demand=pb.DemandUpdate(app=self.app, demand=demand)))

    def report_jobs(self, jobs) -> None:
        """D35: the app's running jobs now (``RunningJob``s). Sent only while the arbiter models
        contention (it said so with a Neighbourhood); kept, and sent again after a reconnect."""
        self._jobs = tuple(jobs)
        if self.contention is not None:
            self._put(pb.AgentMessage(jobs=wire.running_jobs_pb(self.app, self._jobs)))

    def done(self) -> None:
        """The app finished: its leases end and it leaves the rounds; the client then stops."""
        self.finished = True
        self._done_at = time.monotonic()
        self._put(pb.AgentMessage(done=pb.Done(app=self.app)))

    def stop(self) -> None:
        self._stop.set()
        self._put(None)  # type: ignore[arg-type]

    # -- the connection --------------------------------------------------------------------------

    async def run(self) -> None:
        """Stay connected until :meth:`stop` (or the app is done): reconnect with backoff.

        Raises :class:`AgentStopped` when going on is pointless: the arbiter ended the stream
        for good (removed, revoked, replaced; every held GPU is reported lost first), refused the
        credential, or was never reached within ``first_connect_timeout_s``."""
        delay = self.backoff_s[0]
        started = time.monotonic()
        noticed = False
        while not self._stop.is_set():
            self.goodbye = None
            problem = None
            try:
                await self._session()
            except grpc.aio.AioRpcError as exc:
                if self.goodbye is None and exc.code() in FATAL:
                    log.debug("arbiter refused %s: %s: %s", self.app, exc.code().name, exc.details())
                    raise self._refused(exc) from exc
                problem = rpc_cause(exc)
            except _Silent as exc:
                problem = str(exc)
            bye = self.goodbye
            if bye is not None and not bye.reconnect:
                if bye.why == "finished":
                    break
                raise self._ended(bye)
            if self._stop.is_set() or (self.finished and not self._say_done_again()):
                break
            if self.welcomed.is_set():
                delay = self.backoff_s[0]  # the session worked: start the backoff over
            if bye is not None:
                problem = f"{bye.why}: {bye.reason}"
            waited = time.monotonic() - started
            pause = delay * random.uniform(0.8, 1.2)
            if not self.ever_welcomed:
                # Never connected: one line at the end (AgentStopped "unreachable"), and one notice
                # meanwhile if that takes a while -- not a warning per try.
                limit = self.first_connect_timeout_s
                if limit is not None and waited > limit:
                    stopped = exits.unreachable(self.target, f"no Welcome in {waited:.0f} s; last: "
                                                             f"{problem or 'stream ended'}", tls=self.tls_ca is not None)
                    raise AgentStopped(stopped.why, stopped.reason, stopped.fix)
                if waited > FIRST_NOTICE_S and not noticed:
                    noticed = True
                    log.warning("%s cannot reach the arbiter at %s yet (%s); trying again%s", self.app, self.target,
                                problem or "stream ended", f" for up to {limit:.0f} s" if limit is not None else "")
                else:
                    log.debug("%s: no arbiter at %s (%s); trying again in %.1f s", self.app, self.target,
                              problem or "stream ended", pause)
            else:
                # one warning per cause, not one per try while the arbiter restarts; the Welcome that
                # ends the outage says so (_handle)
                cause = problem or "ended by the arbiter"
                if self._lost_since is None or cause != self._lost_said:
                    log.warning("stream of %s to %s lost (%s); reconnecting in %.1f s", self.app, self.target,
                                cause, pause)
                else:
                    log.debug("still no stream of %s to %s (%s); trying again in %.1f s", self.app, self.target,
                              cause, pause)
                self._lost_said = cause
                if self._lost_since is None:
                    self._lost_since = time.monotonic()
            self.welcomed.clear()
            try:
                await asyncio.wait_for(self._stop.wait(), pause)
            except TimeoutError:
                pass
            delay = min(self.backoff_s[1], delay * 2)

    def _refused(self, exc: grpc.aio.AioRpcError) -> AgentStopped:
        """The arbiter refused the stream itself (no Goodbye): what that means, and what to do."""
        code, details = exc.code(), exc.details() or ""
        said = f"{code.name}: {' '.join(details.split())}"
        if code == grpc.StatusCode.ALREADY_EXISTS:  # the arbiter's reason names the way out already
            return AgentStopped("refused", said, None, exits.REPLACED)
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return AgentStopped("refused", f"the arbiter at {self.target} refused the credential of {self.app!r} "
                                           f"({said})", new_token_fix(self.app, self.credential_file))
        return AgentStopped("refused", f"the arbiter at {self.target} refused {self.app!r} ({said})",
                            "each credential is good for the one app it was issued for: check the app name, or "
                            + new_token_fix(self.app, self.credential_file))

    def _ended(self, bye: pb.Goodbye) -> AgentStopped:
        """The arbiter ended the stream for good (a Goodbye without reconnect)."""
        fixes = {
            "removed": "to run it again, " + new_token_fix(self.app, self.credential_file),
            "revoked": new_token_fix(self.app, self.credential_file),
            "replaced": f"another agent of {self.app!r} runs it now (it connected with --take-over); if that was "
                        "not meant, stop that one and start this one with --take-over (AppRunner: take_over=True)",
        }
        return AgentStopped(bye.why, bye.reason, fixes.get(bye.why))

    def _say_done_again(self) -> bool:
        """The app is done but no Goodbye "finished" came: its Done went out on a stream that broke
        before the arbiter read it. Connect again to say it (``_session`` does), for a while: else the
        arbiter kept the finished app and its leases, GPUs nobody used, until they ran out."""
        if self._done_at is not None and time.monotonic() - self._done_at <= DONE_RETRY_S:
            return True
        log.warning("%s could not tell %s that it is done; its leases end when they run out", self.app, self.target)
        return False

    async def _session(self) -> None:
        out: asyncio.Queue = asyncio.Queue()  # this stream's own: a later stream never reads it
        self._out = out
        # after a Welcome, every reconnect takes over: the old stream is this agent's own, which the
        # arbiter may not have found dead yet
        self._put(pb.AgentMessage(hello=pb.Hello(app=self.app, demand=self.agent.app.demand_now(),
                                                 take_over=self.take_over or self.ever_welcomed)))
        if self.finished:  # Done was said while the stream was down: say it again
            self._put(pb.AgentMessage(done=pb.Done(app=self.app)))

        async with channel(self.target, self.tls_ca) as ch:
            # Written by a task of ours, not by an async generator handed to gRPC: gRPC cancels the
            # task consuming such a generator only while the call is live, so each stream that failed
            # (the arbiter restarting) left one pending on its queue, and at exit Python reported
            # "Task was destroyed but it is pending!" and "cannot reuse already awaited coroutine".
            call = pb_grpc.ArbiterStub(ch).Connect(metadata=bearer(self.credential))
            self.connects += 1
            writer = asyncio.create_task(self._write(call, out), name=f"themis-agent-{self.app}-send")
            try:
                while True:
                    # Before the Welcome: the connect timeout; then any message (heartbeats come
                    # every heartbeat_s) must arrive within SILENT_HEARTBEATS intervals.
                    wait = SILENT_HEARTBEATS * self.heartbeat_s if self.welcomed.is_set() else self.connect_timeout_s
                    try:
                        msg = await asyncio.wait_for(call.read(), wait)
                    except TimeoutError:
                        what = "a heartbeat" if self.welcomed.is_set() else "the Welcome"
                        raise _Silent(f"no message for {wait:.1f} s (waiting for {what})") from None
                    if msg is grpc.aio.EOF:
                        return
                    self._handle(msg)
                    if self._stop.is_set():
                        return
            finally:
                call.cancel()
                writer.cancel()
                await asyncio.wait([writer])  # ended before the channel closes; never left pending

    @staticmethod
    async def _write(call, out: asyncio.Queue) -> None:
        """Send what the app puts on this stream's queue until None (stop) or Done, then half-close."""
        try:
            while True:
                msg = await out.get()
                if msg is None:
                    break
                await call.write(msg)
                if msg.WhichOneof("kind") == "done":
                    break
            await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
            log.debug("stream closed while sending: %s", exc)  # the call ended: its reader says why

    def hears_arbiter(self, within_s: float) -> bool:
        """Welcomed on a stream that brought a message (a heartbeat at least) in the last ``within_s``
        seconds: a stream that went silent is only found broken after three heartbeat intervals."""
        return self.welcomed.is_set() and time.monotonic() - self.heard_at <= within_s

    def _handle(self, msg: pb.ArbiterMessage) -> None:
        self.heard_at = time.monotonic()
        kind = msg.WhichOneof("kind")
        if kind == "welcome":
            now_held = {x.gpu: x for x in msg.welcome.leases}
            where = wire.positions(msg.welcome.places)
            self.cluster = msg.welcome.cluster
            self.known_round = max([self.known_round] + [x.round_id for x in msg.welcome.leases])
            # released while the stream was down: the lease the agent let go of, not one a later
            # round granted back (its Grant may have been lost with the stream)
            again = sorted(g for g, at in self._released.items() if g in now_held and now_held[g].round_id <= at)
            self._released = {}
            for g in again:
                del now_held[g]
            if again:
                self._put(pb.AgentMessage(release=pb.Release(app=self.app, gpus=again, known_round=self.known_round)))
                self._released = dict.fromkeys(again, self.known_round)
            lost = sorted(set(self.held) - set(now_held))
            self.held = {g: HeldGpu(g, where.get(g, ("", "", "")), x.expires_at) for g, x in now_held.items()}
            self.heartbeat_s = msg.welcome.heartbeat_s or self.heartbeat_s
            if lost and self.on_revoke:
                self.on_revoke(lost, "not held after reconnecting")
            if msg.welcome.took_over and not self.ever_welcomed:
                log.warning("%s took over from another agent of the same name, which the arbiter stopped", self.app)
            if self._lost_since is not None:
                log.warning("%s reconnected to %s after %.1f s; holds %d GPU%s", self.app, self.target,
                            time.monotonic() - self._lost_since, len(self.held), "" if len(self.held) == 1 else "s")
                self._lost_since, self._lost_said = None, ""
            self.contention = None  # a Neighbourhood follows if the arbiter models contention
            self.neighbourhood = {}
            self.ever_welcomed = True
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
            self.known_round = max(self.known_round, msg.grant.round_id)
            if self.on_grant:
                self.on_grant(got)
        elif kind == "revocation":
            gone = [g for g in msg.revocation.gpus if g in self.held]
            for g in gone:
                del self.held[g]
            if self.on_revoke:
                self.on_revoke(list(msg.revocation.gpus), msg.revocation.reason)
        elif kind == "neighbourhood":
            told = msg.neighbourhood
            first = self.contention is None
            self.contention = (told.table, told.cls)
            self.neighbourhood = wire.neighbourhood(told.neighbours)
            if first and told.cls and self.agent.contention is None:
                self.agent.contention = _pricing(told.table, told.cls)
            if first and self._jobs:
                self._put(pb.AgentMessage(jobs=wire.running_jobs_pb(self.app, self._jobs)))
        elif kind == "rejection":
            self.rejections.append(msg.rejection)
            log.warning("arbiter rejected %s's %s: %s", self.app, msg.rejection.what, msg.rejection.reason)
        elif kind == "goodbye":
            bye = self.goodbye = msg.goodbye
            # said by AgentStopped when it is for good (removed, revoked, replaced), else by the
            # warning that the stream was lost: a warning here said it twice
            log.info("arbiter ended the stream of %s (%s): %s", self.app, bye.why, bye.reason)
            if not bye.reconnect and bye.why != "finished":
                lost = sorted(self.held)  # the app is gone from the arbiter: nothing is held any more
                self.held = {}
                if lost and self.on_revoke:
                    self.on_revoke(lost, bye.reason)

    def _refresh_positions(self, held: dict[str, Position]) -> None:
        for g, p in held.items():
            if g in self.held and self.held[g].position != p:
                self.held[g] = HeldGpu(g, p, self.held[g].expires_at)

    def positions(self) -> list[Position]:
        return [h.position for h in self.held.values()]
