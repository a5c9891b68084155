"""The rank computed by the arbiter from claimed work at slowdowns it knows (D21, ``arbiter.rank``)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.agent import Agent, packed
from agent.appsched import FixedJobsApp, JobInfo, SingleJobApp, SuccessiveHalvingApp
from agent.fairness import shared_time_left, waiting_rho, work_of_shape
from agent.placement import canonical_shape
from arbiter.cluster import load_cluster
from arbiter.policies import make_policy
from arbiter.rank import MAX_PHASES, WORK_FLOOR_BAND, BadWorkClaim, check_claim, measured_rho, time_left
from arbiter.rounds import InvalidReport, RoundEngine
from protos.messages import RhoReport, RhoRequest, WorkClaim

CLUSTER = load_cluster("sim-256")
SLOW = (1.0, 1.15, 1.6, 2.3)
SPREAD = ["r6-m24-g0", "r6-m25-g0"]  # two machines of one rack: D1 level 2


def _slowdowns():
    """Four finite slowdowns >= 1, not decreasing from slot to cluster (D1)."""
    return st.lists(st.floats(1.0, 4.0), min_size=4, max_size=4).map(lambda v: tuple(sorted(v)))


def _positions(picks: list[int]) -> list[tuple[str, str, str]]:
    ids = sorted(CLUSTER.gpu_ids)
    return [CLUSTER.position(ids[k % len(ids)]) for k in dict.fromkeys(picks)]


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(["halving", "fixed"]),
    jobs=st.integers(1, 12),
    phases=st.integers(1, 4),
    demand=st.integers(1, 8),
    picks=st.lists(st.integers(0, 255), min_size=1, max_size=40),
    progress=st.floats(0.0, 0.9),
    slowdown=_slowdowns(),
)
def test_claimed_work_at_the_apps_slowdowns_is_its_time_left(kind, jobs, phases, demand, picks, progress, slowdown):
    """The claim leaves the slowdowns out and loses nothing: at the app's own slowdowns the
    arbiter's sum of per-phase maxima is the agent's time left (D3's split and the runs' levels do
    not depend on S), for even splits, uneven ones and jobs queued on fewer GPUs than jobs."""
    if kind == "halving":
        jobs = max(jobs, 2 ** (phases - 1))
        app = SuccessiveHalvingApp([0.5 + k / 5 for k in range(jobs)], [200.0 * (k + 1) for k in range(phases)],
                                   job_demand_max=demand, grow_demand=demand > 4, slowdown=slowdown)
        for job in app.phase_jobs():
            app.advance(job, 200.0 * progress)
    else:
        app = FixedJobsApp([JobInfo(1000.0 * (k + 1) * (1 - progress), 0.3 + k / 9, slowdown, demand, f"j{k}")
                            for k in range(jobs)])
    gpus = _positions(picks)
    work = work_of_shape(app, canonical_shape(gpus))
    assert time_left(work, slowdown) == pytest.approx(shared_time_left(app, gpus), rel=1e-12)


def _engine(rank: str = "measured") -> RoundEngine:
    engine = RoundEngine(CLUSTER, make_policy("themis"), rank=rank)
    engine.add_app("busy", 0.0)
    engine.set_demand("busy", 0, 0.0)
    engine.leases.grant("busy", [g for g in CLUSTER.gpu_ids if g not in SPREAD][:-8], now=0.0, expires_at=1e6,
                        round_id=0)
    return engine


def _with_a(rank: str = "measured", *, holds: bool = True) -> RoundEngine:
    """``_engine`` and app "a", whose model's slowdowns (SLOW) the arbiter knows, holding SPREAD
    (two machines of one rack) unless ``holds`` is False."""
    engine = _engine(rank)
    engine.add_app("a", 0.0, slowdown=SLOW)
    if holds:
        engine.leases.grant("a", SPREAD, now=0.0, expires_at=1e6, round_id=0)
    return engine


def _request(rnd) -> RhoRequest:
    """The round's rho request to app "a"."""
    return next(r for r in rnd.requests if r.app == "a")


def _app() -> SuccessiveHalvingApp:
    return SuccessiveHalvingApp([1.0, 1.2, 0.9, 1.1], [100, 200, 300], job_demand_max=4, slowdown=SLOW)


