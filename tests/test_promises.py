"""Themis's promises across a round, on the hand-made rounds where they used to fail (issue 10):
rho ranks every app (D13), holders cannot claim infinity, a winner's hidden payment goes to starving
bidders, identical apps bid on different machines (D7), and the auction decides (D8, D9, D14)."""

from __future__ import annotations

import math

import pytest

from agent.agent import Agent
from agent.appsched import JobInfo, SingleJobApp
from agent.placement import load_profiles
from arbiter.auction import run_auction
from arbiter.cluster import load_cluster
from arbiter.policies import make_policy
from arbiter.rounds import RoundEngine
from protos.messages import BidTable, RhoReport


def job_app(demand: int, iters: float = 10_000, start: float = 0.0, model: str = "vgg19") -> SingleJobApp:
    return SingleJobApp(JobInfo(iters, 1.0, load_profiles()[model].slowdown, demand, "job0"), start_time=start)


class Fixed:
    """An agent with scripted answers (to test what the engine refuses)."""

    def __init__(self, rho: float, demand: int, bid=None, wait: float = 0.0):
        self.rho, self.demand, self.table, self.wait = rho, demand, bid, wait

    def report(self, request):
        return RhoReport(self.rho, self.demand, rho_wait=self.wait)

    def bid(self, offer):
        return self.table(offer) if callable(self.table) else self.table


def test_apps_whose_leases_run_out_together_report_their_rho_on_what_they_held():
    """The mass tie at lease expiry: every continuing app reported rho = infinity because its
    leases had already been taken away. Now the report is on what it held as the round opened."""
    cluster = load_cluster("testbed-64").subcluster(["r0-m4", "r0-m5"])  # 8 GPUs
    engine = RoundEngine(cluster, make_policy("themis"), lease_s=100, expiry_window_s=0, coalesce_s=0)
    agents = {name: Agent(job_app(4, start=0), name=name) for name in ("a", "b")}
    for name in agents:
        engine.add_app(name, 0)
    first = engine.run_round(0, agents)
    assert sorted(len(g.gpus) for g in first.grants) == [4, 4]
    for name, agent in agents.items():
        agent.app.advance("job0", 500)
        engine.set_demand(name, 8, 50)  # both want more: asked for rho at the next round
    rnd = engine.open_round(100)
    assert len(rnd.expired) == 8 and not engine.leases.taken()
    assert all(len(req.held) == 4 for req in rnd.requests)  # the GPUs whose lease just ran out
    reports = {req.app: agents[req.app].report(req) for req in rnd.requests}
    assert all(math.isfinite(r.rho) for r in reports.values())
    assert reports["a"].rho == pytest.approx(reports["b"].rho)


def test_apps_holding_nothing_are_ranked_by_how_long_they_waited_not_by_a_draw():
    """D13: among apps at rho = infinity the waiting rho decides, and it grows while an app waits:
    the same app is chosen whatever the round's seed."""
    cluster = load_cluster("testbed-64").subcluster(["r0-m0"])  # 2 GPUs
    chosen = set()
    for seed in range(8):
        engine = RoundEngine(cluster, make_policy("themis", fairness_knob=0.8, fill=False), seed=seed)
        early, late = job_app(2, iters=5_000, start=0), job_app(2, iters=5_000, start=900)
        engine.add_app("early", 0)
        engine.add_app("late", 900)
        agents = {"early": Agent(early, name="early"), "late": Agent(late, name="late")}
        r = engine.run_round(1000, agents)
        assert all(math.isinf(rho) for rho in r.rho.values())
        chosen.add(r.bidders)
    assert chosen == {("early",)}


def test_a_holder_cannot_report_or_bid_rho_infinity():
    """D13: rho = infinity means holding nothing; an app that holds GPUs and says infinity is refused
    with a reason (an app that always said infinity used to finish sooner)."""
    cluster = load_cluster("testbed-64").subcluster(["r0-m4"])  # 4 GPUs
    engine = RoundEngine(cluster, make_policy("themis", fairness_knob=0.0), lease_s=1000)
    engine.add_app("holder", 0)
    engine.add_app("other", 0)
    engine.leases.grant("holder", ["r0-m4-g0"], now=0, expires_at=1000, round_id=0)
    r = engine.run_round(1, {"holder": Fixed(math.inf, 4), "other": Fixed(2.0, 1)})
    assert "must be finite" in r.rejected["holder"]
    assert "holder" not in r.bidders
    r = engine.run_round(2, {"holder": Fixed(2.0, 4, bid=lambda o: BidTable(math.inf, ())),
                             "other": Fixed(2.0, 1)})
    assert "rho_old must be finite" in r.rejected["holder"]
    assert "r0-m4-g0" in engine.held("holder")  # refusing its words takes nothing it holds


