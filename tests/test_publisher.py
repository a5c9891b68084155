"""The service's one event stream (``arbiter.publisher``), on a real arbiter with real agents.

Every event a sink gets was committed first: a sink that reads the journal when a grant reaches it
finds the lease there. A round's events come in order (opened, rho, revocations, grants, leases,
closed), and what ``RoundClosed`` says of the round -- bidders in rank order, contenders with their
PF rows, c_i and draws, the GPUs each tier handed out -- agrees with itself and with the grants.
"""

from __future__ import annotations

import asyncio
import math

from arbiter.publisher import (
    AgentConnected,
    EventLog,
    Granted,
    LeasesChanged,
    RoundClosed,
    RoundOpened,
    ServiceEvent,
)
from tests.service_kit import arbiter, halving_app, start_agent, wait_for


def test_sinks_hear_of_a_grant_only_once_the_journal_has_it_and_a_round_reads_whole(tmp_path):
    async def scenario():
        async with arbiter(tmp_path, fairness_knob=0.0) as server:
            service = server.service
            heard: list[tuple[Granted, dict[str, str]]] = []

            class JournalProbe:
                """A sink placed before the others: what the journal holds when a grant arrives."""

                def consume(self, event: ServiceEvent) -> None:
                    if isinstance(event, Granted):
                        state, _ = service.store.load()
                        heard.append((event, {x.gpu: x.app for x in state.leases}))

            service.publisher.sinks.insert(0, JournalProbe())
            with service.events.follow() as queue:
                a, a_task = await start_agent(server, "a", halving_app(jobs=4, demand=2))
                b, b_task = await start_agent(server, "b", halving_app(jobs=4, demand=2))
                await wait_for(lambda: a.held and b.held, 20)
                events: list[ServiceEvent] = []
                while not queue.empty():
                    events.append(queue.get_nowait())
                a.stop()
                b.stop()
                await asyncio.gather(a_task, b_task)

            assert heard and all(journaled.get(gpu) == g.app for g, journaled in heard for gpu in g.gpus), heard
            assert {e.app for e in events if isinstance(e, AgentConnected)} == {"a", "b"}
            granted_rounds = {e.round_id for e in events if isinstance(e, Granted)}
            assert granted_rounds
            for rid in granted_rounds:
                first = next(i for i, e in enumerate(events) if isinstance(e, RoundOpened) and e.round_id == rid)
                last = next(i for i, e in enumerate(events) if isinstance(e, RoundClosed) and e.round_id == rid)
                window = events[first:last + 1]
                opened, closed = window[0], window[-1]
                grants = {e.app: set(e.gpus) for e in window if isinstance(e, Granted) and e.round_id == rid}
                at = [i for i, e in enumerate(window) if isinstance(e, LeasesChanged) and e.cause == "round"]
                assert len(at) == 1 and at[0] > max(i for i, e in enumerate(window) if isinstance(e, Granted))
                leases = window[at[0]]
                for app, gpus in grants.items():
                    assert {x.gpu for x in leases.gpus if x.app == app} >= gpus
                assert closed.summary["granted"] == {app: len(g) for app, g in grants.items()}
                assert closed.trigger in ("expiry", "reclaim", "change") and closed.policy == "themis"
                assert set(opened.free) == set(closed.result.offered)
                bidders = closed.bidders()
                assert [x.app for x in bidders] == list(closed.result.bidders)
                assert [x.rank for x in bidders] == list(range(1, len(bidders) + 1))
                assert all(x.rho > 0 for x in bidders)
                taken: dict[str, set[str]] = {}
                for take in closed.taken():
                    assert take.tier in ("auction", "queue", "leftover", "policy")
                    assert not taken.get(take.app, set()) & set(take.gpus)
                    taken.setdefault(take.app, set()).update(take.gpus)
                assert taken == grants
                auction = {t.app: set(t.gpus) for t in closed.taken() if t.tier == "auction"}
                for c in closed.contenders():
                    assert c.app in closed.result.bidders
                    if c.won is None:
                        assert not c.pf and c.app not in auction
                    else:
                        assert c.pf and math.isfinite(c.pf_rho)
                        lo, hi = (c.c, c.c) if c.c is not None else c.c_bounds  # D39: the service may report bounds
                        assert 0.0 <= lo <= hi <= 1.0
                        assert (auction.get(c.app) == set(c.pf)) is c.won
                standing = {s.app: s for s in closed.standing}
                assert set(grants) <= set(standing) <= {"a", "b"}
                assert all(standing[app].held >= len(gpus) for app, gpus in grants.items())

    asyncio.run(scenario())


def test_a_follower_that_does_not_keep_up_loses_its_oldest_events_not_the_service():
    async def scenario():
        log = EventLog(keep=3)
        with log.follow(limit=2) as queue:
            for k in range(5):
                log.consume(AgentConnected(now=float(k), app=f"a{k}", took_over=False, connected=k))
            assert [queue.get_nowait().app for _ in range(queue.qsize())] == ["a3", "a4"]
        assert log.lost == 3 and [e.app for e in log.recent] == ["a2", "a3", "a4"]
        log.consume(AgentConnected(now=9.0, app="late", took_over=False, connected=1))  # no follower left
        assert log.lost == 3

    asyncio.run(scenario())
