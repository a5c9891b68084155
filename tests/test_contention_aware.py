"""Contention-aware Themis (D36): offers carry the neighbourhood, bids price the contention they
would suffer, the auction and the reserve's turn charge the harm a row does to running jobs, and
with awareness off every outcome is as before."""

from __future__ import annotations

import csv
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.appsched import JobInfo, SingleJobApp
from agent.bidding import make_bid
from agent.contention_pricing import ContentionPricing
from agent.fairness import finish_time_fairness
from agent.placement import NO_SLOWDOWN
from arbiter.auction import QUANTUM, row_value, run_auction
from arbiter.cluster import load_cluster
from arbiter.contention import FLOOR, JobKind, Placed, load_table, shipped_path
from arbiter.contention_aware import harm_of, neighbourhood_of, suffered
from arbiter.leftover import harm_draw, serve_queue
from arbiter.policies import make_policy
from protos.messages import BidTable, Neighbour, Offer
from simulator.contention import ContentionModel
from simulator.runs import simulate

CLUSTER = load_cluster("deepshare-4x8")
TABLE = load_table("deepshare")
TOL = 1.0 / QUANTUM


def cell(target: str, neighbour: str) -> float:
    """The shipped CSV's cell, read directly (row = target, column = neighbour)."""
    with open(shipped_path("deepshare"), encoding="utf-8") as f:
        rows = list(csv.reader(f))
    col = rows[0].index(neighbour)
    return float(next(r for r in rows[1:] if r[0] == target)[col])


def gpus_on(machine: int, n: int, first: int = 0) -> list[str]:
    return [f"r0-m{machine}-g{k}" for k in range(first, first + n)]


# -- the agent: a bid that prices the contention it would suffer ---------------------------------


def test_a_contention_aware_bid_avoids_the_heavy_neighbour():
    """Two free GPUs on each of four machines; a DLRM job spread over machines 0 and 1. A 4-GPU
    Transformer-XL job must span two machines: on 0 or 1 it runs at the table's ratio next to
    DLRM, on 2 and 3 alone. Its best row is 2 and 3, and a row on 0 and 1 is priced at the cell."""
    free = gpus_on(0, 2) + gpus_on(1, 2) + gpus_on(2, 2) + gpus_on(3, 2)
    dlrm = Neighbour("DLRM", 4, 2)
    offer = Offer(1, {g: CLUSTER.position(g) for g in free}, 0.0, 2.0, CLUSTER.size,
                  neighbourhood={"r0-m0": (dlrm,), "r0-m1": (dlrm,)})
    app = SingleJobApp(JobInfo(10_000, 1.0, NO_SLOWDOWN, 4))
    pricing = ContentionPricing(TABLE, "Transformer-XL")
    bid = make_bid(app, offer, contention=pricing)
    fours = {frozenset(g): rho for g, rho in bid.rows if len(g) == 4}
    best = min(fours, key=fours.get)
    assert {CLUSTER.position(g)[1] for g in best} == {"r0-m2", "r0-m3"}
    ratio = max(FLOOR, cell("Transformer-XL,4,2", "DLRM,4,2"))
    assert ratio < 1
    hurt = [g for g in fours if {CLUSTER.position(x)[1] for x in g} & {"r0-m0", "r0-m1"}]
    assert hurt
    for gpus in hurt:
        positions = [CLUSTER.position(g) for g in gpus]
        alone = finish_time_fairness(app, positions, now=0.0, n_avg=2.0, cluster_size=CLUSTER.size)
        # rho = (elapsed 0 + time left / ratio) / T_id: the time left divided by the cell
        assert fours[gpus] == pytest.approx(alone / ratio, rel=1e-12)
    assert fours[best] == pytest.approx(finish_time_fairness(
        app, [CLUSTER.position(g) for g in best], now=0.0, n_avg=2.0, cluster_size=CLUSTER.size), rel=1e-12)
    # unaware (no pricing, or an offer without a neighbourhood): every 4-GPU row of the same shape is equal
    plain = make_bid(app, offer)
    assert len({rho for g, rho in plain.rows if len(g) == 4}) == 1


