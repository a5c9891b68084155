"""The Optuna adapter (issue 5): real Optuna studies (in-memory storage, seeded samplers) driven by
ask/tell through ``hyperparam_adapters.optuna_adapter.OptunaAdapter``, and its Figure 8 estimate
(curve stopping, D4) checked against hand-computed values."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.pruners import HyperbandPruner, MedianPruner, NopPruner, SuccessiveHalvingPruner
from optuna.trial import TrialState

from agent.agent import Agent
from agent.appsched import CurveStoppingScheduler, SuccessiveHalvingScheduler
from agent.fairness import shared_time_left
from hyperparam_adapters.optuna_adapter import (
    OptunaAdapter,
    hyperband_bracket,
    pruner_settings,
    rung_schedule,
)
from protos.messages import Offer

optuna.logging.set_verbosity(optuna.logging.WARNING)

SPACE = {"lr": FloatDistribution(1e-4, 1.0, log=True)}


def study(pruner, name="s", seed=0):
    return optuna.create_study(
        study_name=name,
        storage=optuna.storages.InMemoryStorage(),
        sampler=optuna.samplers.RandomSampler(seed=seed),
        pruner=pruner,
        direction="minimize",
    )


def sh_app(n_trials=4, parallel=2, **kw):
    """Successive halving r=1, eta=2 over M=8 iterations: decisions after 2, 3 and 5 iterations."""
    pruner = SuccessiveHalvingPruner(min_resource=1, reduction_factor=2)
    return OptunaAdapter(study(pruner), n_trials=n_trials, max_resource=8, parallel=parallel, search_space=SPACE,
                         iter_time_serial=10.0, **kw)


def hb_app(n_trials=4, parallel=2):
    """Hyperband r=1, M=9, eta=3: 3 brackets; study "a" puts trials 0..3 in brackets 2, 1, 0, 0."""
    return OptunaAdapter(study(HyperbandPruner(min_resource=1, max_resource=9, reduction_factor=3), name="a"),
                         n_trials=n_trials, parallel=parallel, search_space=SPACE, iter_time_serial=10.0)


def positions(n, machine="m0"):
    return [("r0", machine, f"s{k}") for k in range(n)]


# ---------------------------------------------------------------------------------------------- Optuna internals


def test_pruner_settings_match_the_installed_optuna():
    """Guards the private attributes pruner_settings reads (Optuna has no public getters)."""
    assert pruner_settings(HyperbandPruner(min_resource=2, max_resource=50, reduction_factor=4)) == {
        "min_resource": 2, "max_resource": 50, "reduction_factor": 4}
    assert pruner_settings(HyperbandPruner(min_resource=1))["max_resource"] is None  # "auto"
    assert pruner_settings(SuccessiveHalvingPruner(min_resource=3, reduction_factor=5, min_early_stopping_rate=2)) == {
        "min_resource": 3, "reduction_factor": 5, "min_early_stopping_rate": 2}
    assert pruner_settings(SuccessiveHalvingPruner())["min_resource"] is None  # "auto"


def test_hyperband_bracket_matches_optuna():
    """Guards the re-implementation of HyperbandPruner._get_bracket_id (private)."""
    pruner = HyperbandPruner(min_resource=1, max_resource=27, reduction_factor=3)
    s = study(pruner, name="brackets")
    trial = s.ask()
    trial.report(1.0, 0)
    trial.should_prune()  # the pruner initialises its brackets on its first decision
    ours = [hyperband_bracket("brackets", n, 1, 27, 3) for n in range(300)]
    assert ours == [pruner._get_bracket_id(s, SimpleNamespace(number=n)) for n in range(300)]
    assert set(ours) == {0, 1, 2, 3}
    # the brackets the hand-computed test below relies on
    assert [hyperband_bracket("a", n, 1, 9, 3) for n in range(4)] == [2, 1, 0, 0]


def test_rung_boundaries_are_where_optuna_prunes():
    """SH r=1, eta=2, M=8 decides after 2, 3, 5 iterations (steps 1, 2, 4): the worse trial survives
    iteration 1 and is pruned at iteration 2, exactly at the schedule's first boundary."""
    assert rung_schedule(1, 2, 0, 8).boundaries == (2, 3, 5, 8)
    assert rung_schedule(1, 3, 0, 9).boundaries == (2, 4, 9)
    assert rung_schedule(1, 3, 2, 9).boundaries == (9,)  # the decision at the last step saves nothing
    app = sh_app()
    app.runnable()
    assert app.observe("trial-0", 1, 1.0) == [] and app.observe("trial-1", 1, 9.0) == []
    assert app.observe("trial-0", 2, 0.9) == []
    assert app.observe("trial-1", 2, 8.0) == ["trial-1"]


