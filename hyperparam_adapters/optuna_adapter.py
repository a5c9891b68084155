"""An Optuna study as a Themis app (paper Figure 8), driven by ask/tell instead of an objective.

Tuner side. ``OptunaAdapter`` wraps an :class:`optuna.Study` whose pruner is a
``HyperbandPruner``, ``SuccessiveHalvingPruner`` or ``MedianPruner``. No objective function runs:

* :meth:`OptunaAdapter.runnable` creates trials with ``study.ask()`` only when the runner has GPUs
  for them -- at most ``parallel`` trials run at once, at most ``n_trials`` are ever asked, and with
  ``runnable(gpus=k)`` no more trials run than the k GPUs granted can hold;
* jobs report through :meth:`OptunaAdapter.observe`: ``trial.report(loss, step)`` then
  ``trial.should_prune()``; a pruned trial is told ``TrialState.PRUNED``, a trial that reaches
  ``max_resource`` iterations is told COMPLETE with its last loss, and both ids are returned as
  stopped. ``iteration`` is the number of iterations (resource units) the job has completed; the
  Optuna step is ``iteration - 1`` because Optuna's pruners count steps from 0 (``Trial.report``'s
  documentation; ``HyperbandPruner``'s automatic ``max_resource`` is the last step + 1).

Figure 8 side: a curve-stopping scheduler (D4), not a successive-halving one (D3). Optuna's
``SuccessiveHalvingPruner`` and ``HyperbandPruner`` are *asynchronous* successive halving (ASHA):
a trial reaching a rung is promoted or pruned at once against the trials that reached the rung
before it, never waiting for a rung to fill, so there are no phases whose slowest job ends them.
Eq. 2's sum of per-phase maxima would charge the app barrier waits that never happen, and "the
current phase" is undefined while trials stand at different rungs. What Optuna does have is D4's
shape: every running trial has a predicted stop, known from the pruner. ``MedianPruner`` is a
curve-comparison stop rule, D4 exactly.

The estimate (:meth:`OptunaAdapter.expected_iterations_left`):

* SH/Hyperband. A bracket with ``min_resource`` r, ``reduction_factor`` eta and early-stopping
  rate s decides at steps r * eta^(s+k), k = 0, 1, ..., i.e. after b_k = r * eta^(s+k) + 1
  iterations; decisions at or after the last step cannot save work, so only b_k < max_resource M
  count, and b_m = M closes the list. A trial that passed k rungs and has done d iterations runs
  to b_k for sure and each further segment with probability eta^-(number of further rungs):
  ``left(d) = (b_k - d) + sum_{j>k} (b_j - b_{j-1}) / eta^(j-k)``. A fresh trial expects
  ``left(0)``. This is the count D3 uses for future phases (phase i runs n / eta^(i-1) jobs), taken
  per trial. A trial's bracket (Hyperband) is the one Optuna computes from the study name and the
  trial number, so trials not asked yet get the bracket of the number they will receive.
* Median. No rungs: the empirical remaining length, ``mean(L - d)`` over the study's finished
  trials (pruned or complete) that ran more than d iterations, M - d when none did.
* D4 says to use the *pessimistic* end of a fitted curve. The pessimistic end of a pruned search is
  "nothing is ever pruned", which would make every Optuna app bid for a budget it will not spend;
  here the stop rule is known and what is uncertain is which trials lose, whose expected number the
  pruner fixes. So the default is the expectation; ``pessimistic=True`` gives D4's literal reading
  (every trial runs to M).

Trials still to ask (``n_trials`` minus those asked) and running trials share ``parallel`` lanes
(the runner starts a trial whenever one ends): a running trial heads each lane, the next trials in
trial-number order go to the lane that frees first (list scheduling), and each lane is one
``JobInfo`` (id of its running trial, or ``<prefix>next-<k>`` for a lane not started yet) whose
work is the lane's total at its head's iteration time. So ``T_sh`` (D4: the last job to finish)
counts the queued trials and never assumes more than ``parallel`` trials run at once. B (Eq. 2) is
the work done plus the same estimate of the work left, in GPU-seconds at S = 1.

Iteration times: each trial's serial time is the mean of what it reported (``iter_time_s``),
converted with D2: ``iter_time_s * min(|G|, trial_demand) / S(G)``, with G the GPUs
:meth:`OptunaAdapter.assign` gave it (or the ``gpus=`` passed to observe; one GPU when unknown) and
S the app's current ``slowdown`` (which ``agent.profiler.Profiler.apply`` keeps up to date).
Trials without a measurement, and trials not asked yet, use the median of the measured trials (D3's
median rule), else ``iter_time_serial``.

Fragile points of Optuna's API are confined to :func:`pruner_settings` (private attributes: Optuna
has no public getters for a pruner's settings) and :func:`hyperband_bracket` (a re-implementation of
``HyperbandPruner._get_bracket_id``, which answers 0 until the pruner's first decision); both are
checked against the installed Optuna by ``tests/test_optuna_adapter.py``.
"""

