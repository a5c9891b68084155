"""The Ray Tune adapter: Tune's own searchers and trial schedulers (ASHA, HyperBand) decide, Themis runs.

Unit tests drive real Tune objects (``ASHAScheduler``, ``HyperBandScheduler``, ``BasicVariantGenerator``,
``OptunaSearch``, a ``Searcher`` subclass as users write them) through ``TuneAdapter``; no Ray runtime
is started. The end-to-end tests run a real arbiter on loopback with real agents and real training
processes: the example at its test budget, an interrupted ASHA + OptunaSearch search resumed from its
journal, and HyperBand pausing a trial at its rung and resuming it from its checkpoint.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import math
import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import optuna
import pytest
from ray import tune
from ray.tune.schedulers import (
    ASHAScheduler,
    HyperBandForBOHB,
    HyperBandScheduler,
    MedianStoppingRule,
    PopulationBasedTraining,
    ResourceChangingScheduler,
)
from ray.tune.search import ConcurrencyLimiter, Searcher
from ray.tune.search.optuna import OptunaSearch

from agent.appsched import CurveStoppingScheduler
from agent.run_record import JOURNAL, RECORD, TunerJournal
from agent.runner import AppRunner
from hyperparam_adapters.ray_tune import (
    Rungs,
    TuneAdapter,
    asha_decisions_ahead,
    hyperband_decisions_ahead,
    scheduler_settings,
)
from tests.service_kit import ADMIN, arbiter, cluster_file, target, wait_for

optuna.logging.set_verbosity(optuna.logging.WARNING)

PY = sys.executable
ROOT = Path(__file__).resolve().parents[1]
SPACE = {"lr": tune.loguniform(1e-4, 1.0)}


def config(scheduler=None, *, num_samples=6, parallel=3, search_alg=None, **kw) -> tune.TuneConfig:
    return tune.TuneConfig(metric="loss", mode="min", num_samples=num_samples, max_concurrent_trials=parallel,
                           scheduler=scheduler, search_alg=search_alg, **kw)


def asha(**kw) -> ASHAScheduler:
    """Rungs at 1, 3 and 9 iterations; the worst two thirds at a rung stop."""
    return ASHAScheduler(max_t=9, grace_period=1, reduction_factor=3, **kw)


def asha_app(num_samples=6, parallel=3, space=SPACE, **kw) -> TuneAdapter:
    return TuneAdapter(space, config(asha(), num_samples=num_samples, parallel=parallel), iter_time_serial=10.0, **kw)


def running(app: TuneAdapter) -> list[str]:
    return [s.job_id for s in app.runnable()]


# ---------------------------------------------------------------------------------------------- Tune internals


def test_scheduler_settings_match_the_installed_tune():
    """Guards the private Tune attributes the estimate reads (Tune has no public getters)."""
    two = ASHAScheduler(max_t=9, grace_period=1, reduction_factor=3, brackets=2)
    two.set_search_properties("loss", "min")
    assert scheduler_settings(two) == {"kind": "asha", "time_attr": "training_iteration", "mode": "min", "max_t": 9,
                                       "reduction_factor": 3.0, "brackets": [(9.0, 3.0, 1.0), (9.0, 3.0)]}
    hb = HyperBandScheduler(max_t=9, reduction_factor=3, metric="loss", mode="min")
    assert scheduler_settings(hb) == {"kind": "hyperband", "time_attr": "training_iteration", "mode": "min",
                                      "max_t": 9, "eta": 3.0, "s_max_1": 3}
    median = MedianStoppingRule(metric="loss", mode="min")
    assert scheduler_settings(median)["kind"] == "median" and scheduler_settings(median)["time_attr"] == "time_total_s"
    # a trial's decisions still ahead, as Tune records them
    app = asha_app()
    trial = app.tune_trial("trial-0")
    assert asha_decisions_ahead(app.scheduler, trial) == (1.0, 3.0, 9.0)
    app.observe("trial-0", 1, 1.0)
    assert asha_decisions_ahead(app.scheduler, trial) == (3.0, 9.0)
    hb_app = TuneAdapter(SPACE, config(HyperBandScheduler(max_t=9, reduction_factor=3), num_samples=12, parallel=12))
    # Tune fills the brackets s = 0 (3 trials, 9 iterations), s = 1 (5 trials from 3), s = 2 (from 1)
    assert hyperband_decisions_ahead(hb_app.scheduler, hb_app.tune_trial("trial-0")) == ((9,), ())
    assert hyperband_decisions_ahead(hb_app.scheduler, hb_app.tune_trial("trial-3")) == ((3, 9), (2 / 5,))
    assert hyperband_decisions_ahead(hb_app.scheduler, hb_app.tune_trial("trial-8")) == ((1, 3, 9), (3 / 9, 1 / 3))


# ---------------------------------------------------------------------------------------------- decisions


def test_asha_stops_the_bad_trials_and_a_new_trial_takes_the_lane():
    app = asha_app(num_samples=6, parallel=3)
    assert isinstance(app, CurveStoppingScheduler)
    assert running(app) == ["trial-0", "trial-1", "trial-2"] and app.demand_now() == 3 and app.demand_max() == 3
    spec = app.runnable()[0]
    assert (spec.start_iteration, spec.target_iteration) == (0, 9) and 1e-4 <= spec.params["lr"] <= 1.0
    assert app.observe("trial-0", 1, 1.0) == []  # the first at a rung goes on
    assert app.observe("trial-1", 1, 5.0) == ["trial-1"]  # below the rung's cutoff: stopped
    assert app.status("trial-1") == "TERMINATED" and app.outcome("trial-1") == "pruned"
    assert running(app) == ["trial-0", "trial-2", "trial-3"]  # the lane it freed runs the next trial
    assert app.observe("trial-2", 1, 0.5) == []
    assert app.observe("trial-1", 2, 4.0) == ["trial-1"]  # a late report: stop it again, Tune untouched
    for it in (2, 3):
        assert app.observe("trial-0", it, 1.0 / it) == []
    assert app.observe("trial-2", 2, 0.9) == [] and app.observe("trial-2", 3, 0.8) == ["trial-2"]  # rung 3
    for it in range(4, 9):
        assert app.observe("trial-0", it, 1.0 / it) == []
    assert app.observe("trial-0", 9, 0.1) == ["trial-0"]  # ASHA's max_t: completed
    assert app.outcome("trial-0") == "completed" and app.trials_decided() == 3
    best = app.best()
    assert (best.job_id, best.loss, best.iteration) == ("trial-0", 0.1, 9.0)
    assert app.last_result("trial-2") == (3.0, 0.8)
    with pytest.raises(KeyError):
        app.observe("trial-99", 1, 1.0)
    with pytest.raises(ValueError, match="whole number"):
        app.observe("trial-3", 1.5, 1.0)


class RecordingSearcher(Searcher):
    """A user's own Tune searcher (random, seeded) that keeps what Tune tells it."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.rng = random.Random(seed)
        self.suggested: dict[str, dict] = {}
        self.results: list[tuple[str, int, float]] = []
        self.completed: dict[str, tuple[tuple[int, float] | None, bool]] = {}

    def suggest(self, trial_id: str):
        self.suggested[trial_id] = {"lr": self.rng.uniform(0.1, 1.0)}
        return self.suggested[trial_id]

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        self.results.append((trial_id, result["training_iteration"], result["loss"]))

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        self.completed[trial_id] = ((result["training_iteration"], result["loss"]) if result else None, error)