def test_a_winners_unkept_share_goes_to_a_starving_bidder_before_an_app_that_holds_gpus():
    """The issue's round: two starving bidders, one free GPU, and a third app holding GPUs at rho
    0.54 with unmet demand. The GPU used to go to the third app; now a starving bidder gets it."""
    cluster = load_cluster("testbed-64").subcluster(["r0-m0", "r0-m1"])  # 4 GPUs
    for seed in range(10):
        # D27 would end one of rich's leases (it holds 3 GPUs, above its share of 4 / 3): this is D8 alone
        engine = RoundEngine(cluster, make_policy("themis", fairness_knob=0.5, fill=False), lease_s=1000, seed=seed,
                             reclaim=False)
        for app in ("s1", "s2", "rich"):
            engine.add_app(app, 0)
        engine.leases.grant("rich", ["r0-m0-g0", "r0-m0-g1", "r0-m1-g0"], now=0, expires_at=1000, round_id=0)
        free = sorted(engine.free_gpus())
        assert len(free) == 1

        def one_gpu(offer):
            return BidTable(math.inf, ((frozenset(offer.gpus), 3.0),))

        r = engine.run_round(1, {"s1": Fixed(math.inf, 1, one_gpu, wait=2.0),
                                 "s2": Fixed(math.inf, 1, one_gpu, wait=1.0),
                                 "rich": Fixed(0.54, 4, lambda o: BidTable(0.54, ((frozenset(o.gpus), 0.5),)))})
        assert [(g.app, sorted(g.gpus)) for g in r.grants] == [("s1", free)]
        assert r.grants[0].source == "auction" and r.decision.auction.hidden_payment["s1"] == 1.0


def test_identical_starving_apps_bid_for_different_machines_and_the_auction_grants_them():
    """Five identical vgg19 apps (8 GPUs each) with the whole sim-256 free: they all used to bid on
    the same 24 GPUs and the auction granted none. Now each lists its own machines (D7)."""
    cluster = load_cluster("sim-256")
    engine = RoundEngine(cluster, make_policy("themis", fairness_knob=0.0), lease_s=1000)
    agents = {f"vgg{k}": Agent(job_app(8), name=f"vgg{k}") for k in range(5)}
    for name in agents:
        engine.add_app(name, 0)
    r = engine.run_round(1, agents)
    outcome = r.decision.auction
    assert set(outcome.granted) == set(agents)
    assert all(c == 1.0 for c in outcome.hidden_payment.values())
    for g in r.grants:
        assert g.source == "auction" and len(g.gpus) == 8
        assert len({cluster.gpus[x].machine for x in g.gpus}) == 1
    assert r.granted_by == {"auction": 40, "queue": 0, "leftover": 0, "policy": 0}


def test_six_starving_apps_on_eight_gpus_in_four_slots_are_all_served_by_the_auction():
    """D18, the starvation traced in the paper setup (Workload 1, testbed-64/4, seed 3): every
    container starts with its lowest-numbered GPU, so all apps' 1-GPU rows named the same first GPU
    of each slot -- 4 of the 8 free GPUs. Six starving apps could not all be served, each of the five
    the PF served had c_i = 0 (without it the sixth would be served), and the auction granted
    nothing. With every free GPU a 1-GPU row of its own, all six are served and keep a share."""
    cluster = load_cluster("testbed-64").subcluster(["r0-m4", "r0-m5"])  # 8 GPUs, 4 slots of 2
    assert len({p.slot for p in cluster.gpus.values()}) == 4
    engine = RoundEngine(cluster, make_policy("themis", fairness_knob=0.0), lease_s=1000)
    agents = {f"s{k}": Agent(job_app(4, iters=1_000 * (k + 1)), name=f"s{k}") for k in range(6)}
    for name in agents:
        engine.add_app(name, 0)
    r = engine.run_round(1, agents)
    outcome = r.decision.auction
    assert set(outcome.contenders) == set(agents)
    assert set(outcome.pf) == set(agents)
    assert all(0 < outcome.hidden_payment[a] <= 1 for a in agents)
    assert r.granted_by["auction"] > 0