# ---------------------------------------------------------------------------------------------- ask/tell


def test_trials_are_created_only_when_runnable_is_asked_with_capacity():
    app = sh_app(n_trials=3, parallel=2)
    assert isinstance(app, CurveStoppingScheduler) and not isinstance(app, SuccessiveHalvingScheduler)
    offer = Offer(1, {f"g{k}": p for k, p in enumerate(positions(4))}, now=0.0, n_avg=2.0, cluster_size=16)
    bid = Agent(app).bid(offer)  # rho and bids come from estimates: no trial is created for them
    assert bid.rows and all(math.isfinite(rho) for _, rho in bid.rows)
    assert app.budget() > 0 and len(app.study.trials) == 0 and app.demand_now() == 2
    assert app.runnable(gpus=0) == [] and len(app.study.trials) == 0
    assert [t.job_id for t in app.runnable(gpus=1)] == ["trial-0"]
    specs = app.runnable()
    assert [t.job_id for t in specs] == ["trial-0", "trial-1"] and len(app.study.trials) == 2
    assert specs[1].params == app.study.trials[1].params and 1e-4 <= specs[1].params["lr"] <= 1.0
    assert (specs[0].start_iteration, specs[0].target_iteration) == (0, 8)
    assert len(app.runnable()) == 2 and len(app.study.trials) == 2  # parallel caps the running trials
    for it in range(1, 9):
        stopped = app.observe("trial-0", it, 1.0 / it)
    assert stopped == ["trial-0"]
    assert [t.job_id for t in app.runnable()] == ["trial-1", "trial-2"]
    app.fail("trial-2")
    assert [t.job_id for t in app.runnable()] == ["trial-1"]  # n_trials is spent
    assert len(app.study.trials) == 3 and app.demand_now() == 1


@pytest.mark.parametrize("kind", ["successive-halving", "hyperband", "median"])
def test_pruning_through_observe(kind):
    if kind == "successive-halving":
        app, good, bad, at = sh_app(), "trial-0", "trial-1", 2
    elif kind == "hyperband":
        app, good, bad, at = hb_app(parallel=4), "trial-2", "trial-3", 2  # both in bracket 0: rungs at 2, 4
    else:
        app = OptunaAdapter(study(MedianPruner(n_startup_trials=1)), n_trials=3, max_resource=4, parallel=2,
                            search_space=SPACE)
        good, bad, at = "trial-0", "trial-1", 1
    app.runnable()
    for it in range(1, at):
        assert app.observe(good, it, 1.0) == [] and app.observe(bad, it, 5.0) == []
    if kind == "median":  # the median rule compares with finished trials: finish the good one first
        assert [app.observe(good, it, 1.0 / it) for it in range(1, 5)][-1] == [good]
    else:
        assert app.observe(good, at, 0.5) == []
    assert app.observe(bad, at, 5.0) == [bad]
    frozen = app.study.trials[app.trial_number(bad)]
    assert frozen.state == TrialState.PRUNED and app.stopped()[bad] == TrialState.PRUNED
    assert frozen.last_step == at - 1  # Optuna steps count from 0
    assert bad not in app.running() and bad not in [t.job_id for t in app.runnable()]
    assert app.observe(bad, at + 1, 4.0) == [bad]  # a late report: stop it again, Optuna untouched
    with pytest.raises(KeyError):
        app.observe("trial-99", 1, 1.0)