def test_the_searcher_sees_results_completions_and_errors():
    searcher = RecordingSearcher()
    app = TuneAdapter({}, config(asha(), search_alg=searcher, num_samples=5, parallel=2))
    assert isinstance(app.search_alg.searcher, ConcurrencyLimiter)  # as tune.Tuner wraps it
    assert app.search_alg.searcher.max_concurrent == 2
    tid = {job: app.tune_trial(job).trial_id for job in app.trials()}
    assert running(app) == ["trial-0", "trial-1"] and app.trial_params("trial-0") == searcher.suggested[tid["trial-0"]]
    app.observe("trial-0", 1, 1.0)
    assert app.observe("trial-1", 1, 3.0) == ["trial-1"]  # stopped by ASHA
    # Tune's rule: the searcher hears every result but a stopping one, and every end with its last result
    assert searcher.results == [(tid["trial-0"], 1, 1.0)]
    assert searcher.completed == {tid["trial-1"]: ((1, 3.0), False)}
    tid.update({job: app.tune_trial(job).trial_id for job in app.trials()})
    assert running(app) == ["trial-0", "trial-2"]
    assert app.fail("trial-2") == []  # the runner gave up on its job
    assert app.status("trial-2") == "ERROR" and app.outcome("trial-2") == "failed"
    assert searcher.completed[tid["trial-2"]] == (None, True)
    for it in range(2, 10):
        app.observe("trial-0", it, 1.0 / it)
    assert searcher.completed[tid["trial-0"]] == ((9, 1.0 / 9), False)
    assert (tid["trial-0"], 8, 1.0 / 8) in searcher.results and (tid["trial-0"], 9, 1.0 / 9) not in searcher.results
    while not app.finished():
        for spec in app.runnable():
            app.observe(spec.job_id, spec.start_iteration + 1, 0.5)
    assert len(searcher.suggested) == 5 and app.trials_planned() == 5
    assert set(searcher.completed) == set(searcher.suggested)  # every trial's end reached the searcher