def test_one_machine_rows_and_light_neighbours_cost_nothing():
    app = SingleJobApp(JobInfo(10_000, 1.0, NO_SLOWDOWN, 2))
    hood = {"r0-m0": (Neighbour("MoE", 8, 4), Neighbour("FSDP", 2, 1))}
    pricing = ContentionPricing(TABLE, "MoE")
    assert suffered(TABLE, JobKind("MoE", 2, 1), ["r0-m0"], hood) == 1.0  # one machine: untouched
    assert suffered(TABLE, JobKind("MoE", 2, 2), ["r0-m0", "r0-m1"], {"r0-m0": (Neighbour("FSDP", 2, 1),)}) == 1.0
    offer = Offer(1, {g: CLUSTER.position(g) for g in gpus_on(0, 2)}, 0.0, 2.0, CLUSTER.size, neighbourhood=hood)
    assert make_bid(app, offer, contention=pricing) == make_bid(app, offer)


# -- the arbiter: the neighbourhood and the harm -------------------------------------------------


def test_the_neighbourhood_lists_who_runs_on_each_machine_without_names():
    moe = Placed.on("MoE", ["r0-m0"] * 4 + ["r0-m1"] * 4)
    one = Placed.on("GraphSage", ["r0-m2"] * 2)
    hood = neighbourhood_of([moe, one], ["r0-m1", "r0-m2", "r0-m3"])
    assert hood == {"r0-m1": (Neighbour("MoE", 8, 2),), "r0-m2": (Neighbour("GraphSage", 2, 1),)}


def test_the_harm_is_the_incumbents_ratio_with_the_row_over_their_ratio_now():
    moe = Placed.on("MoE", ["r0-m0"] * 4 + ["r0-m1"] * 4)
    fsdp = Placed.on("FSDP", ["r0-m1"] * 2 + ["r0-m2"] * 2)
    row = Placed.on("Transformer-XL", ["r0-m1"] * 2 + ["r0-m3"] * 2)
    a, b = cell("MoE,8,2", "Transformer-XL,4,2"), cell("FSDP,4,2", "Transformer-XL,4,2")
    # both incumbents alone now (ratio 1): the harm is the product of the two cells (floored)
    assert harm_of(TABLE, row, [(moe, 1.0), (fsdp, 1.0)]) == pytest.approx(max(FLOOR, a) * max(FLOOR, b))
    # an incumbent already slower than the row would make it loses nothing (D35's min rule)
    assert harm_of(TABLE, row, [(moe, min(a, 1.0) * 0.9), (fsdp, 1.0)]) == pytest.approx(max(FLOOR, b))
    # a row on one machine, or one away from the incumbents, harms nobody
    assert harm_of(TABLE, Placed.on("Transformer-XL", ["r0-m1"] * 4), [(moe, 1.0)]) == 1.0
    assert harm_of(TABLE, Placed.on("Transformer-XL", ["r0-m2", "r0-m3"]), [(moe, 1.0)]) == 1.0


# -- the auction with passive participants --------------------------------------------------------


def test_the_auction_picks_the_row_that_harms_less_when_the_harm_outweighs_the_gain():
    offered = frozenset(["a", "b", "c", "d"])
    bid = BidTable(math.inf, ((frozenset("ab"), 0.5), (frozenset("cd"), 0.6)))  # values 2 and 1.67
    plain = run_auction(offered, {"x": bid}, seed=0)
    assert plain.pf["x"] == frozenset("ab") and plain.hidden_payment["x"] == 1.0
    aware = run_auction(offered, {"x": bid}, seed=0, harm={"x": [0.5, 1.0]})  # 2 x 0.5 < 1.67 x 1
    assert aware.pf["x"] == frozenset("cd") and aware.hidden_payment["x"] == 1.0
    light = run_auction(offered, {"x": bid}, seed=0, harm={"x": [0.9, 1.0]})  # 2 x 0.9 > 1.67
    assert light.pf["x"] == frozenset("ab")
    # alone, a bidder's c_i is the harm of its row: it keeps it with that probability
    assert light.hidden_payment["x"] == pytest.approx(0.9)


