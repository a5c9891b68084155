"""The agent's profiler (issue 5): slowdowns and serial iteration times learned from job reports,
the metrics payload, the bus subscription, and bids that follow what jobs measured (D1, D2, D7)."""

from __future__ import annotations

import asyncio
import random

import pytest

from agent.agent import Agent
from agent.appsched import CurveJob, CurveStoppingApp, JobInfo, SingleJobApp, SuccessiveHalvingApp
from agent.fairness import shared_time_left
from agent.placement import model_slowdown
from agent.profiler import Profiler, metrics_payload, parse_metrics, publish_metrics
from arbiter.events import Event, MemoryBus, decode, encode, job_metrics_topic
from protos.messages import Offer

PRIOR = (1.0, 1.0, 1.2, 1.4)
SINGLE = [("r0", "m0", "s0")]
SLOT = [("r0", "m0", "s0")] * 2  # two GPUs of one slot: level 0
MACHINE = [("r0", "m0", "s0"), ("r0", "m0", "s1"), ("r0", "m0", "s2"), ("r0", "m0", "s3")]  # level 1
RACK = [("r0", "m0", "s0"), ("r0", "m0", "s1"), ("r0", "m1", "s0"), ("r0", "m1", "s1")]  # level 2
CLUSTER = [("r0", "m0", "s0"), ("r0", "m0", "s1"), ("r1", "m5", "s0"), ("r1", "m5", "s1")]  # level 3
BY_LEVEL = {-1: SINGLE, 0: SLOT, 1: MACHINE, 2: RACK, 3: CLUSTER}


# ---------------------------------------------------------------------------------------------- payload


def test_metrics_payload_round_trips_through_the_bus_encoding():
    payload = metrics_payload(iteration=12, iter_time_s=0.5, gpus=RACK, demand=4, loss=0.25)
    assert payload == {"demand": 4, "gpus": [list(p) for p in RACK], "iter_time_s": 0.5, "iteration": 12, "loss": 0.25}
    m = parse_metrics(decode(encode(payload)))
    assert (m.iteration, m.loss, m.iter_time_s, m.gpus, m.demand) == (12.0, 0.25, 0.5, tuple(RACK), 4)
    assert metrics_payload(iteration=1, iter_time_s=1.0, gpus=SINGLE, demand=1, loss=float("nan"))["loss"] is None
    for bad in ({**payload, "gpus": []}, {**payload, "gpus": [["r0", "m0"]]}, {**payload, "iter_time_s": 0},
                {**payload, "demand": 0}, {k: v for k, v in payload.items() if k != "demand"}, [payload]):
        with pytest.raises(ValueError):
            parse_metrics(bad)
    with pytest.raises(ValueError, match="iter_time_s"):
        metrics_payload(iteration=1, iter_time_s=float("inf"), gpus=SINGLE, demand=1)


# ---------------------------------------------------------------------------------------------- learning


def test_learning_converges_to_a_known_slowdown_from_noisy_reports():
    """Two jobs of different speed (serial 1 s and 2 s), true S = (1.05, 1.2, 1.6, 2.4), +-15% noise;
    the prior (resnet50's table row, serial 1.5 s) is far from the truth."""
    truth, serial = (1.05, 1.2, 1.6, 2.4), {"fast": 1.0, "slow": 2.0}
    profiler = Profiler.for_model("resnet50", iter_time_serial=1.5)
    assert profiler.slowdown == model_slowdown("resnet50") and profiler.prior == model_slowdown("resnet50")
    rng = random.Random(7)
    for _ in range(3000):
        job, level = rng.choice(sorted(serial)), rng.choice([-1, 0, 1, 2, 3])
        gpus = BY_LEVEL[level]
        s = 1.0 if level == -1 else truth[level]
        t = serial[job] * s / min(len(gpus), 4) * rng.uniform(0.85, 1.15)
        assert profiler.observe(job, t, gpus, demand=4) == level
    assert profiler.slowdown == pytest.approx(truth, rel=0.02)
    assert profiler.job_iter_time_serial("fast") == pytest.approx(1.0, rel=0.02)
    assert profiler.job_iter_time_serial("slow") == pytest.approx(2.0, rel=0.02)
    assert profiler.iter_time_serial == pytest.approx(1.5, rel=0.03)  # both jobs' one-GPU reports
    assert sum(profiler.observations()) + profiler.serial_observations() == 3000