def test_what_the_auction_leaves_is_placed_by_the_reserves_bids_in_rank_order():
    """D9, D14: the apps after the filtered ones got the offer too; GPUs the auction did not place go
    to them worst first, each taking the row of its own bid it values most."""
    cluster = load_cluster("testbed-64").subcluster(["r0-m4", "r0-m5"])  # two 4-GPU machines
    engine = RoundEngine(cluster, make_policy("themis", fairness_knob=0.8), lease_s=1000)
    m4 = frozenset(g for g in cluster.gpus if cluster.gpus[g].machine == "r0-m4")
    m5 = frozenset(g for g in cluster.gpus if cluster.gpus[g].machine == "r0-m5")
    names = ["worst", "next", "last"]
    for name in names:
        engine.add_app(name, 0)
    agents = {
        "worst": Fixed(math.inf, 4, BidTable(math.inf, ((m4, 1.0),)), wait=3.0),
        "next": Fixed(math.inf, 4, BidTable(math.inf, ((m4, 1.0), (m5, 1.2))), wait=2.0),
        "last": Fixed(math.inf, 4, BidTable(math.inf, ((m5, 1.0),)), wait=1.0),
    }
    r = engine.run_round(1, agents)
    assert r.bidders == ("worst", "next", "last")  # the reserve's demand covers the 8 free GPUs with both
    assert r.decision.auction.contenders == ("worst",)
    # 'next' ranks before 'last', so it takes m5 although 'last' values it more
    assert {g.app: (g.gpus, g.source) for g in r.grants} == {"worst": (m4, "auction"), "next": (m5, "queue")}


CAP_CLUSTER = load_cluster("testbed-64").subcluster(["r0-m4", "r0-m5"])
M4 = frozenset(g for g in CAP_CLUSTER.gpus if CAP_CLUSTER.gpus[g].machine == "r0-m4")
M5 = frozenset(g for g in CAP_CLUSTER.gpus if CAP_CLUSTER.gpus[g].machine == "r0-m5")


def capped_round(rows: dict, cap: int | None):
    """One round on two 4-GPU machines among apps holding nothing that bid ``rows`` (ranked in the
    order given, by waiting rho), with D20's cap ``cap``."""
    engine = RoundEngine(CAP_CLUSTER, make_policy("themis", fairness_knob=0.0, max_contenders=cap), lease_s=1000)
    for name in rows:
        engine.add_app(name, 0)
    agents = {n: Fixed(math.inf, 4, BidTable(math.inf, rows[n]), wait=float(len(rows) - k))
              for k, n in enumerate(rows)}
    return engine.run_round(1, agents)


def test_a_contender_cap_auctions_among_the_worst_and_queues_the_rest_in_rank_order():
    """D20: with max_contenders = 1 only the worst-ranked of three filtered bidders contends; the
    next two are served from what the auction left, by their own rows, in rank order."""
    m4, m5 = M4, M5
    rows = {"worst": ((m4, 1.0), (m5, 1.0)), "next": ((m4, 1.0), (m5, 1.1)), "last": ((m5, 1.0),)}

    def run(cap):
        return capped_round(rows, cap)

    capped = run(1)
    assert capped.decision.auction.contenders == ("worst",)
    assert capped.decision.auction.hidden_payment["worst"] == 1.0  # alone in its auction
    # the PA gave 'worst' m4 (its first row, D16); 'next' ranks before 'last' and takes m5 from the queue
    assert {g.app: (g.gpus, g.source) for g in capped.grants} == {"worst": (m4, "auction"), "next": (m5, "queue")}
    uncapped = run(None)
    assert uncapped.decision.auction.contenders == ("worst", "next", "last")
    with pytest.raises(ValueError, match="max_contenders"):
        make_policy("themis", max_contenders=0)


def test_a_bidder_without_a_useful_row_takes_no_place_under_the_contender_cap():
    """D8 leaves a bidder with no useful row out of the auction, and D20's cap counts contenders:
    an empty table ranked first used up the one place, so the next bidder skipped the lottery and
    took its row for sure from the queue."""
    rows = {"empty": (), "next": ((M4, 1.0),), "last": ((M4, 1.0),)}
    assert capped_round(rows, 1).decision.auction.contenders == ("next",)
    assert (capped_round(rows, 2).decision.auction.contenders == capped_round(rows, None).decision.auction.contenders
            == ("next", "last"))