def test_a_trial_reaching_max_resource_completes_with_its_last_loss():
    app = sh_app(n_trials=2)
    app.runnable()
    assert app.best() is None
    app.observe("trial-1", 1, 3.0)
    assert app.best().job_id == "trial-1" and app.best().loss == 3.0  # provisional: nothing completed yet
    losses = [1.0, 0.8, 0.7, 0.6, 0.5, 0.45, 0.42, 0.41]
    answers = [app.observe("trial-0", it, loss) for it, loss in enumerate(losses, 1)]
    assert answers == [[]] * 7 + [["trial-0"]]
    frozen = app.study.trials[0]
    assert frozen.state == TrialState.COMPLETE and frozen.value == 0.41 and frozen.last_step == 7
    best = app.best()
    assert (best.job_id, best.loss, best.iteration) == ("trial-0", 0.41, 8.0)
    assert best.params == frozen.params == app.study.best_params
    with pytest.raises(ValueError):
        app.observe("trial-1", 1.5, 1.0)  # iterations are whole numbers
    with pytest.raises(ValueError):
        app.observe("trial-1", 0, 1.0)


# ---------------------------------------------------------------------------------------------- the estimate


def test_successive_halving_estimate_matches_hand_computation():
    """E[iterations] of a fresh trial = 2 + 1/2 + 2/4 + 3/8 = 3.375, so 33.75 s at 10 s each; four
    trials on two lanes: 67.5 s per lane, 135 GPU-s in all."""
    app = sh_app(n_trials=4, parallel=2)
    assert app.work_left() == pytest.approx(135.0) and app.budget() == pytest.approx(135.0)
    lanes = app.jobs_remaining(())
    assert [j.job_id for j in lanes] == ["trial-next-0", "trial-next-1"]
    assert [j.iters_remaining * j.iter_time_serial for j in lanes] == pytest.approx([67.5, 67.5])
    assert shared_time_left(app, positions(2)) == pytest.approx(67.5)
    assert shared_time_left(app, positions(1)) == pytest.approx(135.0)  # two lanes queued on one GPU
    app.runnable()
    history = [app.work_left()]
    app.observe("trial-0", 1, 1.0, iter_time_s=10.0)  # 2.375 left: one iteration of work less
    history.append(app.work_left())
    app.observe("trial-1", 1, 2.0, iter_time_s=10.0)
    history.append(app.work_left())
    assert history == pytest.approx([135.0, 125.0, 115.0])
    # passing a rung raises the trial's conditional expectation: 1 + 2/2 + 3/4 = 2.75 iterations left
    app.observe("trial-0", 2, 0.5)
    assert app.expected_iterations_left(0, 2) == pytest.approx(2.75)
    assert app.work_left() == pytest.approx(27.5 + 23.75 + 2 * 33.75)
    app.observe("trial-1", 2, 3.0)  # pruned: its lane starts trial 2, trial 3 goes to trial-0's lane
    lanes = {j.job_id: j.iters_remaining * j.iter_time_serial for j in app.jobs_remaining(())}
    assert lanes == pytest.approx({"trial-0": 27.5 + 33.75, "trial-next-0": 33.75})
    assert app.budget() == pytest.approx(app.work_done() + app.work_left()) and app.work_done() == pytest.approx(40.0)


def test_hyperband_estimate_matches_hand_computation():
    """Brackets 2, 1, 0, 0 expect 9, 4 + 5/3 = 17/3 and 2 + 2/3 + 5/9 = 29/9 iterations; list
    scheduling on two lanes: 90 | 56.7 + 32.2 + 32.2 = 121.1 s."""
    app = hb_app(n_trials=4, parallel=2)
    works = [90.0, 170 / 3, 290 / 9, 290 / 9]
    assert [app.expected_iterations_left(n, 0) * 10 for n in range(4)] == pytest.approx(works)
    assert app.work_left() == pytest.approx(sum(works))
    assert sorted(j.iters_remaining * j.iter_time_serial for j in app.jobs_remaining(())) == pytest.approx(
        [90.0, works[1] + works[2] + works[3]])
    assert shared_time_left(app, positions(2)) == pytest.approx(works[1] + works[2] + works[3])


