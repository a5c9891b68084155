"""The round driver: the wall clock around the sans-I/O round engine (paper 4.2, Fig. 7; D10).

When a round is due (``RoundEngine.round_due``) the driver opens it, journals it, sends a RhoRequest
to every connected app the engine wants a report from (D6) and waits until all answered or the
report deadline passed; then it sends the offers and waits for bids until the bid deadline. Apps
that miss a deadline, or are not connected, are treated as not reporting or not bidding. The
allocation (the auction's MILPs) runs in a worker thread while nothing on the loop mutates the
engine; agents' releases, demand updates and Done are held back until it returns. The round
closes, its outcome is committed (journal, then its events: rho, revocations, grants, leases and
the round itself), and only then do agents, the broker and the metrics hear of it -- so after a
crash, what agents were told is never ahead of the journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from dataclasses import replace
from typing import Any

from arbiter.auction import InvalidBid
from arbiter.connection import INVALID
from arbiter.publisher import (
    GpuLease,
    Granted,
    LeasesChanged,
    Revoked,
    RhoUpdated,
    RoundClosed,
    RoundFailed,
    RoundOpened,
    ServiceEvent,
    Standing,
    json_num,
)
from arbiter.rounds import OpenRound, RoundResult
from arbiter.service_core import ServiceCore
from protos import themis_pb2 as pb
from protos import wire

log = logging.getLogger("themis.arbiter")

RECLAIMED = "reclaimed: beyond the app's fair share while an app that holds nothing waits (D27)"


def round_summary(result: RoundResult, latency: float) -> dict[str, Any]:
    """The round as the journal keeps it and RoundHistory and MQTT serve it. ``moved`` counts GPUs
    whose lease expired as the round opened and that went to another app: the churn an operator
    sees (GPUs move only when the apps' rho order changes, D13)."""
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
        "rho": {a: json_num(r) for a, r in result.rho.items()},
        "seed": result.seed,  # D24: revealed now that the round has closed
        "commitment": result.commitment,
    }


def trigger_of(rnd: OpenRound) -> str:
    """Why a round ran (D10): leases ran out (``expiry``), only leases beyond a fair share were
    ended for apps that hold nothing (``reclaim``, D27), or a change -- an arrival, a release, new
    demand, new GPUs -- met free GPUs and unmet demand (``change``, the resource-available event)."""
    if len(rnd.expired) > len(rnd.reclaimed):
        return "expiry"
    return "reclaim" if rnd.reclaimed else "change"