def test_the_round_event_counts_gpus_that_moved_to_another_app_at_expiry():
    """The round event's ``moved``: expired GPUs granted to a different app (churn), not renewals."""
    from arbiter.service import _summary

    cluster = load_cluster("testbed-64").subcluster(["r0-m4"])  # 4 GPUs
    engine = RoundEngine(cluster, make_policy("themis", fairness_knob=0.0), lease_s=100, expiry_window_s=0,
                         coalesce_s=0)
    engine.add_app("first", 0)
    first = engine.run_round(0, {"first": Agent(job_app(4, iters=100_000), name="first")})
    assert _summary(first, 0.0)["moved"] == 0 and sum(len(g.gpus) for g in first.grants) == 4
    engine.add_app("second", 50)
    engine.set_demand("first", 0, 90)  # first is done with them: at expiry they go to second
    renewed = engine.run_round(100, {"first": Fixed(1.0, 0), "second": Agent(job_app(4), name="second")})
    summary = _summary(renewed, 0.0)
    assert summary["expired"] == 4 and summary["granted"] == {"second": 4} and summary["moved"] == 4


def test_gpus_an_app_wins_back_at_expiry_do_not_count_as_moved():
    from arbiter.service import _summary

    cluster = load_cluster("testbed-64").subcluster(["r0-m4"])
    engine = RoundEngine(cluster, make_policy("themis", fairness_knob=0.0), lease_s=100, expiry_window_s=0,
                         coalesce_s=0)
    engine.add_app("only", 0)
    agents = {"only": Agent(job_app(4, iters=100_000), name="only")}
    engine.run_round(0, agents)
    again = _summary(engine.run_round(100, agents), 0.0)
    assert again["expired"] == 4 and again["granted"] == {"only": 4} and again["moved"] == 0


def test_a_bidder_that_did_not_contend_is_served_before_a_better_off_reserve_app():
    """D9 tier 1 in rank order: only the first |offered| bidders contend; a bidder behind them
    places what the auction leaves before the reserve app behind it (it used to be sent to the
    random tier, after the reserve)."""
    cluster = load_cluster("testbed-64").subcluster(["r0-m4"])  # 4 GPUs
    g = sorted(cluster.gpus)
    engine = RoundEngine(cluster, make_policy("themis", fairness_knob=0.25), lease_s=1000, expiry_window_s=0,
                         coalesce_s=0, reclaim=False)  # z holds 2 GPUs, above its share of 1: D9 alone
    for name in ("w", "x", "y", "z"):
        engine.add_app(name, 0)
    engine.leases.grant("z", frozenset(g[:2]), now=0, expires_at=1000, round_id=0)

    def only(gpu: str, rho_old: float = 2.0):
        return lambda offer: BidTable(rho_old, ((frozenset([gpu]), 1.0),))

    agents = {"w": Fixed(9.0, 1, only(g[2])), "x": Fixed(8.0, 1, only(g[2])), "y": Fixed(7.0, 1, only(g[3])),
              "z": Fixed(6.0, 4, only(g[3], 1.5))}
    r = engine.run_round(10, agents)
    assert r.bidders == ("w", "x", "y", "z")  # ceil(0.75 * 4) = 3 bid; z is the reserve
    by_app = {grant.app: (grant.source, grant.gpus) for grant in r.grants}
    assert by_app["y"] == ("queue", frozenset([g[3]]))  # w and x contend for g2 and leave g3
    assert "z" not in by_app


def test_a_round_keeps_its_policy_and_its_number_of_bidders_from_offer_to_close():
    """D6: the bidders are fixed when the offer goes out. A settings change (or a release that
    changes how many apps want GPUs) between the offer and the close used to change who contends."""
    cluster = load_cluster("testbed-64").subcluster(["r0-m4"])  # 4 GPUs
    g = sorted(cluster.gpus)
    engine = RoundEngine(cluster, make_policy("themis", fairness_knob=0.8), lease_s=1000, expiry_window_s=0,
                         coalesce_s=0)
    names = ("a", "b", "c", "d", "e")
    for name in names:
        engine.add_app(name, 0)
    rows = lambda offer: BidTable(math.inf, tuple((frozenset([x]), 1.0) for x in g))  # noqa: E731
    rnd = engine.open_round(10)
    for k, request in enumerate(rnd.requests):
        rnd.report(request.app, RhoReport(math.inf, 1, rho_wait=10.0 - k))
    offers = rnd.offers()
    assert list(offers) == list(names)  # ceil(0.2 * 5) = 1 bidder, then a reserve of four
    for app, offer in offers.items():
        rnd.bid(app, rows(offer))
    engine.policy = make_policy("themis", fairness_knob=0.0)  # as UpdateSettings does, mid-round
    result = rnd.close()
    sources = sorted(grant.source for grant in result.grants)
    assert sources == ["auction", "queue", "queue", "queue"]  # one contender, not four