def test_a_winners_hidden_payment_includes_the_harm_it_does():
    """c_i = (others' Nash product with i, incumbents included) / (without i) = c_i of the auction on
    V x h times h_i: computed here by hand from the rows' values."""
    offered = frozenset(["a", "b"])
    bids = {"x": BidTable(math.inf, ((frozenset("a"), 1.0), (frozenset("ab"), 0.4))),
            "y": BidTable(math.inf, ((frozenset("a"), 0.5), (frozenset("b"), 0.8)))}
    harm = {"x": [0.7, 0.8], "y": [1.0, 0.6]}
    out = run_auction(offered, bids, seed=0, harm=harm, priority=["x", "y"])
    # serve both: x on a (1 x 0.7) and y on b (1.25 x 0.6) -- the only way to serve two
    assert out.pf == {"x": frozenset("a"), "y": frozenset("b")}
    # without x, y takes a (2 x 1); with x, y has 1.25 x 0.6: c_x = 0.75 / 2, then times x's own 0.7
    assert out.hidden_payment["x"] == pytest.approx(0.75 / 2.0 * 0.7, rel=3 * TOL)
    # without y, x takes ab (2.5 x 0.8 = 2); with y, x has 0.7: c_y = 0.7 / 2, times y's own 0.6
    assert out.hidden_payment["y"] == pytest.approx(0.7 / 2.0 * 0.6, rel=3 * TOL)


def test_harm_of_one_everywhere_is_no_harm():
    rng = random.Random(3)
    offered = frozenset("abcdef")
    for seed in range(30):
        bids = {f"app{k}": BidTable(math.inf if rng.random() < 0.5 else rng.uniform(0.5, 8),
                                    tuple((frozenset(rng.sample(sorted(offered), rng.randint(1, 4))),
                                           rng.uniform(0.1, 10)) for _ in range(rng.randint(0, 4))))
                for k in range(rng.randint(1, 4))}
        ones = {a: [1.0] * len(b.rows) for a, b in bids.items()}
        assert run_auction(offered, bids, seed=seed, harm=ones) == run_auction(offered, bids, seed=seed)


@st.composite
def harmed(draw):
    gpus = list("abcde")[: draw(st.integers(2, 5))]
    bids, harm = {}, {}
    for a in range(draw(st.integers(1, 3))):
        # the arbiter's harm is a function of the row's GPUs: one factor per GPU set
        sets = {frozenset(draw(st.sets(st.sampled_from(gpus), min_size=1, max_size=len(gpus))))
                for _ in range(draw(st.integers(1, 4)))}
        rows = tuple((g, draw(st.floats(0.1, 10.0))) for g in sorted(sets, key=sorted))
        bids[f"app{a}"] = BidTable(math.inf, rows)
        harm[f"app{a}"] = [draw(st.sampled_from([1.0, 0.9, 0.6, 0.35])) for _ in rows]
    return frozenset(gpus), bids, harm


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_no_lie_in_values_raises_the_expected_value_when_harm_is_charged(data):
    """D36: the harm factors are the arbiter's (the bidder's class is bound to its model), so the PA
    argument holds: a bidder's expected gain c_i h_i V_i = NW(PF) / NW_{-i} with the incumbents in
    both, and no scaling of its rows' values raises it. Rows keep their sizes (D25 admits by size)."""
    offered, bids, harm = data.draw(harmed())
    liar = data.draw(st.sampled_from(sorted(bids)))
    lie = BidTable(math.inf, tuple((g, rho * data.draw(st.floats(0.3, 3.0))) for g, rho in bids[liar].rows))
    priority = sorted(bids)

    def expected(outcome) -> float:
        if liar not in outcome.pf:
            return 0.0
        return outcome.hidden_payment[liar] * max(row_value(rho, math.inf) for g, rho in bids[liar].rows
                                                  if frozenset(g) == outcome.pf[liar])

    truth = run_auction(offered, bids, seed=0, priority=priority, harm=harm)
    lied = run_auction(offered, {**bids, liar: lie}, seed=0, priority=priority, harm=harm)
    assert expected(lied) <= expected(truth) * math.exp(4 * len(bids) * TOL) + 1e-12