def test_the_prior_dominates_with_few_observations():
    profiler = Profiler(PRIOR, iter_time_serial=1.0, prior_weight=5)
    profiler.observe("j", 3.0 / 4, CLUSTER, demand=4)  # one report: S3 looks like 3.0
    assert profiler.slowdown == pytest.approx((1.0, 1.0, 1.2, (5 * 1.4 + 3.0) / 6))
    assert abs(profiler.slowdown[3] - 1.4) < abs(profiler.slowdown[3] - 3.0)
    for _ in range(199):
        profiler.observe("j", 3.0 / 4, CLUSTER, demand=4)
    assert profiler.slowdown[3] == pytest.approx((5 * 1.4 + 200 * 3.0) / 205)
    assert abs(profiler.slowdown[3] - 3.0) < 0.05 and profiler.slowdown[:3] == (1.0, 1.0, 1.2)
    profiler.observe("j", 0.5, SINGLE)  # a one-GPU report moves the serial time by 1/6 of the way
    assert profiler.iter_time_serial == pytest.approx((5 * 1.0 + 0.5) / 6)


def test_levels_stay_monotone_and_at_least_one():
    profiler = Profiler(PRIOR, iter_time_serial=1.0, prior_weight=1)
    for _ in range(9):
        profiler.observe("j", 2.0 / 4, RACK, demand=4)  # S2 measured 2.0
    # level 3 not measured: it follows level 2 instead of pulling it back to its prior (1.4)
    s2 = (1.2 + 9 * 2.0) / 10
    assert profiler.slowdown[2] == pytest.approx(s2) and profiler.slowdown[3] == pytest.approx(s2)
    for _ in range(3):
        profiler.observe("j", 1.5 / 4, CLUSTER, demand=4)  # S3 measured 1.5 < S2: the two are pooled
    s3 = (1.4 + 3 * 1.5) / 4
    pooled = (9 * s2 + 3 * s3) / 12
    assert profiler.slowdown == pytest.approx((1.0, 1.0, pooled, pooled))
    for _ in range(20):
        profiler.observe("j", 0.4 / 4, MACHINE, demand=4)  # faster than serial/4: S is clamped at 1
    s = profiler.slowdown
    assert s[1] == 1.0 and all(a <= b for a, b in zip(s, s[1:])) and min(s) >= 1.0


def test_profiler_follows_a_memory_bus_subscription():
    async def scenario():
        bus = MemoryBus()
        await bus.start()
        app = CurveStoppingApp([CurveJob("j1", 1.0, 100, demand_max=4), CurveJob("j2", 1.0, 100, demand_max=4)],
                               slowdown=PRIOR)
        profiler = Profiler(PRIOR, iter_time_serial=1.0, prior_weight=1)
        seen = []
        ready = asyncio.Event()
        task = asyncio.create_task(profiler.follow(bus, "c", "a", app=app, ready=ready,
                                                   on_report=lambda job, m: seen.append((job, m.iteration, m.loss))))
        await asyncio.wait_for(ready.wait(), 1)
        for k in range(1, 5):
            publish_metrics(bus, "c", "a", "j1", iteration=k, iter_time_s=3.0 / 4, gpus=CLUSTER, demand=4, loss=1 / k)
        publish_metrics(bus, "c", "a", "j2", iteration=1, iter_time_s=2.0, gpus=SINGLE, demand=4, loss=None)
        publish_metrics(bus, "c", "b", "j1", iteration=1, iter_time_s=99.0, gpus=CLUSTER, demand=4)  # another app
        bus.publish(job_metrics_topic("c", "a", "j1"), {"iteration": 5})  # not a usable report
        await bus.stop()  # ends the subscription once what arrived is consumed
        return await asyncio.wait_for(task, 1), profiler, seen, app

    taken, profiler, seen, app = asyncio.run(scenario())
    assert taken == 5 and profiler.rejected == 1
    assert seen == [("j1", 1.0, 1.0), ("j1", 2.0, 0.5), ("j1", 3.0, 1 / 3), ("j1", 4.0, 0.25), ("j2", 1.0, None)]
    assert profiler.observations() == (0, 0, 0, 4) and profiler.serial_observations() == 1
    assert profiler.slowdown[3] == pytest.approx((1.4 + 4 * 3.0 / 1.5) / 5)  # serial (1 + 2) / 2 = 1.5
    assert app.slowdown == profiler.slowdown  # applied as reports arrived
    assert app.job("j2").iter_time_serial == 2.0 and app.job("j1").iter_time_serial == 1.0


# ---------------------------------------------------------------------------------------------- applying


