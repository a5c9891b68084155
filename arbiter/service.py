"""The arbiter as a gRPC service: the wall-clock shell around the round engine (paper 4.2, Fig. 7).

One asyncio loop owns everything: the gRPC server (grpc.aio), the round loop, the journal and the
event bus. The one exception is a round's allocation (the auction's MILPs, CPU-heavy): it runs in a
worker thread so heartbeats, health and admin reads answer meanwhile (issue 12, item 5), and while
it runs nothing on the loop mutates the engine -- agents' releases, demand updates and Done are held
back and applied when it returns, Hellos and the admin calls that change the engine (settings,
machines) wait for it, an app's removal waits for the round to close. Reads see the leases and free
GPUs as they were when it started; of the rest they show, only who is connected and N_avg (computed
for the moment of the call) can move meanwhile. So no GPU can be granted twice by a race; the lease
table refuses it anyway, and the journal's primary key on the GPU would too.

A round follows D10 on the wall clock. When one is due the service opens it, sends a RhoRequest to
every connected app the engine wants a report from (D6) and waits until all answered or the report
deadline passed; then it sends the offers and waits for bids until the bid deadline. Apps that miss
a deadline, or are not connected, are treated as not reporting or not bidding. The round closes,
the new state is journaled, and only then do grants and revocations go out and events get published
-- so after a crash, what agents were told is never ahead of the journal.

Every message from an agent is checked: an app acts only for itself (PERMISSION_DENIED), and a bid
or report that is malformed, unparsable, late or for a stale round is rejected with INVALID_ARGUMENT
and a reason, on the stream, which stays open; the round goes on for everyone else. Every stream
the arbiter ends gets a Goodbye and a status saying why (:class:`StreamEnd`, issue 12).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import re
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import grpc

from arbiter.auction import InvalidBid, validate_bid
from arbiter.events import (
    EventBus,
    app_grants_topic,
    app_leases_topic,
    app_revocations_topic,
    app_rho_topic,
    arbiter_status_topic,
    gpu_lease_topic,
    last_round_topic,
    rounds_topic,
)
from arbiter.limits import Limits, TokenBucket
from arbiter.policies import POLICIES, make_policy
from arbiter.rank import check_rank
from arbiter.rounds import EXPIRY_WINDOW_SHARE, InvalidReport, OpenRound, RoundEngine, RoundResult, cut_reason
from arbiter.service_metrics import ServiceMetrics
from arbiter.store import Store, StoreError
from protos import themis_pb2 as pb
from protos import themis_pb2_grpc as pb_grpc
from protos import wire

log = logging.getLogger("themis.arbiter")

APP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
RACK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.]{0,63}$")  # no '-': machines are named <rack>-m<n>
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
DENIED = grpc.StatusCode.PERMISSION_DENIED.value[0]
OUTBOX_LIMIT = 1000  # messages queued to one agent before it counts as stuck and its stream is ended
MAX_CONTENDERS = 4096  # the largest cap an admin may set (D20); 0 means none
MAX_BID_ROWS = 303  # D7's 15 rows x 18 counts, D18's 32 single GPUs, the previous GPUs; bounds the auction's work

# Bounds on admin input (issue 12, item 2). Each is checked before any work is done, so an absurd
# call is refused at once; together they bound the journal's rows per write (apps + leases).
MAX_MACHINE_GPUS = 64  # GPUs in one added machine (a DGX has 8-16)
MAX_CLUSTER_GPUS = 4096  # GPUs in the whole cluster after AddMachine
MAX_ADDED_MACHINES = 256
MAX_APPS = 10_000  # apps known to the arbiter (registered or running): rows per journal write
MAX_OPEN_TOKENS = 16  # unused registration tokens per app
RECLAIMED = "reclaimed: beyond the app's fair share while an app that holds nothing waits (D27)"
MAX_HISTORY = 10_000  # RoundHistory limit (the journal keeps that many rounds)
LEASE_RANGE_S = (1.0, 30 * 86400.0)
DEPARTED_PENDING = 1000  # apps that left kept in memory while the journal cannot write them
DEPARTED_SHOWN = 20  # apps that left, newest first, in ListApps (the journal keeps more)
GOODBYE_WAIT_S = 1.0  # a write that takes longer means flow control holds it: the agent is not reading
NAME_MAX = 128  # machine names in DrainMachine; app names are checked by APP_NAME
REASON_NAMES = 5  # names of an agent's message quoted back in a rejection, each cut to ...
NAME_QUOTE = 64  # ... this many characters: a rejection never echoes megabytes


@dataclass
class Settings:
    """What an admin may change on a running arbiter (journaled with the state)."""

    policy: str = "themis"
    fairness_knob: float = 0.8
    lease_s: float = 600.0
    coalesce_s: float = 1.0
    expiry_window_s: float | None = None
    report_timeout_s: float = 2.0
    bid_timeout_s: float = 2.0
    heartbeat_s: float = 10.0
    # D20: bidders the auction takes per round, worst first (0 = no cap). The exact auction's work
    # grows steeply with them: 16 keep a 256-GPU mass expiry near 1 s, 98 took 438 s (D20).
    max_contenders: int = 16
    # D21: "measured" ranks an app bound to a model (IssueToken) by its claimed work at that model's
    # slowdowns (apps bound to none by their report); "reported" ranks every app by its report.
    rank: str = "measured"
    # D27: a round ends the leases an app holds beyond its fair share while an app that holds nothing
    # waits (once per such app); False lets every lease run to its end.
    reclaim: bool = True
    # issue 36: an app with no agent connected and no lease for this long goes idle -- it counts in
    # no one's N_avg and is not asked for rho until its agent comes back. None: a lease and a minute.
    idle_s: float | None = None

    def idle_after(self) -> float:
        return self.idle_s if self.idle_s is not None else self.lease_s + 60.0

    def check(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(sorted(POLICIES))}")
        if not 0 <= self.fairness_knob < 1:
            raise ValueError(f"fairness knob f must be in [0, 1), got {self.fairness_knob}")
        for name in ("lease_s", "report_timeout_s", "bid_timeout_s", "heartbeat_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if not self.coalesce_s >= 0:
            raise ValueError(f"coalesce_s must be >= 0, got {self.coalesce_s}")
        if isinstance(self.max_contenders, bool) or not isinstance(self.max_contenders, int) \
                or not 0 <= self.max_contenders <= MAX_CONTENDERS:
            raise ValueError(f"max_contenders must be an integer from 0 (no cap) to {MAX_CONTENDERS}, "
                             f"got {self.max_contenders!r}")
        check_rank(self.rank)
        if not isinstance(self.reclaim, bool):
            raise ValueError(f"reclaim must be true or false, got {self.reclaim!r}")
        if self.idle_s is not None and not (self.idle_s > 0 and math.isfinite(self.idle_s)):
            raise ValueError(f"idle_s must be a positive number of seconds, got {self.idle_s}")

    def policy_object(self):
        options = ({"fairness_knob": self.fairness_knob, "max_contenders": self.max_contenders or None}
                   if self.policy == "themis" else {})
        return make_policy(self.policy, **options)


@dataclass(frozen=True)
class StreamEnd:
    """Why the arbiter ends an agent's stream: the final Goodbye and the gRPC status after it."""

    why: str
    reason: str
    gpus: tuple[str, ...] = ()

    # why -> (status, whether a new stream may pick up where this one ended)
    KINDS = {
        "removed": (grpc.StatusCode.PERMISSION_DENIED, False),
        "revoked": (grpc.StatusCode.UNAUTHENTICATED, False),
        "replaced": (grpc.StatusCode.ABORTED, False),
        "too_slow": (grpc.StatusCode.RESOURCE_EXHAUSTED, True),
        "shutting_down": (grpc.StatusCode.UNAVAILABLE, True),
        "finished": (grpc.StatusCode.OK, False),
        "invalid": (grpc.StatusCode.INVALID_ARGUMENT, True),
    }

    @property
    def status(self) -> grpc.StatusCode:
        return self.KINDS[self.why][0]

    @property
    def reconnect(self) -> bool:
        return self.KINDS[self.why][1]

    def goodbye(self) -> pb.ArbiterMessage:
        return pb.ArbiterMessage(goodbye=pb.Goodbye(why=self.why, reason=self.reason, reconnect=self.reconnect,
                                                    gpus=list(self.gpus)))