from __future__ import annotations

import binascii
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.pruners import HyperbandPruner, MedianPruner, SuccessiveHalvingPruner
from optuna.study import StudyDirection
from optuna.trial import TrialState

from agent.appsched import CurveStoppingScheduler, JobInfo
from agent.fairness import split_allocation
from agent.placement import NO_SLOWDOWN, Position, Slowdown, locality_of
from agent.trial import TrialSpec
from hyperparam_adapters.base import Result, TunerAdapter, lanes

__all__ = ["OptunaAdapter", "RungSchedule", "hyperband_bracket", "pruner_settings", "rung_schedule"]

_FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
RUN_ATTR = "themis_run"  # user attribute naming the search run a trial belongs to


# ---------------------------------------------------------------------------------------------- pruner schedule


def pruner_settings(pruner: optuna.pruners.BasePruner) -> dict[str, Any]:
    """The settings of a Hyperband or successive-halving pruner.

    PRIVATE OPTUNA ATTRIBUTES: Optuna 5.0 keeps them only as ``_min_resource``, ``_max_resource``,
    ``_reduction_factor`` and ``_min_early_stopping_rate`` (no public getter). They are read here
    and nowhere else; ``test_pruner_settings_match_the_installed_optuna`` fails if Optuna renames
    them. ``min_resource``/``max_resource`` are None when the pruner was given "auto".
    """
    try:
        if isinstance(pruner, HyperbandPruner):
            max_resource = pruner._max_resource
            return {
                "min_resource": int(pruner._min_resource),
                "max_resource": max_resource if isinstance(max_resource, int) else None,
                "reduction_factor": int(pruner._reduction_factor),
            }
        if isinstance(pruner, SuccessiveHalvingPruner):
            min_resource = pruner._min_resource
            return {
                "min_resource": min_resource if isinstance(min_resource, int) else None,
                "reduction_factor": int(pruner._reduction_factor),
                "min_early_stopping_rate": int(pruner._min_early_stopping_rate),
            }
    except AttributeError as exc:
        raise RuntimeError(
            f"optuna {optuna.__version__} changed the private attributes of {type(pruner).__name__} "
            f"that hyperparam_adapters.optuna_adapter.pruner_settings reads ({exc})"
        ) from None
    raise TypeError(f"{type(pruner).__name__} has no rung schedule")


def _n_brackets(min_resource: int, max_resource: int, reduction_factor: int) -> int:
    # the same expression as HyperbandPruner._try_initialization, so the same float rounding
    return math.floor(math.log(max_resource / min_resource, reduction_factor)) + 1


def hyperband_bracket(study_name: str, number: int, min_resource: int, max_resource: int, reduction_factor: int) -> int:
    """The bracket HyperbandPruner puts trial ``number`` of study ``study_name`` in.

    Re-implements Optuna 5.0's ``HyperbandPruner._get_bracket_id`` (crc32 of "<study>_<number>"
    modulo the brackets' total trial budget, budgets ceil(n * eta^s / (s + 1)) for s = n - 1 - id),
    which is private and answers 0 for every trial until the pruner's first decision. Checked
    against it by ``test_hyperband_bracket_matches_optuna``.
    """
    n = _n_brackets(min_resource, max_resource, reduction_factor)
    budgets = [math.ceil(n * reduction_factor ** (n - 1 - b) / (n - b)) for b in range(n)]
    left = binascii.crc32(f"{study_name}_{number}".encode()) % sum(budgets)
    for bracket, budget in enumerate(budgets):
        left -= budget
        if left < 0:
            return bracket
    raise AssertionError("unreachable: the budgets sum to the modulus")


