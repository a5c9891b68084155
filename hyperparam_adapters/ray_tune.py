"""A Ray Tune search as a Themis app (paper Figure 8): Tune picks the trials and their fates, Themis runs them.

Why. Ray Tune is the other search library most ML teams use (ASHA, HyperBand, median stopping, many
searchers). Its own runner, ``tune.Tuner(...).fit()``, starts every trial as a Ray actor on whatever
resources the Ray cluster has; under Themis the arbiter decides which GPUs a search holds and when.
So :class:`TuneAdapter` keeps the two halves of Tune that decide and drops the one that launches:

* **the search algorithm** (``TuneConfig.search_alg``: Tune's default random/grid search,
  ``BasicVariantGenerator``, or any ``Searcher`` such as ``OptunaSearch``) makes the trials and
  hears their results, through Tune's public ``SearchAlgorithm`` API (``set_search_properties``,
  ``add_configurations``, ``next_trial``, ``on_trial_result``, ``on_trial_complete``), wrapped as
  ``tune.Tuner`` wraps it (a ``Searcher`` in a ``ConcurrencyLimiter`` and a ``SearchGenerator``);
* **the trial scheduler** (``TuneConfig.scheduler``: ``ASHAScheduler``/``AsyncHyperBandScheduler``,
  ``HyperBandScheduler``, ``MedianStoppingRule``, or none) answers CONTINUE, PAUSE or STOP to every
  result (``on_trial_result``) and picks the next trial to run (``choose_trial_to_run``), through
  Tune's ``TrialScheduler`` API;
* Tune's ``TuneController`` (which starts Ray actors) is not used. The schedulers call back into it
  (HyperBand stops paused trials, the median rule lists the live ones), so :class:`_Controller`
  stands in for the part of it they call: ``get_trials``, ``get_live_trials``, ``stop_trial`` and
  ``pause_trial``, with the semantics ``TuneController.stop_trial``'s docstring gives (a PENDING or
  PAUSED trial: the scheduler's ``on_trial_remove``, the searcher's ``on_trial_complete``; a RUNNING
  one: both ``on_trial_complete`` with its last result). The trials are Tune's own ``Trial`` objects,
  made by the search algorithm; their status is Tune's (PENDING, RUNNING, PAUSED, TERMINATED, ERROR).

"RUNNING" here means "Tune wants it to run": those trials are :meth:`TuneAdapter.runnable`, and the
Themis runner runs them on the GPUs the arbiter granted, stops them (with a checkpoint) when a lease
is lost and starts them again from their checkpoint, none of which Tune sees. A PAUSE (HyperBand
waiting for a rung to fill) and a STOP stop the trial's job; a paused trial that Tune runs again
resumes from its checkpoint. ``iteration`` (what the job reports to ``job.step``) is Tune's
``training_iteration``, the job's loss is the TuneConfig's ``metric``, minimised.

Deterministic by construction, so a resumed run replays (``base.JournaledTuner``): trials are made
and started right after each event (construction, every report, every give-up), as many as
``max_concurrent_trials``, not when GPUs happen to be free, so the search's state depends only on
the seed and the reports in order. A resume (``AppRunner.create(resume=True)``) replays the run's
``tuner.jsonl`` through Tune again. That needs a seeded search (``seed=`` seeds Tune's default
random search; give ``OptunaSearch(seed=...)`` and the like their own seed); an unseeded one draws
other configurations and the resume stops with a ``ValueError`` naming the trial. ASHA with several
brackets draws each trial's bracket from NumPy's global generator; :meth:`TuneAdapter._add` seeds it
from ``seed`` and the trial's number for that call only (and puts the global state back).

Figure 8 side: a curve-stopping app (D4), as the Optuna adapter and for the same reason: ASHA decides
each trial on its own as it reaches a rung (no phases), and even Tune's synchronous HyperBand runs
its brackets side by side. Each trial's remaining length is the *expected* one (``Rungs``): its
iterations to its next decision plus the later ones weighted by the share of trials each decision
keeps (ASHA: 1/reduction_factor per rung; HyperBand: ceil(n/eta)/n of the bracket's n). Trials not
made yet expect a fresh trial's length (ASHA: averaged over its brackets by Tune's own bracket
probabilities; HyperBand: over one band's brackets, weighted by their sizes). Without rungs (the
median rule, no scheduler) it is the empirical ``mean(L - d)`` of the decided trials that ran more
than d iterations, ``max_iterations - d`` before any did. ``pessimistic=True`` runs every trial to
``max_iterations`` (D4's literal reading). HyperBand's waits at a rung barrier are not counted.
The lanes (``max_concurrent_trials`` of them) and iteration times are the Optuna adapter's: each
running trial heads a lane, paused, pending and future trials are list-scheduled onto the lane that
frees first; a trial's serial time is the median of what it reported, else the median of the
measured trials, else ``iter_time_serial`` (which ``agent.profiler.Profiler.apply`` updates).

Not supported, refused with a clear error: ``PopulationBasedTraining``/``PB2`` (they copy
checkpoints between trials and change configurations: Themis's checkpoints belong to one trial),
``HyperBandForBOHB``, ``ResourceChangingScheduler`` (the arbiter decides resources), a time
attribute other than ``training_iteration`` for ASHA and HyperBand, ``mode="max"`` (report what to
minimise, e.g. ``1 - accuracy``), ``time_budget_s``, ``num_samples=-1``, searchers and schedulers
given by name. ``reuse_actors`` and trial name creators have no meaning here and are ignored.
Tune's own experiment checkpoint (``Tuner.restore``) is not used: the journal is the record.

PRIVATE TUNE ATTRIBUTES (ray 2.60.0, pinned exactly in pyproject.toml's ``tune`` extra): Tune's
schedulers have no public getters for their settings (max_t, reduction factor, rungs, a trial's
bracket), which the estimate needs. They are read in :func:`scheduler_settings`,
:func:`asha_decisions_ahead` and :func:`hyperband_decisions_ahead` only, and
``tests/test_ray_tune_adapter.py`` fails if Tune renames them.
"""