def test_the_estimate_decreases_as_trials_progress_to_zero():
    """A full seeded run: the estimate falls by exactly one iteration's work between rung decisions,
    falls when a trial is pruned or completes, rises only by the surviving trial's conditional
    expectation at a rung it passes, and reaches zero when the n_trials budget is spent."""
    app = sh_app(n_trials=6, parallel=3)
    left = rung_schedule(1, 2, 0, 8).expected_left
    rng = random.Random(3)
    quality: dict[str, float] = {}
    history = [app.work_left()]
    while not app.finished():
        for spec in app.runnable():
            job, it = spec.job_id, spec.start_iteration + 1
            quality.setdefault(job, rng.uniform(0.5, 2.0))
            before = app.work_left()
            stopped = app.observe(job, it, quality[job] / it, iter_time_s=10.0)
            after = app.work_left()
            if job in stopped:
                assert after <= before - 10.0
            elif it in (2, 3, 5):  # a rung passed: the trial now expects left(it) instead of left(it - 1) - 1
                assert after - before == pytest.approx(10.0 * (left(it) - left(it - 1)))
            else:
                assert after == pytest.approx(before - 10.0)
            history.append(after)
    assert history[-1] == 0.0 and app.demand_now() == 0 and app.jobs_remaining(()) == []
    assert min(history[:-1]) > 0 and history[0] == max(history)
    assert sum(s == TrialState.PRUNED for s in app.stopped().values()) >= 2
    assert sum(s == TrialState.COMPLETE for s in app.stopped().values()) >= 1
    assert app.budget() == pytest.approx(app.work_done())


def test_median_estimate_is_the_finished_trials_lengths():
    app = OptunaAdapter(study(MedianPruner(n_startup_trials=1)), n_trials=4, max_resource=4, search_space=SPACE,
                        parallel=2)
    assert app.expected_iterations_left(0, 0) == 4  # nothing finished: a trial runs to max_resource
    app.runnable()
    for it in range(1, 5):
        app.observe("trial-0", it, 1.0 / it)
    app.observe("trial-1", 1, 9.0)  # pruned after 1 iteration
    assert app.expected_iterations_left(2, 0) == pytest.approx(2.5)  # mean of 4 and 1
    assert app.expected_iterations_left(2, 1) == pytest.approx(3.0)  # only the 4-iteration trial ran longer
    assert app.expected_iterations_left(2, 4) == 0.0


def test_pessimistic_estimate_runs_every_trial_to_max_resource():
    app = sh_app(n_trials=4, parallel=2, pessimistic=True)
    assert app.work_left() == pytest.approx(4 * 8 * 10.0)


def test_iteration_times_are_converted_to_serial_and_assign_places_trials():
    app = sh_app(n_trials=4, parallel=2, trial_demand=2, slowdown=(1.0, 1.0, 1.5, 2.0))
    gpus = {"a0": ("r0", "m0", "s0"), "a1": ("r0", "m0", "s1"), "b0": ("r0", "m1", "s0"), "b1": ("r0", "m1", "s1")}
    placed = app.assign(gpus)
    assert len(app.study.trials) == 2 and sorted(map(len, placed.values())) == [2, 2]
    assert {frozenset(v) for v in placed.values()} == {frozenset({"a0", "a1"}), frozenset({"b0", "b1"})}
    app.observe("trial-0", 1, 1.0, iter_time_s=4.0)  # 2 GPUs on one machine: serial = 4 * 2 / 1
    assert app.measured_iter_time_serial("trial-0") == pytest.approx(8.0)
    spread = [("r0", "m0", "s0"), ("r0", "m1", "s0")]
    app.observe("trial-1", 1, 1.0, iter_time_s=6.0, gpus=spread)  # rack level: 6 * 2 / 1.5
    assert app.measured_iter_time_serial("trial-1") == pytest.approx(8.0)
    version = app.version
    app.slowdown = (1.0, 1.0, 2.0, 2.0)  # a new slowdown is a change of work (agents' caches)
    assert app.version > version and app.measured_iter_time_serial("trial-1") == pytest.approx(6.0)
    assert app.jobs_remaining(())[0].slowdown == (1.0, 1.0, 2.0, 2.0)