@pytest.mark.parametrize("holds", [True, False])
def test_a_truthful_app_ranks_the_same_by_its_report_and_by_its_claimed_work(holds):
    """For a truthful app the measured rank is its reported rho (holding GPUs) and its waiting rho
    (holding nothing, D13): the same formula, with the arbiter's arrival time and N_avg."""
    ranked = {}
    for rank in ("reported", "measured"):
        engine = _with_a(rank, holds=holds)
        rnd = engine.open_round(500.0)
        request = _request(rnd)
        assert ("work" in request.extras) == (rank == "measured")
        rnd.report("a", Agent(_app(), name="a").report(request))
        ranked[rank] = rnd._reports["a"]
        rnd.abandon()
    if holds:
        assert math.isfinite(ranked["reported"].rho)
        assert ranked["measured"].rho == pytest.approx(ranked["reported"].rho, rel=1e-12)
    else:
        assert math.isinf(ranked["measured"].rho) and math.isinf(ranked["reported"].rho)
        assert ranked["reported"].rho_wait > 0
        assert ranked["measured"].rho_wait == pytest.approx(ranked["reported"].rho_wait, rel=1e-12)


def test_the_measured_rank_uses_the_slowdowns_the_arbiter_knows_not_the_apps():
    """An app whose spread slowdown is really 1.6 / 2.3 and that says 2.4 / 3.45 (Fig. 15's lie)
    ranks as its true self; it would have ranked higher by its report."""
    liar_app = SuccessiveHalvingApp([1.0, 1.2, 0.9, 1.1], [100, 200, 300], job_demand_max=4,
                                    slowdown=(1.0, 1.15, 2.4, 3.45))
    ranked = {}
    for who, the_app in (("truth", _app()), ("liar", liar_app)):
        for rank in ("reported", "measured"):
            engine = _with_a(rank)
            ranked[who, rank] = engine.run_round(500.0, {"a": Agent(the_app, name="a"), "busy": Agent(_app())}).rho["a"]
    assert ranked["liar", "reported"] > 1.05 * ranked["truth", "reported"]
    assert ranked["liar", "measured"] == pytest.approx(ranked["truth", "measured"], rel=1e-12)


def _report(claim: WorkClaim | None, rho: float = 1.0, demand: int = 16) -> RhoReport:
    return RhoReport(rho, demand, work=claim)


GOOD_PHASE = (0.0, 10.0, 50.0, 80.0, 0.0)


@pytest.mark.parametrize("claim, words", [
    (None, "must carry the app's work"),
    (WorkClaim(1000.0, 4, ((0.0, 10.0, 50.0, 80.0, 5.0),)), "beyond the allocation's"),
    (WorkClaim(1000.0, 4, ((0.0, -1.0, 0.0, 0.0, 0.0),)), "finite number >= 0"),
    (WorkClaim(1000.0, 4, ((0.0, math.nan, 0.0, 0.0, 0.0),)), "finite number >= 0"),
    (WorkClaim(1000.0, 4, ((0.0, 1.0, 0.0),)), "must have 5 times"),
    (WorkClaim(1000.0, 4, (GOOD_PHASE,) * (MAX_PHASES + 1)), f"more than {MAX_PHASES}"),
    (WorkClaim(0.0, 4, (GOOD_PHASE,)), "work_gpu_s"),
    (WorkClaim(1000.0, 0, (GOOD_PHASE,)), "demand_max"),
    (WorkClaim(1000.0, 4, ()), "claims no work on them"),
    (WorkClaim(1000.0, 4, (GOOD_PHASE,), (GOOD_PHASE,)), "only from an app that holds nothing"),
])
def test_a_bad_work_claim_is_refused_with_what_is_wrong(claim, words):
    """The claim is checked against what the arbiter knows (D21): an app holding two GPUs of one
    rack has no job spanning racks; times are finite and not negative; the claim fits the holding."""
    engine = _with_a()
    rnd = engine.open_round(500.0)
    with pytest.raises(InvalidReport, match=words):
        rnd.report("a", _report(claim))
    rnd.report("a", _report(WorkClaim(1000.0, 4, (GOOD_PHASE,))))  # a good one is taken after a bad one
    assert rnd._reports["a"].rho == pytest.approx((500.0 + 80.0 * SLOW[2]) / (1000.0 / 4 * engine.n_avg("a", 500.0)))
    rnd.abandon()