def test_hyperband_pauses_a_trial_at_its_rung_and_runs_it_again_from_there():
    """Tune's synchronous HyperBand: a trial that reaches its rung first is PAUSED (its job stops) until
    the bracket's last trial gets there; then the best go on from the rung, the rest stop."""
    app = TuneAdapter(SPACE, config(HyperBandScheduler(max_t=4, reduction_factor=2), num_samples=6, parallel=6))
    assert running(app) == [f"trial-{k}" for k in range(6)]
    # trials 3, 4, 5 form the bracket that runs 3 trials to 2 iterations and keeps 2
    assert hyperband_decisions_ahead(app.scheduler, app.tune_trial("trial-3")) == ((2, 4), (2 / 3,))
    for job, loss in (("trial-3", 1.0), ("trial-4", 2.0)):
        assert app.observe(job, 1, loss) == []
        assert app.observe(job, 2, loss) == [job]
        assert app.status(job) == "PAUSED" and app.outcome(job) == "paused" and job not in running(app)
    assert app.demand_now() == 4
    assert app.observe("trial-5", 1, 3.0) == []
    assert app.observe("trial-5", 2, 3.0) == ["trial-5"]  # the rung is decided: the worst stops
    assert app.outcome("trial-5") == "pruned"
    specs = {s.job_id: s for s in app.runnable()}
    assert specs["trial-3"].start_iteration == 2 and specs["trial-4"].start_iteration == 2  # from their checkpoints
    assert app.status("trial-3") == "RUNNING" and app.outcome("trial-3") is None
    assert app.observe("trial-3", 3, 0.5) == [] and app.observe("trial-3", 4, 0.4) == ["trial-3"]
    assert app.outcome("trial-3") == "completed"


def test_a_seeded_search_replays_from_its_journal(tmp_path):
    """What a resumed run does (``AppRunner.create(resume=True)``): a new adapter built the same way
    replays the journal through Tune (OptunaSearch suggesting, ASHA of two brackets drawing from NumPy's
    global generator) and comes back to the same trials, configurations, decisions and best."""

    def build(seed=0):
        return TuneAdapter(SPACE, config(ASHAScheduler(max_t=9, grace_period=1, reduction_factor=3, brackets=2),
                                         search_alg=OptunaSearch(seed=seed), num_samples=8, parallel=3))

    def state(app):
        return {j: (app.status(j), app.last_result(j), app.trial_params(j)) for j in app.trials()}

    journal = TunerJournal(tmp_path / JOURNAL)
    first = build()
    first.journal = journal
    np.random.seed(7)
    before = np.random.get_state()[1].copy()
    rng = random.Random(1)
    for step in range(14):
        spec = first.runnable()[step % len(first.runnable())]
        if step == 5:
            first.fail(spec.job_id)
            continue
        first.observe(spec.job_id, spec.start_iteration + 1, spec.params["lr"] * rng.uniform(1, 2), 0.1)
    assert (np.random.get_state()[1] == before).all()  # the global generator is the user's, untouched
    assert any(first.outcome(j) == "pruned" for j in first.trials())
    again = build()
    again.journal = journal
    assert again.resume() == running(first)
    assert state(again) == state(first) and again.best() == first.best()
    assert len(journal.read()) == 14  # the replay is not journaled again
    spec = first.runnable()[0]
    assert again.observe(spec.job_id, spec.start_iteration + 1, 9.0) == first.observe(spec.job_id,
                                                                                        spec.start_iteration + 1, 9.0)
    assert state(again) == state(first)
    other = build(seed=1)
    other.journal = journal
    with pytest.raises(ValueError, match="trial trial-0 had the hyperparameters .* there and draws"):
        other.resume()


