"""Finish-time fairness: Eq. 1 (D2), Eq. 2 and the paper's 4.3.3 example (D3), curve stopping (D4)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.appsched import CurveJob, CurveStoppingApp, JobInfo, SingleJobApp, SuccessiveHalvingApp
from agent.curves import predict_stop
from agent.fairness import finish_time_fairness, ideal_time, phase_time, split_allocation

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "paper_4_3_3.toml"
PAPER = {1: 4.0, 2: 2.0, 4: 1.064, 8: 0.532, 16: 0.356}  # mechanism.md D3


def machine(n, rack="r0", name="m0"):
    return [(rack, name, f"s{k}") for k in range(n)]


def paper_app():
    return SuccessiveHalvingApp([80, 100, 100, 120], [8, 16, 36], job_demand_max=8, budget_gpu_seconds=10_000)


@pytest.mark.parametrize("gpus, rho", sorted(PAPER.items()))
def test_paper_4_3_3_example_exact(gpus, rho):
    app = paper_app()
    assert ideal_time(app, n_avg=4, cluster_size=16) == 2500.0
    assert finish_time_fairness(app, machine(gpus), now=0, n_avg=4, cluster_size=16) == pytest.approx(rho, abs=1e-12)


def test_paper_4_3_3_two_gpu_phases():
    app = paper_app()
    two = machine(2)
    # 4 jobs on 2 GPUs: pack {120, 80} and {100, 100}: 8 iterations x 200 s
    assert phase_time(app.jobs_in_phase(1, two), two) == 1600
    assert phase_time(app.jobs_in_phase(2, two), two) == 1600  # median 100 s, one job per GPU
    assert phase_time(app.jobs_in_phase(3, two), two) == 1800  # one job on 2 GPUs


def test_paper_4_3_3_survivors_change_the_bid():
    """Paper 4.3.3: if the survivors are the 120 and 100 s jobs, phase 2 takes 3200 s on 2 GPUs... per
    job; here one job per GPU so the phase is 120 x 16 = 1920, and phase 3 uses the real median."""
    app = paper_app()
    for job in app.phase_jobs():
        app.advance(job, 8)
    assert app.phase_done()
    app.end_phase(["job3", "job1"])  # the 120 s and a 100 s job
    two = machine(2)
    assert phase_time(app.jobs_in_phase(2, two), two) == 120 * 16
    assert phase_time(app.jobs_in_phase(3, two), two) == 110 * 36 / 2


def test_rho_table_command_prints_the_papers_values():
    out = subprocess.run(
        [sys.executable, "-m", "agent.cli", "rho-table", str(EXAMPLE), "--gpus", "1,2,4,8,16"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )
    assert json.loads(out.stdout) == {str(k): v for k, v in PAPER.items()}


def test_rho_table_command_rejects_bad_files(tmp_path):
    bad = tmp_path / "app.toml"
    bad.write_text("[app]\nkind = 'successive_halving'\niter_times = [1, -2]\niterations = [3]\n[context]\ncluster_size = 4\n")
    out = subprocess.run([sys.executable, "-m", "agent.cli", "rho-table", str(bad), "--gpus", "1"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2
    assert "iter_times" in out.stderr and str(bad) in out.stderr


def test_single_job_eq_1():
    job = JobInfo(iters_remaining=1000, iter_time_serial=2.0, slowdown=(1, 1.2, 1.5, 2.0), demand_max=4)
    app = SingleJobApp(job, start_time=100)
    spread = [("r0", "m0", "s0"), ("r0", "m1", "s0"), ("r0", "m2", "s0"), ("r0", "m3", "s0")]
    # T_sh = (400 - 100) + 1000 * 2 * 1.5 / 4 = 1050; T_id = 1000 * 2 / min(64, 4) * 3 = 1500
    assert finish_time_fairness(app, spread, now=400, n_avg=3, cluster_size=64) == pytest.approx(1050 / 1500)
    # more GPUs than demand_max do not help; 8 in one machine: 300 + 2000 * 1.2 / 4
    eight = machine(8)
    assert finish_time_fairness(app, eight, now=400, n_avg=3, cluster_size=64) == pytest.approx(900 / 1500)
    assert finish_time_fairness(app, [], now=400, n_avg=3, cluster_size=64) == math.inf


def test_waiting_raises_rho():
    app = paper_app()
    values = [finish_time_fairness(app, machine(4), now=t, n_avg=4, cluster_size=16) for t in (0, 100, 1000)]
    assert values == sorted(values) and values[0] < values[-1]


def test_split_allocation_keeps_jobs_on_their_own_machines():
    jobs = [JobInfo(10, 1.0, demand_max=4, job_id=f"j{k}") for k in range(2)]
    gpus = machine(4, name="m0") + machine(4, name="m1")
    split = split_allocation(jobs, gpus)
    assert [len(chunk) for _, chunk in split] == [4, 4]
    assert all(len({p[1] for p in chunk}) == 1 for _, chunk in split)


def test_n_avg_below_one_is_refused():
    with pytest.raises(ValueError, match="N_avg"):
        ideal_time(paper_app(), n_avg=0.5, cluster_size=16)


# -- curve stopping (D4) ------------------------------------------------------------------------


def optimus_curve(k, b0=0.01, b1=1.0, b2=0.5):
    return 1.0 / (b0 * k + b1) + b2


def test_curve_fit_finds_the_known_stop_on_noisy_data():
    rng = np.random.default_rng(0)
    k = np.arange(10, 1500, 10.0)
    loss = optimus_curve(k) + rng.normal(0, 0.002, k.size)
    pred = predict_stop(k, loss, tolerance=0.01, max_iterations=100_000)
    true_stop = (1 / 0.01 - 1.0) / 0.01  # 9900
    assert pred.optimistic <= pred.pessimistic
    assert pred.optimistic * 0.7 < true_stop < pred.pessimistic * 1.3


def test_curve_prediction_with_too_few_points_is_pessimistic():
    pred = predict_stop([1, 2], [3.0, 2.0], tolerance=0.01, max_iterations=5000)
    assert pred.pessimistic == 5000


def test_fixed_jobs_remaining_keep_every_field_but_the_iterations_left():
    """``FixedJobsApp.jobs_remaining`` rebuilds its jobs with the constructor (faster than
    ``dataclasses.replace``); every field but ``iters_remaining`` must come through unchanged."""
    from dataclasses import fields, replace

    from agent.appsched import FixedJobsApp

    jobs = [JobInfo(100.0, 0.5, (1.0, 1.2, 1.5, 2.0), 4, "a"), JobInfo(40.0, 2.0, (1.0, 1.1, 1.1, 1.3), 2, "b")]
    assert [f.name for f in fields(JobInfo)] == ["iters_remaining", "iter_time_serial", "slowdown", "demand_max",
                                                 "job_id"]  # a new field must be passed on in jobs_remaining
    app = FixedJobsApp(jobs)
    app.advance("a", 30.0)
    app.advance("b", 40.0)
    assert app.jobs_remaining(()) == [replace(jobs[0], iters_remaining=70.0)]


def test_curve_stopping_rho_uses_the_pessimistic_end_and_tightens():
    rng = np.random.default_rng(1)
    app = CurveStoppingApp([CurveJob("a", 1.0, 50_000), CurveJob("b", 1.0, 50_000)], tolerance=0.01)
    gpus = machine(2)
    before = finish_time_fairness(app, gpus, now=0, n_avg=1, cluster_size=8)
    # with no curve yet, each job is assumed to run to its cap
    assert before == pytest.approx(50_000 / (100_000 / 2))
    for k in range(10, 600, 10):
        app.report("a", k, optimus_curve(k) + rng.normal(0, 0.001))
        app.report("b", k, optimus_curve(k, b0=0.02) + rng.normal(0, 0.001))
    remaining = {j.job_id: j.iters_remaining for j in app.jobs_remaining(gpus)}
    assert remaining["a"] > remaining["b"]  # a converges more slowly
    ends = {j: predict_stop(app.job(j).iterations_seen, app.job(j).losses, tolerance=0.01,
                            max_iterations=50_000) for j in "ab"}
    assert remaining["a"] == pytest.approx(ends["a"].pessimistic - 590)
    budget = ends["a"].pessimistic + ends["b"].pessimistic  # both at 1 s per iteration
    after = finish_time_fairness(app, gpus, now=590, n_avg=1, cluster_size=8)
    assert after == pytest.approx((590 + remaining["a"]) / (budget / 2))
    early = predict_stop(app.job("a").iterations_seen[:6], app.job("a").losses[:6], tolerance=0.01,
                         max_iterations=50_000)
    assert ends["a"].pessimistic - ends["a"].optimistic < early.pessimistic - early.optimistic


def test_curve_job_stops_when_its_curve_flattens():
    app = CurveStoppingApp([CurveJob("a", 1.0, 200)], tolerance=0.01)
    for k in range(10, 210, 10):
        app.report("a", k, optimus_curve(k))
    assert app.jobs[0].stopped and app.finished()


def test_rho_depends_only_on_the_shape_of_the_allocation():
    """Renaming racks, machines and slots never changes rho (bids cache on the shape)."""
    import random as _random

    rng = _random.Random(3)
    app = SuccessiveHalvingApp([1.0, 1.5, 2.0, 2.5, 3.0], [50, 80, 100], job_demand_max=3,
                               slowdown=(1.0, 1.1, 1.6, 2.4))
    for _ in range(200):
        gpus = [(f"r{rng.randrange(3)}", f"m{rng.randrange(3)}", f"s{rng.randrange(2)}") for _ in range(rng.randrange(1, 9))]
        racks = {r: f"R{rng.random()}" for r, _, _ in gpus}
        machines = {m: f"M{rng.random()}" for _, m, _ in gpus}
        slots = {s: f"S{rng.random()}" for _, _, s in gpus}
        renamed = [(racks[r], machines[m], slots[s]) for r, m, s in gpus]
        rng.shuffle(renamed)
        a = finish_time_fairness(app, gpus, now=10, n_avg=2, cluster_size=64)
        b = finish_time_fairness(app, renamed, now=10, n_avg=2, cluster_size=64)
        assert a == pytest.approx(b, rel=1e-12)


# -- the agent's reuse of remaining times (TimeLeftCache) ----------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    jobs=st.integers(2, 16),
    phases=st.integers(1, 4),
    grow=st.booleans(),
    steps=st.lists(st.tuples(st.integers(0, 15), st.floats(0.0, 400.0), st.integers(1, 40)), min_size=1, max_size=25),
)
def test_reused_times_equal_fresh_ones_as_a_halving_app_progresses(jobs, phases, grow, steps):
    """Later phases are cached across progress (plan_version), and each phase's split by GPU count
    (one split serves every shape of that count); every answer must still equal a computation from
    scratch to the last bit, through advances and phase ends alike."""
    from agent.fairness import TimeLeftCache, least_time_left, shared_time_left

    jobs = max(jobs, 2 ** (phases - 1))
    app = SuccessiveHalvingApp([1.0 + k / 7 for k in range(jobs)], [300.0] * phases, job_demand_max=2,
                               grow_demand=grow, slowdown=(1.0, 1.1, 1.4, 2.0))
    cache = TimeLeftCache(app)
    for pick, iters, n in steps:
        if app.finished():
            break
        spread = [(f"r{g // 32}", f"r{g // 32}-m{g // 8}", f"s{g // 4}") for g in range(0, 3 * n, 3)]
        packed = [(f"r{g // 32}", f"r{g // 32}-m{g // 8}", f"s{g // 4}") for g in range(n)]
        for gpus in (spread, packed):
            assert cache(gpus) == shared_time_left(app, gpus)
        assert cache.least(n) == least_time_left(app, n)
        for k, job in enumerate(app.phase_jobs()):
            app.advance(job, iters * (1 + (k + pick) % 3) / 2)
        if app.phase_done():
            app.end_phase(app.phase_jobs()[: max(1, len(app.phase_jobs()) // 2)])


def test_a_halving_app_keeps_its_plan_while_its_phase_progresses():
    app = SuccessiveHalvingApp([1.0, 2.0, 3.0, 4.0], [10.0, 10.0])
    version, plan = app.version, app.plan_version
    app.advance("job0", 5.0)
    assert app.version > version and app.plan_version == plan
    for j in app.phase_jobs():
        app.advance(j, 10.0)
    app.end_phase(["job1", "job2"])
    assert app.plan_version > plan


def _halving(iter_time: float, start_up: float) -> SuccessiveHalvingApp:
    app = SuccessiveHalvingApp(iter_times=[iter_time] * 4, iterations=[10, 20, 40])
    app.start_up_s = start_up
    return app


def _rho_on_fair_share(app: SuccessiveHalvingApp, start_up: float, *, cluster: int = 8, n_avg: float = 2.0) -> float:
    """The app's rho at its finish after running alone on its fair share (R_C / N_avg GPUs), paying
    ``start_up`` before each phase as a real tuner does that restarts its survivors every rung."""
    share = [("r0", "m0", f"s{k}") for k in range(int(cluster / n_avg))]
    elapsed = sum(start_up + phase_time(app.jobs_in_phase(p, share), share) for p in range(1, app.num_phases() + 1))
    return elapsed / ideal_time(app, n_avg=n_avg, cluster_size=cluster)


def test_start_up_counts_in_the_ideal_time_once_per_job_start():
    """D30: T_id = N_avg * (B + start-up * GPU-starts) / min(R_C, demand_max); 4 + 2 + 1 starts."""
    app = _halving(0.01, 5.0)
    assert app.job_starts() == 7
    assert ideal_time(app, n_avg=2.0, cluster_size=8) == pytest.approx((app.budget() + 5.0 * 7) / 4 * 2.0)
    app.start_up_s = 0.0
    assert ideal_time(app, n_avg=2.0, cluster_size=8) == pytest.approx(app.budget() / 4 * 2.0)


def test_a_short_trial_search_on_its_fair_share_has_a_rho_like_a_long_trial_one():
    """Issue 36: a search of millisecond iterations and 5 s start-ups reported rho 35-40 on its fair
    share, because T_id had no start-up in it. With D30 its rho is within a factor 1.5 of a search
    of the same shape whose trials run minutes; without it, more than 10 times higher."""
    short, long_ = _halving(0.01, 5.0), _halving(10.0, 5.0)
    ratio = _rho_on_fair_share(short, 5.0) / _rho_on_fair_share(long_, 5.0)
    assert 1 / 1.5 < ratio < 1.5
    short.start_up_s = long_.start_up_s = 0.0  # what rho said before D30, for the same runs
    assert _rho_on_fair_share(short, 5.0) / _rho_on_fair_share(long_, 5.0) > 10


def test_time_left_counts_a_start_up_for_every_phase_still_to_start():
    """D30: the phases after the current one start their jobs again; the current one is running."""
    gpus = [("r0", "m0", f"s{k}") for k in range(4)]
    app = _halving(1.0, 0.0)
    before = finish_time_fairness(app, gpus, now=0.0, n_avg=1.0, cluster_size=8)
    app.start_up_s = 3.0
    app.touch()
    t_id = ideal_time(app, n_avg=1.0, cluster_size=8)
    after = finish_time_fairness(app, gpus, now=0.0, n_avg=1.0, cluster_size=8)
    left_before = before * (app.budget() / 4)
    assert after * t_id == pytest.approx(left_before + 2 * 3.0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10), st.integers(0, 15), st.integers(0, 2)), min_size=1, max_size=300))
def test_a_shapes_order_is_the_densest_first_order_of_its_stand_ins(cells):
    """``shape_order`` builds the densest-first order from slot sizes; it must be exactly
    ``densest_first`` of the shape's stand-in positions, listed rack by rack, machine by machine."""
    from agent.fairness import _stand_in, densest_first, shape_order
    from agent.placement import canonical_shape

    shape = canonical_shape([(f"r{r}", f"m{m}", f"s{k}") for r, m, k in cells])
    stand_ins = [_stand_in(i, j, k) for i, rack in enumerate(shape) for j, machine in enumerate(rack)
                 for k, n in enumerate(machine) for _ in range(n)]
    assert shape_order.__wrapped__(shape) == tuple(densest_first(stand_ins))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10), st.integers(0, 15), st.integers(0, 2)), min_size=1, max_size=300),
       st.data())
def test_a_shapes_blocks_are_those_of_its_order_and_give_each_run_its_level(cells, data):
    """``shape_ends`` reads the slot, machine and rack blocks off the slot sizes; they must be the
    blocks of the shape's order, and the level they give a stretch the one its two ends give."""
    from agent.fairness import _level_in, _run_level, order_ends, shape_ends, shape_order
    from agent.placement import canonical_shape

    shape = canonical_shape([(f"r{r}", f"m{m}", f"s{k}") for r, m, k in cells])
    order = shape_order(shape)
    ends = shape_ends.__wrapped__(shape)
    assert ends == order_ends(order)
    first = data.draw(st.integers(0, len(order) - 1))
    last = data.draw(st.integers(first, len(order) - 1))
    assert _level_in(ends, first, last) == _run_level(order[first], order[last])