def test_an_app_holding_nothing_cannot_claim_work_on_held_gpus():
    with pytest.raises(BadWorkClaim, match="holds none"):
        check_claim(WorkClaim(1000.0, 4, (GOOD_PHASE,)), 0, 0)
    with pytest.raises(BadWorkClaim, match="beyond the allocation's"):  # a fair share is one machine
        check_claim(WorkClaim(1000.0, 4, (), ((0.0, 0.0, 0.0, 5.0, 0.0),)), 0, 0)


def test_an_app_whose_slowdowns_the_arbiter_does_not_know_is_ranked_by_its_report():
    """Under a measured rank, an app with no known model is asked for no work and ranked by its rho."""
    engine = _engine()
    engine.add_app("a", 0.0)
    engine.leases.grant("a", SPREAD, now=0.0, expires_at=1e6, round_id=0)
    rnd = engine.open_round(500.0)
    request = _request(rnd)
    assert "work" not in request.extras
    rnd.report("a", RhoReport(0.75, 16))
    assert rnd._reports["a"].rho == 0.75
    rnd.abandon()
    with pytest.raises(ValueError, match="4 finite numbers >= 1"):
        engine.set_slowdown("a", (1.0, 0.5, 1.0, 1.0))


def test_measured_rho_time_slices_the_fair_share_below_one_gpu():
    """D13's waiting rho on a share under one GPU: the time on one GPU divided by the share."""
    app = FixedJobsApp([JobInfo(1000.0, 1.0, SLOW, 1, "j0")])
    n_avg = 512.0  # 256 GPUs among 512 apps: half a GPU each
    request = RhoRequest(1, "a", 100.0, n_avg, 256, {}, frozenset({"work"}))
    claim = Agent(app).report(request).work
    _, wait = measured_rho(check_claim(claim, 0, 0), SLOW, held=0, demand=1, elapsed=100.0, n_avg=n_avg,
                           cluster_size=256)
    left = shared_time_left(app, packed(1))  # 1,000 s on one GPU
    assert wait == pytest.approx((100.0 + 2 * left) / (1000.0 * n_avg))  # T_id = B / min(R_C, 1) x N_avg
    assert wait == pytest.approx(waiting_rho(app, now=100.0, n_avg=n_avg, cluster_size=256,
                                             time_left=lambda g: shared_time_left(app, g), packed=packed))


@pytest.mark.parametrize("work_gpu_s, demand_max, phase", [(5e-324, 4, (0.0, 0.0, 0.0, 0.0, 0.0)),
                                                          (1e308, 1, GOOD_PHASE)])
def test_a_claim_whose_ideal_time_is_zero_or_infinite_is_refused_with_the_reason(work_gpu_s, demand_max, phase):
    """T_id = B / min(R_C, demand_max) x N_avg (Eq. 1) divides rho: a B that passes the checks
    (finite, > 0) can still make it 0 (the smallest double over 4 GPUs underflows; with no work
    left claimed, D31 has nothing to raise it to) or infinite (overflow), and the arbiter must
    refuse the claim with the reason (D21), not divide by zero (a ZeroDivisionError in the report
    handler) or rank the app by inf / inf."""
    engine = _with_a()
    rnd = engine.open_round(500.0)
    with pytest.raises(InvalidReport, match="T_id"):
        rnd.report("a", _report(WorkClaim(work_gpu_s, demand_max, (phase,))))
    rnd.report("a", _report(WorkClaim(1000.0, 4, (GOOD_PHASE,))))  # a good one is still taken
    rnd.abandon()


@pytest.mark.parametrize("meanwhile, holds", [("another app arrives", True), ("another app arrives", False),
                                               ("the app gives a GPU back", True)])
def test_a_measured_rank_is_computed_on_what_the_request_named(meanwhile, holds):
    """D21: the agent computes its claim on what the rho request named (the GPUs held as the round
    opened, its N_avg), so the arbiter must rank it on the same, whatever happened before the report
    came: an app that connects meanwhile moves the engine's N_avg (by a third here, for an app that
    arrived 2 s before), and a Release moves what the app holds (the claim's work on two machines
    was refused as beyond the one GPU left). A truthful app ranks as by its report."""
    ranked = {}
    for rank in ("reported", "measured"):
        engine = _with_a(rank, holds=holds)
        rnd = engine.open_round(2.0)
        request = _request(rnd)
        if meanwhile == "another app arrives":
            engine.add_app("late", 3.0)
        else:
            engine.release("a", SPREAD[1:], 3.0)
        rnd.report("a", Agent(_app(), name="a").report(request))
        ranked[rank] = rnd._reports["a"]
        rnd.abandon()
    assert ranked["measured"].rho == pytest.approx(ranked["reported"].rho, rel=1e-12)
    assert ranked["measured"].rho_wait == pytest.approx(ranked["reported"].rho_wait, rel=1e-12)