# ---------------------------------------------------------------------------------------------- the estimate


def test_the_asha_estimate_matches_hand_computation_and_falls_to_zero():
    """A fresh trial expects 1 + 2/3 + 6/9 = 7/3 iterations (rungs at 1, 3, 9 keep a third each); six
    trials at 10 s: 140 GPU-s. A trial that passed rung 1 expects (3 - 1) + 6/3 = 4 more."""
    app = asha_app(num_samples=6, parallel=3)
    assert app.expected_iterations_left(None) == pytest.approx(7 / 3)
    assert app.work_left() == pytest.approx(140.0) and app.budget() == pytest.approx(140.0)
    lanes = app.jobs_remaining(())
    assert [j.job_id for j in lanes] == ["trial-0", "trial-1", "trial-2"]
    assert sum(j.iters_remaining * j.iter_time_serial for j in lanes) == pytest.approx(140.0)
    app.observe("trial-0", 1, 1.0, iter_time_s=10.0)
    assert app.expected_iterations_left("trial-0", 1) == pytest.approx(4.0)
    assert app.work_left() == pytest.approx(140.0 - 70 / 3 + 40.0)
    rng = random.Random(3)
    quality: dict[str, float] = {}
    history = [app.budget()]
    while not app.finished():
        for spec in app.runnable():
            quality.setdefault(spec.job_id, rng.uniform(0.5, 2.0))
            it = spec.start_iteration + 1
            app.observe(spec.job_id, it, quality[spec.job_id] / it, iter_time_s=10.0)
            history.append(app.budget())
    assert app.work_left() == 0.0 and app.jobs_remaining(()) == [] and app.demand_now() == 0
    assert app.budget() == pytest.approx(app.work_done()) and all(b > 0 for b in history)
    assert app.trials_decided() == 6 and app.trials_planned() == 6
    assert app.pessimistic is False
    assert asha_app(pessimistic=True).work_left() == pytest.approx(6 * 9 * 10.0)