class RoundDriver:
    """Runs the rounds of one service; see the module docstring."""

    def __init__(self, core: ServiceCore):
        self.core = core

    async def run_rounds(self) -> None:
        """D10 on the wall clock: sleep until a round may be due or something changed."""
        core = self.core
        while not core._stopping.is_set():
            wake = core.engine.next_wakeup()
            timeout = None if wake is None else max(0.0, wake - core.clock())
            try:
                await asyncio.wait_for(core._kick.wait(), timeout)
            except TimeoutError:
                pass
            core._kick.clear()
            if core._stopping.is_set():
                break
            if core.engine.round_due(core.clock()):
                try:
                    await self.run_round()
                except Exception as exc:  # a bug in one round must not stop the arbiter
                    log.exception("round failed")
                    core.emit(RoundFailed(now=core.clock(), round_id=None, reason=f"{type(exc).__name__}: {exc}"))
                    await asyncio.sleep(max(0.5, core.settings.coalesce_s))  # no hot loop on a persistent fault

    def stop(self) -> None:
        self.core._stopping.set()
        self.core.kick()

    # -- one round (paper 4.2.2 steps 1-5) -----------------------------------------------------

    async def run_round(self) -> RoundResult:
        core, engine = self.core, self.core.engine
        started = time.perf_counter()
        phases = {"reports_s": 0.0, "bids_s": 0.0, "allocation_s": 0.0}
        await core.engine_free()
        now = core.clock()
        if core.contention is not None:  # D35, D36: what a contention-aware policy sees; rounds fill offers from it
            engine.policy.contention = core.contention
        rnd = engine.open_round(now)
        core._round = rnd
        core._between_rounds.clear()
        trigger = trigger_of(rnd)
        closed = False
        try:
            # the round id and the expiries, before anyone hears of this round
            expired = tuple(GpuLease(x.gpu, x.app, x.expires_at, x.round_id) for x in rnd.expired)
            core.commit(RoundOpened(now=now, round_id=rnd.round_id, trigger=trigger, free=tuple(sorted(rnd.free)),
                                    asked=tuple(r.app for r in rnd.requests), expired=expired,
                                    reclaimed=tuple(x.gpu for x in rnd.reclaimed), waiting=tuple(rnd.waiting),
                                    commitment=rnd.commitment),
                        strict=True)
            deadline = now + core.settings.report_timeout_s
            asked = {}
            for request in rnd.requests:
                conn = core.conns.get(request.app)
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
                rnd.note_failure(app, core._bad.get((rnd.round_id, app, "report"), "no rho report before the deadline"))
            offers = rnd.offers()
            deadline = core.clock() + core.settings.bid_timeout_s
            waiting = {}
            for app, offer in offers.items():
                conn = core.conns.get(app)
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
                    core.reject(app, INVALID, exc.reason, "bid", rnd.round_id)
            for app in set(waiting) - set(bids):
                rnd.note_failure(app, core._bad.get((rnd.round_id, app, "bid"), "no bid before the deadline"))
            # The allocation (the auction's MILPs) runs in a worker thread so heartbeats, admin calls
            # and health answer meanwhile; nothing else touches the engine until it returns.
            core._frozen = (tuple(core.leases()), engine.free_gpus())
            core._allocating = True
            core._allocated.clear()
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
                core._allocating = False
                core._frozen = None
                core._allocated.set()
            closed = True
            rho_events = self._rho_after(result, bids)
        finally:
            rnd.abandon()  # a no-op once closed; otherwise the engine must not stay stuck in this round
            for key in [k for k in core._waiting if k[0] == rnd.round_id]:
                core._waiting.pop(key).cancel()
            core._bad.clear()
            held_back, core._held_back = core._held_back, []
            for change in held_back:
                try:
                    change()
                except Exception:
                    log.exception("a change held back during the allocation failed")
            if not closed:
                core._round = None
                core.run_deferred()
        latency = time.perf_counter() - started
        summary = round_summary(result, latency) | phases
        core._round = None
        failure = core.commit(*rho_events, *self._outcome(result),
                              self._closed(result, trigger, rnd.policy.name, latency, summary),
                              closed=(result, summary))
        if failure is not None:  # e.g. disk full: agents heard what memory now says they hold
            log.error("journal write failed after round %d; the next change writes it again", result.round_id,
                      exc_info=failure)
            core.emit(RoundFailed(now=core.clock(), round_id=result.round_id, reason=f"journal: {failure}"))
        core.run_deferred()
        core.rounds_run += 1
        log.info("round", extra={"fields": {k: summary[k] for k in ("round_id", "offered", "bidders", "granted",
                                                                    "idle", "latency_s")}})
        return result

    def _expect(self, round_id: int, app: str, kind: str) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.core._waiting[(round_id, app, kind)] = fut
        return fut

    async def _gather(self, futures: dict[str, asyncio.Future], deadline: float) -> dict[str, Any]:
        if futures:
            await asyncio.wait(list(futures.values()), timeout=max(0.0, deadline - self.core.clock()))
        for f in futures.values():
            if not f.done():
                f.cancel()  # the deadline passed: a late answer is refused with that reason
        return {app: f.result() for app, f in futures.items() if f.done() and not f.cancelled()}

    # -- what a closed round changed -----------------------------------------------------------

    def _rho_after(self, result: RoundResult, bids: dict[str, Any]) -> list[ServiceEvent]:
        """Each reporting app's rho on what it holds after the round: the rows of its bid are
        rho(held + S), so the best row whose S it was granted bounds it from above (and is exact
        when S is all it got); with no grant, rho_old is rho on what it kept. Infinity only for an
        app that holds nothing (D13). ``exact`` is False when the value is only a bound or an
        estimate: a best row for a superset of what it won, or, for an app that did not bid, its
        report from before the round changed what it holds. Sets ``last_rho`` (journaled with the
        round) and returns the events that say it."""
        core, engine = self.core, self.core.engine
        got = {g.app: g.gpus for g in result.grants}
        lost = {lease.app for lease in result.expired
                if not any(lease.gpu in g.gpus and g.app == lease.app for g in result.grants)}
        events: list[ServiceEvent] = []
        for app, reported in result.rho.items():
            if app not in engine.apps:
                continue
            held = engine.held(app)
            if not held:
                core.last_rho[app] = math.inf
                events.append(RhoUpdated(now=result.now, round_id=result.round_id, app=app, rho=math.inf, gpus=()))
                continue
            table = bids.get(app)
            won = got.get(app, frozenset())
            rho, exact = math.inf, True
            if table is not None:
                rows = [(r, gpus == won) for gpus, r in table.rows if won and gpus <= won]
                rho, exact = min(rows) if rows else (table.rho_old, not won)
            if not math.isfinite(rho):
                rho = reported if math.isfinite(reported) else core.last_rho.get(app, math.inf)
                exact = not won and app not in lost
            core.last_rho[app] = rho
            events.append(RhoUpdated(now=result.now, round_id=result.round_id, app=app, rho=rho,
                                     gpus=tuple(sorted(held)), exact=exact))
        return events

    def _outcome(self, result: RoundResult) -> list[ServiceEvent]:
        """Revocations (what expired and was not granted back), grants, and every lease they changed."""
        regained = {(g.app, gpu) for g in result.grants for gpu in g.gpus}
        reclaimed = {lease.gpu for lease in result.reclaimed}
        lost: dict[tuple[str, str], list[str]] = {}
        for lease in result.expired:
            if (lease.app, lease.gpu) not in regained:
                reason = RECLAIMED if lease.gpu in reclaimed else "lease expired"
                lost.setdefault((lease.app, reason), []).append(lease.gpu)
        events: list[ServiceEvent] = [
            Revoked(now=result.now, round_id=result.round_id, app=app, gpus=tuple(sorted(gpus)), reason=reason,
                    reclaimed=reason == RECLAIMED)
            for (app, reason), gpus in sorted(lost.items())]
        events += [Granted(now=result.now, round_id=result.round_id, app=g.app, gpus=tuple(sorted(g.gpus)),
                           expires_at=g.expires_at, source=g.source) for g in result.grants]
        changed = {lease.gpu for lease in result.expired} | {gpu for g in result.grants for gpu in g.gpus}
        apps = {lease.app for lease in result.expired} | {g.app for g in result.grants}
        events.append(LeasesChanged(now=result.now, cause="round",
                                    gpus=tuple(self.core.gpu_lease(g) for g in sorted(changed)),
                                    apps=tuple(self.core.app_leases(a) for a in sorted(apps))))
        return events

    def _closed(self, result: RoundResult, trigger: str, policy: str, latency: float,
                summary: dict[str, Any]) -> RoundClosed:
        """The round's own event. Its standing and lease count are those after the removals that
        waited for the round (they run right after it): the apps leaving are left out."""
        core = self.core
        leaving = {app for app, _ in core._deferred if app in core.engine.apps}
        held = Counter(lease.app for lease in core.leases())
        standing = tuple(Standing(a, core.last_rho.get(a, math.inf), held.get(a, 0))
                         for a in core.engine.apps if a not in leaving)
        return RoundClosed(now=result.now, result=result, trigger=trigger, policy=policy, latency_s=latency,
                           standing=standing, leases=len(core.engine.leases) - sum(held[a] for a in leaving),
                           connected=len(core.conns), summary=summary)
