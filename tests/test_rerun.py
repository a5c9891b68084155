"""Safe re-runs (issue 11, item 1): a checkpoint belongs to one trial of one run of a search.

A second run in the same workdir used to resume its trials from the first run's checkpoints, with
other hyperparameters. Here: a fresh run starts every trial from scratch, a job refuses a checkpoint
another trial wrote, and an explicit resume goes on from the interrupted run's checkpoints. Real
arbiter on loopback, real job processes.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import sys
import textwrap
from pathlib import Path

import pytest

from agent.client import AgentStopped
from agent.job import Job
from agent.launcher import Launcher
from agent.runner import AppRunner
from agent.search_run import RUN_FILE, SearchRun
from agent.trial import TrialSpec
from hyperparam_adapters.hyperband import BracketTuner, Rung
from tests.service_kit import ADMIN, arbiter, cluster_file, target, wait_for

PY = sys.executable
ROOT = Path(__file__).resolve().parents[1]
COUNTER = textwrap.dedent("""
    import time
    from agent.job import Job
    job = Job.from_env()
    state = job.resume() or {"iteration": 0}
    it = state["iteration"]
    while True:
        time.sleep(0.05)
        it += 1
        if job.step(it, 1.0 / it):
            break
    job.save({"iteration": it})
""")


def counter(tmp_path: Path) -> Path:
    path = tmp_path / "counter.py"
    path.write_text(COUNTER)
    return path


async def interrupted_run(server, script: Path, workdir: Path, *, resume: bool, reports: int) -> AppRunner:
    """One run of a one-trial search, stopped (as Ctrl-C would) once it has reported ``reports`` times."""
    adapter = BracketTuner({"lr": [0.1]}, [[Rung(1, 10_000)]], iter_time=0.05)
    cred = workdir / "cred"
    token = None if cred.exists() else await AppRunner.token(target(server), "rerun", ADMIN)
    runner = await AppRunner.create(adapter, [PY, str(script)], app="rerun", arbiter=target(server), token=token,
                                    credential_file=cred, workdir=str(workdir), cluster="test-8",
                                    grace_s=5.0, env={"PYTHONPATH": str(ROOT)}, resume=resume, quiet=True)
    task = asyncio.create_task(runner.run(timeout=60))
    await wait_for(lambda: len(runner.reports) >= reports, 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return runner


def test_a_rerun_in_the_same_workdir_starts_afresh_and_an_explicit_resume_goes_on(tmp_path):
    script, workdir = counter(tmp_path), tmp_path / "work"
    workdir.mkdir()

    async def scenario():
        async with arbiter(tmp_path, cluster=str(cluster_file(tmp_path))) as server:
            first = await interrupted_run(server, script, workdir, resume=False, reports=5)
            second = await interrupted_run(server, script, workdir, resume=False, reports=3)
            third = await interrupted_run(server, script, workdir, resume=True, reports=2)
            return first, second, third

    first, second, third = asyncio.run(asyncio.wait_for(scenario(), 120))
    one, two, three = (r.launcher.history for r in (first, second, third))
    assert one[-1].last_iteration >= 5 and Path(first.launcher.checkpoint_path("t0")).exists()
    # the rerun: another run id, its own folder, and t0 started at iteration 1 without a checkpoint
    assert second.search_run.run_id != first.search_run.run_id and not second.search_run.resumed
    assert not two[0].resumed and two[0].first_iteration == 1
    assert second.launcher.checkpoint_path("t0") != first.launcher.checkpoint_path("t0")
    # the explicit resume: the second run's id (the one recorded), t0 from its checkpoint
    assert third.search_run.run_id == second.search_run.run_id and third.search_run.resumed
    assert three[0].resumed and three[0].first_iteration == two[-1].last_iteration + 1
    assert json.loads((workdir / RUN_FILE).read_text())["run"] == second.search_run.run_id


def test_a_job_refuses_a_checkpoint_another_trial_wrote(tmp_path):
    script = counter(tmp_path)
    search = SearchRun.begin(tmp_path / "work")
    launcher = Launcher("a", [PY, str(script)], tmp_path / "work", run_id=search.run_id, env={"PYTHONPATH": str(ROOT)})
    path = launcher.checkpoint_path("t0")
    # what a trial with other hyperparameters left at the same path
    Job(app="a", job_id="t0", run=search.run_id, params={"lr": 0.5}, checkpoint=path,
        handle_sigterm=False).save({"iteration": 27})
    launcher.start(TrialSpec("t0", {"lr": 0.1}), ["r0-m0-g0"])
    polled = asyncio.run(launcher.wait("t0", timeout=30))
    ended = polled.exited[0]
    assert ended.resumed and ended.returncode != 0 and ended.reports == 0
    log = launcher.log_path("t0").read_text()
    assert "CheckpointMismatch: refusing the checkpoint" in log and '"lr":0.5' in log and '"lr":0.1' in log
    # its own checkpoint (same run, job and hyperparameters) is taken
    Job(app="a", job_id="t0", run=search.run_id, params={"lr": 0.1}, checkpoint=path,
        handle_sigterm=False).save({"iteration": 27})
    run = launcher.start(TrialSpec("t0", {"lr": 0.1}), ["r0-m0-g0"])
    assert run.resumed and asyncio.run(first_report_then_stop(launcher, "t0")) == 28


async def first_report_then_stop(launcher: Launcher, job: str) -> float:
    async def report() -> float:
        while not (got := launcher.poll()).metrics:
            await asyncio.sleep(0.02)
        return float(got.metrics[0][1]["iteration"])

    try:
        return await asyncio.wait_for(report(), 30)
    finally:
        await launcher.shutdown(5)


def test_resume_needs_a_run_to_resume(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"nothing to resume in {tmp_path}"):
        SearchRun.begin(tmp_path, resume=True)
    first = SearchRun.begin(tmp_path)
    assert SearchRun.begin(tmp_path, resume=True).run_id == first.run_id
    assert SearchRun.begin(tmp_path).run_id != first.run_id


def test_resume_skips_a_later_run_that_never_started_a_job(tmp_path):
    """A run that failed before any job (bad token, arbiter down) must not hide the interrupted run
    that ``resume`` should go on with."""
    from agent.search_run import SearchRun

    interrupted = SearchRun.begin(tmp_path)
    (interrupted.folder / "trial-0").mkdir()
    SearchRun.begin(tmp_path)  # recorded as the latest run, but it never started a job
    resumed = SearchRun.begin(tmp_path, resume=True)
    assert resumed.run_id == interrupted.run_id and resumed.resumed


def test_resume_skips_a_later_run_whose_agent_never_got_in(tmp_path):
    """A new run whose agent the arbiter refused (or never answered) started no job, but its runner
    still closed its record: ``record.jsonl`` and the plot in the run's folder. That folder counted as
    a run that had started, so ``resume`` went on with it instead of the interrupted run: every trial
    started over from scratch, the interrupted run's checkpoints left behind."""
    script, workdir = counter(tmp_path), tmp_path / "work"
    workdir.mkdir()

    async def scenario():
        async with arbiter(tmp_path, cluster=str(cluster_file(tmp_path))) as server:
            first = await interrupted_run(server, script, workdir, resume=False, reports=3)
            adapter = BracketTuner({"lr": [0.1]}, [[Rung(1, 10_000)]], iter_time=0.05)
            refused = await AppRunner.create(adapter, [PY, str(script)], app="rerun", arbiter=target(server),
                                             credential="not-a-credential", workdir=str(workdir), cluster="test-8",
                                             quiet=True)
            with pytest.raises(AgentStopped, match="refused"):
                await refused.run(timeout=60)
            third = await interrupted_run(server, script, workdir, resume=True, reports=2)
            return first, refused, third

    first, refused, third = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert not refused.launcher.starts and any(refused.launcher.run_dir.iterdir())  # its record, no job
    assert third.search_run.run_id == first.search_run.run_id
    one, three = first.launcher.history, third.launcher.history
    assert three[0].resumed and three[0].first_iteration == one[-1].last_iteration + 1


