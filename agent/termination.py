"""Loss-based termination: a job whose loss has stopped improving is ended (Blox, seeds/000,
section 5.3; D34).

An app may declare a :class:`ConvergenceRule`: a job has converged when its last ``patience`` loss
reports brought no improvement of more than ``min_delta`` over the best loss it reported before them
(``min_delta`` a share of that best loss, or with ``relative=False`` an absolute amount) -- the rule
of Keras's and Lightning's early stopping. The job is then ended, its trial counts as finished at its
latest loss, and its GPUs go back to the app (and, beyond its demand, to the cluster) at once.

Curve stopping (D4, ``agent.curves``, ``hyperparam_adapters.curve_stopping``) *predicts* where a
curve will flatten and stops the job there; this rule waits until the reports *show* it flat. It
needs no fit and no tolerance on an asymptote, only the losses the job already reports, so it can
end any job -- a trial of a search that runs every configuration to a fixed length, or one
training run -- whichever scheduler the app uses. Only finite losses count: a job reporting
infinity or NaN is failing, not converging (the tuner's own rules deal with it).

:class:`LossWatch` applies one rule to the reports of many jobs, keeping per job only the best loss
before its window and the window itself. The runner (``agent.runner``, the service) feeds it the
reports the job metrics bring; the simulator (``simulator.apps.converge_points``) feeds it the
simulated curves at the jobs' report points. Both then end the job the same way.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ConvergenceRule:
    """Stop a job when its last ``patience`` reports improved on its earlier best by at most
    ``min_delta`` (a share of that best loss when ``relative``, else an absolute amount)."""

    min_delta: float
    patience: int
    relative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.min_delta, bool) or not isinstance(self.min_delta, (int, float)) \
                or not math.isfinite(self.min_delta) or self.min_delta < 0:
            raise ValueError(f"convergence rule: min_delta must be a finite number >= 0, got {self.min_delta!r}")
        if isinstance(self.patience, bool) or not isinstance(self.patience, int) or self.patience < 1:
            raise ValueError(f"convergence rule: patience must be a whole number of reports >= 1, "
                             f"got {self.patience!r}")
        if not isinstance(self.relative, bool):
            raise ValueError(f"convergence rule: relative must be true or false, got {self.relative!r}")

    @classmethod
    def parse(cls, text: str) -> ConvergenceRule:
        """``MIN_DELTA:PATIENCE[:abs|rel]``, e.g. ``0.01:3`` (1% of the best loss over 3 reports) or
        ``0.005:4:abs`` (an absolute 0.005 over 4 reports)."""
        parts = [p.strip() for p in str(text).split(":")]
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("abs", "rel")):
            raise ValueError(f"convergence rule {text!r}: expected MIN_DELTA:PATIENCE[:abs|rel], e.g. 0.01:3")
        try:
            min_delta = float(parts[0])
        except ValueError:
            raise ValueError(f"convergence rule {text!r}: MIN_DELTA must be a number, got {parts[0]!r}") from None
        try:
            patience = int(parts[1])
        except ValueError:
            raise ValueError(f"convergence rule {text!r}: PATIENCE must be a whole number, got {parts[1]!r}") from None
        return cls(min_delta, patience, relative=len(parts) == 2 or parts[2] == "rel")

    def spec(self) -> str:
        """The text :meth:`parse` reads back into this rule."""
        return f"{self.min_delta:g}:{self.patience}" + ("" if self.relative else ":abs")

    def improved(self, best_before: float, best_recent: float) -> bool:
        """Whether ``best_recent`` beats ``best_before`` by more than the rule's ``min_delta``."""
        need = self.min_delta * abs(best_before) if self.relative else self.min_delta
        return best_before - best_recent > need

    def converged(self, losses: Sequence[float]) -> bool:
        """Whether a job that reported ``losses`` (in order) has converged by this rule."""
        finite = [x for x in losses if math.isfinite(x)]
        if len(finite) <= self.patience:
            return False
        return not self.improved(min(finite[:-self.patience]), min(finite[-self.patience:]))


class _Job:
    __slots__ = ("best_before", "window")

    def __init__(self, patience: int):
        self.best_before = math.inf
        self.window: deque[float] = deque(maxlen=patience)


class LossWatch:
    """One :class:`ConvergenceRule` over the loss reports of many jobs. A job that has converged
    stays converged (``converged_at``): a later run of it -- a search that promotes it, a restart
    from its checkpoint -- is ended at its first report."""

    def __init__(self, rule: ConvergenceRule):
        self.rule = rule
        self._jobs: dict[str, _Job] = {}
        #: job -> (iteration, loss) of the report at which it converged
        self.converged_at: dict[str, tuple[float, float]] = {}

    def report(self, job: str, iteration: float, loss: float) -> bool:
        """Take one report; True when the job has converged (now or before)."""
        if job in self.converged_at:
            return True
        if not math.isfinite(loss):
            return False
        state = self._jobs.get(job)
        if state is None:
            state = self._jobs[job] = _Job(self.rule.patience)
        if len(state.window) == state.window.maxlen:
            state.best_before = min(state.best_before, state.window[0])
        state.window.append(loss)
        if (len(state.window) == state.window.maxlen and math.isfinite(state.best_before)
                and not self.rule.improved(state.best_before, min(state.window))):
            self.converged_at[job] = (float(iteration), float(loss))
            del self._jobs[job]
            return True
        return False

    def forget(self, job: str) -> None:
        """Drop what is known of ``job`` (it was given up)."""
        self._jobs.pop(job, None)
        self.converged_at.pop(job, None)
