"""Bidding strategies change only what an agent says (D12)."""

from __future__ import annotations

import pytest

from agent.agent import Agent
from agent.appsched import SuccessiveHalvingApp
from agent.fairness import finish_time_fairness
from arbiter.cluster import load_cluster
from protos.messages import Offer
from simulator.strategic import STRATEGIES, StrategicAgent, make_strategy

CLUSTER = load_cluster("sim-256")
SLOW = (1.0, 1.0, 1.4, 2.0)


def app():
    return SuccessiveHalvingApp([1.0, 1.2, 0.9, 1.1], [100, 200, 300], job_demand_max=4, slowdown=SLOW)


def offer():
    free = list(CLUSTER.machines["r0-m0"]) + [g for m in ("r6-m24", "r6-m25", "r7-m28") for g in CLUSTER.machines[m]]
    return Offer(1, {g: CLUSTER.position(g) for g in free}, 0.0, 2.0, 256)


def by_set(bid):
    return {gpus: rho for gpus, rho in bid.rows}


def level(gpus):
    return CLUSTER.locality(gpus)


def test_overreporting_spread_raises_only_spread_rows():
    truthful = by_set(Agent(app()).bid(offer()))
    lying = by_set(StrategicAgent(app(), make_strategy("overreport-spread", 50)).bid(offer()))
    common = set(truthful) & set(lying)
    assert any(level(g) >= 2 for g in common) and any(level(g) <= 1 for g in common)
    raised = 0
    for gpus in common:
        if level(gpus) >= 2:  # higher when some job's own GPUs span machines, never lower
            assert lying[gpus] >= truthful[gpus] - 1e-12
            raised += lying[gpus] > truthful[gpus] + 1e-12
        else:
            assert lying[gpus] == pytest.approx(truthful[gpus])
    assert raised > 0


def test_the_liars_app_itself_is_untouched():
    a = app()
    liar = StrategicAgent(a, make_strategy("misreport-work", 100))
    liar.bid(offer())
    spread = [CLUSTER.position(g) for g in ("r6-m24-g0", "r6-m25-g0")]
    assert a.jobs_in_phase(1, spread)[0].slowdown == SLOW
    assert finish_time_fairness(a, spread, now=0, n_avg=2, cluster_size=256) == pytest.approx(
        finish_time_fairness(app(), spread, now=0, n_avg=2, cluster_size=256))


def test_hide_rows_and_noisy():
    full = Agent(app()).bid(offer())
    hidden = StrategicAgent(app(), make_strategy("hide-rows", 50)).bid(offer())
    assert len(hidden.rows) == round(len(full.rows) / 2)
    assert min(r for _, r in hidden.rows) == min(r for _, r in full.rows)
    noisy = by_set(StrategicAgent(app(), make_strategy("noisy", 20, seed=1)).bid(offer()))
    truthful = by_set(full)
    ratios = [noisy[g] / truthful[g] for g in truthful]
    assert all(0.8 - 1e-9 <= r <= 1.2 + 1e-9 for r in ratios) and len(set(ratios)) > 1


def test_unknown_strategy():
    with pytest.raises(ValueError, match="unknown strategy"):
        make_strategy("bribe", 10)
    assert {"overreport-spread", "underreport-dense", "misreport-work", "hide-rows", "noisy"} <= set(STRATEGIES)


def test_misestimate_keeps_one_error_per_app_and_it_reaches_the_rho_report():
    """Fig. 14 (issue 13 item 3): one error per app on work and slowdown, the same in every round,
    in the rho report that picks the bidders as well as in the bid."""
    from protos.messages import RhoRequest

    plan = make_strategy("misestimate", 20, seed="s:app7")
    assert -0.2 <= plan.work_error <= 0.2 and -0.2 <= plan.slowdown_error <= 0.2
    assert plan.work_error != 0 and plan.slowdown_error != 0
    again = make_strategy("misestimate", 20, seed="s:app7")
    assert (again.work_error, again.slowdown_error) == (plan.work_error, plan.slowdown_error)
    assert make_strategy("misestimate", 20, seed="s:app8").work_error != plan.work_error
    held = {g: CLUSTER.position(g) for g in ("r6-m24-g0", "r6-m25-g0")}
    request = RhoRequest(1, "a", 0.0, 2.0, 256, held)
    truthful, agent = Agent(app()), StrategicAgent(app(), plan)
    first = agent.report(request).rho
    assert first != pytest.approx(truthful.report(request).rho)
    assert agent.report(request).rho == first  # no redraw between rounds
    spread = [CLUSTER.position(g) for g in ("r6-m24-g0", "r6-m25-g0")]
    seen = plan.view(app()).jobs_in_phase(1, spread)[0].slowdown
    assert all(s >= 1.0 for s in seen) and seen != SLOW
    assert make_strategy("misestimate", 0).view(app()).jobs_in_phase(1, spread)[0].slowdown == SLOW


def _spread_request():
    from protos.messages import RhoRequest

    held = {g: CLUSTER.position(g) for g in ("r6-m24-g0", "r6-m25-g0")}
    return RhoRequest(1, "a", 0.0, 2.0, 256, held)