from __future__ import annotations

import logging
import math
import shutil
import statistics
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from ray.tune import TuneConfig
from ray.tune.experiment import Experiment, Trial
from ray.tune.result import DEFAULT_METRIC
from ray.tune.schedulers import (
    AsyncHyperBandScheduler,
    FIFOScheduler,
    HyperBandForBOHB,
    HyperBandScheduler,
    MedianStoppingRule,
    PopulationBasedTraining,
    ResourceChangingScheduler,
    TrialScheduler,
)
from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter, SearchAlgorithm, Searcher, SearchGenerator
from ray.tune.search.sample import Domain

from agent.appsched import CurveStoppingScheduler, JobInfo
from agent.placement import NO_SLOWDOWN, Position, Slowdown
from agent.trial import TrialSpec
from hyperparam_adapters.base import JournaledTuner, Result, TunerAdapter, lanes

__all__ = ["Rungs", "TuneAdapter", "asha_decisions_ahead", "hyperband_decisions_ahead", "scheduler_settings"]

log = logging.getLogger("themis.tuner")

ITERATION = "training_iteration"
_LIVE = (Trial.PENDING, Trial.RUNNING, Trial.PAUSED)


def themis_trial(config: dict) -> None:
    """The trainable Tune's ``Experiment`` is given (it needs one to make trials). Tune never runs it
    here: the trials are the training script's processes, started by the Themis runner."""
    raise RuntimeError("a Themis app's Tune trials run as the runner's training processes, not as a trainable")


# ---------------------------------------------------------------------------------------------- Tune's settings


def scheduler_settings(scheduler: TrialScheduler) -> dict[str, Any]:
    """What the estimate needs of a trial scheduler: ``kind`` (asha, hyperband, median, fifo, other),
    ``time_attr``, ``mode``, ``max_t`` (None: trials are not stopped at a length), and for ASHA its
    ``reduction_factor`` and each bracket's milestones, for HyperBand its ``eta`` and ``s_max_1``.

    PRIVATE TUNE ATTRIBUTES: Tune has no public getters for these; they are read here and in the two
    ``*_decisions_ahead`` functions only (``test_scheduler_settings_match_the_installed_tune`` fails if
    Tune renames them)."""
    try:
        if isinstance(scheduler, AsyncHyperBandScheduler):
            return {"kind": "asha", "time_attr": scheduler._time_attr, "mode": scheduler._mode,
                    "max_t": scheduler._max_t if scheduler._stop_last_trials else None,
                    "reduction_factor": float(scheduler._reduction_factor),
                    "brackets": [tuple(float(m) for m, _ in b._rungs) for b in scheduler._brackets]}
        if isinstance(scheduler, HyperBandScheduler):
            return {"kind": "hyperband", "time_attr": scheduler._time_attr, "mode": scheduler._mode,
                    "max_t": scheduler._max_t_attr if scheduler._stop_last_trials else None,
                    "eta": float(scheduler._eta), "s_max_1": int(scheduler._s_max_1)}
        if isinstance(scheduler, MedianStoppingRule):
            return {"kind": "median", "time_attr": scheduler._time_attr, "mode": scheduler._mode, "max_t": None}
    except AttributeError as exc:
        raise RuntimeError(f"ray {_ray_version()} changed the private attributes of {type(scheduler).__name__} that "
                           f"hyperparam_adapters.ray_tune.scheduler_settings reads ({exc})") from None
    kind = "fifo" if type(scheduler) is FIFOScheduler else "other"
    return {"kind": kind, "time_attr": ITERATION, "mode": getattr(scheduler, "_mode", None), "max_t": None}