def test_hyperband_and_median_estimates():
    """HyperBand (max_t 9, eta 3): brackets of 3 trials x 9, 5 from 3 keeping 2, 9 from 1 keeping 3
    then 1: 9, 3 + 0.4 x 6 = 5.4 and 1 + 2/3 + 6/9 = 7/3 iterations, weighted by size: 75/17. Without
    rungs: the decided trials' mean length beyond d, the full length before any."""
    hb = TuneAdapter(SPACE, config(HyperBandScheduler(max_t=9, reduction_factor=3), num_samples=20, parallel=4))
    assert hb.expected_iterations_left(None) == pytest.approx(75 / 17)
    assert hb.expected_iterations_left("trial-0") == pytest.approx(9.0)
    assert Rungs((3.0, 9.0), (0.4,)).expected_left(0) == pytest.approx(5.4)
    assert Rungs((3.0, 9.0), (0.4,)).expected_left(3) == pytest.approx(2.4)  # paused at the rung: undecided
    fifo = TuneAdapter(SPACE, config(num_samples=4, parallel=2), max_iterations=4)
    assert fifo.expected_iterations_left(None) == 4.0
    for it in range(1, 5):
        fifo.observe("trial-0", it, 1.0)
    fifo.observe("trial-1", 1, 1.0)
    fifo.fail("trial-1")
    assert fifo.expected_iterations_left(None) == pytest.approx(2.5)  # lengths 4 and 1
    assert fifo.expected_iterations_left(None, 1) == pytest.approx(3.0)


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("make, error, match", [
    (lambda: config(asha(), parallel=None), ValueError, "max_concurrent_trials=N"),
    (lambda: tune.TuneConfig(metric="loss", mode="max", num_samples=2, max_concurrent_trials=1, scheduler=asha()),
     ValueError, "must be minimised"),
    (lambda: tune.TuneConfig(num_samples=2, max_concurrent_trials=1, scheduler=asha(metric="loss", mode="min")),
     None, None),
    (lambda: tune.TuneConfig(mode="min", num_samples=2, max_concurrent_trials=1), ValueError, "name the metric"),
    (lambda: config(asha(), num_samples=-1), ValueError, "num_samples must be an int >= 1"),
    (lambda: config(asha(), time_budget_s=60), ValueError, "time_budget_s"),
    (lambda: config(PopulationBasedTraining(hyperparam_mutations={"lr": [0.1, 0.2]})), TypeError, "copies checkpoints between trials"),
    (lambda: config(HyperBandForBOHB(max_t=9)), TypeError, "HyperBandForBOHB"),
    (lambda: config(ResourceChangingScheduler(asha())), TypeError, "the arbiter decides"),
    (lambda: config(ASHAScheduler(time_attr="time_total_s", max_t=60)), ValueError, "rungs must be in iterations"),
    (lambda: config(None), ValueError, "give max_iterations="),
    (lambda: config(asha(metric="loss", mode="min")), ValueError, "give them in one place"),
    (lambda: config("asha"), TypeError, "not by name"),
])
def test_bad_configurations_are_refused_with_what_to_change(make, error, match):
    if error is None:  # metric and mode on the scheduler only: accepted, as by tune.Tuner
        assert TuneAdapter(SPACE, make()).metric == "loss"
        return
    with pytest.raises(error, match=match):
        TuneAdapter(SPACE, make())


def test_max_iterations_and_config_values():
    with pytest.raises(ValueError, match="past the scheduler's max_t 9"):
        TuneAdapter(SPACE, config(asha()), max_iterations=10)
    assert TuneAdapter(SPACE, config(asha()), max_iterations=5).runnable()[0].target_iteration == 5
    space = {"opt": {"lr": tune.uniform(0.1, 1.0), "steps": tune.randint(1, 5)}, "layers": [1, 2], "name": "mlp"}
    params = TuneAdapter(space, config(asha())).runnable()[0].params
    assert json.loads(json.dumps(params)) == params and isinstance(params["opt"]["steps"], int)
    assert params["layers"] == [1, 2] and params["name"] == "mlp"
    with pytest.raises(ValueError, match=r"config value config.model = .*object.* cannot go to a training process"):
        TuneAdapter({"model": object()}, config(asha()))
    with pytest.raises(TypeError, match="TuneConfig"):
        TuneAdapter(SPACE, {"metric": "loss"})  # type: ignore[arg-type]
    # a searcher with its own space: param_space may add constants, not a second space
    own = {"lr": optuna.distributions.FloatDistribution(0.1, 1.0)}
    with pytest.raises(ValueError, match="keep the domains in one of the two"):
        TuneAdapter(SPACE, config(asha(), search_alg=OptunaSearch(space=own, metric="loss", mode="min")))
    app = TuneAdapter({"epochs": 3}, config(asha(), search_alg=OptunaSearch(space=own, metric="loss", mode="min")))
    assert app.runnable()[0].params["epochs"] == 3 and 0.1 <= app.runnable()[0].params["lr"] <= 1.0


# ---------------------------------------------------------------------------------------------- the docs