def test_a_report_beyond_the_rho_bounds_is_refused():
    """A finite rho above RHO_MAX would outrank every honest app; it is refused like a bid row's."""
    from arbiter.rounds import InvalidReport

    cluster = load_cluster("testbed-64").subcluster(["r0-m4"])
    engine = RoundEngine(cluster, make_policy("themis"), lease_s=1000)
    engine.add_app("big", 0)
    rnd = engine.open_round(1)
    with pytest.raises(InvalidReport, match="within"):
        rnd.report("big", RhoReport(1e300, 4))


def test_a_queued_app_cannot_skip_its_turn_for_a_bigger_random_gift():
    """The lie that paid after the reserve was added (strategy-proofness benchmark: "only the
    biggest rows" in 10% of cases, up to +63%): a reserve app whose rows cannot fit what the auction
    leaves used to get its whole unmet demand at random. Tier 1 is its turn (D9): truthful, it
    places one row; bidding only rows that cannot fit now gets it nothing."""
    cluster = load_cluster("testbed-64").subcluster(["r0-m4"])  # 4 GPUs
    g = sorted(cluster.gpus)

    def round_with(q_rows):
        engine = RoundEngine(cluster, make_policy("themis", fairness_knob=0.5), lease_s=1000, expiry_window_s=0,
                             coalesce_s=0)
        for name in ("w", "q"):
            engine.add_app(name, 0)
        agents = {"w": Fixed(math.inf, 2, lambda o: BidTable(math.inf, ((frozenset(g[:2]), 1.0),)), wait=9.0),
                  "q": Fixed(math.inf, 4, lambda o: BidTable(math.inf, q_rows), wait=8.0)}
        r = engine.run_round(10, agents)
        assert r.bidders == ("w", "q")
        return {grant.app: (grant.source, len(grant.gpus)) for grant in r.grants}

    truthful = round_with(((frozenset(g[:1]), 2.0), (frozenset(g[2:3]), 2.0)))
    lying = round_with(((frozenset(g), 1.0),))
    assert truthful == {"w": ("auction", 2), "q": ("queue", 1)}
    assert lying == {"w": ("auction", 2)}


def test_gpus_left_idle_while_apps_want_more_are_offered_again_at_once():
    """D10: idle GPUs and unmet demand after a round that granted something is a resource-available
    event: the next round follows after the coalescing window, not at the next lease expiry, and
    there the queued app bids on exactly what is left."""
    cluster = load_cluster("testbed-64").subcluster(["r0-m4"])  # 4 GPUs
    g = sorted(cluster.gpus)
    engine = RoundEngine(cluster, make_policy("themis", fairness_knob=0.5), lease_s=1000, expiry_window_s=0,
                         coalesce_s=5)
    for name in ("w", "q"):
        engine.add_app(name, 0)
    q_rows = lambda o: BidTable(math.inf, ((frozenset(sorted(o.gpus)[:2]), 1.0),) if len(o.gpus) == 2  # noqa: E731
                                 else ((frozenset(g), 1.0),))
    agents = {"w": Fixed(math.inf, 2, lambda o: BidTable(math.inf, ((frozenset(g[:2]), 1.0),)), wait=9.0),
              "q": Fixed(math.inf, 4, q_rows, wait=8.0)}
    first = engine.run_round(10, agents)
    assert len(first.idle) == 2 and first.unmet_after == {"q": 4}
    assert engine.next_wakeup() == 15 and engine.round_due(15)
    agents["w"] = Fixed(1.0, 2)  # w has what it wants now
    second = engine.run_round(15, agents)
    assert {grant.app: len(grant.gpus) for grant in second.grants} == {"q": 2} and not second.idle


