"""What the service's four jobs share, and the one commit step every change goes through.

The arbiter as a service does four jobs (``arbiter.service`` composes them): the agents' streams
(``arbiter.streams``), the round driver (``arbiter.round_driver``), the admin API
(``arbiter.admin``) and publishing (``arbiter.publisher``). They act on one state -- the round
engine, the journal, the open round, the agents' connections, the apps' last rho -- which lives
here, with :meth:`ServiceCore.commit`: journal the whole state, then emit the change's events once
to every sink, then wake the round loop. Nothing told to an agent, the broker or an operator is
ever ahead of the journal.

One asyncio loop owns everything. The one exception is a round's allocation (the auction's
MILPs, CPU-heavy): it runs in a worker thread so heartbeats, health and admin reads answer
meanwhile, and while it runs nothing on the loop mutates the engine (:meth:`engine_free`); reads
see the leases and free GPUs as they were when it started (:meth:`leases`, :meth:`free`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from typing import Any

from arbiter.connection import OUTBOX_LIMIT, Connection, StreamEnd
from arbiter.limits import Limits
from arbiter.publisher import AppLeases, AppLeft, GpuLease, LeasesChanged, Publisher, Refused, ServiceEvent
from arbiter.rounds import OpenRound, RoundEngine, RoundResult, cut_reason
from arbiter.service_contention import ServiceContention
from arbiter.service_metrics import ServiceMetrics
from arbiter.settings import Settings
from arbiter.store import Store
from protos import themis_pb2 as pb

log = logging.getLogger("themis.arbiter")

DEPARTED_PENDING = 1000  # apps that left kept in memory while the journal cannot write them


class ServiceCore:
    """The state the service's jobs share and the one commit step; see the module docstring."""

    def __init__(
        self,
        engine: RoundEngine,
        store: Store,
        *,
        settings: Settings,
        metrics: ServiceMetrics | None = None,
        clock: Callable[[], float] = time.time,
        profiles: Mapping[str, tuple[float, float, float, float]] | None = None,
        limits: Limits | None = None,
    ):
        self.engine = engine
        self.store = store
        self.settings = settings
        self.limits = limits or Limits()
        self.limits.check()
        self.metrics = metrics or ServiceMetrics()
        self.publisher = Publisher()
        self._wall = clock
        self.cluster = engine.cluster.name
        self.conns: dict[str, Connection] = {}
        self.outbox_limit = OUTBOX_LIMIT  # the Connection of each new stream gets it
        self.last_rho: dict[str, float] = store.last_rho()
        self.problems: dict[str, str] = {}  # what makes health NOT_SERVING ("journal", "loop"), and why
        self.rounds_run = 0
        #: model -> placement slowdowns by D1 level (the profile table): what IssueToken may bind an
        #: app to, and what a measured rank applies to its claimed work (D21)
        self.profiles = dict(profiles or {})
        self.models = store.models()
        #: D35: the jobs agents report and who runs where, when ``serve --contention`` is given; None:
        #: no contention model, no job reports taken, nothing on the wire changed
        self.contention: ServiceContention | None = None
        #: app -> when its agent's stream ended (after idle_s with nothing held it goes idle); after
        #: a restart every app's agent is away until it comes back
        self._away: dict[str, float] = dict.fromkeys(engine.apps, max(clock(), engine.clock))
        # the open round and the agents' answers it waits for
        self._round: OpenRound | None = None
        self._waiting: dict[tuple[int, str, str], asyncio.Future] = {}  # (round, app, kind) -> answer
        self._bad: dict[tuple[int, str, str], str] = {}  # (round, app, kind) -> why its answer was refused
        self._kick = asyncio.Event()
        self._stopping = asyncio.Event()
        # the allocation in its worker thread, and what waits for it
        self._allocating = False
        self._allocated = asyncio.Event()
        self._allocated.set()
        self._held_back: list[Callable[[], None]] = []  # agent changes that arrived during an allocation
        self._frozen: tuple[tuple, frozenset[str]] | None = None  # (leases, free GPUs) while allocating
        # apps leaving: removals wait for the open round to close
        self._deferred: list[tuple[str, StreamEnd | None]] = []
        self._leaving: dict[str, str] = {}  # app -> why it leaves ("finished", "removed"), until it has left
        self._departed: list[dict[str, Any]] = []  # apps that left, for the next journal write (status)
        self._between_rounds = asyncio.Event()  # set when no round is open and deferred removals are done
        self._between_rounds.set()
        for app, model in sorted(self.models.items()):
            if model not in self.profiles:  # e.g. started without the --profiles file that had it
                log.warning("an app's model is not in the profile table: it is ranked by its report",
                            extra={"fields": {"app": app, "model": model}})
        for app in engine.apps:
            engine.set_slowdown(app, self.slowdown_of(app))

    def clock(self) -> float:
        """The wall clock, never behind the engine's: after an NTP step back, or on a journal
        written by a clock that ran ahead, time stands still until the wall catches up."""
        return max(self._wall(), self.engine.clock)

    def slowdown_of(self, app: str) -> tuple[float, float, float, float] | None:
        """The slowdowns of the model bound to ``app``; None when none is, or the profile table no
        longer has it (the app is then ranked by its report, D21)."""
        return self.profiles.get(self.models.get(app, ""))

    # -- the commit step -----------------------------------------------------------------------

    def journal(self, result: RoundResult | None = None, summary: dict[str, Any] | None = None) -> None:
        """One transaction with the whole state. A failure marks the service unhealthy until a
        write succeeds again, and is raised to the caller."""
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

    def journal_failed(self, exc: BaseException) -> None:
        """A write the store refused outside :meth:`journal` (tokens): health shows it until a
        write succeeds again."""
        self.problems["journal"] = f"journal write failed: {exc}"
        self.metrics.journal_failures.inc()
        log.error("the journal cannot be written", extra={"fields": {"cause": str(exc)}})

    def commit(self, *events: ServiceEvent, closed: tuple[RoundResult, dict[str, Any]] | None = None,
               wake: bool = False, strict: bool = False) -> Exception | None:
        """The one commit step: journal the whole state (with the round that ``closed``), then emit
        ``events`` to every sink, then, with ``wake``, let the round loop look whether a round is due.

        With ``strict`` a failed write is raised and nothing is emitted: the caller undoes the change
        and refuses it (an admin's call: nothing is acknowledged that a restart would not have).
        Otherwise the events go out all the same -- agents must hear what memory now says they hold,
        and health shows the journal failing until a write succeeds -- and the failure is returned."""
        try:
            if closed is None:
                self.journal()
            else:
                self.journal(*closed)
        except Exception as exc:
            if strict:
                raise
            failure: Exception | None = exc
        else:
            failure = None
        self.publisher.emit(*events)
        if wake:
            self.kick()
        return failure

    def emit(self, *events: ServiceEvent) -> None:
        """Events that record no change (nothing to journal): a refusal, a stream that came or went."""
        self.publisher.emit(*events)

    def kick(self) -> None:
        self._kick.set()

    # -- reading the state while an allocation runs --------------------------------------------

    async def engine_free(self) -> None:
        """Wait while a round's allocation runs in the worker thread: changes to the engine apply
        between allocations, never during one."""
        while self._allocating:
            await self._allocated.wait()

    def leases(self) -> list:
        """Every lease, sorted by GPU; while an allocation runs, as it was when it started."""
        if self._frozen is not None:
            return list(self._frozen[0])
        return sorted(self.engine.leases, key=lambda x: x.gpu)

    def leases_of(self, app: str) -> list:
        """The app's leases, sorted by GPU; while an allocation runs, as they were when it started."""
        return [x for x in self.leases() if x.app == app]

    def free(self) -> frozenset[str]:
        return self._frozen[1] if self._frozen is not None else self.engine.free_gpus()

    def gpu_lease(self, gpu: str) -> GpuLease:
        lease = self.engine.leases.lease(gpu)
        return GpuLease(gpu) if lease is None else GpuLease(gpu, lease.app, lease.expires_at, lease.round_id)

    def app_leases(self, app: str) -> AppLeases:
        leases = self.engine.leases
        return AppLeases(app, tuple((g, leases.lease(g).expires_at) for g in sorted(self.engine.held(app))))

    def settings_pb(self) -> pb.Settings:
        return self.settings.to_pb(self.engine.expiry_window_s)

    # -- talking to agents ---------------------------------------------------------------------

    def send(self, app: str, message: pb.ArbiterMessage) -> None:
        conn = self.conns.get(app)
        if conn is not None:
            conn.send(message)

    def reject(self, app: str, code: int, reason: str, what: str, round_id: int = 0) -> None:
        """Refuse an agent's message with a reason (the streams sink sends it as a Rejection); the
        stream stays open."""
        reason = cut_reason(reason)
        log.info("rejected", extra={"fields": {"app": app, "what": what, "reason": reason}})
        self.emit(Refused(now=self.clock(), app=app, what=what, code=code, reason=reason, round_id=round_id,
                          active=app in self.engine.apps))

    # -- an app leaves ---------------------------------------------------------------------------

    def remove_app(self, app: str, end: StreamEnd | None) -> None:
        """The app leaves: its leases end now. While a round is open the removal waits for it to
        close (the round may already hold the app's report or bid); its stream, if any, ends now
        with ``end``."""
        if end is not None and app in self.conns and end.why != "finished":
            self.conns[app].end(replace(end, gpus=tuple(x.gpu for x in self.leases_of(app))))
        if end is not None:
            self._leaving.setdefault(app, end.why)
        if self._round is not None or self._allocating:
            self._deferred.append((app, None))
            return
        now = self.clock()
        record = self.engine.apps[app]
        why = self._leaving.pop(app, "removed")
        last_rho = self.last_rho.get(app, math.inf)
        attained = self.engine.attained(app, now)
        self._departed.append({"app": app, "arrived": record.arrived, "left": now, "why": why,
                               "last_rho": last_rho, "gpu_seconds": attained})
        del self._departed[:-DEPARTED_PENDING]  # a journal failing for long keeps only the latest
        freed = self.engine.remove_app(app, now)
        self.last_rho.pop(app, None)
        self.commit(LeasesChanged(now=now, cause="app left", gpus=tuple(GpuLease(g) for g in sorted(freed)),
                                  apps=(AppLeases(app, gone=True),)),
                    AppLeft(now=now, app=app, why=why, arrived=record.arrived, last_rho=last_rho,
                            gpu_seconds=attained),
                    wake=True)

    def run_deferred(self) -> None:
        """The removals that waited for the round to close."""
        deferred, self._deferred = self._deferred, []
        for app, end in deferred:
            if app in self.engine.apps:
                self.remove_app(app, end)
        self._between_rounds.set()