@dataclass
class Connection:
    """One agent's open stream: what to send it, when it was last heard from, and why it ends."""

    app: str
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    last_seen: float = 0.0
    limit: int = OUTBOX_LIMIT
    ending: StreamEnd | None = None

    def send(self, message: pb.ArbiterMessage) -> None:
        if self.ending is not None:
            return
        if self.outbox.qsize() >= self.limit:
            self.end(StreamEnd("too_slow", f"{self.limit} messages were queued to {self.app!r} and not read; "
                                           "reconnect and resume"))
            return
        self.outbox.put_nowait(message)

    def end(self, end: StreamEnd) -> None:
        """The first reason wins; the Connect handler sends it as Goodbye and ends the call with its status."""
        if self.ending is None:
            self.ending = end
            self.closed.set()


@dataclass(frozen=True)
class Unparsable:
    """A request whose bytes are not the message the method takes (issue 12, item 4)."""

    what: str
    reason: str


class ParseGuard(grpc.aio.ServerInterceptor):
    """Lets the Arbiter service see unparsable requests instead of gRPC failing them with UNKNOWN or,
    on a stream, ending it with OK: a unary call is refused with INVALID_ARGUMENT and the parser's
    reason; on the agent stream the message becomes an :class:`Unparsable` the service rejects with
    a reason (the stream stays open)."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if handler is None or handler.request_deserializer is None or not method.startswith("/themis.v1.Arbiter/"):
            return handler
        parse_strict, name = handler.request_deserializer, method.rsplit("/", 1)[-1]

        def parse(data: bytes):
            try:
                return parse_strict(data)
            except Exception as exc:
                return Unparsable(name, f"could not parse the {name} request ({len(data)} bytes): {exc}")

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                if isinstance(request, Unparsable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
                return await inner(request, context)

            return handler._replace(request_deserializer=parse, unary_unary=unary)
        return handler._replace(request_deserializer=parse)


def _quote(names) -> str:
    """Names from an agent's message, as a rejection quotes them: a few, each cut short."""
    names = list(names)
    shown = [n if len(n) <= NAME_QUOTE else n[:NAME_QUOTE] + "..." for n in names[:REASON_NAMES]]
    more = f" and {len(names) - REASON_NAMES} more" if len(names) > REASON_NAMES else ""
    return f"{shown}{more}"


def new_secret(kind: str) -> str:
    """A bearer secret, prefixed with its kind so that it never starts with '-'.

    A bare token_urlsafe starts with '-' one time in 64, and a command line then reads
    ``--token -abc`` as a missing value (seen in CI).
    """
    return f"{kind}_{secrets.token_urlsafe(32)}"