def asha_decisions_ahead(scheduler: AsyncHyperBandScheduler, trial: Trial) -> tuple[float, ...]:
    """The milestones of ``trial``'s ASHA bracket at which it has not been decided yet, ascending.
    PRIVATE TUNE ATTRIBUTES (see :func:`scheduler_settings`): the bracket Tune drew for the trial and
    the trials each rung recorded."""
    bracket = scheduler._trial_info.get(trial.trial_id)
    if bracket is None:  # completed or removed: Tune dropped it
        return ()
    return tuple(sorted(float(m) for m, recorded in bracket._rungs if trial.trial_id not in recorded))


def hyperband_decisions_ahead(scheduler: HyperBandScheduler, trial: Trial) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """``(milestones, keep)`` of ``trial``'s HyperBand bracket from its current rung on: the cumulative
    iterations each rung runs to (the last one ends the bracket) and the share of the bracket's trials
    each halving keeps (ceil(n / eta) of n, as ``_Bracket.successive_halving``). PRIVATE TUNE
    ATTRIBUTES (see :func:`scheduler_settings`)."""
    info = scheduler._trial_info.get(trial)
    if info is None:
        return (), ()
    bracket = info[0]
    r, n, eta, top = int(bracket._cumul_r), int(bracket._n), float(bracket._eta), int(bracket._max_t_attr)
    milestones, keep = [r], []
    for _ in range(int(bracket._halves)):
        kept = math.ceil(n / eta)
        keep.append(kept / n if n else 1.0)
        n = kept
        r = int(min(r * eta, top))
        milestones.append(r)
    return tuple(milestones), tuple(keep)


def _ray_version() -> str:
    import ray

    return ray.__version__


@dataclass(frozen=True)
class Rungs:
    """The decisions still ahead of a trial: it runs to ``bounds[0]`` for sure, on to ``bounds[k]``
    with probability ``keep[0] * ... * keep[k-1]``; the last bound is where it ends anyway. This is
    the Optuna adapter's ``RungSchedule`` with a share kept per decision (HyperBand keeps ceil(n/eta)
    of n, not 1/eta), counted from the next decision (HyperBand decides a rung when its last trial
    reaches it, so a paused trial at its rung has the decision still ahead)."""

    bounds: tuple[float, ...]
    keep: tuple[float, ...]

    def expected_left(self, done: float) -> float:
        """Iterations a trial that has done ``done`` is expected to run more."""
        left, reach, at = 0.0, 1.0, done
        for k, bound in enumerate(self.bounds):
            if bound > at:
                left += reach * (bound - at)
                at = bound
            if k < len(self.keep):
                reach *= self.keep[k]
        return left


def _rungs(milestones: Sequence[float], keep: Sequence[float], end: float) -> Rungs:
    """Decisions at ``milestones`` (in completed iterations: a milestone m is decided at the first
    report at or past it), cut at ``end`` where every trial stops."""
    bounds: list[float] = []
    kept: list[float] = []
    for m, p in zip(milestones, list(keep) + [1.0] * len(milestones)):
        at = float(math.ceil(m - 1e-9))
        if at >= end:
            break
        bounds.append(at)
        kept.append(p)
    return Rungs((*bounds, float(end)), tuple(kept))