def test_bad_studies_are_refused():
    with pytest.raises(ValueError, match="minimized"):
        OptunaAdapter(optuna.create_study(direction="maximize", pruner=MedianPruner()), n_trials=2, max_resource=4)
    with pytest.raises(TypeError, match="pruner"):
        OptunaAdapter(study(NopPruner()), n_trials=2, max_resource=4)
    with pytest.raises(ValueError, match="auto"):
        OptunaAdapter(study(HyperbandPruner(min_resource=1)), n_trials=2)
    with pytest.raises(ValueError, match="auto"):
        OptunaAdapter(study(SuccessiveHalvingPruner()), n_trials=2, max_resource=4)
    with pytest.raises(ValueError, match="differs"):
        OptunaAdapter(study(HyperbandPruner(max_resource=9)), n_trials=2, max_resource=10)
    with pytest.raises(ValueError, match="max_resource"):
        OptunaAdapter(study(MedianPruner()), n_trials=2)
    with pytest.raises(ValueError, match="parallel"):
        OptunaAdapter(study(MedianPruner()), n_trials=2, max_resource=4, parallel=0)


def test_a_profiler_keeps_the_adapter_up_to_date():
    """agent.profiler.Profiler.apply gives the adapter the learned slowdown and serial time."""
    from agent.profiler import Profiler

    app = sh_app(n_trials=2, parallel=2, trial_demand=2)
    assert app.work_left() == pytest.approx(2 * 3.375 * 10.0)
    profiler = Profiler((1.0, 1.0, 1.0, 1.0), iter_time_serial=10.0, prior_weight=1)
    for _ in range(9):
        profiler.observe("trial-0", 20.0 * 2.0 / 2, [("r0", "m0", "s0"), ("r0", "m1", "s0")], demand=2)
    profiler.observe("trial-0", 20.0, [("r0", "m0", "s0")])  # one GPU: trial-0's serial time is 20 s
    version = app.version
    assert profiler.apply(app) is True and app.version > version
    assert app.slowdown == profiler.slowdown and app.slowdown[2] == pytest.approx((1.0 + 9 * 2.0) / 10)
    assert app.iter_time_serial == pytest.approx(15.0)  # the prior (10 s) and one report (20 s), weight 1 each
    assert app.work_left() == pytest.approx(2 * 3.375 * 15.0)
    assert app.jobs_remaining(())[0].slowdown == profiler.slowdown


def test_a_missing_search_space_is_refused_with_what_to_pass():
    """Issue 11: without ``search_space=`` or ``suggest=`` every trial ran with params={}."""
    for kw in ({}, {"search_space": {}}):
        with pytest.raises(ValueError, match=r"needs a search space: pass search_space=.*or suggest=fn") as caught:
            OptunaAdapter(study(MedianPruner()), n_trials=2, max_resource=4, **kw)
        assert "FloatDistribution" in str(caught.value)
    with pytest.raises(TypeError, match="suggest must be a function"):
        OptunaAdapter(study(MedianPruner()), n_trials=2, max_resource=4, suggest={"lr": 0.1})
    app = OptunaAdapter(study(MedianPruner()), n_trials=2, max_resource=4,
                        suggest=lambda trial: trial.suggest_float("lr", 1e-3, 1e-1, log=True))
    assert 1e-3 <= app.runnable()[0].params["lr"] <= 1e-1


def stored_study(storage: str, name: str) -> optuna.Study:
    """The named study in ``storage``, created or loaded: what a process restarting a search does."""
    return optuna.create_study(study_name=name, storage=storage, load_if_exists=True,
                               sampler=optuna.samplers.RandomSampler(seed=0),
                               pruner=SuccessiveHalvingPruner(min_resource=1, reduction_factor=2))