def test_what_jobs_report_on_their_way_out_reaches_the_tuner(tmp_path):
    """A run that stops (Ctrl-C, a timeout) SIGTERMs its jobs; each finishes its iteration, reports it
    and saves it in its checkpoint. The runner read those last reports while it waited for the jobs
    and dropped them: the study's trial ended a step short of its checkpoint, so a resumed search had
    a gap in its curve (and a trial that reached its last iteration then stayed RUNNING, its result lost)."""
    import optuna
    from optuna.distributions import FloatDistribution

    from hyperparam_adapters.optuna_adapter import OptunaAdapter

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    script, workdir = counter(tmp_path), tmp_path / "work"

    async def scenario():
        async with arbiter(tmp_path, cluster=str(cluster_file(tmp_path))) as server:
            study = optuna.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 'study.db'}",
                                        pruner=optuna.pruners.MedianPruner(n_startup_trials=100))
            adapter = OptunaAdapter(study, n_trials=1, max_resource=10_000, search_space={
                "lr": FloatDistribution(1e-3, 1e-1, log=True)})
            runner = await AppRunner.create(adapter, [PY, str(script)], app="outgoing", arbiter=target(server),
                                            token=await AppRunner.token(target(server), "outgoing", ADMIN),
                                            workdir=str(workdir), cluster="test-8", grace_s=5.0,
                                            env={"PYTHONPATH": str(ROOT)}, quiet=True)
            task = asyncio.create_task(runner.run(timeout=60))
            await wait_for(lambda: len(runner.reports) >= 3, 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return runner, study

    runner, study = asyncio.run(asyncio.wait_for(scenario(), 120))
    run = runner.launcher.history[-1]
    assert run.requested and run.clean  # stopped by the shutdown; checkpointed and left
    checkpoint = pickle.loads(runner.launcher.checkpoint_path("trial-0").read_bytes())["state"]["iteration"]
    assert checkpoint == run.last_iteration == max(r.iteration for r in runner.reports)
    assert study.trials[0].last_step + 1 == checkpoint