def _plain(value: Any, where: str) -> Any:
    """A configuration value as ``THEMIS_PARAMS`` carries it (JSON): NumPy scalars as Python numbers."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"config value {where} = {value!r} ({type(value).__name__}) cannot go to a training process: "
                     "a trial's config reaches it as JSON (THEMIS_PARAMS); use numbers, strings, lists and dicts")


# ---------------------------------------------------------------------------------------------- the stand-in


class _Controller:
    """What Tune's schedulers call on the ``TuneController`` (see the module docstring): the trials,
    and stopping and pausing them as ``TuneController.stop_trial`` / ``pause_trial`` do, without any
    Ray actor (the Themis runner stops the trial's job)."""

    def __init__(self, adapter: TuneAdapter) -> None:
        self._adapter = adapter

    @property
    def search_alg(self) -> SearchAlgorithm:
        return self._adapter.search_alg

    def get_trials(self) -> list[Trial]:
        return [t.trial for t in self._adapter._trials.values()]

    def get_live_trials(self) -> set[Trial]:
        return {t.trial for t in self._adapter._trials.values() if t.trial.status != Trial.TERMINATED}

    def stop_trial(self, trial: Trial) -> None:
        if trial.status in (Trial.ERROR, Trial.TERMINATED):
            return
        adapter = self._adapter
        if trial.status in (Trial.PENDING, Trial.PAUSED):
            adapter.scheduler.on_trial_remove(self, trial)
            adapter.search_alg.on_trial_complete(trial.trial_id)
        else:
            result = dict(trial.last_result)
            adapter.scheduler.on_trial_complete(self, trial, result)
            adapter.search_alg.on_trial_complete(trial.trial_id, result=result)
        trial.set_status(Trial.TERMINATED)

    def pause_trial(self, trial: Trial, should_checkpoint: bool = True) -> None:
        if trial.status == Trial.RUNNING:
            trial.set_status(Trial.PAUSED)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"the trial scheduler called TuneController.{name}, which a Themis app does not have "
                             "(hyperparam_adapters.ray_tune stands in for get_trials, get_live_trials, stop_trial and "
                             "pause_trial): this scheduler is not supported")


@dataclass
class _TuneTrial:
    job_id: str
    number: int
    trial: Trial
    params: dict[str, Any]
    done: int = 0  # the last training_iteration Tune was told
    loss: float = math.inf  # its loss
    time_total: float = 0.0
    times: list[float] = field(default_factory=list)  # serial iteration times reported

    def iter_time(self) -> float | None:
        return statistics.median(self.times) if self.times else None


# ---------------------------------------------------------------------------------------------- the adapter