def test_an_offered_app_that_sends_no_valid_bid_is_leased_nothing_and_gets_one_more_round():
    """D22, the leak the strategy-proofness benchmark found under the measured rank: a holder whose
    bid was refused (or never sent) came last in D9's random tier and, when GPUs were left, took its
    whole unmet demand -- more than bidding truthfully won it (7.2% of its cases, up to +59%). Now
    it is leased nothing that round, as if it had bid an empty table; the GPUs it left idle get one
    follow-up round (D10), where an agent that merely missed the deadline bids for them."""
    cluster = load_cluster("testbed-64").subcluster(["r0-m4"])  # 4 GPUs
    g = sorted(cluster.gpus)
    truthful = lambda o: BidTable(2.0, tuple((frozenset([x]), 1.5) for x in sorted(o.gpus)))  # noqa: E731
    spoiled = lambda o: BidTable(math.inf, truthful(o).rows)  # noqa: E731 -- rho_old = inf from a holder

    def first_round(holder_bid):
        engine = RoundEngine(cluster, make_policy("themis", fairness_knob=0.0), lease_s=1000, expiry_window_s=0,
                             coalesce_s=5)
        engine.add_app("h", 0)
        engine.add_app("o", 0)
        engine.leases.grant("h", [g[0]], now=0, expires_at=1000, round_id=0)
        agents = {"h": Fixed(2.0, 4, holder_bid), "o": Fixed(math.inf, 1, truthful, wait=1.0)}
        return engine, agents, engine.run_round(10, agents)

    _, _, honest = first_round(truthful)
    assert {grant.app: len(grant.gpus) for grant in honest.grants}["h"] >= 1

    engine, agents, r = first_round(spoiled)
    assert "rho_old must be finite" in r.rejected["h"]
    assert {grant.app: len(grant.gpus) for grant in r.grants} == {"o": 1}  # before D22: h took the other 2
    assert len(r.idle) == 2 and r.unmet_after["h"] == 3
    assert engine.round_due(15)  # one more round for the app that did not bid
    again = engine.run_round(15, agents)  # still spoiled: nothing, and no round after it
    assert again.grants == () and not engine.round_due(500)
    agents["h"] = Fixed(2.0, 4, truthful)  # the next event's round: a bid wins the idle GPUs
    engine.add_app("late", 600)
    assert {grant.app for grant in engine.run_round(605, agents | {"late": Fixed(0.5, 0)}).grants} == {"h"}


def test_a_lone_app_that_misses_its_first_bid_is_not_left_waiting_for_an_unrelated_event():
    """D22's follow-up: a round that grants nothing normally ends the follow-ups (D10), but an app
    that was offered GPUs and sent no bid gets one more round, or an agent slow to start on an idle
    cluster would wait for the next arrival or expiry."""
    cluster = load_cluster("testbed-64").subcluster(["r0-m4"])
    engine = RoundEngine(cluster, make_policy("themis"), lease_s=1000, coalesce_s=1)
    engine.add_app("a", 0)
    r = engine.run_round(1, {"a": Fixed(math.inf, 2)})  # offered, answers no bid
    assert r.grants == () and "expected a BidTable" in r.rejected["a"] and engine.round_due(2)
    r = engine.run_round(2, {"a": Fixed(math.inf, 2, lambda o: BidTable(math.inf, ((frozenset(sorted(o.gpus)[:2]), 1.0),)))})
    assert [len(grant.gpus) for grant in r.grants] == [2]


# -- D25: the winner ranked first is not zeroed by the tables behind it -----------------------------

def _two_free_gpus(seed: int) -> RoundEngine:
    """One machine of 4 GPUs, two of them free; the other two held by x (one GPU per job) and b."""
    cluster = load_cluster("testbed-64").subcluster(["r0-m4"])
    g = sorted(cluster.gpus)
    engine = RoundEngine(cluster, make_policy("themis", fairness_knob=0.4), lease_s=1000, expiry_window_s=0,
                         coalesce_s=0, seed=seed, reclaim=False)
    for name in ("v", "x", "b"):
        engine.add_app(name, 0)
    engine.leases.grant("x", [g[0]], now=0, expires_at=1000, round_id=0)
    engine.leases.grant("b", [g[1]], now=0, expires_at=1000, round_id=0)
    return engine


def _wide(offer) -> BidTable:
    """A starving app's truthful table: every free GPU, and both."""
    gpus = sorted(offer.gpus)
    return BidTable(math.inf, tuple((frozenset([x]), 4.0) for x in gpus) + ((frozenset(gpus), 2.0),))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("x_bids", ["narrow", "spoiler"])
def test_a_table_whose_rows_start_at_two_gpus_does_not_zero_the_starving_app_ranked_first(seed, x_bids):
    """The audit's round: two free GPUs, v starving and ranked first, x a truthful search holding one
    GPU per job (one more GPU is worth nothing to it, so its rows start at two), b a better-off
    reserve app at rho 0.65. The PF gave v both GPUs with c_v = 0 (without v, x would be served),
    the auction granted nothing and b took both, in every seed. A spoiler that bids one worthless
    2-GPU row did the same on purpose. D25: x's smallest row does not fit next to one GPU for v."""
    engine = _two_free_gpus(seed)
    both = lambda offer: frozenset(offer.gpus)  # noqa: E731
    x_row = {"narrow": 1.5, "spoiler": 1.9999}[x_bids]  # rho_old 2: a real gain, or next to none
    agents = {"v": Fixed(math.inf, 2, _wide, wait=3.0),
              "x": Fixed(2.0, 3, lambda o: BidTable(2.0, ((both(o), x_row),))),
              "b": Fixed(0.65, 3, lambda o: BidTable(0.65, tuple((frozenset([g]), 0.5) for g in o.gpus)))}
    r = engine.run_round(10, agents)
    assert r.bidders[:2] == ("v", "x") and r.bidders[2] == "b"  # ceil(0.6 * 3) = 2 bid, b is the reserve
    outcome = r.decision.auction
    assert outcome.contenders == ("v", "x") and set(outcome.pf) == {"v"}
    assert outcome.hidden_payment["v"] == 1.0
    assert [(g.app, g.source, len(g.gpus)) for g in r.grants] == [("v", "auction", 2)]


