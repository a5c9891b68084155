"""The agents' streams: one gRPC ``Connect`` stream per app, and everything said on it (paper 4.2).

An agent's stream starts with its Hello (checked: credential, name, demand, rate, a live stream of
the same app), gets a Welcome with its leases and the settings, then carries rho reports, bids,
releases, demand updates and Done from the agent, and rho requests, offers, grants, revocations,
rejections and heartbeats from the arbiter. Every message from an agent is checked: an app acts
only for itself (PERMISSION_DENIED), and a report or bid that is malformed, unparsable, late or
for a stale round is rejected with INVALID_ARGUMENT and a reason, on the stream, which stays open;
the round goes on for everyone else. Every stream the arbiter ends gets a Goodbye and a status
saying why (:class:`~arbiter.connection.StreamEnd`).

With a contention model on (``serve --contention``, D35) a stream also carries the agent's running
jobs (``RunningJobs``) and, from the arbiter, who runs on the app's machines (``Neighbourhood``),
sent after the Welcome and whenever it changes; the jobs' ratios are published from here too.

The streams are also a sink of the service's events (:meth:`AgentStreams.consume`): grants,
revocations and rejections reach the agents from the one event stream, after the journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from arbiter.auction import InvalidBid, validate_bid
from arbiter.connection import DENIED, INVALID, Connection, StreamEnd, Unparsable, bearer, quote
from arbiter.events import check_segment
from arbiter.limits import TokenBucket
from arbiter.publisher import (
    AgentConnected,
    AgentDisconnected,
    AppArrived,
    AppIdle,
    AppLeft,
    DemandChanged,
    Granted,
    JobsContention,
    LeasesChanged,
    Refused,
    Released,
    Revoked,
    ServiceEvent,
    StreamRefused,
)
from arbiter.rounds import InvalidReport, cut_reason
from arbiter.service_contention import JobContention, JobsRefused
from arbiter.service_core import ServiceCore
from protos import themis_pb2 as pb
from protos import wire

log = logging.getLogger("themis.arbiter")

MAX_APPS = 10_000  # apps known to the arbiter (registered or running): rows per journal write
MAX_BID_ROWS = 303  # D7's 15 rows x 18 counts, D18's 32 single GPUs, the previous GPUs; bounds the auction's work
GOODBYE_WAIT_S = 1.0  # a write that takes longer means flow control holds it: the agent is not reading


async def _take_first(request_iterator, wait_s: float) -> None:
    """Read (and drop) the stream's first message, or give up after ``wait_s``.

    A stream refused while the agent's Hello is still being written races that write against the
    status: when the write fails after the status, grpcio's asyncio client reports INTERNAL and
    loses the status (grpc/grpc#36066). An agent told INTERNAL retries where UNAUTHENTICATED would
    stop it, so the refusal waits for the Hello it is sending."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(anext(request_iterator.__aiter__()), wait_s)


class AgentStreams:
    """The ``Connect`` handler of one service and the messages on its streams."""

    def __init__(self, core: ServiceCore):
        self.core = core
        self._unauthenticated = 0  # streams with an unknown credential whose first message is awaited
        self._hellos = TokenBucket(core.limits.hellos, core.limits.per_s)
        # D35, with a contention model on: what each agent was last told, what was last published
        self._told: dict[str, bytes] = {}
        self._published: dict[str, tuple[JobContention, ...]] = {}
        self._refresh_due = False

    # -- the events agents hear ------------------------------------------------------------------

    def consume(self, event: ServiceEvent) -> None:
        core = self.core
        match event:
            case Granted():
                position = core.engine.cluster.position
                core.send(event.app, pb.ArbiterMessage(grant=pb.Grant(
                    round_id=event.round_id, gpus=wire.places({g: position(g) for g in event.gpus}),
                    expires_at=event.expires_at, source=event.source)))
            case Revoked():
                core.send(event.app, pb.ArbiterMessage(revocation=pb.Revocation(
                    gpus=list(event.gpus), reason=event.reason, round_id=event.round_id)))
            case Refused():
                core.send(event.app, pb.ArbiterMessage(rejection=pb.Rejection(
                    code=event.code, reason=event.reason, what=event.what, round_id=event.round_id)))
            case LeasesChanged() if core.contention is not None:
                self.contention_changed()
            case AppLeft() if core.contention is not None:
                core.contention.forget(event.app)
                self.contention_changed()

    def end_all(self, end: StreamEnd) -> None:
        for conn in list(self.core.conns.values()):
            conn.end(end)

    # -- a stream --------------------------------------------------------------------------------

    async def _refuse(self, context, code: grpc.StatusCode, reason: str) -> None:
        """End a stream before its Welcome, counted by status (``themis_refused_streams``)."""
        self.core.emit(StreamRefused(now=self.core.clock(), code=code.name, reason=reason))
        log.info("stream refused", extra={"fields": {"code": code.name, "reason": reason}})
        await context.abort(code, reason)

    async def Connect(self, request_iterator, context) -> None:
        """The agent's stream. Written with ``context.write`` (not as a generator) so that every
        stream the arbiter ends gets a Goodbye and a status saying why -- even a stuck reader, whose
        status goes out in the trailers when its messages cannot."""
        core, engine = self.core, self.core.engine
        credential = bearer(context)
        app = core.store.token_app(credential, "credential") if credential else None
        limits = core.limits
        if app is None:
            if self._unauthenticated >= limits.unauthenticated:  # refused unread: no megabytes buffered
                await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"{limits.unauthenticated} streams without a known credential are being refused "
                                   "already (the limit); an app credential is required (Register first)")
            self._unauthenticated += 1
            try:
                await _take_first(request_iterator, limits.first_message_s)
            finally:
                self._unauthenticated -= 1
            await self._refuse(context, grpc.StatusCode.UNAUTHENTICATED,
                               "an app credential is required (Register first); this one is unknown or revoked")
        if not self._hellos.take(app):
            await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{app!r} connected more than {limits.hellos} times in a burst (the limit; "
                               f"{limits.per_s:g} more a second): wait and reconnect")
        try:
            first = await asyncio.wait_for(anext(request_iterator.__aiter__()), limits.hello_s)
        except StopAsyncIteration:  # said nothing, or an incomplete message, and closed: never OK
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                               "the stream ended before its Hello (no message, or an incomplete one)")
        except TimeoutError:
            await self._refuse(context, grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"no Hello within {limits.hello_s:g} s of connecting (the limit)")
        if isinstance(first, Unparsable):
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                               f"{first.reason}; the first message must be Hello")
        if first.WhichOneof("kind") != "hello":
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                               "the first message on the stream must be Hello")
        if first.hello.app != app:
            await self._refuse(context, grpc.StatusCode.PERMISSION_DENIED,
                               f"this credential belongs to {app!r}, not {quote([first.hello.app])[2:-2]!r}")
        if first.hello.demand < 0:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                               f"demand must be >= 0, got {first.hello.demand}")
        live = core.conns.get(app)
        if live is not None and live.ending is None and not first.hello.take_over:
            # a second agent of the same name used to take over silently and end the running
            # search; now it must ask (an agent reconnecting after a Welcome always does)
            await self._refuse(context, grpc.StatusCode.ALREADY_EXISTS,
                               f"{app!r} is connected on another stream (its agent is running); stop that agent, or "
                               "connect with take_over (themis-agent run --take-over) to replace it")
        # An app that said Done while a round was open leaves when that round closes; a Hello that
        # comes meanwhile waits for it, then starts the app afresh (else it would be removed under
        # a live stream: a "ghost app").
        while core._allocating or any(a == app for a, _ in core._deferred):
            await (core._allocated if core._allocating else core._between_rounds).wait()
        if core.store.token_app(credential, "credential") != app:  # revoked while it waited
            await self._refuse(context, grpc.StatusCode.UNAUTHENTICATED, "this credential was revoked")
        now = core.clock()
        new = app not in engine.apps
        if new:
            if len(engine.apps) >= MAX_APPS:
                await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"the arbiter runs at most {MAX_APPS} apps")
            engine.add_app(app, now, slowdown=core.slowdown_of(app))
        before = (engine.apps[app].demand, engine.apps[app].most, app in engine.idle)
        core._away.pop(app, None)
        engine.set_idle(app, False, now)  # back: counted and asked again
        engine.set_demand(app, first.hello.demand, now)
        engine.note_ready(app, now)
        # A reconnect that changes nothing journaled writes nothing: a flood of Hellos used to write
        # the whole journal each, and its latency turned health NOT_SERVING.
        if new or (engine.apps[app].demand, engine.apps[app].most, False) != before:
            events: list[ServiceEvent] = [AppArrived(now=now, app=app)] if new else []
            if before[2]:
                events.append(AppIdle(now=now, app=app, idle=False))
            if before[0] != first.hello.demand:
                events.append(DemandChanged(now=now, app=app, demand=first.hello.demand))
            core.commit(*events, wake=True)  # a failing journal must not refuse agents; health shows it
        else:
            core.kick()
        old = core.conns.get(app)
        if old is not None and old.ending is not None:
            old = None  # ending already: nothing to take over
        if old is not None:
            old.end(StreamEnd("replaced", f"another stream connected as {app!r} and replaced this one"))
        conn = Connection(app, last_seen=now, limit=core.outbox_limit)
        core.conns[app] = conn
        mine = core.leases_of(app)
        if core._round is not None:
            # Leases that ran out as the open round began are the app's until the round decides
            # (D13: it runs on them, and the round may grant them back); left out, the agent would
            # stop its jobs on them as lost while the round still offers them to it.
            mine += [x for x in core._round.expired if x.app == app]
            mine.sort(key=lambda x: x.gpu)
        position = engine.cluster.position
        conn.send(pb.ArbiterMessage(welcome=pb.Welcome(
            app=app, cluster=core.cluster, leases=[wire.lease_pb(x) for x in mine],
            settings=core.settings_pb(), now=now, heartbeat_s=core.settings.heartbeat_s,
            places=wire.places({x.gpu: position(x.gpu) for x in mine}), took_over=old is not None)))
        if core.contention is not None:  # D35: says a model runs, so the agent reports its jobs
            self._told.pop(app, None)
            self.tell_neighbourhood(app)
        core.emit(AgentConnected(now=now, app=app, took_over=old is not None, connected=len(core.conns)))
        log.info("connected", extra={"fields": {"app": app}})
        # The headers go out on their own before the first message: HTTP/2 flow control never holds
        # them, and a Welcome that flow control holds is then a pending message alone. Sent with the
        # Welcome, they made the status of a stream ended meanwhile a second send of headers
        # (TOO_MANY_OPERATIONS): the agent was never told.
        with contextlib.suppress(Exception):
            await context.send_initial_metadata(())
        await self._serve(conn, request_iterator, context)

    async def _serve(self, conn: Connection, request_iterator, context) -> None:
        """Write the stream's outbox until it ends; then the Goodbye and the status saying why."""
        core, app = self.core, conn.app
        reader = asyncio.create_task(self._read(conn, request_iterator))
        closed = asyncio.create_task(conn.closed.wait())
        get = write = None
        stuck = False
        try:
            while True:
                get = asyncio.create_task(conn.outbox.get())
                done, _ = await asyncio.wait({get, closed, reader}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    break
                write = asyncio.create_task(context.write(get.result()))
                done, _ = await asyncio.wait({write, closed}, return_when=asyncio.FIRST_COMPLETED)
                if write not in done:
                    done, _ = await asyncio.wait({write}, timeout=GOODBYE_WAIT_S)
                if write not in done:
                    stuck = True  # flow control holds the writes: the agent stopped reading
                    break
                if write.exception() is not None:
                    return  # the agent is gone
            end = conn.ending
            if end is None:
                return  # the agent closed its side: nothing to say
            log.info("stream ended", extra={"fields": {"app": app, "why": end.why, "reason": end.reason}})
            if not stuck:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(context.write(end.goodbye()), GOODBYE_WAIT_S)
            if end.status is not grpc.StatusCode.OK:
                if stuck:
                    context.set_code(end.status)
                    context.set_details(end.reason)
                    return
                await context.abort(end.status, end.reason)
        finally:
            for task in (reader, closed, get, write):
                if task is not None and not task.done():
                    task.cancel()
            if core.conns.get(app) is conn:
                del core.conns[app]
                self._told.pop(app, None)
                core._away[app] = core.clock()
            core.emit(AgentDisconnected(now=core.clock(), app=app, why=conn.ending.why if conn.ending else None,
                                        connected=len(core.conns)))
            log.info("disconnected", extra={"fields": {"app": app}})

    async def _read(self, conn: Connection, request_iterator) -> None:
        """Hands each message to its handler until the agent closes its side. A stream whose last
        message could not be read ends with INVALID_ARGUMENT and the parser's reason, not OK: the
        agent may have closed before the Rejection reached it."""
        core = self.core
        unreadable = None
        try:
            async for msg in request_iterator:
                if conn.ending is not None:
                    continue  # an ended stream speaks no more for the app (drained, not closed: see Connect)
                conn.last_seen = core.clock()
                unreadable = msg.reason if isinstance(msg, Unparsable) else None
                if unreadable is not None:
                    core.reject(conn.app, INVALID, unreadable, "message")
                    continue
                try:
                    self._dispatch(conn.app, msg, conn)
                except Exception as exc:  # one bad message must never take the arbiter down
                    log.exception("message from %s failed", conn.app)
                    core.reject(conn.app, INVALID, f"could not handle the message: {exc}", "message")
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        except Exception as exc:  # whatever gRPC raised while reading: say why the stream ends
            conn.end(StreamEnd("invalid", f"could not read the stream: {type(exc).__name__}: {exc}"))
        else:
            if unreadable is not None:
                conn.end(StreamEnd("invalid", f"the stream ended on a message that could not be read: {unreadable}"))

    def _dispatch(self, app: str, msg: pb.AgentMessage, conn: Connection | None = None) -> None:
        core = self.core
        kind = msg.WhichOneof("kind")
        if core._allocating and kind in ("release", "demand", "done", "jobs"):
            def later() -> None:  # applied when the allocation returns, unless the stream ended meanwhile
                if conn is None or conn.ending is None:
                    self._dispatch(app, msg)

            core._held_back.append(later)
            return
        if kind == "report":
            self._on_report(app, msg.report)
        elif kind == "bid":
            self._on_bid(app, msg.bid)
        elif kind == "release":
            self._on_release(app, msg.release)
        elif kind == "demand":
            self._on_demand(app, msg.demand)
        elif kind == "done":
            self._on_done(app, msg.done)
        elif kind == "jobs":
            self._on_jobs(app, msg.jobs)
        elif kind == "heartbeat":
            pass
        elif kind == "hello":
            core.reject(app, INVALID, "Hello is only the first message on a stream", "hello")
        else:
            core.reject(app, INVALID, "empty message (no known kind set)", "message")

    # -- the messages ----------------------------------------------------------------------------

    def _answer(self, app: str, claimed: str, round_id: int, kind: str) -> asyncio.Future | None:
        """The open request this message answers, or None after rejecting it with a reason."""
        core = self.core
        if claimed and claimed != app:
            core.reject(app, DENIED, f"{app!r} cannot send a {kind} for {quote([claimed])}", kind, round_id)
            return None
        fut = core._waiting.get((round_id, app, kind))
        if fut is None or fut.done():
            current = core._round.round_id if core._round is not None else None
            if fut is not None and fut.cancelled():
                reason = f"round {round_id}: the {kind} deadline passed"
            elif fut is not None:
                reason = f"round {round_id}: a {kind} was already received"
            elif current is None or round_id != current:
                reason = f"round {round_id} is not open (stale or unknown round; open: {current})"
            else:
                reason = f"round {round_id}: no {kind} was asked of {app!r}"
            core.reject(app, INVALID, reason, kind, round_id)
            return None
        return fut

    def _on_report(self, app: str, msg: pb.RhoReport) -> None:
        core = self.core
        fut = self._answer(app, msg.app, msg.round_id, "report")
        if fut is None:
            return
        try:
            core._round.report(app, wire.report(msg))
        except (InvalidReport, wire.WireError) as exc:
            # Rejected with its reason; the app may send a corrected report before the deadline.
            core.reject(app, INVALID, str(exc), "report", msg.round_id)
            core._bad[(msg.round_id, app, "report")] = cut_reason(str(exc))
            return
        fut.set_result(msg)

    def _on_bid(self, app: str, msg: pb.Bid) -> None:
        core = self.core
        fut = self._answer(app, msg.app, msg.round_id, "bid")
        if fut is None:
            return
        table = wire.bid(msg)
        try:
            validate_bid(app, table, core._round.free if core._round else frozenset(), max_rows=MAX_BID_ROWS)
        except InvalidBid as exc:
            # Rejected with its reason; the app may send a corrected bid before the deadline.
            core.reject(app, INVALID, exc.reason, "bid", msg.round_id)
            core._bad[(msg.round_id, app, "bid")] = cut_reason(exc.reason)
            return
        fut.set_result(wire.frozen(table))

    def _on_release(self, app: str, msg: pb.Release) -> None:
        core, engine = self.core, self.core.engine
        if msg.app and msg.app != app:
            core.reject(app, DENIED, f"{app!r} cannot release GPUs for {quote([msg.app])}", "release")
            return
        if app not in engine.apps:
            core.reject(app, INVALID, f"{app!r} has left (removed or done)", "release")
            return
        gpus = set(msg.gpus)
        held = engine.held(app)
        if msg.known_round > 0:
            # A lease from a later round than the agent knew of is one whose Grant is still on its
            # way (or a round granted back a GPU while this Release was held back): the agent let
            # go of the lease before it, not of this one, and will hold the GPU when the Grant comes.
            newer = {g for g in gpus & held if engine.leases.lease(g).round_id > msg.known_round}
            if newer:
                log.info("release kept newer leases", extra={"fields": {"app": app, "gpus": sorted(newer)[:5],
                                                                         "known_round": msg.known_round}})
                gpus -= newer
                if not gpus:
                    return
        if not gpus:
            core.reject(app, INVALID, f"{app!r} does not hold an empty set", "release")
            return
        # What it holds is released whatever else the message names: a Release that raced the
        # expiry of one of its leases used to be refused whole, and the GPUs it still held sat idle
        # until their own leases ran out. A GPU nobody holds (its lease just ran out) needs nothing;
        # one of another app, or no GPU at all, is refused by name.
        mine = gpus & held
        if mine:
            now = core.clock()
            engine.release(app, mine, now)
            core.commit(Released(now=now, app=app, gpus=tuple(sorted(mine))),
                        LeasesChanged(now=now, cause="release", gpus=tuple(core.gpu_lease(g) for g in sorted(mine)),
                                      apps=(core.app_leases(app),)),
                        wake=True)
        cluster = engine.cluster.gpus
        others = sorted(g for g in gpus - mine if g in cluster and engine.leases.holder(g))
        unknown = sorted(g for g in gpus - mine if g not in cluster)
        if others or unknown:
            done = f" (released {quote(sorted(mine))})" if mine else ""
            core.reject(app, DENIED if others else INVALID,
                        f"{app!r} does not hold {quote(others + unknown)}{done}", "release")

    def _on_demand(self, app: str, msg: pb.DemandUpdate) -> None:
        core, engine = self.core, self.core.engine
        if msg.app and msg.app != app:
            core.reject(app, DENIED, f"{app!r} cannot set the demand of {quote([msg.app])}", "demand")
            return
        if msg.demand < 0:
            core.reject(app, INVALID, f"demand must be >= 0, got {msg.demand}", "demand")
            return
        if app not in engine.apps:
            core.reject(app, INVALID, f"{app!r} has left (removed or done)", "demand")
            return
        if engine.apps[app].demand == msg.demand:
            return  # nothing changed: no journal write (a whole-journal transaction) for a repeat
        now = core.clock()
        engine.set_demand(app, msg.demand, now)
        core.commit(DemandChanged(now=now, app=app, demand=msg.demand), wake=True)

    def _on_done(self, app: str, msg: pb.Done) -> None:
        core = self.core
        if msg.app and msg.app != app:
            core.reject(app, DENIED, f"{app!r} cannot finish {quote([msg.app])}", "done")
            return
        end = StreamEnd("finished", f"{app!r} is done: its leases ended")
        if app in core.engine.apps:
            core.remove_app(app, end)
        conn = core.conns.get(app)
        if conn is not None:
            conn.end(end)

    def _on_jobs(self, app: str, msg: pb.RunningJobs) -> None:
        """D35: the app's running jobs (the whole list), checked against what it holds."""
        core = self.core
        if msg.app and msg.app != app:
            core.reject(app, DENIED, f"{app!r} cannot report the jobs of {quote([msg.app])}", "jobs")
            return
        if core.contention is None:
            core.reject(app, INVALID, "this arbiter runs no contention model (serve --contention): it takes no "
                        "job reports", "jobs")
            return
        if app not in core.engine.apps:
            core.reject(app, INVALID, f"{app!r} has left (removed or done)", "jobs")
            return
        try:
            jobs = wire.running_jobs(msg)
            for j in jobs:  # published under themis/<cluster>/apps/<app>/jobs/<job>/contention
                check_segment("job", j.job)
            core.contention.report(app, jobs)
        except (ValueError, JobsRefused) as exc:
            core.reject(app, INVALID, str(exc), "jobs")
            return
        self.contention_changed()

    # -- D35: who runs where, told to the agents and published ---------------------------------

    def tell_neighbourhood(self, app: str) -> None:
        """Send the app the other apps' jobs on its machines (and the table, its class), if changed."""
        view = self.core.contention
        if view is None or app not in self.core.conns:
            return
        msg = pb.Neighbourhood(table=view.name, cls=view.kind(app) or "",
                               neighbours=wire.neighbours_pb(view.around(app)))
        said = msg.SerializeToString(deterministic=True)
        if self._told.get(app) != said:
            self._told[app] = said
            self.core.send(app, pb.ArbiterMessage(neighbourhood=msg))

    def contention_changed(self) -> None:
        """Jobs or leases changed: tell the agents and publish, once for a burst of changes (on the
        loop's next turn, never inside another event's delivery)."""
        if self._refresh_due:
            return
        self._refresh_due = True
        try:
            asyncio.get_running_loop().call_soon(self._refresh)
        except RuntimeError:  # no loop (a synchronous caller): now
            self._refresh()

    def _refresh(self) -> None:
        core = self.core
        view = core.contention
        if view is None:
            self._refresh_due = False
            return
        if core._allocating:  # the engine is the allocation's until it returns
            asyncio.get_running_loop().call_later(0.05, self._refresh)
            return
        self._refresh_due = False
        for app in list(core.conns):
            self.tell_neighbourhood(app)
        now, current, events = core.clock(), view.jobs(), []
        for app in sorted(set(current) | set(self._published)):
            jobs, before = current.get(app, ()), self._published.get(app, ())
            if jobs != before:
                gone = tuple(sorted({j.job for j in before} - {j.job for j in jobs}))
                events.append(JobsContention(now=now, app=app, jobs=jobs, gone=gone))
            if jobs:
                self._published[app] = jobs
            else:
                self._published.pop(app, None)
        core.emit(*events)

    # -- keeping streams and apps alive ----------------------------------------------------------

    async def heartbeats(self) -> None:
        core = self.core
        while not core._stopping.is_set():
            await asyncio.sleep(core.settings.heartbeat_s)
            now = core.clock()
            for conn in list(core.conns.values()):
                conn.send(pb.ArbiterMessage(heartbeat=pb.Heartbeat(now=now)))
            await self._quieten(now)

    async def _quieten(self, now: float) -> None:
        """Apps whose agent has been away for ``idle_s`` and that hold nothing go idle: a crashed or
        abandoned agent's app stayed in every app's N_avg (D5) for good."""
        core, engine = self.core, self.core.engine
        after = core.settings.idle_after()
        core._away = {a: t for a, t in core._away.items() if a in engine.apps}
        due = [a for a, t in core._away.items() if now - t >= after and a in engine.apps
               and a not in engine.idle and a not in core.conns and not engine.held(a)]
        if not due:
            return
        await core.engine_free()
        events: list[ServiceEvent] = []
        for app in due:
            if app in engine.apps and app not in core.conns and not engine.held(app):
                engine.set_idle(app, True, core.clock())
                events.append(AppIdle(now=core.clock(), app=app, idle=True))
                log.info("app idle", extra={"fields": {"app": app, "away_s": round(now - core._away[app], 1)}})
        core.commit(*events)