async def _take_first(request_iterator, wait_s: float) -> None:
    """Read (and drop) the stream's first message, or give up after ``wait_s``.

    A stream refused while the agent's Hello is still being written races that write against the
    status: when the write fails after the status, grpcio's asyncio client reports INTERNAL and
    loses the status (grpc/grpc#36066; the suspected cause of a rare INTERNAL in a test here). An
    agent told INTERNAL retries where UNAUTHENTICATED would stop it, so the refusal waits for the
    Hello it is sending."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(anext(request_iterator.__aiter__()), wait_s)


def _bearer(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return None


class ArbiterService(pb_grpc.ArbiterServicer):
    def __init__(
        self,
        engine: RoundEngine,
        store: Store,
        bus: EventBus,
        *,
        settings: Settings,
        admin_token: str,
        metrics: ServiceMetrics | None = None,
        clock: Callable[[], float] = time.time,
        profiles: Mapping[str, tuple[float, float, float, float]] | None = None,
        limits: Limits | None = None,
    ):
        self.engine = engine
        self.limits = limits or Limits()
        self.limits.check()
        self._unauthenticated = 0  # streams with an unknown credential whose first message is awaited
        self._removed: dict[str, float] = {}  # app -> when RemoveApp removed it (this run), for NOT_FOUND's reason
        #: app -> when its agent's stream ended (issue 36: after idle_s with nothing held it goes idle);
        #: after a restart every app's agent is away until it comes back
        self._away: dict[str, float] = dict.fromkeys(engine.apps, max(clock(), engine.clock))
        self._hellos = TokenBucket(self.limits.hellos, self.limits.per_s)
        self._registers = TokenBucket(self.limits.registers, self.limits.per_s)
        self.store = store
        self.bus = bus
        self.settings = settings
        self.admin_token = admin_token
        self.metrics = metrics or ServiceMetrics()
        self._wall = clock
        self.cluster = engine.cluster.name
        self.conns: dict[str, Connection] = {}
        self.last_rho: dict[str, float] = store.last_rho()
        self._kick = asyncio.Event()
        self._waiting: dict[tuple[int, str, str], asyncio.Future] = {}  # (round, app, kind) -> answer
        self._bad: dict[tuple[int, str, str], str] = {}  # (round, app, kind) -> why its answer was refused
        self._round: OpenRound | None = None
        self._stopping = asyncio.Event()
        self._deferred: list[tuple[str, StreamEnd | None]] = []  # apps to remove once the open round closes
        self._leaving: dict[str, str] = {}  # app -> why it leaves ("finished", "removed"), until it has left
        self._departed: list[dict[str, Any]] = []  # apps that left, for the next journal write (status)
        self._between_rounds = asyncio.Event()  # set when no round is open and deferred removals are done
        self._between_rounds.set()
        self._allocating = False  # the round's allocation runs in a worker thread (issue 12, item 5)
        self._allocated = asyncio.Event()
        self._allocated.set()
        self._held_back: list[Callable[[], None]] = []  # agent changes that arrived during an allocation
        self._frozen: tuple[tuple, frozenset[str]] | None = None  # (leases, free GPUs) while allocating
        self.outbox_limit = OUTBOX_LIMIT
        self.problems: dict[str, str] = {}  # what makes health NOT_SERVING ("journal", "loop"), and why
        self.rounds_run = 0
        #: model -> placement slowdowns by D1 level (the profile table): what IssueToken may bind an
        #: app to, and what a measured rank applies to its claimed work (D21)
        self.profiles = dict(profiles or {})
        self.models = store.models()
        for app, model in sorted(self.models.items()):
            if model not in self.profiles:  # e.g. started without the --profiles file that had it
                log.warning("an app's model is not in the profile table: it is ranked by its report",
                            extra={"fields": {"app": app, "model": model}})
        for app in engine.apps:
            engine.set_slowdown(app, self._slowdown_of(app))

    def _slowdown_of(self, app: str) -> tuple[float, float, float, float] | None:
        """The slowdowns of the model bound to ``app``; None when none is, or the profile table no
        longer has it (the app is then ranked by its report)."""
        return self.profiles.get(self.models.get(app, ""))

    def clock(self) -> float:
        """The wall clock, never behind the engine's: after an NTP step back, or on a journal
        written by a clock that ran ahead, time stands still until the wall catches up."""
        return max(self._wall(), self.engine.clock)

    # -- lifecycle -----------------------------------------------------------------------------

    def journal(self, result: RoundResult | None = None, summary: dict[str, Any] | None = None) -> None:
        """One transaction with the whole state. A failure marks the service unhealthy until a
        write succeeds again (issue 12, item 5), and is raised to the caller."""
        rho = dict(self.last_rho) if result is not None else None
        started = time.perf_counter()
        try:
            self.store.save(self.engine.state(), settings=asdict(self.settings), rho=rho, round_summary=summary,
                            departed=self._departed)
            self._departed = []
            self.store.flush()  # revocations an earlier failure kept in memory only
        except Exception as exc:
            self.problems["journal"] = f"journal write failed: {exc}"
            self.metrics.journal_failures.inc()
            raise
        self.problems.pop("journal", None)
        self.metrics.journal_latency.observe(time.perf_counter() - started)

    async def _durable(self, context, what: str, undo: Callable[[], None] | None = None) -> None:
        """Journal a change an admin asked for before answering (issue 32: fail closed). When the
        journal cannot be written the call is refused with UNAVAILABLE and the cause, and ``undo``
        puts memory back as it was: nothing is acknowledged that a restart would not have."""
        try:
            self.journal()
        except Exception as exc:
            if undo is not None:
                undo()
            log.error("refused: the journal cannot be written", extra={"fields": {"call": what, "cause": str(exc)}})
            await context.abort(grpc.StatusCode.UNAVAILABLE, cut_reason(f"{what} was not done: {exc}"))

    def _journal_failed(self, exc: BaseException) -> None:
        """A write the store refused: health shows it until a write succeeds again."""
        self.problems["journal"] = f"journal write failed: {exc}"
        self.metrics.journal_failures.inc()
        log.error("the journal cannot be written", extra={"fields": {"cause": str(exc)}})

    async def _journal_works(self, context, what: str) -> None:
        """While the journal is failing, a mutating call is refused before it changes anything
        (after one more write, in case the journal has recovered)."""
        if "journal" in self.problems:
            await self._durable(context, what)

    def republish_state(self) -> None:
        """Retained state for late subscribers: every GPU's lease and every app's leases."""
        self.bus.publish(arbiter_status_topic(self.cluster), {"online": True}, retain=True)
        for gpu in self.engine.cluster.gpu_ids:
            self._publish_gpu(gpu)
        for app in self.engine.apps:
            self._publish_app_leases(app)

    async def sweep_retained(self, window_s: float = 2.0) -> list[str]:
        """Clear retained topics the journal does not know (issue 12): an app's leases and rho
        from an app that is gone, a GPU's lease on a GPU the cluster no longer has -- left on the
        broker by an earlier arbiter (another journal, a lost journal). Reads what the broker
        retains for ``window_s`` s after subscribing and clears each topic as it arrives, if it is
        unknown at that moment (:meth:`clear_unknown`); returns the topics cleared. Clearing only
        once the window had passed left an earlier arbiter's lease lists beside this one's for the
        first rounds, overlapping on the same GPUs (issue 32)."""
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
        """An app's leases or rho of an app the engine does not have, or a GPU's lease on a GPU the
        cluster does not have; any other topic (rounds, arbiter status, jobs' metrics) is left."""
        prefix = f"themis/{self.cluster}/"
        if not topic.startswith(prefix):
            return False
        levels = topic[len(prefix):].split("/")
        if len(levels) != 3:
            return False
        kind, name, leaf = levels
        if kind == "apps" and leaf in ("leases", "rho"):
            return name not in self.engine.apps
        if kind == "gpus" and leaf == "lease":
            return name not in self.engine.cluster.gpus
        return False

    async def run_rounds(self) -> None:
        """D10 on the wall clock: sleep until a round may be due or something changed."""
        while not self._stopping.is_set():
            wake = self.engine.next_wakeup()
            timeout = None if wake is None else max(0.0, wake - self.clock())
            try:
                await asyncio.wait_for(self._kick.wait(), timeout)
            except TimeoutError:
                pass
            self._kick.clear()
            if self._stopping.is_set():
                break
            if self.engine.round_due(self.clock()):
                try:
                    await self.run_round()
                except Exception:  # a bug in one round must not stop the arbiter
                    log.exception("round failed")
                    self.metrics.round_failures.inc()
                    await asyncio.sleep(max(0.5, self.settings.coalesce_s))  # no hot loop on a persistent fault

    async def heartbeats(self) -> None:
        while not self._stopping.is_set():
            await asyncio.sleep(self.settings.heartbeat_s)
            now = self.clock()
            for conn in list(self.conns.values()):
                conn.send(pb.ArbiterMessage(heartbeat=pb.Heartbeat(now=now)))
            await self._quieten(now)

    async def _quieten(self, now: float) -> None:
        """Apps whose agent has been away for ``idle_s`` and that hold nothing go idle (issue 36): a
        crashed or abandoned agent's app stayed in every app's N_avg for good."""
        after = self.settings.idle_after()
        self._away = {a: t for a, t in self._away.items() if a in self.engine.apps}
        due = [a for a, t in self._away.items() if now - t >= after and a in self.engine.apps
               and a not in self.engine.idle and a not in self.conns and not self.engine.held(a)]
        if not due:
            return
        await self._engine_free()
        for app in due:
            if app in self.engine.apps and app not in self.conns and not self.engine.held(app):
                self.engine.set_idle(app, True, self.clock())
                log.info("app idle", extra={"fields": {"app": app, "away_s": round(now - self._away[app], 1)}})
        with contextlib.suppress(Exception):
            self.journal()

    def stop(self) -> None:
        self._stopping.set()
        self._kick.set()
        for conn in list(self.conns.values()):
            conn.end(StreamEnd("shutting_down", "the arbiter is shutting down; reconnect when it is back"))

    def kick(self) -> None:
        self._kick.set()

    async def _engine_free(self) -> None:
        """Wait while a round's allocation runs in the worker thread: changes to the engine apply
        between allocations, never during one."""
        while self._allocating:
            await self._allocated.wait()

    def _leases(self) -> list:
        """Every lease, sorted by GPU; while an allocation runs, as it was when it started."""
        if self._frozen is not None:
            return list(self._frozen[0])
        return sorted(self.engine.leases, key=lambda x: x.gpu)

    def _leases_of(self, app: str) -> list:
        """The app's leases, sorted by GPU; while an allocation runs, as they were when it started."""
        return [x for x in self._leases() if x.app == app]

    def _free(self) -> frozenset[str]:
        return self._frozen[1] if self._frozen is not None else self.engine.free_gpus()

    # -- one round (paper 4.2.2 steps 1-5) -----------------------------------------------------

    async def run_round(self) -> RoundResult:
        started = time.perf_counter()
        phases = {"reports_s": 0.0, "bids_s": 0.0, "allocation_s": 0.0}
        await self._engine_free()
        now = self.clock()
        rnd = self.engine.open_round(now)
        self._round = rnd
        self._between_rounds.clear()
        closed = False
        try:
            self.journal()  # the round id and the expiries, before anyone hears of this round
            deadline = now + self.settings.report_timeout_s
            asked = {}
            for request in rnd.requests:
                conn = self.conns.get(request.app)
                if conn is None:
                    rnd.note_failure(request.app, "not connected")
                    continue
                asked[request.app] = self._expect(rnd.round_id, request.app, "report")
                conn.send(pb.ArbiterMessage(rho_request=wire.rho_request_pb(request, deadline)))
            phase = time.perf_counter()
            reports = await self._gather(asked, deadline)  # each checked (rnd.report) as it arrived
            if asked:  # 0 when nobody was asked: nothing was waited for
                phases["reports_s"] = time.perf_counter() - phase
            for app in set(asked) - set(reports):
                rnd.note_failure(app, self._bad.get((rnd.round_id, app, "report"), "no rho report before the deadline"))
            offers = rnd.offers()
            deadline = self.clock() + self.settings.bid_timeout_s
            waiting = {}
            for app, offer in offers.items():
                conn = self.conns.get(app)
                if conn is None:
                    rnd.note_failure(app, "not connected")
                    continue
                waiting[app] = self._expect(rnd.round_id, app, "bid")
                conn.send(pb.ArbiterMessage(offer=wire.offer_pb(replace(offer, deadline=deadline))))
            phase = time.perf_counter()
            bids = await self._gather(waiting, deadline)
            if waiting:
                phases["bids_s"] = time.perf_counter() - phase
            for app, table in bids.items():
                try:
                    rnd.bid(app, table)
                except InvalidBid as exc:
                    self._reject(app, INVALID, exc.reason, "bid", rnd.round_id)
            for app in set(waiting) - set(bids):
                rnd.note_failure(app, self._bad.get((rnd.round_id, app, "bid"), "no bid before the deadline"))
            # The allocation (the auction's MILPs) runs in a worker thread so heartbeats, admin calls
            # and health answer meanwhile; nothing else touches the engine until it returns.
            self._frozen = (tuple(self._leases()), self.engine.free_gpus())
            self._allocating = True
            self._allocated.clear()
            allocation = asyncio.ensure_future(asyncio.to_thread(rnd.close))
            phase = time.perf_counter()
            try:
                result = await asyncio.shield(allocation)
            except asyncio.CancelledError:
                # Shutting down: the thread cannot be stopped, so wait for it before anything below
                # touches the engine it is still changing; the round is then dropped unannounced.
                with contextlib.suppress(BaseException):
                    await allocation
                raise
            finally:
                phases["allocation_s"] = time.perf_counter() - phase
                self._allocating = False
                self._frozen = None
                self._allocated.set()
            closed = True
            self._rho_after(result, bids)
        finally:
            rnd.abandon()  # a no-op once closed; otherwise the engine must not stay stuck in this round
            for key in [k for k in self._waiting if k[0] == rnd.round_id]:
                self._waiting.pop(key).cancel()
            self._bad.clear()
            held_back, self._held_back = self._held_back, []
            for change in held_back:
                try:
                    change()
                except Exception:
                    log.exception("a change held back during the allocation failed")
            if not closed:
                self._round = None
                self._run_deferred()
        latency = time.perf_counter() - started
        summary = _summary(result, latency) | phases
        try:
            self.journal(result, summary)
        except Exception:  # e.g. disk full: agents must still hear what memory now says they hold
            log.exception("journal write failed after round %d; the next change writes it again", result.round_id)
            self.metrics.round_failures.inc()
        self._round = None
        self._announce(result, summary)
        self._run_deferred()
        self.metrics.observe_round(result, latency, leases=len(self.engine.leases), connected=len(self.conns))
        self.metrics.observe_apps(self._app_metrics(), result)
        self.rounds_run += 1
        log.info("round", extra={"fields": {k: summary[k] for k in ("round_id", "offered", "bidders", "granted",
                                                                    "idle", "latency_s")}})
        return result

    def _run_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for app, end in deferred:
            if app in self.engine.apps:
                self._remove(app, end)
        self._between_rounds.set()

    def _rho_after(self, result: RoundResult, bids: dict[str, Any]) -> None:
        """Each reporting app's rho on what it holds after the round (issue 11, item 2): the rows of
        its bid are rho(held + S), so the best row whose S it was granted bounds it from above (and
        is exact when S is all it got); with no grant, rho_old is rho on what it kept. Infinity
        (``null`` on MQTT) only for an app that holds nothing. ``exact`` is False when the value is
        only a bound or an estimate: a best row for a superset of what it won, or, for an app that
        did not bid, its report from before the round changed what it holds."""
        got = {g.app: g.gpus for g in result.grants}
        lost = {lease.app for lease in result.expired
                if not any(lease.gpu in g.gpus and g.app == lease.app for g in result.grants)}
        for app, reported in result.rho.items():
            if app not in self.engine.apps:
                continue
            held = self.engine.held(app)
            if not held:
                self.last_rho[app] = math.inf
                self.bus.publish(app_rho_topic(self.cluster, app), {"rho": None, "round_id": result.round_id,
                                                                     "now": result.now, "gpus": []}, retain=True)
                continue
            table = bids.get(app)
            won = got.get(app, frozenset())
            rho, exact = math.inf, True
            if table is not None:
                rows = [(r, gpus == won) for gpus, r in table.rows if won and gpus <= won]
                rho, exact = min(rows) if rows else (table.rho_old, not won)
            if not math.isfinite(rho):
                rho = reported if math.isfinite(reported) else self.last_rho.get(app, math.inf)
                exact = not won and app not in lost
            self.last_rho[app] = rho
            self.bus.publish(app_rho_topic(self.cluster, app), {"rho": _json_num(rho), "round_id": result.round_id,
                                                                 "now": result.now, "gpus": sorted(held),
                                                                 "exact": exact}, retain=True)

    def _expect(self, round_id: int, app: str, kind: str) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._waiting[(round_id, app, kind)] = fut
        return fut

    async def _gather(self, futures: dict[str, asyncio.Future], deadline: float) -> dict[str, Any]:
        if futures:
            await asyncio.wait(list(futures.values()), timeout=max(0.0, deadline - self.clock()))
        for f in futures.values():
            if not f.done():
                f.cancel()  # the deadline passed: a late answer is refused with that reason
        return {app: f.result() for app, f in futures.items() if f.done() and not f.cancelled()}

    def _announce(self, result: RoundResult, summary: dict[str, Any]) -> None:
        """Grants and revocations to the agents, and the round's events (after the journal)."""
        regained = {(g.app, gpu) for g in result.grants for gpu in g.gpus}
        reclaimed = {lease.gpu for lease in result.reclaimed}
        lost: dict[tuple[str, str], list[str]] = {}
        for lease in result.expired:
            if (lease.app, lease.gpu) not in regained:
                reason = RECLAIMED if lease.gpu in reclaimed else "lease expired"
                lost.setdefault((lease.app, reason), []).append(lease.gpu)
        for (app, reason), gpus in sorted(lost.items()):
            self._send(app, pb.ArbiterMessage(revocation=pb.Revocation(gpus=sorted(gpus), reason=reason,
                                                                       round_id=result.round_id)))
            self.bus.publish(app_revocations_topic(self.cluster, app),
                             {"gpus": sorted(gpus), "reason": reason, "round_id": result.round_id})
        position = self.engine.cluster.position
        for grant in result.grants:
            gpus = {g: position(g) for g in sorted(grant.gpus)}
            self._send(grant.app, pb.ArbiterMessage(grant=pb.Grant(
                round_id=result.round_id, gpus=wire.places(gpus), expires_at=grant.expires_at, source=grant.source)))
            self.bus.publish(app_grants_topic(self.cluster, grant.app),
                             {"gpus": sorted(grant.gpus), "expires_at": grant.expires_at, "source": grant.source,
                              "round_id": result.round_id})
        changed = {lease.gpu for lease in result.expired} | {g for grant in result.grants for g in grant.gpus}
        for gpu in sorted(changed):
            self._publish_gpu(gpu)
        for app in sorted({lease.app for lease in result.expired} | {g.app for g in result.grants}):
            self._publish_app_leases(app)
        self.bus.publish(rounds_topic(self.cluster), summary)
        self.bus.publish(last_round_topic(self.cluster), summary, retain=True)

    def _publish_gpu(self, gpu: str) -> None:
        lease = self.engine.leases.lease(gpu)
        payload = None if lease is None else {"app": lease.app, "expires_at": lease.expires_at,
                                              "round_id": lease.round_id}
        self.bus.publish(gpu_lease_topic(self.cluster, gpu), payload, retain=True)

    def _publish_app_leases(self, app: str) -> None:
        leases = [{"gpu": g, "expires_at": self.engine.leases.lease(g).expires_at}
                  for g in sorted(self.engine.held(app))]
        self.bus.publish(app_leases_topic(self.cluster, app), leases, retain=True)

    def _send(self, app: str, message: pb.ArbiterMessage) -> None:
        conn = self.conns.get(app)
        if conn is not None:
            conn.send(message)

    def _reject(self, app: str, code: int, reason: str, what: str, round_id: int = 0) -> None:
        reason = cut_reason(reason)
        self.metrics.rejected.labels(what=what).inc()
        if app in self.engine.apps:  # a departed app's series stay dropped (bounded label sets)
            self.metrics.app_rejections.labels(app=app).inc()
        log.info("rejected", extra={"fields": {"app": app, "what": what, "reason": reason}})
        self._send(app, pb.ArbiterMessage(rejection=pb.Rejection(code=code, reason=reason, what=what,
                                                                 round_id=round_id)))

    # -- the agent stream ----------------------------------------------------------------------

    async def _refuse(self, context, code: grpc.StatusCode, reason: str) -> None:
        """End a stream before its Welcome, counted by status (``themis_refused_streams``)."""
        self.metrics.refused.labels(code=code.name).inc()
        log.info("stream refused", extra={"fields": {"code": code.name, "reason": reason}})
        await context.abort(code, reason)

    async def Connect(self, request_iterator, context) -> None:
        """The agent's stream. Written with ``context.write`` (not as a generator) so that every
        stream the arbiter ends gets a Goodbye and a status saying why (issue 12, item 1) -- even a
        stuck reader, whose status goes out in the trailers when its messages cannot."""
        credential = _bearer(context)
        app = self.store.token_app(credential, "credential") if credential else None
        limits = self.limits
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
        except StopAsyncIteration:  # said nothing, or an incomplete message, and closed: never OK (issue 32)
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                               "the stream ended before its Hello (no message, or an incomplete one)")
        except TimeoutError:
            await self._refuse(context, grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"no Hello within {limits.hello_s:g} s of connecting (the limit)")
        if isinstance(first, Unparsable):
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, f"{first.reason}; the first message must be Hello")
        if first.WhichOneof("kind") != "hello":
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "the first message on the stream must be Hello")
        if first.hello.app != app:
            await self._refuse(context, grpc.StatusCode.PERMISSION_DENIED,
                               f"this credential belongs to {app!r}, not {_quote([first.hello.app])[2:-2]!r}")
        if first.hello.demand < 0:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, f"demand must be >= 0, got {first.hello.demand}")
        live = self.conns.get(app)
        if live is not None and live.ending is None and not first.hello.take_over:
            # issue 36: a second agent of the same name used to take over silently and end the running
            # search; now it must ask (an agent reconnecting after a Welcome always does)
            await self._refuse(context, grpc.StatusCode.ALREADY_EXISTS,
                               f"{app!r} is connected on another stream (its agent is running); stop that agent, or "
                               "connect with take_over (themis-agent run --take-over) to replace it")
        # An app that said Done while a round was open leaves when that round closes; a Hello that
        # comes meanwhile waits for it, then starts the app afresh (else it would be removed under
        # a live stream: the "ghost app" of issue 12).
        while self._allocating or any(a == app for a, _ in self._deferred):
            await (self._allocated if self._allocating else self._between_rounds).wait()
        if self.store.token_app(credential, "credential") != app:  # revoked while it waited
            await self._refuse(context, grpc.StatusCode.UNAUTHENTICATED, "this credential was revoked")
        now = self.clock()
        new = app not in self.engine.apps
        if new:
            if len(self.engine.apps) >= MAX_APPS:
                await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"the arbiter runs at most {MAX_APPS} apps")
            self.engine.add_app(app, now, slowdown=self._slowdown_of(app))
        before = (self.engine.apps[app].demand, self.engine.apps[app].most, app in self.engine.idle)
        self._away.pop(app, None)
        self.engine.set_idle(app, False, now)  # back: counted and asked again
        self.engine.set_demand(app, first.hello.demand, now)
        self.engine.note_ready(app, now)
        # A reconnect that changes nothing journaled writes nothing: a flood of Hellos used to write
        # the whole journal each, and its latency turned health NOT_SERVING (issue 32).
        if new or (self.engine.apps[app].demand, self.engine.apps[app].most, False) != before:
            with contextlib.suppress(Exception):  # a failing journal must not refuse agents; health shows it
                self.journal()
        self.kick()
        old = self.conns.get(app)
        if old is not None and old.ending is not None:
            old = None  # ending already: nothing to take over
        if old is not None:
            old.end(StreamEnd("replaced", f"another stream connected as {app!r} and replaced this one"))
        conn = Connection(app, last_seen=now, limit=self.outbox_limit)
        self.conns[app] = conn
        mine = self._leases_of(app)
        if self._round is not None:
            # Leases that ran out as the open round began are the app's until the round decides
            # (D13: it runs on them, and the round may grant them back); left out, the agent would
            # stop its jobs on them as lost while the round still offers them to it.
            mine += [x for x in self._round.expired if x.app == app]
            mine.sort(key=lambda x: x.gpu)
        position = self.engine.cluster.position
        conn.send(pb.ArbiterMessage(welcome=pb.Welcome(
            app=app, cluster=self.cluster, leases=[wire.lease_pb(x) for x in mine],
            settings=self._settings_pb(), now=now, heartbeat_s=self.settings.heartbeat_s,
            places=wire.places({x.gpu: position(x.gpu) for x in mine}), took_over=old is not None)))
        self.metrics.connected.set(len(self.conns))
        log.info("connected", extra={"fields": {"app": app}})
        # The headers go out on their own before the first message: HTTP/2 flow control never holds
        # them, and a Welcome that flow control holds is then a pending message alone. Sent with the
        # Welcome, they made the status of a stream ended meanwhile a second send of headers
        # (TOO_MANY_OPERATIONS): the agent was never told (issue 32, a flood of Hellos).
        with contextlib.suppress(Exception):
            await context.send_initial_metadata(())
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
            if self.conns.get(app) is conn:
                del self.conns[app]
                self._away[app] = self.clock()
            self.metrics.connected.set(len(self.conns))
            log.info("disconnected", extra={"fields": {"app": app}})

    async def _read(self, conn: Connection, request_iterator) -> None:
        """Hands each message to its handler until the agent closes its side. A stream whose last
        message could not be read ends with INVALID_ARGUMENT and the parser's reason, not OK: the
        agent may have closed before the Reject reached it (issue 32's framing fuzz)."""
        unreadable = None
        try:
            async for msg in request_iterator:
                if conn.ending is not None:
                    continue  # an ended stream speaks no more for the app (drained, not closed: see Connect)
                conn.last_seen = self.clock()
                unreadable = msg.reason if isinstance(msg, Unparsable) else None
                if unreadable is not None:
                    self._reject(conn.app, INVALID, unreadable, "message")
                    continue
                try:
                    self._dispatch(conn.app, msg, conn)
                except Exception as exc:  # one bad message must never take the arbiter down
                    log.exception("message from %s failed", conn.app)
                    self._reject(conn.app, INVALID, f"could not handle the message: {exc}", "message")
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        except Exception as exc:  # whatever gRPC raised while reading: say why the stream ends
            conn.end(StreamEnd("invalid", f"could not read the stream: {type(exc).__name__}: {exc}"))
        else:
            if unreadable is not None:
                conn.end(StreamEnd("invalid", f"the stream ended on a message that could not be read: {unreadable}"))

    def _dispatch(self, app: str, msg: pb.AgentMessage, conn: Connection | None = None) -> None:
        kind = msg.WhichOneof("kind")
        if self._allocating and kind in ("release", "demand", "done"):
            def later() -> None:  # applied when the allocation returns, unless the stream ended meanwhile
                if conn is None or conn.ending is None:
                    self._dispatch(app, msg)

            self._held_back.append(later)
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
        elif kind == "heartbeat":
            pass
        elif kind == "hello":
            self._reject(app, INVALID, "Hello is only the first message on a stream", "hello")
        else:
            self._reject(app, INVALID, "empty message (no known kind set)", "message")

    def _answer(self, app: str, claimed: str, round_id: int, kind: str) -> asyncio.Future | None:
        """The open request this message answers, or None after rejecting it with a reason."""
        if claimed and claimed != app:
            self._reject(app, DENIED, f"{app!r} cannot send a {kind} for {_quote([claimed])}", kind, round_id)
            return None
        fut = self._waiting.get((round_id, app, kind))
        if fut is None or fut.done():
            current = self._round.round_id if self._round is not None else None
            if fut is not None and fut.cancelled():
                reason = f"round {round_id}: the {kind} deadline passed"
            elif fut is not None:
                reason = f"round {round_id}: a {kind} was already received"
            elif current is None or round_id != current:
                reason = f"round {round_id} is not open (stale or unknown round; open: {current})"
            else:
                reason = f"round {round_id}: no {kind} was asked of {app!r}"
            self._reject(app, INVALID, reason, kind, round_id)
            return None
        return fut

    def _on_report(self, app: str, msg: pb.RhoReport) -> None:
        fut = self._answer(app, msg.app, msg.round_id, "report")
        if fut is None:
            return
        try:
            self._round.report(app, wire.report(msg))
        except (InvalidReport, wire.WireError) as exc:
            # Rejected with its reason; the app may send a corrected report before the deadline.
            self._reject(app, INVALID, str(exc), "report", msg.round_id)
            self._bad[(msg.round_id, app, "report")] = cut_reason(str(exc))
            return
        fut.set_result(msg)

    def _on_bid(self, app: str, msg: pb.Bid) -> None:
        fut = self._answer(app, msg.app, msg.round_id, "bid")
        if fut is None:
            return
        table = wire.bid(msg)
        try:
            validate_bid(app, table, self._round.free if self._round else frozenset(), max_rows=MAX_BID_ROWS)
        except InvalidBid as exc:
            # Rejected with its reason; the app may send a corrected bid before the deadline.
            self._reject(app, INVALID, exc.reason, "bid", msg.round_id)
            self._bad[(msg.round_id, app, "bid")] = cut_reason(exc.reason)
            return
        fut.set_result(wire.frozen(table))

    def _on_release(self, app: str, msg: pb.Release) -> None:
        if msg.app and msg.app != app:
            self._reject(app, DENIED, f"{app!r} cannot release GPUs for {_quote([msg.app])}", "release")
            return
        if app not in self.engine.apps:
            self._reject(app, INVALID, f"{app!r} has left (removed or done)", "release")
            return
        gpus = set(msg.gpus)
        held = self.engine.held(app)
        if msg.known_round > 0:
            # A lease from a later round than the agent knew of is one whose Grant is still on its
            # way (or a round granted back a GPU while this Release was held back): the agent let
            # go of the lease before it, not of this one, and will hold the GPU when the Grant comes.
            newer = {g for g in gpus & held if self.engine.leases.lease(g).round_id > msg.known_round}
            if newer:
                log.info("release kept newer leases", extra={"fields": {"app": app, "gpus": sorted(newer)[:5],
                                                                         "known_round": msg.known_round}})
                gpus -= newer
                if not gpus:
                    return
        if not gpus:
            self._reject(app, INVALID, f"{app!r} does not hold an empty set", "release")
            return
        # What it holds is released whatever else the message names: a Release that raced the
        # expiry of one of its leases used to be refused whole, and the GPUs it still held sat idle
        # until their own leases ran out. A GPU nobody holds (its lease just ran out) needs nothing;
        # one of another app, or no GPU at all, is refused by name.
        mine = gpus & held
        if mine:
            self.engine.release(app, mine, self.clock())
            with contextlib.suppress(Exception):
                self.journal()
            for gpu in sorted(mine):
                self._publish_gpu(gpu)
            self._publish_app_leases(app)
            self.kick()
        cluster = self.engine.cluster.gpus
        others = sorted(g for g in gpus - mine if g in cluster and self.engine.leases.holder(g))
        unknown = sorted(g for g in gpus - mine if g not in cluster)
        if others or unknown:
            done = f" (released {_quote(sorted(mine))})" if mine else ""
            self._reject(app, DENIED if others else INVALID,
                         f"{app!r} does not hold {_quote(others + unknown)}{done}", "release")

    def _on_demand(self, app: str, msg: pb.DemandUpdate) -> None:
        if msg.app and msg.app != app:
            self._reject(app, DENIED, f"{app!r} cannot set the demand of {_quote([msg.app])}", "demand")
            return
        if msg.demand < 0:
            self._reject(app, INVALID, f"demand must be >= 0, got {msg.demand}", "demand")
            return
        if app not in self.engine.apps:
            self._reject(app, INVALID, f"{app!r} has left (removed or done)", "demand")
            return
        if self.engine.apps[app].demand == msg.demand:
            return  # nothing changed: no journal write (a whole-journal transaction) for a repeat
        self.engine.set_demand(app, msg.demand, self.clock())
        with contextlib.suppress(Exception):
            self.journal()
        self.kick()

    def _on_done(self, app: str, msg: pb.Done) -> None:
        if msg.app and msg.app != app:
            self._reject(app, DENIED, f"{app!r} cannot finish {_quote([msg.app])}", "done")
            return
        end = StreamEnd("finished", f"{app!r} is done: its leases ended")
        if app in self.engine.apps:
            self._remove(app, end)
        conn = self.conns.get(app)
        if conn is not None:
            conn.end(end)

    def _remove(self, app: str, end: StreamEnd | None) -> None:
        """The app leaves: its leases end now. While a round is open the removal waits for it to
        close (the round may already hold the app's report or bid); its stream, if any, ends now
        with ``end``."""
        if end is not None and app in self.conns and end.why != "finished":
            self.conns[app].end(replace(end, gpus=tuple(x.gpu for x in self._leases_of(app))))
        if end is not None:
            self._leaving.setdefault(app, end.why)
        if self._round is not None or self._allocating:
            self._deferred.append((app, None))
            return
        now = self.clock()
        record = self.engine.apps[app]
        self._departed.append({"app": app, "arrived": record.arrived, "left": now,
                               "why": self._leaving.pop(app, "removed"), "last_rho": self.last_rho.get(app, math.inf),
                               "gpu_seconds": self.engine.attained(app, now)})
        del self._departed[:-DEPARTED_PENDING]  # a journal failing for long keeps only the latest
        freed = self.engine.remove_app(app, now)
        with contextlib.suppress(Exception):
            self.journal()
        for gpu in sorted(freed):
            self._publish_gpu(gpu)
        # gone: no leases or rho to show (None clears the retained state; [] was kept per departed app)
        self.bus.publish(app_leases_topic(self.cluster, app), None, retain=True)
        self.bus.publish(app_rho_topic(self.cluster, app), None, retain=True)
        self.last_rho.pop(app, None)
        self.metrics.forget_app(app)
        self.kick()

    # -- registration and reads ----------------------------------------------------------------

    def _is_admin(self, context) -> bool:
        token = _bearer(context)
        return token is not None and hmac.compare_digest(token.encode(), self.admin_token.encode())

    async def _need_admin(self, context) -> None:
        if _bearer(context) is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "the admin token is required")
        if not self._is_admin(context):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "this call needs the admin token")

    async def _need_app_name(self, app: str, context) -> None:
        if not APP_NAME.match(app):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"app name {_quote([app])[2:-2]!r} must be 1-128 of A-Z a-z 0-9 . _ - "
                                "(starting with a letter or digit)")

    def _known(self, app: str) -> bool:
        return app in self.engine.apps or self.store.registered(app)

    def _unknown(self, app: str) -> str:
        """Why an admin call finds no app of that name: removed (by this arbiter's run), or never
        registered. A second RemoveApp used to say "never registered" of the app it had removed."""
        if app in self._removed:
            return f"app {app!r} was removed already, by RemoveApp at {self._removed[app]:.0f} (Unix time)"
        return f"unknown app {app!r} (never registered)"

    async def IssueToken(self, request: pb.IssueTokenRequest, context) -> pb.IssueTokenReply:
        await self._need_admin(context)
        await self._need_app_name(request.app, context)
        if not self._known(request.app) and len(self.store.token_apps() | set(self.engine.apps)) >= MAX_APPS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the arbiter knows {MAX_APPS} apps already (the limit); remove one first")
        if self.store.open_tokens(request.app) >= MAX_OPEN_TOKENS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{request.app!r} has {MAX_OPEN_TOKENS} unused registration tokens (the limit); "
                                "use one or RevokeCredential")
        if request.model and request.model not in self.profiles:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"unknown model {_quote([request.model])[2:-2]!r}; the profile table has "
                                f"{', '.join(sorted(self.profiles)) or 'none'} (serve --profiles FILE adds models)")
        await self._journal_works(context, "IssueToken")
        try:
            if request.model:  # before the token exists: a crash between the two leaves no token without it
                self.store.bind_model(request.app, request.model)
                self.models[request.app] = request.model
                if request.app in self.engine.apps:  # from the next round on (an open one keeps its own, D21)
                    self.engine.set_slowdown(request.app, self._slowdown_of(request.app))
                log.info("model bound", extra={"fields": {"app": request.app, "model": request.model}})
            token = new_secret("reg")
            self.store.add_token(token, request.app, "registration")
        except StoreError as exc:  # no token is handed out that the journal does not have
            self._journal_failed(exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, cut_reason(f"IssueToken was not done: {exc}"))
        return pb.IssueTokenReply(app=request.app, token=token)

    async def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterReply:
        """A registration token buys the app's credential and revokes any older one (issue 12,
        item 3): its stream, if open, ends. The admin token is not a registration token."""
        token = _bearer(context)
        if token is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a registration token is required")
        await self._need_app_name(request.app, context)
        if self._is_admin(context):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "the admin token is not a registration token: issue one with IssueToken")
        if not self._registers.take(request.app):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"more than {self.limits.registers} Registers for {request.app!r} in a burst (the "
                                f"limit; {self.limits.per_s:g} more a second)")
        owner = self.store.token_app(token, "registration")
        if owner is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "unknown or used registration token")
        if owner != request.app:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"this registration token is for {owner!r}, not {request.app!r}")
        credential = new_secret("app")
        try:
            exchanged = self.store.exchange_token(token, credential, request.app)
        except StoreError as exc:  # the token stays unused, and no credential is handed out
            self._journal_failed(exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, cut_reason(f"Register was not done: {exc}"))
        if not exchanged:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "unknown or used registration token")
        conn = self.conns.get(request.app)
        if conn is not None:
            conn.end(StreamEnd("revoked", f"{request.app!r} registered again: this stream's credential is revoked"))
        log.info("registered", extra={"fields": {"app": request.app}})
        return pb.RegisterReply(app=request.app, credential=credential)

    async def GetApp(self, request: pb.GetAppRequest, context) -> pb.AppState:
        token = _bearer(context)
        if token is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a credential is required")
        if not self._is_admin(context):
            caller = self.store.token_app(token, "credential")
            if caller is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown credential")
            if caller != request.app:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{caller!r} cannot read {request.app!r}")
        elif not self._known(request.app):  # as RemoveApp and RevokeCredential say it
            await context.abort(grpc.StatusCode.NOT_FOUND, self._unknown(request.app))
        return self._app_state(request.app)

    def _app_state(self, app: str) -> pb.AppState:
        state = self.engine.apps.get(app)
        now = self.clock()
        return pb.AppState(
            app=app,
            connected=app in self.conns,
            active=state is not None,
            arrived=state.arrived if state else 0.0,
            demand=(state.demand or 0) if state else 0,
            last_rho=self.last_rho.get(app, math.inf),
            n_avg=self.engine.n_avg(app, now) if state else 0.0,
            leases=[wire.lease_pb(x) for x in self._leases_of(app)],
            model=self.models.get(app, ""),
            idle=app in self.engine.idle,
        )

    def _app_metrics(self) -> dict[str, tuple[float, int]]:
        held: dict[str, int] = {}
        for lease in self._leases():
            held[lease.app] = held.get(lease.app, 0) + 1
        return {a: (self.last_rho.get(a, math.inf), held.get(a, 0)) for a in self.engine.apps}

    # -- admin ---------------------------------------------------------------------------------

    def _settings_pb(self) -> pb.Settings:
        s = self.settings
        return pb.Settings(policy=s.policy, fairness_knob=s.fairness_knob, lease_s=s.lease_s,
                           coalesce_s=s.coalesce_s, expiry_window_s=self.engine.expiry_window_s,
                           report_timeout_s=s.report_timeout_s, bid_timeout_s=s.bid_timeout_s,
                           max_contenders=s.max_contenders, rank=s.rank, reclaim=s.reclaim)

    def _cluster_state(self) -> pb.ClusterState:
        cluster = self.engine.cluster
        return pb.ClusterState(
            cluster=cluster.name, size=cluster.size,
            gpus=wire.places({g: cluster.position(g) for g in cluster.gpu_ids}),
            free=sorted(self._free()), drained_machines=sorted(self.engine.drained),
            leases=[wire.lease_pb(x) for x in self._leases()],
            settings=self._settings_pb(), round_id=self.engine.round_id)

    async def GetClusterState(self, request, context) -> pb.ClusterState:
        await self._need_admin(context)
        return self._cluster_state()

    async def ListApps(self, request, context) -> pb.AppList:
        await self._need_admin(context)
        departed = [pb.DepartedApp(**d) for d in self.store.departed(DEPARTED_SHOWN)]
        return pb.AppList(apps=[self._app_state(a) for a in sorted(set(self.engine.apps) | set(self.conns))],
                          departed=departed)

    async def ListLeases(self, request, context) -> pb.LeaseList:
        await self._need_admin(context)
        return pb.LeaseList(leases=[wire.lease_pb(x) for x in self._leases()])

    async def RoundHistory(self, request: pb.RoundHistoryRequest, context) -> pb.RoundList:
        await self._need_admin(context)
        if not 0 <= request.limit <= MAX_HISTORY:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"limit must be 0 (= 50) to {MAX_HISTORY} rounds, got {request.limit}")
        limit = request.limit or 50
        rounds = []
        for s in self.store.rounds(limit):
            rounds.append(pb.RoundSummary(
                round_id=s["round_id"], now=s["now"], offered=s["offered"], bidders=s["bidders"],
                rejected=s["rejected"], granted=s["granted"], idle=s["idle"], latency_s=s["latency_s"],
                rho={a: (math.inf if r is None else r) for a, r in s["rho"].items()},
                expired=s.get("expired", 0), moved=s.get("moved", 0), reports_s=s.get("reports_s", 0.0),
                bids_s=s.get("bids_s", 0.0), allocation_s=s.get("allocation_s", 0.0),
                seed=s.get("seed", ""), commitment=s.get("commitment", "")))
        return pb.RoundList(rounds=rounds)

    async def UpdateSettings(self, request: pb.SettingsUpdate, context) -> pb.Settings:
        await self._need_admin(context)
        new = replace(self.settings)
        if request.HasField("policy"):
            new.policy = request.policy[:NAME_MAX]
        if request.HasField("fairness_knob"):
            new.fairness_knob = request.fairness_knob
        if request.HasField("lease_s"):
            low, high = LEASE_RANGE_S
            if not low <= request.lease_s <= high:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"lease_s must be {low:g} to {high:g} s, got {request.lease_s}")
            new.lease_s = request.lease_s
        if request.HasField("max_contenders"):
            new.max_contenders = request.max_contenders
        if request.HasField("rank"):
            new.rank = request.rank[:NAME_MAX]
        if request.HasField("reclaim"):
            new.reclaim = request.reclaim
        try:
            new.check()
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        await self._engine_free()
        await self._journal_works(context, "UpdateSettings")
        old = self.settings
        self.apply_settings(new)
        await self._durable(context, "UpdateSettings", lambda: self.apply_settings(old))
        log.info("settings", extra={"fields": asdict(new)})
        return self._settings_pb()

    def apply_settings(self, new: Settings) -> None:
        """Takes effect from the next round; leases already granted keep their expiry."""
        self.settings = new
        self.engine.policy = new.policy_object()
        self.engine.rank = new.rank
        self.engine.reclaim = new.reclaim
        self.engine.lease_s = new.lease_s
        window = new.expiry_window_s if new.expiry_window_s is not None else new.lease_s * EXPIRY_WINDOW_SHARE
        self.engine.expiry_window_s = max(new.coalesce_s, window)

    async def AddMachine(self, request: pb.AddMachineRequest, context) -> pb.ClusterState:
        """Bounded before anything is built (issue 12: gpus = 2^31 - 1 once took the arbiter to 6 GB)."""
        await self._need_admin(context)
        if request.machine:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "machine names are given by the arbiter (<rack>-m<number>); leave it empty")
        if not RACK_NAME.match(request.rack):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"rack name {_quote([request.rack])[2:-2]!r} must be 1-64 of A-Z a-z 0-9 . _ "
                                "(no '-')")
        if not 1 <= request.gpus <= MAX_MACHINE_GPUS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"gpus must be 1 to {MAX_MACHINE_GPUS} per machine, got {request.gpus}")
        if not 0 <= request.slots <= request.gpus:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"slots must be 0 (= 1) to gpus ({request.gpus}), got {request.slots}")
        if self.engine.cluster.size + request.gpus > MAX_CLUSTER_GPUS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the cluster would have {self.engine.cluster.size + request.gpus} GPUs; "
                                f"the limit is {MAX_CLUSTER_GPUS}")
        if len(self.engine.added_machines) >= MAX_ADDED_MACHINES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{MAX_ADDED_MACHINES} machines were added already (the limit)")
        await self._engine_free()
        await self._journal_works(context, "AddMachine")
        try:
            name = self.engine.add_machine(request.rack, request.gpus, request.slots or 1, self.clock())
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        await self._durable(context, "AddMachine", lambda: self.engine.undo_add_machine(name))
        for gpu in self.engine.cluster.machines[name]:
            self._publish_gpu(gpu)
        self.kick()
        log.info("machine added", extra={"fields": {"machine": name, "gpus": request.gpus}})
        return self._cluster_state()

    async def DrainMachine(self, request: pb.DrainMachineRequest, context) -> pb.ClusterState:
        await self._need_admin(context)
        if not 0 < len(request.machine) <= NAME_MAX:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"machine name must be 1-{NAME_MAX} characters, got {len(request.machine)}")
        await self._engine_free()
        await self._journal_works(context, "DrainMachine")
        was_drained = request.machine in self.engine.drained
        try:
            if request.resume:
                self.engine.resume(request.machine, self.clock())
            else:
                self.engine.drain(request.machine)
        except KeyError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))

        def undo() -> None:
            (self.engine.drained.add if was_drained else self.engine.drained.discard)(request.machine)

        await self._durable(context, "DrainMachine", undo)
        if request.resume:
            self.kick()  # its free GPUs are worth a round
        log.info("machine resumed" if request.resume else "machine drained",
                 extra={"fields": {"machine": request.machine}})
        return self._cluster_state()

    async def RemoveApp(self, request: pb.RemoveAppRequest, context) -> pb.AppState:
        """Any registered app, connected or not, done or not (issue 12, item 3): its credentials
        and tokens are revoked, its stream ends with a Goodbye, its leases end (after the open
        round closes, if one is open)."""
        await self._need_admin(context)
        await self._need_app_name(request.app, context)
        if not self._known(request.app):
            await context.abort(grpc.StatusCode.NOT_FOUND, self._unknown(request.app))
        await self._journal_works(context, "RemoveApp")
        try:
            self.store.revoke(request.app)  # fails closed: refused in memory even when not written
            self.store.unbind_model(request.app)
        except StoreError as exc:
            self._journal_failed(exc)
            conn = self.conns.get(request.app)
            if conn is not None:
                conn.end(StreamEnd("revoked", f"the credential of {request.app!r} was revoked by an admin"))
            await context.abort(grpc.StatusCode.UNAVAILABLE, cut_reason(f"RemoveApp was not done: {exc}"))
        self.models.pop(request.app, None)
        self._removed[request.app] = self.clock()
        while len(self._removed) > MAX_APPS:  # the oldest go first: a bound, not a record
            del self._removed[next(iter(self._removed))]
        end = StreamEnd("removed", f"{request.app!r} was removed by an admin: its leases ended")
        if request.app in self.engine.apps:
            self._remove(request.app, end)
        conn = self.conns.get(request.app)
        if conn is not None:
            conn.end(end)
        log.info("app removed", extra={"fields": {"app": request.app}})
        return self._app_state(request.app)

    async def RevokeCredential(self, request: pb.RevokeCredentialRequest, context) -> pb.AppState:
        """The app's credentials and unused registration tokens stop working and its stream ends;
        the app stays (its leases run out as usual) and may come back with a new token."""
        await self._need_admin(context)
        await self._need_app_name(request.app, context)
        if not self._known(request.app):
            await context.abort(grpc.StatusCode.NOT_FOUND, self._unknown(request.app))
        failure = ""
        try:
            revoked = self.store.revoke(request.app)
        except StoreError as exc:  # refused in memory all the same (fail closed), and said so
            self._journal_failed(exc)
            revoked, failure = None, str(exc)
        conn = self.conns.get(request.app)
        if conn is not None:
            conn.end(StreamEnd("revoked", f"the credential of {request.app!r} was revoked by an admin"))
        if revoked is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, cut_reason(f"RevokeCredential: {failure}"))
        log.info("credential revoked", extra={"fields": {"app": request.app, "tokens": revoked}})
        return self._app_state(request.app)


def _json_num(x: float) -> float | None:
    return None if math.isinf(x) or math.isnan(x) else x


def _summary(result: RoundResult, latency: float) -> dict[str, Any]:
    """The round event's payload. ``moved`` counts GPUs whose lease expired as the round opened and
    that went to another app: the churn an operator sees (issue 10's goal: GPUs move only when the
    apps' rho order changes, D13)."""
    granted: dict[str, int] = {}
    for g in result.grants:
        granted[g.app] = granted.get(g.app, 0) + len(g.gpus)
    was = {lease.gpu: lease.app for lease in result.expired}
    moved = sum(1 for g in result.grants for gpu in g.gpus if was.get(gpu, g.app) != g.app)
    return {
        "round_id": result.round_id,
        "now": result.now,
        "offered": len(result.offered),
        "bidders": list(result.bidders),
        "rejected": dict(result.rejected),
        "granted": granted,
        "idle": len(result.idle),
        "expired": len(result.expired),
        "moved": moved,
        "latency_s": latency,
        "rho": {a: _json_num(r) for a, r in result.rho.items()},
        "seed": result.seed,  # D24: revealed now that the round has closed
        "commitment": result.commitment,
    }