@dataclass(frozen=True)
class RungSchedule:
    """One successive-halving bracket: ``boundaries`` b_0 < ... < b_m = max_resource, in completed
    iterations, where b_k (k < m) is where the trial's k-th rung is decided."""

    boundaries: tuple[int, ...]
    reduction_factor: int

    def expected_left(self, done: float) -> float:
        """Iterations a trial that has done ``done`` (and is still running) is expected to run more."""
        bounds, eta = self.boundaries, self.reduction_factor
        if done >= bounds[-1]:
            return 0.0
        k = sum(1 for b in bounds[:-1] if b <= done)  # rungs already passed
        left = bounds[k] - done
        for j in range(k + 1, len(bounds)):
            left += (bounds[j] - bounds[j - 1]) / eta ** (j - k)
        return left


def rung_schedule(min_resource: int, reduction_factor: int, early_stopping_rate: int, max_resource: int) -> RungSchedule:
    """Where Optuna's successive halving decides: at steps r * eta^(s+k), i.e. after that + 1
    iterations (steps count from 0); only decisions before the last step (M - 1) can save work."""
    bounds: list[int] = []
    k = 0
    while (step := min_resource * reduction_factor ** (early_stopping_rate + k)) < max_resource - 1:
        bounds.append(step + 1)
        k += 1
    return RungSchedule((*bounds, max_resource), reduction_factor)


# ---------------------------------------------------------------------------------------------- the adapter


