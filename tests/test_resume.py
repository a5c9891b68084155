"""Resume that resumes (issue 36, item 3).

A user's ``resume=True`` re-ran the whole Hyperband search, re-ran a finished one without a word, and
each trial resumed from a checkpoint already at its target trained one more iteration (28 of 27).
Here, with a real arbiter on loopback, real runners and real job processes that train as the docs'
template does: an interrupted search goes on from its tuner's journal (decided rungs stay decided,
stopped trials stay stopped, trials at their target are not trained again, every iteration is
trained once), a finished one is not resumed and says so, and a job whose checkpoint is at its
target trains nothing. Iterations are counted from what the jobs trained (one line per iteration in
their folders) and from the run's record.
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from collections import Counter
from pathlib import Path

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.pruners import MedianPruner
from optuna.trial import TrialState

from agent.job import Job
from agent.launcher import Launcher
from agent.run_record import JOURNAL, RECORD, TunerJournal
from agent.runner import AppRunner
from agent.search_run import RunFinished, SearchRun
from agent.trial import TrialSpec
from hyperparam_adapters.curve_stopping import CurveStoppingAdapter
from hyperparam_adapters.hyperband import HyperbandAdapter
from hyperparam_adapters.optuna_adapter import OptunaAdapter
from tests.service_kit import ADMIN, arbiter, cluster_file, target, wait_for

PY = sys.executable
ROOT = Path(__file__).resolve().parents[1]

# the training template of docs/agents.md: ask should_stop before training an iteration. An
# iteration takes params["delay"] s; a stop request during it cuts it short (it is not trained).
# Every iteration trained is appended to trained.txt in the job's folder.
TRAIN = textwrap.dedent("""
    import os, time
    from pathlib import Path
    from agent.job import Job

    job = Job.from_env()
    state = job.resume() or {"iteration": 0}
    it = state["iteration"]
    trained = Path(os.environ["THEMIS_CHECKPOINT"]).parent / "trained.txt"

    def work(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if job.stop_requested:
                return False
            time.sleep(0.01)
        return True

    while not job.should_stop(it):
        if not work(job.params["delay"]):
            break
        it += 1
        with open(trained, "a") as f:
            f.write(f"{it}\\n")
        job.step(it, job.params["lr"] * (1 + 1 / it))
    job.save({"iteration": it})
""")


def train_script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    return path


def replaying(params: list[dict]):
    """A sampler that draws ``params`` in order: the same draws in every run, as a seeded space gives."""
    draws = iter(params)
    return lambda rng: dict(next(draws))


async def runner_for(server, adapter, app: str, script: Path, workdir: Path, *, resume: bool) -> AppRunner:
    cred = workdir.parent / f"{app}.cred"
    token = None if cred.exists() else await AppRunner.token(target(server), app, ADMIN)
    return await AppRunner.create(adapter, [PY, str(script)], app=app, arbiter=target(server), token=token,
                                  credential_file=cred, workdir=str(workdir), cluster="test-8", grace_s=5.0,
                                  env={"PYTHONPATH": str(ROOT)}, resume=resume, quiet=True)


async def interrupt_when(runner: AppRunner, condition, timeout: float = 60) -> None:
    """Run until ``condition()`` holds, then stop the run as Ctrl-C would."""
    task = asyncio.create_task(runner.run(timeout=timeout))
    await wait_for(lambda: condition() or task.done(), timeout)
    assert not task.done(), "the search ended before the state to interrupt it in"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def trained(run_dir: Path) -> dict[str, list[int]]:
    """Per job, the iterations its processes trained, in order, over every run of the job."""
    return {p.parent.name: [int(x) for x in p.read_text().split()] for p in run_dir.glob("*/trained.txt")}


def record_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / RECORD).read_text().splitlines()]


def starts(runner: AppRunner) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for e in runner.events:
        if e["what"] == "start":
            out.setdefault(e["job"], []).append(e)
    return out


# ---------------------------------------------------------------------------------------------- Hyperband

# max_resource 4, eta 2: brackets (4 at 1, 2 at 2, 1 at 4), (3 at 2, 1 at 4), (3 at 4): 10 trials.
# Bracket 1 (t4, t5, t6): t4 is fast and the worst (it reaches its rung and waits for the rung's
# end, its checkpoint at its target), t5 and t6 are slow, so the run is interrupted mid-rung.
HB_PARAMS = ([{"lr": lr, "delay": 0.05} for lr in (0.4, 0.3, 0.2, 0.1)]
             + [{"lr": 0.9, "delay": 0.05}, {"lr": 0.5, "delay": 0.6}, {"lr": 0.6, "delay": 0.6}]
             + [{"lr": lr, "delay": 0.05} for lr in (0.7, 0.8, 0.35)])


def hyperband() -> HyperbandAdapter:
    return HyperbandAdapter(replaying(HB_PARAMS), max_resource=4, eta=2, iter_time=0.05)


def test_an_interrupted_hyperband_search_goes_on_and_a_finished_one_is_not_rerun(tmp_path):
    script, workdir = train_script(tmp_path), tmp_path / "work"
    first, again = hyperband(), hyperband()
    planned = sum(rung.count * more for _, rung, more in first._phases)  # iterations of the whole search

    def mid_bracket_1() -> bool:
        return (first.current_phase() == 4 and first.status("t4") == "paused"
                and first._trials["t5"].done >= 1)

    async def scenario():
        async with arbiter(tmp_path, cluster=str(cluster_file(tmp_path))) as server:
            one = await runner_for(server, first, "hb", script, workdir, resume=False)
            await interrupt_when(one, mid_bracket_1)
            at_interrupt = {j: (first.status(j), first._trials[j].done) for j in first.trials()}
            two = await runner_for(server, again, "hb", script, workdir, resume=True)
            replayed = {j: (again.status(j), again._trials[j].done) for j in again.trials()}
            await two.run(timeout=90)
            journal = (two.launcher.run_dir / JOURNAL).read_bytes()
            record = (two.launcher.run_dir / RECORD).read_bytes()
            with pytest.raises(RunFinished) as finished:
                await runner_for(server, hyperband(), "hb", script, workdir, resume=True)
            return one, two, at_interrupt, replayed, journal, record, finished.value

    one, two, at_interrupt, replayed, journal, record, finished = asyncio.run(asyncio.wait_for(scenario(), 180))
    run_dir = two.launcher.run_dir
    assert two.search_run.run_id == one.search_run.run_id and two.finished

    # the interruption came after bracket 0's three rungs were decided, t4 waiting at its target
    assert at_interrupt["t4"] == ("paused", 2.0) and at_interrupt["t5"][0] == "pending"
    assert [j for j, (state, _) in at_interrupt.items() if state == "finished"] == ["t3"]
    # the replay came back to the same state: rungs decided stay decided
    assert replayed == at_interrupt

    later = starts(two)
    for job, (state, done) in at_interrupt.items():
        if state in ("stopped", "finished", "paused"):
            # decided trials never run again; t4, at its rung's target, is not trained again
            assert job not in later, (job, state, later.get(job))
            assert again.status(job) == ("stopped" if job == "t4" else state)
    for job, runs in later.items():  # the others go on from where they stopped, to their rung
        assert runs[0]["start_iteration"] == at_interrupt.get(job, (None, 0.0))[1]
        assert all(r["target_iteration"] > r["start_iteration"] for r in runs)
    assert set(later) >= {"t5", "t7", "t8", "t9"}

    # iterations trained: each once, none past its target, exactly the search's plan in all
    per_job = trained(run_dir)
    for job, its in per_job.items():
        assert its == list(range(1, len(its) + 1)), (job, its)  # no iteration trained twice
        assert its[-1] <= 4 and its[-1] == again._trials[job].done
    assert sum(len(its) for its in per_job.values()) == planned == 28
    assert max(r.iteration for r in one.reports + two.reports) <= 4

    # the record: the interrupted run stopped, the resumed one finished; every trial's last line says
    # pruned or completed, at the iteration it trained to
    lines = record_lines(run_dir)
    ends = [e["what"] for e in lines if e["what"] in ("done", "stopped")]
    assert ends == ["stopped", "done"]
    last = {e["job"]: e for e in lines if e["what"] == "trial"}
    assert set(last) == set(again.trials())
    assert {j: e["outcome"] for j, e in last.items()} == {j: again.outcome(j) for j in again.trials()}
    assert Counter(e["outcome"] for e in last.values()) == Counter(completed=5, pruned=5)
    assert all(e["iteration"] == per_job[j][-1] for j, e in last.items())
    assert [e["outcome"] for e in lines if e.get("job") == "t4" and e["what"] == "trial"] == ["paused", "pruned"]

    # resuming the finished run: one line, nothing run, nothing written
    assert str(finished).startswith(f"run {one.search_run.run_id} finished at ")
    assert "nothing to resume" in str(finished) and "\n" not in str(finished)
    assert (run_dir / JOURNAL).read_bytes() == journal and (run_dir / RECORD).read_bytes() == record
    assert trained(run_dir) == per_job


# ---------------------------------------------------------------------------------------------- curve stopping

# c0 (fast) runs to the cap; c1 (slow) is interrupted two iterations into its curve and pruned after
# the resume once its curve says it cannot beat c0; c2 (the best) takes c0's slot and converges.
CURVE_PARAMS = [{"lr": 0.1, "delay": 0.05}, {"lr": 0.2, "delay": 0.5}, {"lr": 0.05, "delay": 0.2}]


def curves() -> CurveStoppingAdapter:
    return CurveStoppingAdapter(replaying(CURVE_PARAMS), max_trials=3, parallel=2, max_iterations=10,
                                tolerance=0.01, min_reports=4, iter_time=0.05)


def test_an_interrupted_curve_search_keeps_its_curves_and_a_finished_one_is_not_rerun(tmp_path):
    script, workdir = train_script(tmp_path), tmp_path / "work"
    first, again = curves(), curves()

    def c1_mid_curve() -> bool:
        return first.status("c0")[0] != "running" and first._trials["c1"].done >= 2

    async def scenario():
        async with arbiter(tmp_path, cluster=str(cluster_file(tmp_path))) as server:
            one = await runner_for(server, first, "curves", script, workdir, resume=False)
            await interrupt_when(one, c1_mid_curve)
            at_interrupt = {j: (first.status(j), list(first._trials[j].iterations)) for j in first.trials()}
            two = await runner_for(server, again, "curves", script, workdir, resume=True)
            replayed = {j: (again.status(j), list(again._trials[j].iterations)) for j in again.trials()}
            await two.run(timeout=90)
            with pytest.raises(RunFinished, match="finished at .*; nothing to resume"):
                await runner_for(server, curves(), "curves", script, workdir, resume=True)
            return one, two, at_interrupt, replayed

    one, two, at_interrupt, replayed = asyncio.run(asyncio.wait_for(scenario(), 180))
    run_dir = two.launcher.run_dir
    assert two.finished and replayed == at_interrupt  # every curve kept, every stop kept
    assert at_interrupt["c0"][0] == ("finished", "cap") and at_interrupt["c1"][0] == ("running", "")
    later = starts(two)
    assert "c0" not in later  # stopped stays stopped
    for job, runs in later.items():
        done = at_interrupt[job][1][-1] if job in at_interrupt and at_interrupt[job][1] else 0
        assert runs[0]["start_iteration"] == done  # from where its curve stopped
    assert again.status("c1") == ("stopped", "pruned") and again.status("c2")[0] == "finished"
    per_job = trained(run_dir)
    for job, its in per_job.items():
        assert its == list(range(1, len(its) + 1)), (job, its)  # each iteration trained once
        assert its[-1] <= 10 and again._trials[job].iterations == [float(i) for i in its]  # one curve, no gap
    last = {e["job"]: e for e in record_lines(run_dir) if e["what"] == "trial"}
    assert {j: e["outcome"] for j, e in last.items()} == {"c0": "completed", "c1": "pruned", "c2": "completed"}


# ---------------------------------------------------------------------------------------------- pieces


def test_a_job_whose_checkpoint_is_at_its_target_trains_nothing_and_says_its_result_again(tmp_path):
    """The user's trial 28 of 27: resumed from a checkpoint at its target, the template trained one more
    iteration. Now it trains none, and reports the checkpoint's result again (the tuner may not have
    heard it: the run ended as it was made), so the runner sees progress, not a failed run."""
    script = train_script(tmp_path)
    search = SearchRun.begin(tmp_path / "work")
    launcher = Launcher("a", [PY, str(script)], tmp_path / "work", run_id=search.run_id,
                        env={"PYTHONPATH": str(ROOT)})
    params = {"lr": 0.5, "delay": 0.01}
    earlier = Job(app="a", job_id="t0", run=search.run_id, params=params, target_iteration=27,
                  checkpoint=launcher.checkpoint_path("t0"), handle_sigterm=False)
    for it in range(1, 28):
        earlier.step(it, 0.5 * (1 + 1 / it), accuracy=0.9)
    earlier.save({"iteration": 27})
    launcher.start(TrialSpec("t0", params, start_iteration=0, target_iteration=27), ["r0-m0-g0"], [("r0", "m0", "s0")])
    polled = asyncio.run(launcher.wait("t0", timeout=30))
    (ended,) = polled.exited
    assert ended.resumed and ended.clean and ended.reports == 1
    (report,) = [payload for job, payload in polled.metrics if job == "t0"]
    assert report["iteration"] == 27 and report["loss"] == pytest.approx(0.5 * (1 + 1 / 27))
    assert report["extra"] == {"accuracy": 0.9}
    assert not (launcher.checkpoint_path("t0").parent / "trained.txt").exists()  # not one iteration trained


def test_a_resume_refuses_a_journal_of_another_search(tmp_path):
    """Another seed or space draws other hyperparameters for the same trial ids: their checkpoints are
    not this search's, and the replay would decide rungs from someone else's losses."""
    journal = TunerJournal(tmp_path / JOURNAL)
    first = hyperband()
    first.journal = journal
    first.observe("t0", 1, 0.5, 0.05)
    other = HyperbandAdapter(replaying([{"lr": 0.25, "delay": 0.05}] * 10), max_resource=4, eta=2)
    other.journal = journal
    with pytest.raises(ValueError, match="trial t0 had the hyperparameters .*0.4.* there and draws .*0.25"):
        other.resume()
    same = hyperband()
    same.journal = journal
    assert same.resume() == ["t1", "t2", "t3"] and same.status("t0") == "paused"
    assert len(journal.read()) == 1  # the replay is not journaled again


def test_a_run_kept_without_a_record_is_finished_when_its_replayed_tuner_is(tmp_path):
    """``record=False`` keeps no ``record.jsonl`` (no closing ``done`` line): the tuner's journal says
    the search is over."""
    search = SearchRun.begin(tmp_path)
    (search.folder / "t0").mkdir()
    adapter = HyperbandAdapter(replaying([{"lr": 0.1, "delay": 0}]), max_resource=1, eta=2)
    search.attach(adapter)
    adapter.observe("t0", 1, 0.2, 0.05)
    assert adapter.finished()
    again = SearchRun.begin(tmp_path, resume=True)
    with pytest.raises(RunFinished, match=f"run {search.run_id} has nothing left to run: its tuner finished at "):
        again.attach(HyperbandAdapter(replaying([{"lr": 0.1, "delay": 0}]), max_resource=1, eta=2))


def stored_study(storage: str, name: str) -> optuna.Study:
    return optuna.create_study(study_name=name, storage=storage, load_if_exists=True,
                               sampler=optuna.samplers.RandomSampler(seed=0),
                               pruner=MedianPruner(n_startup_trials=100))


def test_optuna_resume_completes_a_trial_at_its_target_and_a_finished_study_is_not_resumed(tmp_path):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage, space = f"sqlite:///{tmp_path / 'study.db'}", {"lr": FloatDistribution(1e-4, 1.0, log=True)}
    search = SearchRun.begin(tmp_path / "work")
    (search.folder / "trial-0").mkdir()
    first = OptunaAdapter(stored_study(storage, "s"), n_trials=2, max_resource=4, parallel=2, search_space=space)
    search.attach(first)
    assert [s.job_id for s in first.runnable()] == ["trial-0", "trial-1"]
    first.observe("trial-1", 1, 0.3)
    for it in range(1, 4):
        first.observe("trial-0", it, 0.2)
    first._running["trial-0"].report(0.1, 3)  # its last report reached the study, the run ended before the tell
    # the resumed run: trial-0 is done (COMPLETE, not started again), trial-1 goes on from iteration 1
    again = OptunaAdapter(stored_study(storage, "s"), n_trials=2, max_resource=4, parallel=2, search_space=space)
    assert SearchRun.begin(tmp_path / "work", resume=True).attach(again) == ["trial-1"]
    assert again.stopped() == {"trial-0": TrialState.COMPLETE} and again.outcome("trial-0") == "completed"
    assert stored_study(storage, "s").trials[0].value == 0.1
    assert [(s.job_id, s.start_iteration, s.target_iteration) for s in again.runnable()] == [("trial-1", 1, 4)]
    for it in range(2, 5):
        again.observe("trial-1", it, 0.25)
    assert again.finished()
    # every trial of the study asked and done: nothing to resume
    with pytest.raises(RunFinished, match="has nothing left to run"):
        SearchRun.begin(tmp_path / "work", resume=True).attach(
            OptunaAdapter(stored_study(storage, "s"), n_trials=2, max_resource=4, parallel=2, search_space=space))


def test_the_plot_of_a_resumed_run_covers_every_session(tmp_path):
    """Issue 36: after a resume, rho_gpus.png covered only the resumed part. The plot now reads the
    run's record.jsonl, which every session of the run appends to."""
    from agent.run_record import RunRecord, history

    first = RunRecord(tmp_path)
    first.write(100.0, "grant", gpus=["g0"], held=["g0"], reason=None, rho=2.0)
    first.write(101.0, "rho", rho=1.5, gpus=1)
    first.write(102.0, "stopped", best="-")
    second = RunRecord(tmp_path)  # the resumed session
    second.write(200.0, "grant", gpus=["g0", "g1"], held=["g0", "g1"], reason=None, rho=1.2)
    second.write(201.0, "rho", rho=None, gpus=0)
    second.write(202.0, "done", best="-")
    rho, held, start = history(tmp_path)
    assert start == 100.0
    assert [t for t, _ in rho] == [101.0, 201.0] and rho[1][1] == float("inf")
    assert held == [(100.0, 1), (102.0, 0), (200.0, 2), (202.0, 0)]


def test_the_progress_bar_knows_every_adapter_s_planned_trials():
    """Issue 36: the Hyperband bar read '49/? trials' (only Optuna said how many)."""
    from hyperparam_adapters.curve_stopping import CurveStoppingAdapter
    from hyperparam_adapters.hyperband import BracketTuner, Rung

    hyperband = BracketTuner({"lr": [0.1, 0.2, 0.3, 0.4]}, [[Rung(4, 1), Rung(2, 3), Rung(1, 9)], [Rung(2, 3), Rung(1, 9)]],
                             iter_time=0.05)
    assert hyperband.trials_planned() == 6 and hyperband.trials_decided() == 0
    curves = CurveStoppingAdapter(lambda rng: {"lr": rng.random()}, max_trials=7, parallel=2, max_iterations=10, tolerance=0.01,
                                  iter_time=0.05)
    assert curves.trials_planned() == 7 and curves.trials_decided() == 0