def test_a_finished_search_still_holding_gpus_is_ranked_as_by_its_report():
    """A successive-halving search whose last phase just ended still holds its GPUs, and a round
    that opened before its demand of 0 reached the arbiter asks it for rho. Its time left is 0, so
    its report is rho = elapsed / T_id with demand 0; under the measured rank its claim must say the
    same (it had no phase left, an empty claim, which D21 refuses from a holder: the app's report
    was refused, and its demand of 0 with it)."""
    done = SuccessiveHalvingApp([1.0, 1.2], [100], job_demand_max=4, slowdown=SLOW)
    for job in done.phase_jobs():
        done.advance(job, 100)
    done.end_phase(done.phase_jobs()[:1])
    assert done.current_phase() > done.num_phases() and done.demand_now() == 0
    ranked = {}
    for rank in ("reported", "measured"):
        engine = _with_a(rank)
        engine.set_demand("a", 8, 0.0)
        rnd = engine.open_round(500.0)
        rnd.report("a", Agent(done, name="a").report(_request(rnd)))
        ranked[rank] = rnd._reports["a"]
        rnd.abandon()
    assert ranked["measured"].demand == 0
    assert ranked["measured"].rho == pytest.approx(ranked["reported"].rho, rel=1e-12)


def test_an_app_holding_nothing_with_no_work_left_is_ranked_as_by_its_report():
    """A job past its predicted end and not yet stopped (curve stopping) can leave an app that holds
    nothing, still says it wants GPUs, and has no work left: its own rho is elapsed / T_id, finite,
    and the arbiter ranked it at infinity, first of all (found in review). Both now say the same."""
    idle = FixedJobsApp([JobInfo(1000.0, 1.0, SLOW, 2, "j0")])
    idle.advance("j0", 1000.0)
    assert idle.budget() > 0 and shared_time_left(idle, []) == 0
    ranked = {}
    for rank in ("reported", "measured"):
        engine = _with_a(rank, holds=False)
        rnd = engine.open_round(500.0)
        report = Agent(idle, name="a").report(_request(rnd))
        rnd.report("a", replace(report, demand=2))  # the demand it still states
        ranked[rank] = rnd._reports["a"].rho
        rnd.abandon()
    assert math.isfinite(ranked["reported"])
    assert ranked["measured"] == pytest.approx(ranked["reported"], rel=1e-12)


@pytest.mark.parametrize("holds", [True, False])
def test_a_claimed_demand_max_counts_only_up_to_what_the_app_has_asked_for(holds):
    """D28: T_id = B / min(R_C, demand_max) x N_avg, so claiming it could use four times the GPUs
    it can shrinks T_id by as much and ranks it as worse off (23.9% of the audit's one-round cases
    paid). The arbiter takes demand_max only up to the most GPUs the app has stated it could use
    (its reports and demand updates) or held: the lie alone moves nothing; stating the demand too
    -- which its rows, the offers and the leftover tiers are then held to -- still does."""
    from simulator.strategic import StrategicAgent, make_strategy

    ranked = {}
    for lie in ("truthful", "overstate-demand-max", "overstate-demand"):
        engine = _with_a(holds=holds)
        rnd = engine.open_round(500.0)
        rnd.report("a", StrategicAgent(_app(), make_strategy(lie, 300), "a").report(_request(rnd)))
        ranked[lie] = rnd._reports["a"].rho if holds else rnd._reports["a"].rho_wait
        rnd.abandon()
    assert ranked["overstate-demand-max"] == pytest.approx(ranked["truthful"], rel=1e-12)
    assert ranked["overstate-demand"] > 1.5 * ranked["truthful"]


