"""Loss-based termination (Blox's block, D34): the rule, the simulator's jobs that it ends on their
simulated curves, and a real search against a real arbiter whose plateauing job is ended and whose
GPU goes back."""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import textwrap
from pathlib import Path

import pytest

from agent.run_record import RECORD
from agent.runner import AppRunner
from agent.termination import ConvergenceRule, LossWatch
from hyperparam_adapters.hyperband import BracketTuner, Rung
from simulator.apps import build_app, converge_points
from simulator.cli import main as sim_main
from simulator.runs import simulate
from simulator.workloads import load_workload
from tests.service_kit import ADMIN, arbiter, target, wait_for

ROOT = Path(__file__).resolve().parents[1]

# -- the rule ------------------------------------------------------------------------------------


def test_a_rule_is_read_from_text_and_written_back():
    rule = ConvergenceRule.parse("0.01:3")
    assert rule == ConvergenceRule(0.01, 3, relative=True) and rule.spec() == "0.01:3"
    assert ConvergenceRule.parse("0.005:4:abs") == ConvergenceRule(0.005, 4, relative=False)
    assert ConvergenceRule.parse(ConvergenceRule(0.5, 2, False).spec()) == ConvergenceRule(0.5, 2, False)


@pytest.mark.parametrize("text, words", [
    ("0.01", "MIN_DELTA:PATIENCE"), ("0.01:3:sometimes", "MIN_DELTA:PATIENCE"), ("x:3", "MIN_DELTA must be a number"),
    ("0.01:2.5", "PATIENCE must be a whole number"), ("-0.1:3", "min_delta must be a finite number >= 0"),
    ("0.01:0", "patience must be a whole number of reports >= 1"), ("nan:3", "min_delta"),
])
def test_a_bad_rule_says_what_is_wrong(text, words):
    with pytest.raises(ValueError, match=words):
        ConvergenceRule.parse(text)


def test_converged_means_the_last_reports_did_not_beat_the_earlier_best_by_min_delta():
    rule = ConvergenceRule(0.01, 2)
    assert not rule.converged([1.0, 0.9])  # patience + 1 reports at least
    assert not rule.converged([1.0, 0.9, 0.8])
    assert rule.converged([1.0, 0.995, 0.994])  # 0.6% better than 1.0 over the last two
    assert not rule.converged([1.0, 1.2, 0.98])  # 2% better than 1.0
    assert rule.converged([1.0, 1.3, 1.4])  # worse is no improvement
    assert not ConvergenceRule(0.01, 2, relative=False).converged([100.0, 99.0, 98.5])  # 1.5 > 0.01
    assert ConvergenceRule(2.0, 2, relative=False).converged([100.0, 99.0, 98.5])
    # only finite losses count: a failing job is not a converged one
    assert not rule.converged([math.inf, math.inf, math.inf, math.nan])
    assert rule.converged([1.0, math.nan, 0.999, math.inf, 0.998])


def test_loss_watch_agrees_with_the_rule_on_every_prefix_and_stays_converged():
    rng = random.Random(7)
    for case in range(300):
        rule = ConvergenceRule(rng.choice([0.0, 0.001, 0.01, 0.05]), rng.randint(1, 5), rng.random() < 0.7)
        watch, losses = LossWatch(rule), []
        fired = False
        for k in range(40):
            loss = rng.choice([math.inf, math.nan]) if rng.random() < 0.05 else 2.0 / (1 + k) + rng.random() * 0.05
            losses.append(loss)
            got = watch.report("j", k, loss)
            fired = fired or rule.converged(losses)
            assert got == fired, (case, rule, losses)
        if fired:
            assert "j" in watch.converged_at and watch.report("j", 99, 0.0)
            watch.forget("j")
            assert "j" not in watch.converged_at


# -- the simulator -----------------------------------------------------------------------------------


def test_the_simulated_jobs_converge_where_their_curves_flatten():
    spec = load_workload("synthetic", seed=3, apps=4, kind="fixed").apps[0]
    app = build_app(spec, (1.0, 1.0, 1.0, 1.0))
    points = converge_points(app, spec, ConvergenceRule(0.01, 3))
    assert points, "Optimus-form curves flatten before their end"
    for job in spec.jobs:
        if job.job_id in points:
            k = points[job.job_id]
            assert 0 < k < job.iterations
            step = math.ceil(job.iterations / 20)
            losses = [app.losses.curves[job.job_id].loss(step * i) for i in range(1, round(k / step) + 1)]
            assert ConvergenceRule(0.01, 3).converged(losses) and not ConvergenceRule(0.01, 3).converged(losses[:-1])
    # a rule that asks for no improvement at all never ends a strictly improving curve
    assert converge_points(app, spec, ConvergenceRule(0.0, 3)) == {}