class TuneAdapter(JournaledTuner, TunerAdapter, CurveStoppingScheduler):
    """A Ray Tune search (``param_space`` and ``tune_config`` as ``tune.Tuner`` takes them) behind
    Figure 8's curve-stopping API; see the module docstring.

    ``max_iterations`` is the trials' full length (the training loop's, or ``RunConfig(stop=
    {"training_iteration": N})``'s): by default the scheduler's ``max_t``; required without one.
    ``trial_demand`` is each trial's GPUs; ``seed`` seeds Tune's default random search and ASHA's
    bracket draws; ``iter_time_serial`` stands for a trial's seconds per iteration on one GPU until
    trials report theirs. ``tune_config.max_concurrent_trials`` is required: the most trials that run
    at once, so the app's largest demand (Tune's default, as many as the resources allow, is the
    arbiter's to decide here).
    """

    def __init__(
        self,
        param_space: Mapping[str, Any] | None,
        tune_config: TuneConfig,
        *,
        max_iterations: int | None = None,
        trial_demand: int = 1,
        seed: int = 0,
        iter_time_serial: float = 1.0,
        slowdown: Slowdown = NO_SLOWDOWN,
        start_time: float = 0.0,
        job_prefix: str = "trial-",
        pessimistic: bool = False,
    ) -> None:
        if not isinstance(tune_config, TuneConfig):
            raise TypeError(f"tune_config must be a ray.tune.TuneConfig, got {type(tune_config).__name__}")
        space = dict(param_space or {})
        parallel = tune_config.max_concurrent_trials
        if parallel is None:
            raise ValueError("set TuneConfig(max_concurrent_trials=N): the most trials that run at once, which is the "
                             "app's largest GPU demand (N x trial_demand); Tune's default, as many as the resources "
                             "allow, is the arbiter's to decide under Themis")
        for name, value in (("max_concurrent_trials", parallel), ("num_samples", tune_config.num_samples),
                            ("trial_demand", trial_demand)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}"
                                 + (" (a Themis app's work is finite)" if name == "num_samples" else ""))
        if tune_config.time_budget_s:
            raise ValueError("TuneConfig(time_budget_s=...) is not supported: the arbiter decides when the trials run, "
                             "so a wall-clock budget would cut the search by how busy the cluster is; bound it with "
                             "num_samples")
        if not (iter_time_serial > 0 and math.isfinite(iter_time_serial)):
            raise ValueError(f"iter_time_serial must be finite and > 0, got {iter_time_serial!r}")
        scheduler = tune_config.scheduler if tune_config.scheduler is not None else FIFOScheduler()
        search_alg = tune_config.search_alg
        _check_supported(scheduler, search_alg)

        # what tune.Tuner does with the same arguments (ray/tune/tune.py, run()): wrap, then tell metric and mode
        if search_alg is None:
            search_alg = BasicVariantGenerator(max_concurrent=parallel, random_state=seed)
        elif isinstance(search_alg, Searcher):
            if not isinstance(search_alg, ConcurrencyLimiter):
                search_alg = ConcurrencyLimiter(search_alg, max_concurrent=parallel)
            search_alg = SearchGenerator(search_alg)
        if space and not search_alg.set_search_properties(tune_config.metric, tune_config.mode, space):
            if _unresolved(space):
                raise ValueError("param_space has search domains (tune.uniform, ...) but the search algorithm was "
                                 "built with its own search space: keep the domains in one of the two")
        if not scheduler.set_search_properties(tune_config.metric, tune_config.mode):
            raise ValueError("TuneConfig has a metric or mode and so does the scheduler: give them in one place")
        settings = scheduler_settings(scheduler)
        metric = tune_config.metric or scheduler.metric or search_alg.metric
        mode = tune_config.mode or settings["mode"] or getattr(getattr(search_alg, "searcher", None), "mode", None)
        if not metric or metric == DEFAULT_METRIC:
            raise ValueError("name the metric the jobs report as their loss: TuneConfig(metric='loss', mode='min')")
        if mode != "min":
            raise ValueError(f"the metric must be minimised (mode='min', got {mode!r}): a Themis job reports a loss; "
                             "report what to minimise, e.g. 1 - accuracy, and set mode='min'")
        if settings["kind"] in ("asha", "hyperband") and settings["time_attr"] != ITERATION:
            raise ValueError(f"{type(scheduler).__name__}(time_attr={settings['time_attr']!r}) is not supported: its "
                             f"rungs must be in iterations ({ITERATION!r}), which the jobs report and the estimate counts")
        max_t = settings["max_t"]
        if max_iterations is None:
            if max_t is None:
                raise ValueError(f"{type(scheduler).__name__} does not stop trials at a length: give max_iterations=, "
                                 "the iterations of a trial that is never stopped (its training loop's length)")
            max_iterations = int(math.floor(max_t))
        if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) or max_iterations < 1:
            raise ValueError(f"max_iterations must be an int >= 1, got {max_iterations!r}")
        if max_t is not None and max_iterations > max_t:
            raise ValueError(f"max_iterations {max_iterations} is past the scheduler's max_t {max_t}, where it stops "
                             "every trial")

        self.param_space = space
        self.tune_config = tune_config
        self.scheduler = scheduler
        self.search_alg = search_alg
        self.metric = metric
        self.settings = settings
        self.parallel = parallel
        self.max_iterations = max_iterations
        self.trial_demand = trial_demand
        self.seed = seed
        self.iter_time_serial = float(iter_time_serial)
        self.slowdown: Slowdown = tuple(slowdown)  # type: ignore[assignment]
        self.start_time = start_time
        self.job_prefix = job_prefix
        self.pessimistic = pessimistic
        self.run_id: str | None = None
        self.version = 0
        self.plan_version = 0
        self._trials: dict[str, _TuneTrial] = {}
        self._by_tune_id: dict[str, str] = {}
        self._best: Result | None = None
        self._search_done = False
        self._lanes: tuple[int, list[JobInfo], float] | None = None
        self._controller = _Controller(self)
        # Tune makes trials from an Experiment, which keeps a folder; nothing is written to it here
        self._storage = tempfile.mkdtemp(prefix="themis-tune-")
        weakref.finalize(self, shutil.rmtree, self._storage, True)
        experiment = Experiment("themis", themis_trial, config=space, num_samples=tune_config.num_samples,
                                storage_path=self._storage)
        search_alg.add_configurations([experiment])
        self._fill()

    # ---- the tuner's side ---------------------------------------------------------------------------

    def runnable(self) -> list[TrialSpec]:
        """The trials Tune runs now (RUNNING), oldest first, each from the iteration it reported last."""
        return [TrialSpec(t.job_id, t.params, self.trial_demand, t.done, self.max_iterations)
                for t in self._trials.values() if t.trial.status == Trial.RUNNING]

    def observe(self, job_id: str, iteration: float, loss: float, iter_time_s: float | None = None) -> list[str]:
        """A result for Tune: the scheduler decides (CONTINUE, PAUSE, STOP), the searcher hears it (unless
        stopped, as in Tune), and a trial at ``max_iterations`` completes (Tune: its function returned).
        Returns the jobs to stop: this one when paused or stopped (or already not running), and any other
        trial the decision took off RUNNING. A report at or before the trial's last iteration (a job
        resumed from a checkpoint behind its reports) is not Tune's again."""
        t = self._trials.get(job_id)
        if t is None:
            raise KeyError(f"{job_id!r} is not a trial of this Tune search")
        if not (math.isfinite(iteration) and iteration >= 1 and iteration == int(iteration)):
            raise ValueError(f"{job_id}: iteration must be a whole number >= 1 (Tune's training_iteration), "
                             f"got {iteration!r}")
        if iter_time_s is not None and not (iter_time_s > 0 and math.isfinite(iter_time_s)):
            raise ValueError(f"{job_id}: iter_time_s must be finite and > 0, got {iter_time_s!r}")
        self.journal_report(job_id, iteration, loss, iter_time_s)  # what a resumed run replays
        trial, it, value = t.trial, int(iteration), float(loss)
        if trial.status != Trial.RUNNING:
            return [job_id]  # a late report from a job being stopped
        running = self._running_ids()
        if it <= t.done:
            if t.done >= self.max_iterations:  # its checkpoint was at the end: Tune's "function returned"
                self._controller.stop_trial(trial)
        else:
            if iter_time_s is not None:
                t.times.append(float(iter_time_s))
            t.time_total += float(iter_time_s or 0.0)
            result = {self.metric: value, ITERATION: it, "time_this_iter_s": float(iter_time_s or 0.0),
                      "time_total_s": t.time_total, "done": False, "trial_id": trial.trial_id}
            t.done, t.loss = it, value
            decision = self.scheduler.on_trial_result(self._controller, trial, result)
            if decision == TrialScheduler.STOP or it >= self.max_iterations:
                result["done"] = True
            if decision != TrialScheduler.STOP:
                self.search_alg.on_trial_result(trial.trial_id, result)
            trial.update_last_result(result)
            if decision == TrialScheduler.PAUSE and it < self.max_iterations:
                self._controller.pause_trial(trial)
            elif decision in (TrialScheduler.STOP, TrialScheduler.PAUSE) or it >= self.max_iterations:
                self._controller.stop_trial(trial)
            elif decision != TrialScheduler.CONTINUE:
                raise ValueError(f"{type(self.scheduler).__name__} decided {decision!r} for {job_id}; only CONTINUE, "
                                 "PAUSE and STOP are supported")
            self._note_best()
        self._fill()
        self.touch()
        return [j for j in running if self._trials[j].trial.status != Trial.RUNNING]

    def fail(self, job_id: str) -> list[str]:
        """The runner gave up on the trial's job: Tune's trial error (the scheduler's ``on_trial_error``,
        the searcher's ``on_trial_complete(error=True)``, status ERROR), and the next trial starts.
        Returns the jobs to stop (any trial the scheduler took off RUNNING because of it)."""
        t = self._trials.get(job_id)
        if t is None:
            raise KeyError(f"{job_id!r} is not a trial of this Tune search")
        self.journal_fail(job_id)
        trial = t.trial
        running = self._running_ids()
        if trial.status in (Trial.RUNNING, Trial.PENDING):
            self.scheduler.on_trial_error(self._controller, trial)
            self.search_alg.on_trial_complete(trial.trial_id, error=True)
        elif trial.status == Trial.PAUSED:
            self.scheduler.on_trial_remove(self._controller, trial)
            self.search_alg.on_trial_complete(trial.trial_id, error=True)
        if trial.status in _LIVE:
            trial.set_status(Trial.ERROR)
        self._fill()
        self.touch()
        return [j for j in running if j != job_id and self._trials[j].trial.status != Trial.RUNNING]

    def best(self) -> Result | None:
        """Tune's default best (``ResultGrid.get_best_result(scope="last")``): the trial whose last
        reported loss is lowest (ties: the older trial); None before any report."""
        return self._best

    def _note_best(self) -> None:
        reported = [x for x in self._trials.values() if x.done > 0]
        top = min(reported, key=lambda x: (x.loss if math.isfinite(x.loss) else math.inf, x.number))
        self._best = Result(top.job_id, top.params, top.loss, float(top.done))

    # ---- making and starting trials, as Tune's controller does -------------------------------------

    def _running_ids(self) -> list[str]:
        return [j for j, t in self._trials.items() if t.trial.status == Trial.RUNNING]

    def _add(self) -> bool:
        """One trial from the search algorithm, given to the scheduler (``on_trial_add``, with NumPy's
        global generator seeded from ``seed`` and the trial's number for the call: ASHA draws brackets
        from it). False when the search has none to give now."""
        trial = self.search_alg.next_trial()
        if trial is None:
            if self.search_alg.is_finished():
                self._search_done = True
            return False
        number = len(self._trials)
        job_id = f"{self.job_prefix}{number}"
        params = _plain(dict(trial.config), "config")
        self._trials[job_id] = _TuneTrial(job_id, number, trial, params)
        self._by_tune_id[trial.trial_id] = job_id
        state = np.random.get_state()
        np.random.seed((self.seed * 1_000_003 + number) % 2**32)
        try:
            self.scheduler.on_trial_add(self._controller, trial)
        finally:
            np.random.set_state(state)
        return True

    def _start(self) -> None:
        while len(self._running_ids()) < self.parallel:
            if not self._search_done and not any(t.trial.status == Trial.PENDING for t in self._trials.values()):
                self._add()
            trial = self.scheduler.choose_trial_to_run(self._controller)
            if trial is None:
                return
            trial.set_status(Trial.RUNNING)
            if self._trials[self._by_tune_id[trial.trial_id]].done >= self.max_iterations:
                self._controller.stop_trial(trial)  # resumed at its end: it has nothing to train

    def _fill(self) -> None:
        """Start trials up to ``max_concurrent_trials`` (the scheduler's ``choose_trial_to_run``, new
        trials from the search algorithm when none is pending). When none can run while some wait
        (paused or pending trials nobody will choose: Tune would wait forever), the oldest is stopped."""
        while True:
            self._start()
            if self._running_ids():
                return
            waiting = [t for t in self._trials.values() if t.trial.status in (Trial.PENDING, Trial.PAUSED)]
            if not waiting:
                return
            log.warning("%s waits and no Tune trial can run: stopping it at iteration %d", waiting[0].job_id,
                        waiting[0].done)
            self._controller.stop_trial(waiting[0].trial)

    # ---- introspection --------------------------------------------------------------------------------

    def trial_params(self, job_id: str) -> dict[str, Any]:
        return self._trials[job_id].params

    def trials(self) -> list[str]:
        return list(self._trials)

    def status(self, job_id: str) -> str:
        """Tune's status of the trial: PENDING, RUNNING, PAUSED, TERMINATED or ERROR."""
        return self._trials[job_id].trial.status

    def tune_trial(self, job_id: str) -> Trial:
        """Tune's ``Trial`` object of the job (its ``trial_id`` is what the searcher and scheduler know)."""
        return self._trials[job_id].trial

    def outcome(self, job_id: str) -> str | None:
        """For the run's record: ``paused``, ``completed`` (ran to ``max_iterations`` or the scheduler's
        end), ``pruned`` (stopped before), ``failed``; None while Tune runs it or has not started it."""
        t = self._trials[job_id]
        status = t.trial.status
        if status == Trial.PAUSED:
            return "paused"
        if status == Trial.ERROR:
            return "failed"
        if status == Trial.TERMINATED:
            return "completed" if t.done >= self.max_iterations else "pruned"
        return None

    def trials_planned(self) -> int:
        return max(int(self.search_alg.total_samples or 0), len(self._trials))

    def trials_decided(self) -> int:
        return sum(1 for t in self._trials.values() if t.trial.status in (Trial.TERMINATED, Trial.ERROR))

    def last_result(self, job_id: str) -> tuple[float, float] | None:
        t = self._trials[job_id]
        return (float(t.done), t.loss) if t.done > 0 else None

    # ---- the estimate (Figure 8, D4) -------------------------------------------------------------------

    def _default_time(self) -> float:
        known = [x for t in self._trials.values() if (x := t.iter_time()) is not None]
        return statistics.median(known) if known else self.iter_time_serial

    def _decided_lengths(self) -> list[int]:
        return [t.done for t in self._trials.values() if t.trial.status in (Trial.TERMINATED, Trial.ERROR)]

    def expected_iterations_left(self, job_id: str | None, done: float = 0.0) -> float:
        """Iterations trial ``job_id`` (None: a trial not made yet) is expected to run beyond ``done``
        (see the module docstring)."""
        end = float(self.max_iterations)
        if self.pessimistic:
            return max(0.0, end - done)
        kind = self.settings["kind"]
        trial = None if job_id is None else self._trials[job_id].trial
        if kind == "asha":
            rf = self.settings["reduction_factor"]
            if trial is not None:
                ahead = asha_decisions_ahead(self.scheduler, trial)  # type: ignore[arg-type]
                return _rungs(ahead, [1 / rf] * len(ahead), end).expected_left(done)
            sizes = np.array([len(b) for b in self.settings["brackets"]], dtype=float)
            weights = np.e ** (sizes - sizes.max())  # Tune's own bracket draw (AsyncHyperBandScheduler.on_trial_add)
            weights /= weights.sum()
            return float(sum(w * _rungs(sorted(b), [1 / rf] * len(b), end).expected_left(done)
                             for w, b in zip(weights, self.settings["brackets"])))
        if kind == "hyperband":
            if trial is not None:
                milestones, keep = hyperband_decisions_ahead(self.scheduler, trial)  # type: ignore[arg-type]
                if milestones:
                    return _rungs(milestones, keep, end).expected_left(done)
                return max(0.0, end - done)
            return self._fresh_hyperband(done)
        lengths = self._decided_lengths()
        longer = [n - done for n in lengths if n > done]
        return statistics.fmean(longer) if longer else max(0.0, end - done)

    def _fresh_hyperband(self, done: float) -> float:
        """A trial not made yet: one band's brackets s = 0 .. s_max (Tune's ``_get_n0``/``_get_r0``), each
        weighted by its size."""
        eta, s_max_1, top = self.settings["eta"], self.settings["s_max_1"], self.settings["max_t"] or self.max_iterations
        total = weight = 0.0
        for s in range(s_max_1):
            n0, r = int(math.ceil(s_max_1 / (s + 1) * eta**s)), int(top * eta ** (-s))
            if r == 0:
                continue
            milestones, keep, n = [r], [], n0
            for _ in range(s):
                kept = math.ceil(n / eta)
                keep.append(kept / n)
                n, r = kept, int(min(r * eta, top))
                milestones.append(r)
            total += n0 * _rungs(milestones, keep, float(self.max_iterations)).expected_left(done)
            weight += n0
        return total / weight if weight else max(0.0, self.max_iterations - done)

    def _plan(self) -> tuple[list[JobInfo], float]:
        """The lanes and the expected work left in GPU-seconds at S = 1 (as the Optuna adapter's)."""
        if self._lanes is not None and self._lanes[0] == self.version:
            return self._lanes[1], self._lanes[2]
        default = self._default_time()
        heads: list[tuple[str, float, float]] = []
        queued: list[float] = []
        for t in self._trials.values():
            status = t.trial.status
            if status not in _LIVE:
                continue
            time = t.iter_time() or default
            work = self.expected_iterations_left(t.job_id, t.done) * time
            if status == Trial.RUNNING:
                heads.append((t.job_id, time, work))
            else:
                queued.append(work)
        future = 0 if self._search_done else max(0, self.trials_planned() - len(self._trials))
        queued += [self.expected_iterations_left(None) * default] * future
        jobs, total = lanes(heads, queued, self.parallel, self.job_prefix, default, self.slowdown, self.trial_demand)
        self._lanes = (self.version, jobs, total)
        return jobs, total

    def jobs_remaining(self, gpu_alloc: Sequence[Position]) -> list[JobInfo]:
        """One JobInfo per lane: its running trial's expected end plus the trials queued behind it."""
        return self._plan()[0]

    def work_left(self) -> float:
        return self._plan()[1]

    def work_done(self) -> float:
        default = self._default_time()
        return sum(t.done * (t.iter_time() or default) for t in self._trials.values())

    def budget(self) -> float:
        """B: work done plus the expected work left (GPU-seconds at S = 1)."""
        return self.work_done() + self.work_left()

    def job_starts(self) -> int:
        """D30: each trial starts once when it runs alone (HyperBand's paused trials start again: not counted)."""
        return self.trials_planned() * self.trial_demand

    def demand_max(self) -> int:
        return self.parallel * self.trial_demand

    def demand_now(self) -> int:
        return len(self._running_ids()) * self.trial_demand