def test_the_reserves_turn_charges_the_harm_by_a_draw():
    """D36 in D9's first tier: the queued app takes the row with the most value x harm and keeps it
    with probability h (its own draw), else the GPUs stay for the apps after it."""
    bid = BidTable(math.inf, ((frozenset("ab"), 0.5), (frozenset("cd"), 0.6)))
    pool = set("abcd")
    assert serve_queue(pool, ["x"], {"x": 2}, {"x": bid}) == {"x": frozenset("ab")}
    assert serve_queue(pool, ["x"], {"x": 2}, {"x": bid}, harm={"x": [0.5, 1.0]}, seed=1) == {"x": frozenset("cd")}
    kept = [s for s in range(200) if serve_queue(pool, ["x"], {"x": 2}, {"x": bid}, harm={"x": [0.9, 1.0]}, seed=s)]
    assert kept == [s for s in range(200) if harm_draw(s, "x") < 0.9]
    assert 150 < len(kept) < 200


# -- the round engine and the simulator ----------------------------------------------------------

DEEPSHARE = {"cluster": "deepshare-4x8", "workload": "deepshare", "lease": 300.0, "restart": 0.0,
             "workload_knobs": {"path": None, "jobs": 24}}


def _run(policy: str, contention: str | None, **kw):
    from simulator.workloads.deepshare import DEFAULT_TRACE

    knobs = {**DEEPSHARE["workload_knobs"], "path": str(DEFAULT_TRACE)}
    return simulate(policy=policy, cluster=DEEPSHARE["cluster"], workload="deepshare", workload_knobs=knobs,
                    lease=300.0, restart=0.0, seed=0, contention=contention, **kw)


def _same(a: dict, b: dict) -> None:
    drop = {"policy", "wall_seconds", "cpu_seconds"}
    assert {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}


def test_aware_without_a_contention_model_is_themis_outcome_for_outcome():
    _same(_run("themis-aware", None), _run("themis", None))


def test_with_awareness_off_offers_and_requests_carry_no_neighbourhood_and_with_it_they_do():
    from agent.agent import Agent
    from simulator.engine import Simulation
    from simulator.workloads import load_workload
    from simulator.workloads.deepshare import DEFAULT_TRACE

    seen: dict[str, list[Offer]] = {}
    pricing: dict[str, set] = {}
    asked: dict[str, list] = {}
    for policy in ("themis", "themis-aware"):
        offers: list[Offer] = []
        requests: list = []

        class Recording(Agent):
            def bid(self, offer, offers=offers):
                offers.append(offer)
                return super().bid(offer)

            def report(self, request, requests=requests):
                requests.append(request)
                return super().report(request)

        workload = load_workload("deepshare", path=str(DEFAULT_TRACE), jobs=24)
        sim = Simulation(CLUSTER, workload, make_policy(policy), lease_s=300.0, restart_s=0.0,
                         contention=ContentionModel.load("deepshare"),
                         agent_factory=lambda spec, app: Recording(app, name=spec.app_id))
        sim.run()
        seen[policy] = offers
        asked[policy] = requests
        pricing[policy] = {run.agent.contention is None for run in sim.runs.values()}
    assert seen["themis"] and all(not o.neighbourhood for o in seen["themis"])
    assert pricing == {"themis": {True}, "themis-aware": {False}}
    assert any(o.neighbourhood for o in seen["themis-aware"])
    assert all(n.cls in TABLE.classes for o in seen["themis-aware"] for ns in o.neighbourhood.values() for n in ns)
    # D43: a rho request lists who runs on the held GPUs' machines, and only there
    assert asked["themis"] and all(not r.neighbourhood for r in asked["themis"])
    aware = [r for r in asked["themis-aware"] if r.neighbourhood]
    assert aware and all(r.held for r in aware)
    assert all(set(r.neighbourhood) <= {p[1] for p in r.held.values()} for r in aware)