def tune_section() -> str:
    text = (ROOT / "docs" / "agents.md").read_text()
    start = text.index("\n## Ray Tune\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def changed_lines(before: str, after: str) -> tuple[int, int]:
    """(added or changed, removed) code lines from ``before`` to ``after``: blank lines, comments and
    lines that only move (an import from the trainable's file to the search's) not counted."""
    diff = [line for line in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]

    def code(line: str) -> bool:
        return bool(line[1:].strip()) and not line[1:].strip().startswith("#")

    removed = [line[1:] for line in diff if line[0] == "-" and code(line)]
    added = [line[1:] for line in diff if line[0] == "+" and code(line)]
    moved = [line for line in removed if line in added]
    return len(added) - len(moved), len(removed) - len(moved)


def test_the_docs_tune_search_wraps_in_under_30_changed_lines(tmp_path):
    """The goal (an ASHA search wrapped in under 30 changed lines), measured on what docs/agents.md
    shows: the plain ``tune.Tuner`` script against the Themis one (the training script, then the
    search); the count the docs state is this one. The doc's training script runs as written (by hand:
    no launcher, nothing reported)."""
    blocks = {b.split("\n", 1)[0]: b for b in re.findall(r"```python\n(.*?)```", tune_section(), re.S)}
    plain = next(b for name, b in blocks.items() if name.startswith("# tune_digits.py"))
    train = next(b for name, b in blocks.items() if name.startswith("# train.py"))
    search = next(b for name, b in blocks.items() if name.startswith("# search.py"))
    added, removed = changed_lines(plain, train + search)
    assert added + removed < 30
    assert f"{added + removed} lines: {added} added or changed, {removed} removed" in " ".join(tune_section().split())
    for name, source in (("plain", plain), ("train", train), ("search", search)):
        compile(source, name, "exec")
    script = tmp_path / "train.py"
    script.write_text(train)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "THEMIS_TARGET_ITERATION": "2", "OMP_NUM_THREADS": "1",
           "THEMIS_PARAMS": json.dumps({"hidden": 16, "lr": 0.01, "alpha": 1e-4, "batch": 64})}
    done = subprocess.run([PY, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


# ---------------------------------------------------------------------------------------------- end to end


def test_the_tune_example_runs_end_to_end_against_a_real_arbiter(tmp_path):
    """``examples/tune_search.py`` at its test budget: its own arbiter, Tune's random search and ASHA
    deciding, real training processes (``examples/train_digits.py``) on the leased "GPUs"."""
    out, work = tmp_path / "summary.json", tmp_path / "work"
    done = subprocess.run([PY, str(ROOT / "examples" / "tune_search.py"), "--budget", "test", "--workdir", str(work),
                           "--json", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "best: trial-" in done.stdout
    summary = json.loads(out.read_text())
    assert summary["finished"] and not summary["failed_jobs"] and summary["jobs"] == 8
    assert sum(summary["trials"].values()) == 8 and summary["trials"].get("pruned", 0) >= 1  # ASHA stopped some
    assert summary["trials"].get("completed", 0) >= 1  # and let the best run to max_t
    assert summary["best"]["accuracy"] > 0.9 and summary["best"]["iteration"] <= 9
    assert set(summary["best"]["params"]) == {"solver", "hidden", "lr", "alpha", "batch", "epochs"}
    pruned = [j for j, n in summary["iterations"].items() if n < 9]
    assert pruned and all(summary["iterations"][j] in (1, 3) for j in pruned)  # stopped at a rung (1, 3)
    loud = " ".join(done.stderr.split())
    assert "tune-asha: granted r0-m" in loud and "result: loss" in loud and "8/8 trials" in loud
    run_dir = Path(summary["run_dir"])
    records = [json.loads(line) for line in (run_dir / RECORD).read_text().splitlines()]
    last = {r["job"]: r for r in records if r["what"] == "trial"}
    assert set(last) == {f"trial-{k}" for k in range(8)}
    assert {r["outcome"] for r in last.values()} <= {"pruned", "completed"}
    assert (run_dir / JOURNAL).exists() and (run_dir / "rho_gpus.png").exists()


# the docs' training template: an iteration takes params["delay"] s and a stop request cuts it short;
# every iteration trained is appended to trained.txt in the job's folder
TRAIN = textwrap.dedent("""
    import os, time
    from pathlib import Path
    from agent.job import Job

    job = Job.from_env()
    state = job.resume() or {"iteration": 0}
    it = state["iteration"]
    trained = Path(os.environ["THEMIS_CHECKPOINT"]).parent / "trained.txt"
    p = job.params.get("p", job.params)

    def work(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if job.stop_requested:
                return False
            time.sleep(0.01)
        return True

    while not job.should_stop(it):
        if not work(p["delay"]):
            break
        it += 1
        with open(trained, "a") as f:
            f.write(f"{it}\\n")
        job.step(it, p["lr"] * (1 + 1 / it))
    job.save({"iteration": it})
""")


async def runner_for(server, adapter, app: str, script: Path, workdir: Path, *, resume: bool = False) -> AppRunner:
    cred = workdir.parent / f"{app}.cred"
    token = None if cred.exists() else await AppRunner.token(target(server), app, ADMIN)
    return await AppRunner.create(adapter, [PY, str(script)], app=app, arbiter=target(server), token=token,
                                  credential_file=cred, workdir=str(workdir), cluster="test-8", grace_s=5.0,
                                  env={"PYTHONPATH": str(ROOT)}, resume=resume, quiet=True)


def trained(run_dir: Path) -> dict[str, list[int]]:
    return {p.parent.name: [int(x) for x in p.read_text().split()] for p in run_dir.glob("*/trained.txt")}


def starts(runner: AppRunner) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for e in runner.events:
        if e["what"] == "start":
            out.setdefault(e["job"], []).append(e)
    return out


async def interrupt(task: asyncio.Task) -> None:
    """Stop a run as Ctrl-C does. Cancelled again until it stops: Python 3.11's ``asyncio.wait_for``
    (the runner's loop waits with it) loses a cancellation that arrives as its inner wait completes."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
    assert task.cancelled(), "the run ended by itself before it was interrupted"


def test_an_interrupted_asha_search_resumes_from_its_journal(tmp_path):
    """ASHA with Tune's OptunaSearch, interrupted (as Ctrl-C) once a trial is decided and another has
    passed rung 3 (its next decision, at 9, is reports away, so it is still running when the run has
    stopped); the resumed run replays the journal through new Tune objects, comes back to the same
    trials, never runs a decided trial again, goes on with the others from their checkpoints, and every
    iteration is trained once."""
    script, workdir = tmp_path / "train.py", tmp_path / "work"
    script.write_text(TRAIN)

    def build() -> TuneAdapter:
        return TuneAdapter({"lr": tune.uniform(0.1, 1.0), "delay": 0.2},
                           config(asha(), search_alg=OptunaSearch(seed=0), num_samples=8, parallel=2),
                           iter_time_serial=0.1)

    first, again = build(), build()

    def decided_and_part_way() -> bool:
        states = [(first.status(j), first.last_result(j)) for j in first.trials()]
        return (any(s == "TERMINATED" for s, _ in states)
                and any(s == "RUNNING" and r is not None and 3 <= r[0] <= 6 for s, r in states))

    def snapshot(app):
        return {j: (app.status(j), app.last_result(j), app.trial_params(j)) for j in app.trials()}

    async def scenario():
        async with arbiter(tmp_path, cluster=str(cluster_file(tmp_path))) as server:
            one = await runner_for(server, first, "asha", script, workdir)
            task = asyncio.create_task(one.run(timeout=120))
            await wait_for(lambda: decided_and_part_way() or task.done(), 120)
            assert not task.done(), "the search ended before a state to interrupt it in"
            await interrupt(task)
            at_interrupt = snapshot(first)
            two = await runner_for(server, again, "asha", script, workdir, resume=True)
            replayed = snapshot(again)
            await two.run(timeout=120)
            return one, two, at_interrupt, replayed

    one, two, at_interrupt, replayed = asyncio.run(asyncio.wait_for(scenario(), 300))
    run_dir = two.launcher.run_dir
    assert two.search_run.run_id == one.search_run.run_id and two.finished
    assert replayed == at_interrupt  # the same trials, configurations and decisions
    later = starts(two)
    for job, (status, last, _) in at_interrupt.items():
        if status == "TERMINATED":
            assert job not in later  # decided trials never run again
        elif job in later:
            assert later[job][0]["start_iteration"] == (last[0] if last else 0)  # from where it stopped
    went_on = [j for j, (status, last, _) in at_interrupt.items() if status == "RUNNING" and last is not None]
    assert went_on and all(later[j][0]["start_iteration"] >= 1 for j in went_on)
    assert {r["job"] for r in two.resumes} >= set(went_on)  # each from its checkpoint, not from scratch
    assert all(again.status(j) == "TERMINATED" for j in again.trials()) and len(again.trials()) == 8
    per_job = trained(run_dir)
    for job, its in per_job.items():
        assert its == list(range(1, len(its) + 1)), (job, its)  # every iteration trained once
        # a stopped job may finish the iteration it was in before the stop lands (its report is late)
        assert again.last_result(job)[0] <= its[-1] <= min(9, again.last_result(job)[0] + 1), (job, its)
    outcomes = {j: again.outcome(j) for j in again.trials()}
    assert set(outcomes.values()) <= {"pruned", "completed"} and "completed" in outcomes.values()
    last = {e["job"]: e for e in map(json.loads, (run_dir / RECORD).read_text().splitlines()) if e["what"] == "trial"}
    assert {j: e["outcome"] for j, e in last.items()} == outcomes


def test_hyperband_pauses_a_real_job_and_resumes_it_from_its_checkpoint(tmp_path):
    """Tune's HyperBand (max_t 4, eta 2) over six trials of a grid: trials 3-5 share the bracket that
    runs three trials to 2 iterations and keeps two. The first of them to get there is PAUSED: its
    job stops with a checkpoint, and when the rung is decided it starts again from iteration 2."""
    script, workdir = tmp_path / "train.py", tmp_path / "work"
    script.write_text(TRAIN)
    grid = [{"lr": lr, "delay": delay} for lr, delay in
            ((0.5, 0.05), (0.6, 0.05), (0.7, 0.05), (0.2, 0.05), (0.3, 0.05), (0.9, 0.8))]
    app = TuneAdapter({"p": tune.grid_search(grid)},
                      config(HyperBandScheduler(max_t=4, reduction_factor=2), num_samples=1, parallel=6),
                      iter_time_serial=0.1)
    assert [app.trial_params(j)["p"] for j in app.trials()] == grid

    async def scenario():
        async with arbiter(tmp_path, cluster=str(cluster_file(tmp_path))) as server:
            runner = await runner_for(server, app, "hb", script, workdir)
            return await runner.run(timeout=120)

    runner = asyncio.run(asyncio.wait_for(scenario(), 200))
    assert runner.finished and not runner.failed
    per_job = trained(runner.launcher.run_dir)
    for job, its in per_job.items():
        assert its == list(range(1, len(its) + 1)), (job, its)  # paused and resumed: no iteration twice
    records = [json.loads(line) for line in (runner.launcher.run_dir / RECORD).read_text().splitlines()]
    fates = {}
    for r in records:
        if r["what"] == "trial":
            fates.setdefault(r["job"], []).append(r["outcome"])
    paused = [j for j, f in fates.items() if f[0] == "paused"]
    assert paused and set(paused) <= {"trial-3", "trial-4", "trial-5"}
    runs = starts(runner)
    for job in paused:  # its job stopped at the rung; if kept, it ran again from its checkpoint at 2
        assert fates[job][-1] in ("completed", "pruned")
        if fates[job][-1] == "completed":
            # (later starts, if any, are the runner's: one GPU held and two trials to run, D3 packs)
            assert [r["start_iteration"] for r in runs[job][:2]] == [0, 2] and runs[job][1]["after"] == "tuner"
            assert all(r["resumed"] for r in runs[job][1:]) and per_job[job] == [1, 2, 3, 4]
    kept = [j for j in paused if fates[j][-1] == "completed"]
    assert kept and all(runner.launcher.history and j in {r["job"] for r in runner.resumes} for j in kept)
    assert {j: app.outcome(j) for j in app.trials()} == {j: f[-1] for j, f in fates.items()}
    assert sum(f[-1] == "pruned" for f in fates.values()) == 1  # the rung of three keeps two
    assert math.isclose(app.best().loss, 0.2 * 1.25)  # trial-3 (lr 0.2) completed: 0.2 (1 + 1/4)