class OptunaAdapter(TunerAdapter, CurveStoppingScheduler):
    """An ask/tell Optuna study behind Figure 8's curve-stopping API; see the module docstring.

    ``search_space`` (name -> Optuna distribution) is passed to ``study.ask``; ``suggest``, if
    given, is called with each new trial to suggest define-by-run parameters. One of the two is
    required (issue 11: without either every trial ran with no hyperparameters). ``trial_demand`` is
    each trial's GPU demand (job_demand_max); ``max_resource`` the iterations of a full trial
    (taken from a HyperbandPruner when omitted).
    """

    def __init__(
        self,
        study: optuna.Study,
        *,
        n_trials: int,
        max_resource: int | None = None,
        parallel: int = 1,
        trial_demand: int = 1,
        search_space: Mapping[str, BaseDistribution] | None = None,
        suggest: Callable[[optuna.Trial], None] | None = None,
        iter_time_serial: float = 1.0,
        slowdown: Slowdown = NO_SLOWDOWN,
        start_time: float = 0.0,
        job_prefix: str = "trial-",
        pessimistic: bool = False,
    ) -> None:
        if len(study.directions) != 1 or study.direction != StudyDirection.MINIMIZE:
            raise ValueError("the study must have one objective, minimized (jobs report a loss)")
        pruner = study.pruner
        if not isinstance(pruner, (HyperbandPruner, SuccessiveHalvingPruner, MedianPruner)):
            raise TypeError(
                f"the study's pruner must be a HyperbandPruner, SuccessiveHalvingPruner or MedianPruner, "
                f"got {type(pruner).__name__}"
            )
        self.run_id: str | None = None  # the search run (agent.search_run) that asks; AppRunner sets it
        self._settings: dict[str, Any] = {}
        if isinstance(pruner, (HyperbandPruner, SuccessiveHalvingPruner)):
            self._settings = pruner_settings(pruner)
            if self._settings["min_resource"] is None:
                raise ValueError("the pruner's min_resource must be a number, not 'auto' (the rungs must be known)")
        if isinstance(pruner, HyperbandPruner):
            pruner_max = self._settings["max_resource"]
            if pruner_max is None:
                raise ValueError("the HyperbandPruner's max_resource must be a number, not 'auto'")
            if max_resource is None:
                max_resource = pruner_max
            elif max_resource != pruner_max:
                raise ValueError(f"max_resource {max_resource} differs from the HyperbandPruner's {pruner_max}")
        if isinstance(max_resource, bool) or not isinstance(max_resource, int) or max_resource < 1:
            raise ValueError(f"max_resource must be an int >= 1, got {max_resource!r}")
        for name, value in (("n_trials", n_trials), ("parallel", parallel), ("trial_demand", trial_demand)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not (iter_time_serial > 0 and math.isfinite(iter_time_serial)):
            raise ValueError(f"iter_time_serial must be finite and > 0, got {iter_time_serial!r}")
        if not search_space and suggest is None:  # issue 11: every trial ran with params={}
            raise ValueError(
                "OptunaAdapter needs a search space: pass search_space={'lr': FloatDistribution(1e-4, 1e-1, log=True), "
                "...} (name -> optuna.distributions), or suggest=fn where fn(trial) calls trial.suggest_*(...) as "
                "your objective did; without one every trial would run with no hyperparameters")
        if suggest is not None and not callable(suggest):
            raise TypeError(f"suggest must be a function of the trial, got {type(suggest).__name__}")
        self.study = study
        self.n_trials = n_trials
        self.max_resource = max_resource
        self.parallel = parallel
        self.trial_demand = trial_demand
        self.search_space = dict(search_space or {})
        self.suggest = suggest
        self.iter_time_serial = float(iter_time_serial)
        self._slowdown: Slowdown = tuple(slowdown)  # type: ignore[assignment]
        self.start_time = start_time
        self.job_prefix = job_prefix
        self.pessimistic = pessimistic
        self.version = 0
        self.plan_version = 0
        self._running: dict[str, optuna.Trial] = {}  # job id -> trial, in ask order
        self._number: dict[str, int] = {}
        self._done: dict[str, int] = {}  # job id -> iterations completed (last report)
        self._loss: dict[str, float] = {}  # job id -> last reported loss
        self._stopped: dict[str, TrialState] = {}
        self._asked = 0
        self._positions: dict[str, tuple[Position, ...]] = {}  # job id -> GPUs assign() gave it
        self._measured: dict[str, dict[tuple[int, int], list[float]]] = {}  # job -> (level, min(|G|, d)) -> [sum, n]
        self._lanes: tuple[int, list[JobInfo], float] | None = None  # (version, lanes, work left)

    # -- app-side settings ---------------------------------------------------------------------------

    @property
    def slowdown(self) -> Slowdown:
        """Figure 8's locality sensitivity of every trial; setting it counts as a change of work."""
        return self._slowdown

    @slowdown.setter
    def slowdown(self, value: Slowdown) -> None:
        self._slowdown = tuple(value)  # type: ignore[assignment]
        self.touch()

    def job_id(self, number: int) -> str:
        return f"{self.job_prefix}{number}"

    def trial_number(self, job_id: str) -> int:
        return self._number[job_id]

    @property
    def asked(self) -> int:
        """Trials created so far (``study.ask`` calls made by this adapter)."""
        return self._asked

    def running(self) -> list[str]:
        return list(self._running)

    def stopped(self) -> dict[str, TrialState]:
        """Trials that ended, with the state they were told."""
        return dict(self._stopped)

    # -- tuner side ----------------------------------------------------------------------------------

    def runnable(self, gpus: int | None = None) -> list[TrialSpec]:
        """The running trials, oldest first, after asking new ones while fewer than ``parallel`` run,
        the ``n_trials`` budget lasts and (``gpus`` given) fewer trials run than there are GPUs."""
        limit = self.parallel if gpus is None else min(self.parallel, max(0, gpus))
        new = max(0, min(limit - len(self._running), self.n_trials - self._asked))
        for _ in range(new):
            trial = self.study.ask(self.search_space or None)
            if self.run_id is not None:
                trial.set_user_attr(RUN_ATTR, self.run_id)  # which search run owns it (resume)
            if self.suggest is not None:
                self._suggest(trial)
            job = self.job_id(trial.number)
            self._running[job] = trial
            self._number[job] = trial.number
            self._done[job] = 0
            self._asked += 1
        if new:
            self.touch()
        return [
            TrialSpec(job, dict(trial.params), self.trial_demand, self._done[job], self.max_resource)
            for job, trial in self._running.items()
        ]

    def _suggest(self, trial: optuna.Trial) -> None:
        """The user's ``suggest``. When it raises, the trial is told FAIL before the error goes on, as
        ``study.optimize`` does with an objective that raises: left RUNNING with part of its
        parameters, it would be taken up by a resumed run and trained with them."""
        try:
            self.suggest(trial)  # type: ignore[misc]
        except (Exception, KeyboardInterrupt):
            self.study.tell(trial, state=TrialState.FAIL)
            raise

    def assign(self, gpus: Mapping[str, Position]) -> dict[str, tuple[str, ...]]:
        """As ``TunerAdapter.assign`` (D3), asking first the trials these GPUs can run; remembers each
        trial's GPUs to turn its reported iteration times into serial ones."""
        specs = self.runnable(gpus=len(gpus))
        by_position: dict[Position, list[str]] = {}
        for gpu, pos in sorted(gpus.items()):
            by_position.setdefault(pos, []).append(gpu)
        positions = [p for p, ids in by_position.items() for _ in ids]
        jobs = {j.job_id: j for j in self.current_jobs(positions)}
        wanted = [jobs[t.job_id] for t in specs if t.job_id in jobs]
        out: dict[str, tuple[str, ...]] = {}
        for job, chunk in split_allocation(wanted, positions):
            out[job.job_id] = tuple(by_position[p].pop(0) for p in chunk)
            self._positions[job.job_id] = tuple(chunk)
        return out

    def observe(
        self,
        job_id: str,
        iteration: float,
        loss: float,
        iter_time_s: float | None = None,
        *,
        gpus: Sequence[Position] | None = None,
    ) -> list[str]:
        """Report ``loss`` after ``iteration`` completed iterations (Optuna step ``iteration - 1``);
        returns ``[job_id]`` when the trial is pruned, reaches ``max_resource`` (told COMPLETE) or
        had already ended, else ``[]``. ``gpus`` are the GPUs the job ran on when it is not where
        :meth:`assign` put it."""
        if job_id in self._stopped:
            return [job_id]  # a late report from a job the runner has not stopped yet
        trial = self._running.get(job_id)
        if trial is None:
            raise KeyError(f"{job_id!r} is not a trial of this app")
        if not (math.isfinite(iteration) and iteration >= 1 and iteration == int(iteration)):
            raise ValueError(f"{job_id}: iteration must be a whole number >= 1 (iterations completed), got {iteration!r}")
        if iter_time_s is not None and not (iter_time_s > 0 and math.isfinite(iter_time_s)):
            raise ValueError(f"{job_id}: iter_time_s must be finite and > 0, got {iter_time_s!r}")
        it, value = int(iteration), float(loss)
        trial.report(value, it - 1)  # Optuna's steps count from 0
        if iter_time_s is not None:
            self._measure(job_id, iter_time_s, gpus)
        self._done[job_id] = max(self._done[job_id], it)
        self._loss[job_id] = value
        stopped: list[str] = []
        if trial.should_prune():
            self._finish(job_id, self.study.tell(trial, state=TrialState.PRUNED).state)
            stopped.append(job_id)
        elif it >= self.max_resource:
            self._finish(job_id, self.study.tell(trial, value).state)
            stopped.append(job_id)
        self.touch()
        return stopped

    def resume(self) -> list[str]:
        """Go on with the search an interrupted run of this study left (issue 11; ``AppRunner.create(
        resume=True)`` calls it): its RUNNING trials are taken up again under their job ids, from the
        iteration they last reported (their jobs resume from their checkpoints), and every trial of
        the study counts toward ``n_trials``. A RUNNING trial that already reported ``max_resource``
        iterations (the run ended between its report and the tell) is told COMPLETE here with its last
        loss, not started again: its job would train past its target. The study must come from its
        storage (``optuna.load_study`` or ``create_study(..., load_if_exists=True)``). Returns the job
        ids taken up.

        PRIVATE OPTUNA ATTRIBUTE: a ``FrozenTrial`` has no public getter for its storage id, which
        ``optuna.Trial(study, trial_id)`` needs; ``_trial_id`` is read here and nowhere else
        (``test_a_resumed_study_takes_up_its_running_trials`` fails if Optuna renames it)."""
        taken: list[str] = []
        for frozen in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if self.run_id is not None and frozen.user_attrs.get(RUN_ATTR, self.run_id) != self.run_id:
                continue  # another run's trial: its checkpoints are not this run's to resume
            job = self.job_id(frozen.number)
            if job in self._running or job in self._stopped:
                continue
            self._running[job] = optuna.Trial(self.study, frozen._trial_id)
            self._number[job] = frozen.number
            step = frozen.last_step
            self._done[job] = 0 if step is None else step + 1
            if step is not None:
                self._loss[job] = float(frozen.intermediate_values[step])
            if self._done[job] >= self.max_resource:  # at its target already: its result, not another run
                self._finish(job, self.study.tell(self._running[job], self._loss[job]).state)
                continue
            taken.append(job)
        self._asked = max(self._asked, len(self.study.get_trials(deepcopy=False)))
        self.touch()
        return taken

    def fail(self, job_id: str) -> list[str]:
        """The job died (the runner gave up on it): tell Optuna FAIL and free its lane. Returns the
        jobs to stop, as the other adapters' ``fail`` does (none: the failed job is not running)."""
        trial = self._running.get(job_id)
        if trial is None:
            raise KeyError(f"{job_id!r} is not a running trial of this app")
        self._finish(job_id, self.study.tell(trial, state=TrialState.FAIL).state)
        self.touch()
        return []

    def outcome(self, job_id: str) -> str | None:
        """For the run's record: what the study was told (``completed``, ``pruned``, ``failed``); None
        while the trial runs."""
        state = self._stopped.get(job_id)
        return None if state is None else {TrialState.COMPLETE: "completed", TrialState.PRUNED: "pruned",
                                           TrialState.FAIL: "failed"}.get(state, state.name.lower())

    def trials_planned(self) -> int:
        return self.n_trials

    def trials_decided(self) -> int:
        """Every trial asked of the study and not running: a resumed study's earlier ones too."""
        return self._asked - len(self._running)

    def last_result(self, job_id: str) -> tuple[float, float] | None:
        return (float(self._done[job_id]), self._loss[job_id]) if job_id in self._loss else None

    def _finish(self, job_id: str, state: TrialState) -> None:
        del self._running[job_id]
        self._stopped[job_id] = state

    def best(self) -> Result | None:
        """``study.best_trial`` once a trial completed; before that, provisionally, the trial with the
        lowest last reported loss; None before any report."""
        if self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            best = self.study.best_trial
            return Result(self.job_id(best.number), dict(best.params), float(best.value),
                          float((best.last_step or 0) + 1))
        if not self._loss:
            return None
        job = min(self._loss, key=lambda j: (self._loss[j], self._number[j]))
        params = self._running[job].params if job in self._running else self._frozen(job).params
        return Result(job, dict(params), self._loss[job], float(self._done[job]))

    def _frozen(self, job_id: str) -> optuna.trial.FrozenTrial:
        return self.study.get_trials(deepcopy=False)[self._number[job_id]]

    # -- iteration times -----------------------------------------------------------------------------

    def _measure(self, job_id: str, iter_time_s: float, gpus: Sequence[Position] | None) -> None:
        where = tuple(gpus) if gpus is not None else self._positions.get(job_id, ())
        level = locality_of(where) if len(where) > 1 else -1  # -1: one GPU, S = 1
        key = (level, min(max(1, len(where)), self.trial_demand))
        cell = self._measured.setdefault(job_id, {}).setdefault(key, [0.0, 0])
        cell[0] += iter_time_s
        cell[1] += 1

    def measured_iter_time_serial(self, job_id: str) -> float | None:
        """The trial's serial iteration time from its reports (D2 inverted), None before any."""
        cells = self._measured.get(job_id)
        if not cells:
            return None
        total = sum(s * k / (self._slowdown[level] if level >= 0 else 1.0) for (level, k), (s, _) in cells.items())
        return total / sum(n for _, n in cells.values())

    def _default_time(self) -> float:
        """Serial time of a trial without measurements: the median of the measured ones (D3), else
        ``iter_time_serial``."""
        known = [t for j in self._number if (t := self.measured_iter_time_serial(j)) is not None]
        return statistics.median(known) if known else self.iter_time_serial

    # -- the estimate ---------------------------------------------------------------------------------

    def _schedule(self, number: int) -> RungSchedule | None:
        s, pruner = self._settings, self.study.pruner
        if isinstance(pruner, HyperbandPruner):
            bracket = hyperband_bracket(self.study.study_name, number, s["min_resource"], self.max_resource,
                                        s["reduction_factor"])
            return rung_schedule(s["min_resource"], s["reduction_factor"], bracket, self.max_resource)
        if isinstance(pruner, SuccessiveHalvingPruner):
            return rung_schedule(s["min_resource"], s["reduction_factor"], s["min_early_stopping_rate"],
                                 self.max_resource)
        return None

    def expected_iterations_left(self, number: int, done: float, lengths: Sequence[int] | None = None) -> float:
        """Iterations trial ``number`` is expected to run beyond ``done`` (see the module docstring).
        ``lengths`` are the finished trials' lengths (MedianPruner's empirical estimate)."""
        if self.pessimistic:
            return max(0.0, self.max_resource - done)
        schedule = self._schedule(number)
        if schedule is not None:
            return schedule.expected_left(done)
        if lengths is None:
            lengths = self._finished_lengths()
        longer = [n - done for n in lengths if n > done]
        return statistics.fmean(longer) if longer else max(0.0, self.max_resource - done)

    def _finished_lengths(self) -> list[int]:
        return [t.last_step + 1 for t in self.study.get_trials(deepcopy=False, states=_FINISHED)
                if t.last_step is not None]

    def _plan(self) -> tuple[list[JobInfo], float]:
        """The lanes (see the module docstring) and the expected work left in GPU-seconds at S = 1."""
        if self._lanes is not None and self._lanes[0] == self.version:
            return self._lanes[1], self._lanes[2]
        lengths = None if self._settings or self.pessimistic else self._finished_lengths()
        default = self._default_time()
        heads: list[tuple[str, float, float]] = []  # (job id, serial time, work left in s)
        for job in self._running:
            t = self.measured_iter_time_serial(job) or default
            heads.append((job, t, self.expected_iterations_left(self._number[job], self._done[job], lengths) * t))
        future = max(0, self.n_trials - self._asked)
        first = len(self.study.get_trials(deepcopy=False))  # the number the next ask() gets
        queued = [self.expected_iterations_left(number, 0.0, lengths) * default for number in range(first, first + future)]
        jobs, total = lanes(heads, queued, self.parallel, self.job_prefix, default, self._slowdown, self.trial_demand)
        self._lanes = (self.version, jobs, total)
        return jobs, total

    # -- Figure 8 (curve stopping) --------------------------------------------------------------------

    def jobs_remaining(self, gpu_alloc: Sequence[Position]) -> list[JobInfo]:
        """One JobInfo per lane: its running trial's expected end plus the queued trials it will run."""
        return self._plan()[0]

    def work_left(self) -> float:
        """Expected GPU-seconds (S = 1) still to run: the running trials' and the trials not asked yet."""
        return self._plan()[1]

    def work_done(self) -> float:
        default = self._default_time()
        return sum(done * (self.measured_iter_time_serial(j) or default) for j, done in self._done.items())

    def budget(self) -> float:
        """B: work done plus the expected work left (GPU-seconds at S = 1)."""
        return self.work_done() + self.work_left()

    def job_starts(self) -> int:
        """D30: each trial starts once when it runs alone (a pruned one too)."""
        return self.n_trials * self.trial_demand

    def demand_max(self) -> int:
        return self.parallel * self.trial_demand

    def demand_now(self) -> int:
        return min(self.parallel, len(self._running) + max(0, self.n_trials - self._asked)) * self.trial_demand

    def placement_slowdown(self) -> Slowdown:
        return self._slowdown