def test_a_pace_counts_only_intervals_on_the_same_gpus_and_scales_only_beyond_its_band():
    from arbiter.rank import PACE_BAND, PACE_MAX, Pace

    a, b = frozenset({"g0"}), frozenset({"g1"})
    pace = Pace().after(0.0, a, 1000.0).after(100.0, a, 950.0)  # 100 s held, 50 s of claims burned
    assert (pace.observed_s, pace.claimed_s) == (100.0, 50.0) and pace.factor(100.0) == 2.0
    assert pace.factor(101.0) == 1.0  # not watched long enough yet
    moved = pace.after(200.0, b, 800.0)  # other GPUs: that interval says nothing
    assert (moved.observed_s, moved.claimed_s) == (100.0, 50.0) and moved.last == (200.0, b, 800.0)
    assert Pace().after(0.0, a, 100.0).after(0.0, frozenset(), 0.0).last is None
    near = Pace(1000.0, 1000.0 / (1 + PACE_BAND / 2))
    assert near.factor(0) == 1.0  # an honest app's few percent
    assert Pace(1000.0, 0.0).factor(0) == PACE_MAX and Pace(10.0, 1e6).factor(0) == 1 / PACE_MAX


@pytest.mark.parametrize("lie", ["understate-work", "misreport-work"])
def test_claims_that_do_not_keep_pace_with_the_gpus_held_are_scaled_to_it(lie):
    """D29: an app claiming a fifth of its work (done and left alike: a small app that has waited as
    long) ranks far worse off than it is; one claiming twice the work it has left ranks worse off too.
    Neither can be told from the truth in one round. After it has held the same GPUs for longer than
    a lease, its claimed time left has gone down 5x slower (or 2x faster) than the time it held
    them, and the arbiter scales its claims by that: it ranks as its true self again."""
    from simulator.strategic import StrategicAgent, make_strategy

    level = {"understate-work": 80, "misreport-work": 100}[lie]
    ranked = {}
    for who in ("truth", "liar"):
        engine = _engine()
        engine.lease_s = 300.0
        engine.add_app("a", 0.0, slowdown=SLOW)
        app = SingleJobApp(JobInfo(40_000, 0.5, SLOW, 4, "job0"))  # it wants 4 GPUs and holds 2
        agent = Agent(app, name="a") if who == "truth" else StrategicAgent(app, make_strategy(lie, level), "a")
        engine.leases.grant("a", SPREAD, now=0.0, expires_at=1e6, round_id=0)
        rhos = []
        for now in (500.0, 1500.0):
            rhos.append(engine.run_round(now, {"a": agent, "busy": Agent(_app())}).rho["a"])
            engine.release("a", engine.held("a") - set(SPREAD), now)  # it goes on on the same two GPUs
            app.advance("job0", 1000.0 / (0.5 * SLOW[2] / 2))  # 1,000 s on two GPUs of two machines
        ranked[who] = rhos
    assert ranked["liar"][0] > 1.1 * ranked["truth"][0]  # one round: the lie pays
    assert ranked["liar"][1] == pytest.approx(ranked["truth"][1], rel=1e-9)  # watched: it does not


def test_a_budget_below_the_work_the_claim_says_is_left_is_raised_to_it():
    """D31: B is all of the app's work, done and left, so it is at least the work its claim says
    is left: per phase the slowest job's time at slowdown 1 (GOOD_PHASE: 80 s). A B understated to
    8 GPU-seconds ranked the app as ten times further behind than it is; now T_id counts 80 over
    1 + WORK_FLOOR_BAND, and the floor stays when later claims have less left (the most any claim
    said)."""
    honest = _with_a()
    first = honest.open_round(500.0)
    first.report("a", _report(WorkClaim(80.0 / (1 + WORK_FLOOR_BAND), 4, (GOOD_PHASE,))))
    truthful = first._reports["a"].rho
    first.close()
    liar = _with_a()
    rnd = liar.open_round(500.0)
    rnd.report("a", _report(WorkClaim(8.0, 4, (GOOD_PHASE,))))
    assert rnd._reports["a"].rho == pytest.approx(truthful)
    rnd.close()
    later = liar.open_round(600.0)
    later.report("a", _report(WorkClaim(8.0, 4, ((0.0, 5.0, 10.0, 20.0, 0.0),))))
    assert liar.work_floor["a"] == 80.0
    honest_later = honest.open_round(600.0)
    honest_later.report("a", _report(WorkClaim(80.0 / (1 + WORK_FLOOR_BAND), 4, ((0.0, 5.0, 10.0, 20.0, 0.0),))))
    assert later._reports["a"].rho == pytest.approx(honest_later._reports["a"].rho)