def test_the_reported_rho_prices_the_held_gpus_neighbourhood_as_the_bids_rho_old_does():
    """D43: a 4-GPU Transformer-XL job spread over machines 0 and 1, where a DLRM job also spans
    them. Asked with the neighbourhood, the agent reports the time left over the table's ratio --
    the rho_old its bid gives the same GPUs; asked without one (an unaware arbiter), as before."""
    from agent.agent import Agent
    from protos.messages import RhoRequest

    held = {g: CLUSTER.position(g) for g in gpus_on(0, 2) + gpus_on(1, 2)}
    hood = {"r0-m0": (Neighbour("DLRM", 4, 2),), "r0-m1": (Neighbour("DLRM", 4, 2),)}
    app = SingleJobApp(JobInfo(10_000, 1.0, NO_SLOWDOWN, 8))
    agent = Agent(app, name="a", contention=ContentionPricing(TABLE, "Transformer-XL"))
    kw = dict(now=600.0, n_avg=2.0, cluster_size=CLUSTER.size)
    plain = agent.report(RhoRequest(1, "a", 600.0, 2.0, CLUSTER.size, held)).rho
    priced = agent.report(RhoRequest(1, "a", 600.0, 2.0, CLUSTER.size, held, neighbourhood=hood)).rho
    ratio = max(FLOOR, cell("Transformer-XL,4,2", "DLRM,4,2"))
    assert ratio < 1.0
    left = agent.time_left(list(held.values()))
    assert plain == pytest.approx(finish_time_fairness(app, list(held.values()), **kw, left=left))
    assert priced == pytest.approx(finish_time_fairness(app, list(held.values()), **kw, left=left / ratio))
    offer = Offer(1, {g: CLUSTER.position(g) for g in gpus_on(2, 2)}, 600.0, 2.0, CLUSTER.size, held=held,
                  neighbourhood=hood)
    assert agent.bid(offer).rho_old == pytest.approx(priced)
    assert Agent(app, name="a").report(RhoRequest(1, "a", 600.0, 2.0, CLUSTER.size, held, neighbourhood=hood)).rho \
        == pytest.approx(plain)


def test_with_no_other_app_around_the_report_still_prices_its_own_spread_jobs_as_rho_old_does():
    """D43 with D35's own neighbours: two 4-GPU jobs of one app split 3 + 1 and 2 + 2 over three
    machines share the middle one; no other app runs there, so the request lists nothing, and the
    report is still the bid's rho_old, below the rho of running alone."""
    from agent.agent import Agent
    from agent.appsched import SuccessiveHalvingApp
    from protos.messages import RhoRequest

    held = {g: CLUSTER.position(g) for g in gpus_on(0, 3) + gpus_on(1, 3) + gpus_on(2, 2)}
    app = SuccessiveHalvingApp([1.0, 1.1], [10_000.0], job_demand_max=4, slowdown=NO_SLOWDOWN)
    agent = Agent(app, name="a", contention=ContentionPricing(TABLE, "MoE"))
    alone = Agent(app, name="a").report(RhoRequest(1, "a", 600.0, 2.0, CLUSTER.size, held)).rho
    priced = agent.report(RhoRequest(1, "a", 600.0, 2.0, CLUSTER.size, held)).rho
    assert priced > alone
    offer = Offer(1, {g: CLUSTER.position(g) for g in gpus_on(3, 2)}, 600.0, 2.0, CLUSTER.size, held=held)
    assert agent.bid(offer).rho_old == pytest.approx(priced)


def test_the_measured_rank_divides_the_time_left_on_held_gpus_by_the_ratio_now():
    """D21 with D36: the arbiter's own rho of a holder, from its claimed work at its slowdowns, with
    the time left on what it holds divided by the contention ratio its jobs run at by the table."""
    from arbiter.rank import measured_rho
    from protos.messages import WorkClaim

    claim = WorkClaim(7_200.0, 4, held=((0.0, 0.0, 0.0, 1_000.0, 0.0),))
    slowdown = (1.0, 1.0, 1.2, 1.5)
    kw = dict(held=4, demand=4, elapsed=600.0, n_avg=2.0, cluster_size=32)
    t_id = 7_200.0 / 4 * 2.0
    ratio = max(FLOOR, cell("MoE,4,2", "FSDP,8,4"))
    assert measured_rho(claim, slowdown, **kw)[0] == pytest.approx((600.0 + 1_200.0) / t_id)
    assert measured_rho(claim, slowdown, **kw, contention=ratio)[0] == pytest.approx((600.0 + 1_200.0 / ratio) / t_id)
    with pytest.raises(ValueError):
        measured_rho(claim, slowdown, **kw, contention=0.0)