@pytest.mark.parametrize("kind", ["fixed", "successive_halving"])
def test_termination_saves_gpu_time_and_keeps_the_best_loss(kind):
    common = dict(cluster="testbed-64", workload="synthetic", policy="themis", show_progress=False,
                  workload_knobs={"apps": 10, "kind": kind, "load": 1.0})
    plain = simulate(**common, admission="accept-all")  # names a block: the best losses are reported
    ended = simulate(**common, convergence="0.01:3")
    assert plain["converged_jobs"] == 0 and ended["converged_jobs"] > 0 and ended["convergence"] == "0.01:3"
    assert ended["gpu_time"] < plain["gpu_time"]
    for before, after in zip(plain["apps"], ended["apps"], strict=True):
        assert after["best_loss"] >= before["best_loss"]  # a job stopped early is no better...
        assert after["best_loss"] <= before["best_loss"] * 1.02  # ...and within 2% here (a rule of 1%)


def test_themis_sim_takes_a_convergence_rule_and_refuses_a_bad_one(tmp_path, capsys):
    assert sim_main(["run", "--cluster", "testbed-64", "--workload", "small", "--converge", "0.01:3",
                     "--out", str(tmp_path / "run")]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["convergence"] == "0.01:3" and summary["converged_jobs"] > 0
    assert sim_main(["run", "--workload", "small", "--converge", "0.01", "--out", str(tmp_path / "bad")]) == 2
    assert "MIN_DELTA:PATIENCE" in capsys.readouterr().err


# -- a real search against a real arbiter -----------------------------------------------------------------

# Two trials of a fixed-length search (one rung to 300 iterations). "plateau" reports lr * (1 + 1/it):
# by it ~55 three reports gain under 0.1%; "linear" keeps improving by 0.1 per 100 iterations.
TRAIN = textwrap.dedent("""
    import time
    from agent.job import Job

    job = Job.from_env()
    state = job.resume() or {"iteration": 0}
    it = state["iteration"]
    while not job.should_stop(it):
        end = time.monotonic() + job.params["delay"]
        while time.monotonic() < end and not job.stop_requested:
            time.sleep(0.005)
        if job.stop_requested:
            break
        it += 1
        loss = job.params["lr"] * (1 + 1 / it) if job.params["shape"] == "plateau" else 1.0 - it / 1000
        job.step(it, loss)
    job.save({"iteration": it})
""")


def test_a_plateauing_job_is_ended_and_its_gpu_goes_back_to_the_arbiter(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    draws = iter([{"shape": "plateau", "lr": 0.5, "delay": 0.02}, {"shape": "linear", "lr": 0.5, "delay": 0.05}])
    adapter = BracketTuner(lambda rng: dict(next(draws)), [[Rung(2, 300)]], iter_time=0.05)

    async def scenario():
        async with arbiter(tmp_path, lease_s=600.0, coalesce_s=0.05) as server:
            engine = server.service.engine
            token = await AppRunner.token(target(server), "s", ADMIN)
            runner = await AppRunner.create(adapter, [sys.executable, str(script)], app="s", arbiter=target(server),
                                            token=token, workdir=str(tmp_path / "w"), cluster="test-8",
                                            grace_s=5.0, env={"PYTHONPATH": str(ROOT)}, quiet=True,
                                            convergence=ConvergenceRule(0.001, 3))
            task = asyncio.create_task(runner.run(timeout=60))
            await wait_for(lambda: len(engine.held("s")) == 2, 30)
            await wait_for(lambda: bool(runner.watch.converged_at) or task.done(), 30)
            (job, (iteration, loss)), = runner.watch.converged_at.items()
            assert adapter.trial_params(job)["shape"] == "plateau" and iteration < 300
            # its GPU goes back while the other trial trains on
            await wait_for(lambda: len(engine.held("s")) == 1 or task.done(), 30)
            assert not task.done() and len(engine.held("s")) == 1 and len(runner.launcher.live()) == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return job, iteration, loss

    job, iteration, loss = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert 30 < iteration < 100  # 3/it^2 < 0.1% from it ~55 on
    stops = [e for e in runner_events(tmp_path) if e.get("what") == "trial" and e.get("job") == job]
    assert stops and stops[-1]["outcome"] == "converged" and stops[-1]["iteration"] == iteration
    assert stops[-1]["loss"] == pytest.approx(loss)


def runner_events(tmp_path: Path) -> list[dict]:
    records = list((tmp_path / "w").glob(f"*/{RECORD}"))
    assert len(records) == 1
    return [json.loads(line) for line in records[0].read_text().splitlines()]