def test_a_resumed_study_takes_up_its_running_trials(tmp_path):
    """Issue 11: ``resume()`` (what ``AppRunner.create(resume=True)`` calls) goes on with the trials an
    interrupted run left RUNNING in the study's storage, from the iteration they last reported."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"

    def load():
        return stored_study(storage, "resumable")

    first = OptunaAdapter(load(), n_trials=4, max_resource=8, parallel=2, search_space=SPACE)
    specs = first.runnable()
    assert [s.job_id for s in specs] == ["trial-0", "trial-1"]
    first.observe("trial-0", 1, 0.5)
    first.observe("trial-0", 2, 0.4)
    first.observe("trial-1", 1, 0.6)
    # the process dies here; a new one loads the study and resumes
    again = OptunaAdapter(load(), n_trials=4, max_resource=8, parallel=2, search_space=SPACE)
    assert again.resume() == ["trial-0", "trial-1"]
    resumed = {s.job_id: s for s in again.runnable()}
    assert set(resumed) == {"trial-0", "trial-1"}  # parallel 2: no new trial while both run
    assert resumed["trial-0"].start_iteration == 2 and resumed["trial-1"].start_iteration == 1
    assert resumed["trial-0"].params == specs[0].params
    assert again.observe("trial-0", 3, 0.3) == [] and again.best().loss == 0.3
    assert again.asked == 2 and again.demand_now() == 2
    for it in range(4, 9):
        again.observe("trial-0", it, 0.3)
    assert again.stopped()["trial-0"] == TrialState.COMPLETE
    assert [s.job_id for s in again.runnable()] == ["trial-1", "trial-2"]  # 4 trials in all, not 4 more
    # without resume, a rerun of the study asks new trials (new job ids: no checkpoint is shared)
    fresh = OptunaAdapter(load(), n_trials=1, max_resource=8, parallel=1, search_space=SPACE)
    assert [s.job_id for s in fresh.runnable()] == ["trial-3"]


def test_resume_takes_up_only_the_resumed_runs_trials(tmp_path):
    """A trial left RUNNING by another search run has its checkpoints in that run's folder: resuming
    this run must not take it up (it would restart at 0 where the tuner expects its last step)."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"

    def load():
        return stored_study(storage, "two-runs")

    older = OptunaAdapter(load(), n_trials=4, max_resource=8, parallel=1, search_space=SPACE)
    older.run_id = "run-a"
    assert [s.job_id for s in older.runnable()] == ["trial-0"]
    mine = OptunaAdapter(load(), n_trials=4, max_resource=8, parallel=1, search_space=SPACE)
    mine.run_id = "run-b"
    assert [s.job_id for s in mine.runnable()] == ["trial-1"]
    mine.observe("trial-1", 1, 0.5)
    again = OptunaAdapter(load(), n_trials=4, max_resource=8, parallel=1, search_space=SPACE)
    again.run_id = "run-b"
    assert again.resume() == ["trial-1"]


def test_a_suggest_that_raises_leaves_no_trial_running(tmp_path):
    """``suggest`` is the user's code. When it raised, the trial ``study.ask`` had just made stayed
    RUNNING in the study with part of its parameters, and a resumed run took it up and trained it
    with them. Like ``study.optimize`` with an objective that raises, the trial is told FAIL and the
    error goes on to the caller."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    calls = []

    def suggest(trial):
        calls.append(trial.number)
        trial.suggest_float("lr", 1e-4, 1.0, log=True)
        if len(calls) == 2:
            raise KeyError("momentum")  # a typo in the user's search space
        trial.suggest_float("momentum", 0.0, 0.99)

    adapter = OptunaAdapter(stored_study(storage, "raising"), n_trials=4, max_resource=8, parallel=2,
                            suggest=suggest)
    adapter.run_id = "run-a"
    with pytest.raises(KeyError, match="momentum"):
        adapter.runnable()
    states = {t.number: t.state for t in stored_study(storage, "raising").get_trials(deepcopy=False)}
    assert states == {0: TrialState.RUNNING, 1: TrialState.FAIL}
    again = OptunaAdapter(stored_study(storage, "raising"), n_trials=4, max_resource=8, parallel=2,
                          suggest=suggest)
    again.run_id = "run-a"
    assert again.resume() == ["trial-0"]  # the trial with all its parameters, not the half-suggested one