def _unresolved(value: Any) -> bool:
    """Does a search space hold something to sample (a Tune ``Domain``, a ``grid_search``)?"""
    if isinstance(value, Domain):
        return True
    if isinstance(value, Mapping):
        return "grid_search" in value or any(_unresolved(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_unresolved(v) for v in value)
    return False


def _check_supported(scheduler: Any, search_alg: Any) -> None:
    if isinstance(scheduler, str) or isinstance(search_alg, str):
        raise TypeError("give the scheduler and the search algorithm as objects (ASHAScheduler(...), OptunaSearch(...)), "
                        "not by name")
    if not isinstance(scheduler, TrialScheduler):
        raise TypeError(f"TuneConfig.scheduler must be a ray.tune TrialScheduler, got {type(scheduler).__name__}")
    if isinstance(scheduler, PopulationBasedTraining):
        raise TypeError(f"{type(scheduler).__name__} is not supported: it copies checkpoints between trials and "
                        "changes their configs, and a Themis checkpoint belongs to one trial")
    if isinstance(scheduler, HyperBandForBOHB):
        raise TypeError("HyperBandForBOHB is not supported (it drives its searcher through Tune's controller); use "
                        "HyperBandScheduler or ASHAScheduler")
    if isinstance(scheduler, ResourceChangingScheduler):
        raise TypeError("ResourceChangingScheduler is not supported: the arbiter decides the GPUs a trial gets")
    if search_alg is not None and not isinstance(search_alg, (Searcher, SearchAlgorithm)):
        raise TypeError(f"TuneConfig.search_alg must be a ray.tune Searcher or SearchAlgorithm, "
                        f"got {type(search_alg).__name__}")