def _ranked_rho(agent, rank: str) -> float:
    """The rho that ranks ``agent``'s app in a round on sim-256 where it holds two GPUs on two
    machines of one rack, the arbiter knowing the app's true slowdowns (SLOW)."""
    from arbiter.policies import make_policy
    from arbiter.rounds import RoundEngine

    engine = RoundEngine(CLUSTER, make_policy("themis"), rank=rank)
    engine.add_app("a", 0.0, slowdown=SLOW)
    engine.leases.grant("a", ["r6-m24-g0", "r6-m25-g0"], now=0.0, expires_at=1e6, round_id=0)
    return engine.run_round(100.0, {"a": agent}).rho["a"]


def test_a_measured_rank_takes_the_claimed_work_at_the_measured_slowdowns():
    """D21: with the engine's rank="measured" a slowdown lie no longer reaches the rho that ranks
    the app (nor does a claim of infinity), a work lie still does, and the bid carries both lies."""
    truth = _ranked_rho(Agent(app()), "reported")
    assert _ranked_rho(Agent(app()), "measured") == pytest.approx(truth, rel=1e-12)
    assert _ranked_rho(StrategicAgent(app(), make_strategy("overreport-spread", 50)), "reported") > truth * 1.05
    assert _ranked_rho(StrategicAgent(app(), make_strategy("overreport-spread", 50)), "measured") == \
        pytest.approx(truth, rel=1e-12)
    for rank in ("reported", "measured"):
        assert _ranked_rho(StrategicAgent(app(), make_strategy("misreport-work", 100)), rank) > truth * 1.05
    assert _ranked_rho(StrategicAgent(app(), make_strategy("report-inf", 0)), "measured") == \
        pytest.approx(truth, rel=1e-12)
    assert by_set(StrategicAgent(app(), make_strategy("overreport-spread", 50)).bid(offer())) != \
        by_set(Agent(app()).bid(offer()))


def test_an_agent_that_withholds_its_bid_is_leased_nothing_in_that_round():
    """D22 through the strategy: ``withhold-bid`` reports the truthful rho, then sends no bid; the
    round records why and leases it nothing, even with GPUs left that it wants (before D22 it took
    them all as the last random tier)."""
    from arbiter.policies import make_policy
    from arbiter.rounds import RoundEngine

    request = _spread_request()
    assert StrategicAgent(app(), make_strategy("withhold-bid", 0)).report(request).rho == \
        pytest.approx(Agent(app()).report(request).rho)
    engine = RoundEngine(CLUSTER.subcluster(["r0-m0"]), make_policy("themis", fairness_knob=0.0), coalesce_s=1)
    engine.add_app("quiet", 0)
    r = engine.run_round(1, {"quiet": StrategicAgent(app(), make_strategy("withhold-bid", 0), "quiet")})
    assert r.bidders == ("quiet",) and "withholds its bid" in r.rejected["quiet"]
    assert r.grants == () and len(r.idle) == len(engine.free_gpus()) > 0 and engine.round_due(2)
    r = engine.run_round(2, {"quiet": Agent(app(), name="quiet")})  # D22's one follow-up round
    assert [g.app for g in r.grants] == ["quiet"]


def test_fig15_lie_pays_through_the_reported_rank_and_not_through_the_measured_one(tmp_path):
    """Fig. 15's setup (D21): app0 over-reports its spread slowdown by 50%, seed 0. Ranked by its
    report it is among the bidders at every expiry and finishes well before its truthful self; ranked
    by measured slowdowns it finishes within 1% of it (what is left is the leftover's outside option, D21)."""
    from simulator.experiments import _identical_apps_trace, fig15_cluster
    from simulator.runs import simulate

    cluster, trace = fig15_cluster(tmp_path), str(_identical_apps_trace(tmp_path))

    def liar_jct(level: float, rank: str) -> float:
        summary = simulate(cluster=cluster, workload=trace, policy="themis", seed=0, show_progress=False,
                           strategy=("overreport-spread", level, ("app0",)), rank=rank)
        return next(a["jct_s"] for a in summary["apps"] if a["app"] == "app0")

    truthful = liar_jct(0.0, "reported")
    assert liar_jct(0.0, "measured") == truthful
    assert liar_jct(50.0, "reported") < 0.97 * truthful
    assert liar_jct(50.0, "measured") >= 0.99 * truthful


def test_a_liar_keeps_its_remaining_times_between_rounds_only_while_its_app_is_unchanged():
    """The liar's view of its app carries the app's version, so what it computed stays valid while
    nothing moved and is recomputed once its jobs progress or a phase ends."""
    from protos.messages import RhoRequest

    a = app()
    liar = StrategicAgent(a, make_strategy("misestimate", 20, seed=3))
    spread = {g: CLUSTER.position(g) for g in ("r6-m24-g0", "r6-m25-g0")}
    request = RhoRequest(1, "liar", 100.0, 2.0, 256, spread)

    def fresh():  # the same liar with nothing kept
        twin = StrategicAgent(a, make_strategy("misestimate", 20, seed=3))
        return twin.bid(offer()), twin.report(request)

    first = (liar.bid(offer()), liar.report(request))
    assert first == fresh()
    for job in a.phase_jobs():
        a.advance(job, 60)
    moved = (liar.bid(offer()), liar.report(request))
    assert moved == fresh() and moved != first
    a.end_phase(a.phase_jobs()[:2])
    ended = (liar.bid(offer()), liar.report(request))
    assert ended == fresh() and ended != moved