def test_a_starving_app_is_not_zeroed_by_two_narrow_tables_that_fit_only_without_it():
    """From a contended run (testbed-64, seed 0, rounds 91-93): 4 free GPUs, v starving with every
    GPU as a row, two holders whose rows start at two GPUs. Both holders fit without v, so the PF's
    winners all had c_i = 0 (v included) and the auction granted nothing, round after round. D25
    admits by size in rank order: the second holder is a shadow, and the first answers for it."""
    gpus = ["r0-m2-g0", "r0-m7-g0", "r0-m7-g2", "r0-m8-g1"]
    bids = {"v": BidTable(math.inf, tuple((frozenset([g]), 2.0) for g in gpus)),
            "h1": BidTable(1.2, ((frozenset(gpus[1:3]), 0.9), (frozenset([gpus[0], gpus[3]]), 1.0))),
            "h2": BidTable(0.7, ((frozenset([gpus[0], gpus[3]]), 0.6), (frozenset(gpus[1:3]), 0.62)))}
    outcome = run_auction(frozenset(gpus), bids, seed=0, priority=["v", "h1", "h2"])
    assert outcome.shadows == ("h2",)
    assert set(outcome.pf) == {"v", "h1"} and outcome.hidden_payment["v"] > 0
    assert len(outcome.pf["v"]) == 1
    # h1's row and the GPU nobody took would hold h2's: h1's smallest row is what kept h2 out
    assert outcome.hidden_payment["h1"] == 0.0


def test_hiding_small_rows_to_shut_out_the_contenders_behind_costs_the_hider():
    """D18's example under D25: x ranked first values either free GPU or both; so does y. Truthful,
    both are served a GPU each. If x bids only both GPUs, y no longer fits by size behind it and is a
    shadow -- and x, whose smallest row shut it out, has c_x = 0: hiding its small rows gains x
    nothing from the auction."""
    a, b = "r0-m0-g0", "r0-m0-g1"
    table = BidTable(math.inf, ((frozenset([a]), 2.0), (frozenset([b]), 2.0), (frozenset([a, b]), 1.0)))
    truth = run_auction(frozenset([a, b]), {"x": table, "y": table}, seed=0, priority=["x", "y"])
    assert set(truth.pf) == {"x", "y"} and truth.hidden_payment["x"] > 0
    lie = run_auction(frozenset([a, b]), {"x": BidTable(math.inf, ((frozenset([a, b]), 1.0),)), "y": table},
                      seed=0, priority=["x", "y"])
    assert lie.shadows == ("y",) and lie.hidden_payment["x"] == 0.0 and not lie.granted


def test_what_nobody_bid_for_goes_to_the_worst_off_apps_first():
    """D26: the GPUs left after the auction and the reserve go to the apps that got no offer in rank
    order, worst off first, not at random: in the audit's run one starving app held nothing for 27 h
    while the random tier handed GPUs to holders at rho 0.34-0.77. Here three apps that hold nothing
    and were not offered (f = 0.8 lets one app bid, no reserve) want the one GPU the bidder left; the
    one that has waited longest for its size (the highest waiting rho, D13) gets it, in every seed."""
    cluster = load_cluster("testbed-64").subcluster(["r0-m4"])  # 4 GPUs
    g = sorted(cluster.gpus)
    for seed in range(10):
        engine = RoundEngine(cluster, make_policy("themis", fairness_knob=0.8, fill=False), lease_s=1000,
                             expiry_window_s=0, coalesce_s=0, seed=seed, reclaim=False)
        for name in ("v", "a", "b", "c", "holder"):
            engine.add_app(name, 0)
        engine.leases.grant("holder", g[:3], now=0, expires_at=1000, round_id=0)
        nothing = lambda offer: BidTable(math.inf, ())  # noqa: E731 -- v bids for none of the GPU
        agents = {"v": Fixed(math.inf, 1, nothing, wait=5.0), "a": Fixed(math.inf, 1, wait=3.0),
                  "b": Fixed(math.inf, 1, wait=1.0), "c": Fixed(math.inf, 1, wait=2.0), "holder": Fixed(0.5, 3)}
        r = engine.run_round(10, agents)
        assert r.bidders == ("v",)  # ceil(0.2 * 5) = 1 bidder, no reserve (fill=False)
        assert [(x.app, x.source) for x in r.grants] == [("a", "leftover")]