def test_an_apps_own_spread_jobs_are_each_others_neighbours():
    """D35 counts every spread job on a shared machine, the app's own too: eight GPUs as 3 + 3 + 2
    on three machines split into two 4-GPU jobs (D3: contiguous runs), 3 + 1 and 2 + 2, which share
    the middle machine; each runs at the table's cell for its class next to itself."""
    jobs = [JobInfo(1_000, 1.0, NO_SLOWDOWN, 4, job_id="a"), JobInfo(1_000, 1.0, NO_SLOWDOWN, 4, job_id="b")]
    positions = [CLUSTER.position(g) for g in gpus_on(0, 3) + gpus_on(1, 3) + gpus_on(2, 2)]
    pricing = ContentionPricing(TABLE, "MoE")
    assert pricing.factor(jobs, positions, {}) == pytest.approx(max(FLOOR, cell("MoE,4,2", "MoE,4,2")))
    assert pricing.factor(jobs[:1], [CLUSTER.position(g) for g in gpus_on(0, 4)], {}) == 1.0


def test_the_price_does_not_depend_on_the_order_the_gpus_come_in():
    """A row's GPUs are a set: two machines with as many GPUs each must split the same way whatever
    the order (else a run's outcome depends on the interpreter's string hashing)."""
    jobs = [JobInfo(1_000, 1.0, NO_SLOWDOWN, 2, job_id="a"), JobInfo(1_000, 1.0, NO_SLOWDOWN, 4, job_id="b")]
    hood = {"r0-m1": (Neighbour("DLRM", 4, 2),)}
    positions = [CLUSTER.position(g) for g in gpus_on(0, 3) + gpus_on(1, 3)]
    pricing = ContentionPricing(TABLE, "Transformer-XL")
    prices = {pricing.factor(jobs, order, hood) for order in (positions, positions[::-1],
                                                              random.Random(1).sample(positions, len(positions)))}
    assert len(prices) == 1


@pytest.mark.parametrize("iterations, restart_s, moves", [(10_000, 35.0, True), (160, 300.0, False)])
def test_at_a_lease_expiry_a_job_moves_away_from_a_heavy_neighbour_only_when_the_gain_outweighs_the_restart(
        iterations, restart_s, moves):
    """D36 with D17 at a renewal: a 4-GPU Transformer-XL job ran on machines 0 and 1 next to a DLRM
    job; its lease ran out (``previous``), and machines 2 and 3 are free too. Staying costs no
    restart and runs at the table's ratio; moving runs alone after one restart. A long job moves
    (the time it gains, left x (1/ratio - 1), is far above a 35 s restart); a short one with a 300 s
    restart stays. The single-bidder auction grants the row the bid prefers. Unaware, it stays."""
    stay = gpus_on(0, 2) + gpus_on(1, 2)
    away = gpus_on(2, 2) + gpus_on(3, 2)
    dlrm = Neighbour("DLRM", 4, 2)
    offer = Offer(7, {g: CLUSTER.position(g) for g in stay + away}, 0.0, 2.0, CLUSTER.size,
                  previous={g: CLUSTER.position(g) for g in stay},
                  neighbourhood={"r0-m0": (dlrm,), "r0-m1": (dlrm,)})
    app = SingleJobApp(JobInfo(iterations, 1.0, NO_SLOWDOWN, 4))
    pricing = ContentionPricing(TABLE, "Transformer-XL")
    bid = make_bid(app, offer, restart_s=restart_s, contention=pricing)
    rows = {frozenset(g): rho for g, rho in bid.rows}
    assert frozenset(stay) in rows and frozenset(away) in rows
    ratio = max(FLOOR, cell("Transformer-XL,4,2", "DLRM,4,2"))
    assert ratio < 1
    assert (rows[frozenset(away)] < rows[frozenset(stay)]) is moves
    outcome = run_auction(frozenset(offer.gpus), {"app": bid}, seed=0)
    assert outcome.granted["app"] == frozenset(away if moves else stay)
    plain = make_bid(app, offer, restart_s=restart_s)
    fours = {frozenset(g): rho for g, rho in plain.rows if len(g) == 4}
    assert min(fours, key=fours.get) == frozenset(stay)
    assert all(fours[frozenset(stay)] < rho for g, rho in fours.items() if g != frozenset(stay))