def test_bids_change_after_a_job_observes_a_slowdown_the_prior_did_not_predict():
    """The app holds one GPU on m0. The offer has three more GPUs on m0 (packed rows) and four on m1
    (spread rows: m0 + m1 is rack level). resnet50's prior says rack level costs 1.4%; the job measures
    3x. After applying, every spread row is worse or gone (a lone m1 GPU would now be slower than the
    held GPU alone), and every packed row is exactly as before."""
    held = {"g0": ("r0", "m0", "s0")}
    offer_gpus = {f"g{k}": ("r0", "m0", f"s{k}") for k in (1, 2, 3)} | {f"h{k}": ("r0", "m1", f"s{k}") for k in range(4)}
    offer = Offer(1, offer_gpus, now=0.0, n_avg=2.0, cluster_size=16, held=held)
    app = CurveStoppingApp([CurveJob("job", 1.0, 1000, demand_max=4)], slowdown=model_slowdown("resnet50"))
    agent = Agent(app)
    before = agent.bid(offer)

    def spread(gpus):
        return any(g.startswith("h") for g in gpus)

    assert any(spread(g) for g, _ in before.rows) and any(not spread(g) for g, _ in before.rows)
    profiler = Profiler.for_model("resnet50", iter_time_serial=1.0)
    rng = random.Random(1)
    for _ in range(30):
        profiler.observe("job", 3.0 / 2 * rng.uniform(0.95, 1.05), [held["g0"], offer_gpus["h0"]], demand=4)
        profiler.observe("job", 1.0 / 4 * rng.uniform(0.95, 1.05), list(held.values()) + [offer_gpus["g1"],
                         offer_gpus["g2"], offer_gpus["g3"]], demand=4)
    assert profiler.apply(app) is True
    assert app.slowdown[2] > 2.5 and app.slowdown[1] == 1.0
    after = agent.bid(offer)
    rows_before, rows_after = dict(before.rows), dict(after.rows)
    assert after.rho_old == before.rho_old
    packed = [g for g in rows_before if not spread(g)]
    assert packed and all(rows_after[g] == rows_before[g] for g in packed)
    assert [g for g in rows_after if not spread(g)] == packed
    worse = [g for g in rows_before if spread(g) and g in rows_after]
    gone = [g for g in rows_before if spread(g) and g not in rows_after]
    assert worse and gone
    assert all(rows_after[g] > rows_before[g] * 2 for g in worse)
    assert all(len(g) == 1 for g in gone)  # 2 GPUs at S = 2.6 are slower than the one GPU held
    assert profiler.apply(app) is False  # nothing new: the agents' caches are kept


def test_apply_reaches_a_successive_halving_app():
    """Guards the one place the profiler reaches into agent.appsched (SuccessiveHalvingApp's phase
    cache, which touch() does not clear)."""
    app = SuccessiveHalvingApp([1.0, 1.0], [10, 10], job_demand_max=4, slowdown=PRIOR)
    spread_gpus = RACK
    t_before = shared_time_left(app, spread_gpus)
    assert app.jobs_in_phase(1, spread_gpus)[0].slowdown == PRIOR
    profiler = Profiler(PRIOR, iter_time_serial=1.0, prior_weight=1)
    for _ in range(9):
        profiler.observe("job0", 2.0 / 2, [RACK[0], RACK[2]], demand=4)
    version = app.version
    assert profiler.apply(app) is True and app.version > version
    assert app.jobs_in_phase(1, spread_gpus)[0].slowdown == profiler.slowdown
    assert app.jobs_in_phase(2, spread_gpus)[0].slowdown == profiler.slowdown
    # phase 1 splits the four GPUs 2 + 2, one machine each (S = 1); phase 2 runs one job on all four
    assert t_before == pytest.approx(10 * 1.0 / 2 + 10 * 1.2 / 4)
    assert shared_time_left(app, spread_gpus) == pytest.approx(10 * 1.0 / 2 + 10 * profiler.slowdown[2] / 4)
    assert profiler.slowdown[2] > 1.8


def test_apply_skips_noise_and_refuses_apps_without_a_slowdown():
    app = CurveStoppingApp([CurveJob("job", 1.0, 100)], slowdown=PRIOR)
    profiler = Profiler(PRIOR, iter_time_serial=1.0)
    profiler.observe("job", 1.4 * 1.001 / 4, CLUSTER, demand=4)  # S3 moves by far less than 0.5%
    version = app.version
    assert profiler.apply(app) is False and app.version == version and app.slowdown == PRIOR
    single = SingleJobApp(JobInfo(100, 1.0, PRIOR, 4))
    for _ in range(50):
        profiler.observe("job", 3.0 / 4, CLUSTER, demand=4)
    with pytest.raises(TypeError, match="slowdown"):
        profiler.apply(single)
    with pytest.raises(ValueError):
        Profiler((1.0, 2.0, 1.5, 3.0))  # a prior must not decrease with the level
    assert profiler.consume(Event("themis/c/apps/a/rho", {"rho": 1.0})) is None and profiler.rejected == 1