# -- D27: an app that holds nothing does not wait out a lease while others hold more than their share --

def _full_cluster(reclaim: bool = True) -> tuple[RoundEngine, list[str]]:
    """4 GPUs, all leased until t = 600 to "big", which still wants all 4."""
    cluster = load_cluster("testbed-64").subcluster(["r0-m4"])
    g = sorted(cluster.gpus)
    engine = RoundEngine(cluster, make_policy("themis"), lease_s=600, coalesce_s=1, reclaim=reclaim)
    engine.add_app("big", 0)
    r = engine.run_round(0, {"big": Fixed(math.inf, 4, lambda o: BidTable(math.inf, ((frozenset(g), 1.0),)))})
    assert engine.held("big") == frozenset(g) and engine.next_wakeup() == 660 and r.grants
    return engine, g


def _wants_any(offer) -> BidTable:
    """One GPU or two of what is offered."""
    gpus = sorted(offer.gpus)
    return BidTable(math.inf, tuple((frozenset([x]), 2.0) for x in gpus) + ((frozenset(gpus[:2]), 1.0),))


def test_an_arrival_into_a_full_cluster_gets_its_share_from_an_app_above_its_share_at_once():
    """The tail of every figure: a short app that arrived while every GPU was leased waited for the
    next expiry (up to 286 s for a 24-second app). D27: the arrival is an event when another app
    holds more than its share (R_C / N = 2 here); the round ends big's leases beyond its share and
    re-auctions them; big keeps its share under its own leases."""
    engine, g = _full_cluster()
    engine.add_app("short", 100)
    assert engine.next_wakeup() == 101  # the coalescing window, not the expiry at 600 + 60
    r = engine.run_round(101, {"short": Fixed(math.inf, 2, _wants_any, wait=1.0),
                               "big": Fixed(1.5, 4, lambda o: BidTable(1.5, ()))})
    assert sorted(x.gpu for x in r.reclaimed) == sorted(set(g) - engine.held("big"))
    assert len(r.reclaimed) == 2 and all(x.app == "big" for x in r.reclaimed)
    assert len(engine.held("short")) == 2 and len(engine.held("big")) == 2
    assert all(engine.leases.lease(x).expires_at == 600 for x in engine.held("big"))


def test_without_reclaim_the_arrival_waits_for_the_expiry():
    engine, _ = _full_cluster(reclaim=False)
    engine.add_app("short", 100)
    assert engine.next_wakeup() == 660  # the lease's end and its expiry window


def test_a_lease_within_the_share_is_never_ended_early_and_an_app_is_reclaimed_for_once():
    """big holds exactly its share: nothing is reclaimed. Above it, one reclaim is made for a
    starving app; if that app then gets nothing (here it bids for nothing), later rounds do not move
    GPUs for it again until it has held some."""
    engine, g = _full_cluster()
    engine.add_app("a", 0)
    engine.add_app("b", 0)
    engine.release("big", g[2:], 0)
    engine.leases.grant("a", g[2:], now=0, expires_at=600, round_id=0)  # big and a each hold their 2
    engine.add_app("c", 50)  # shares are now 4 / 4 = 1: big and a are above theirs
    nothing = {"b": Fixed(math.inf, 1, lambda o: BidTable(math.inf, ()), wait=1.0),
               "c": Fixed(math.inf, 1, lambda o: BidTable(math.inf, ()), wait=2.0),
               "big": Fixed(1.0, 4, lambda o: BidTable(1.0, tuple((frozenset([x]), 0.9) for x in o.gpus))),
               "a": Fixed(1.0, 2, lambda o: BidTable(1.0, tuple((frozenset([x]), 0.9) for x in o.gpus)))}
    first = engine.run_round(51, nothing)
    assert len(first.reclaimed) == 2  # b and c need one each
    assert not engine.held("b") and not engine.held("c")
    engine.set_demand("c", 2, 60)
    second = engine.run_round(61, nothing)
    assert second.reclaimed == ()
