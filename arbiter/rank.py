"""The rho that ranks an app, computed by the arbiter from the work the app claims (D21).

The auction prices a lie in a bid (D15), but the rho that picks the bidders (D13) is the app's
word, and no auction sees it: an app that over-reports how much a spread placement slows it ranks
as worse off while it runs spread, and bids more often (Fig. 15). The arbiter can know an app's
placement slowdowns without asking it -- they are measurements of its model (the profile table,
``agent/profiles/slowdowns.toml``; in the simulator, the model's true slowdowns) -- while the work
an app has left cannot be known until it is done. So, ranking by ``measured``, the arbiter takes
the work from the app (:class:`protos.messages.WorkClaim`) and applies the slowdowns it knows:

    rho = (now - arrival + sum over phases of max(one_gpu, slot S0, machine S1, rack S2, cluster S3))
          / (B / min(R_C, demand_max) x N_avg)

which is Eq. 1 / Eq. 2 exactly as the agent computes it (``agent.fairness``), for the app's own
allocation, with the arrival the arbiter saw and its own N_avg. An app that held nothing as the
round opened has rho = infinity (or, with no work left, elapsed / T_id, as its own figure says),
and its waiting rho (D13) is the same formula on its fair share. The agent's own rho, including a
claim of infinity, is then not used for the rank. One slowdown per app: a search whose trials run
different models cannot be described by one profile, so bind only single-model searches.

The claim is checked against what the arbiter knows: finite, non-negative times, no work at a
locality level the allocation does not reach (an app holding one machine has no job spanning
racks), a claim on what it holds only when it holds something, and an ideal time T_id that is a
finite time > 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from arbiter.auction import RHO_MAX, RHO_MIN
from protos.messages import MAX_PHASES, WORK_COLUMNS, PhaseWork, WorkClaim

__all__ = ["MAX_PHASES", "PACE_BAND", "PACE_MAX", "RANKS", "WORK_FLOOR_BAND", "BadWorkClaim", "Pace", "check_claim", "check_rank",
           "measured_rho", "time_left", "work_left_floor"]

#: Where the rho that ranks an app comes from (D21): its report, or its claimed work at slowdowns
#: the arbiter knows.
RANKS = ("reported", "measured")
_SHARE_LEVEL = 1  # D13's fair share is packed on one machine: no job of it spans more
#: D29: a claimed pace within a factor 1 + PACE_BAND of the observed one is taken as it is. An
#: honest app's pace is off by what its claim cannot foresee -- later phases estimated at the current
#: phase's median, restarts inside a holding, jobs kept where they run instead of D3's split: at most
#: 1.6% on single-job traces (the crowded trace, Fig. 15), factors 0.61-1.33 on searches and
#: multi-job apps (paper setup, Workloads 1 and 2, 75 apps; the contended workload; session 17)
PACE_BAND = 0.7
#: D29: the most the arbiter scales an app's claims by
PACE_MAX = 10.0
#: D31: B is taken as at least the most work the app's claims said was left, over 1 + this. A
#: search's B is a plan at its trials' median speed while its claims follow the actual slowest trial,
#: so an honest claim can say up to 1.7% more work is left than its B holds (the contended workload;
#: 0.01% on the paper setup's Workload 2; 0 on the crowded trace; session 18)
WORK_FLOOR_BAND = 0.05


class BadWorkClaim(ValueError):
    """A work claim the arbiter cannot use; the message says what is wrong."""


def check_rank(rank: str) -> str:
    """``rank`` if it names one of :data:`RANKS`, else ValueError saying which there are."""
    if rank not in RANKS:
        raise ValueError(f"unknown rank {rank!r}; choose one of {', '.join(RANKS)} (D21)")
    return rank


def _phases(phases: object, what: str, deepest: int) -> tuple[PhaseWork, ...]:
    """The claim's phases as floats, checked: at most MAX_PHASES, five finite times >= 0 each, and
    no work at a locality level deeper than ``deepest`` (the allocation's, D1)."""
    if not isinstance(phases, (list, tuple)):
        raise BadWorkClaim(f"{what} must be a list of phases, got {type(phases).__name__}")
    if len(phases) > MAX_PHASES:
        raise BadWorkClaim(f"{what} has {len(phases)} phases, more than {MAX_PHASES}")
    out = []
    for k, phase in enumerate(phases):
        if not isinstance(phase, (list, tuple)) or len(phase) != len(WORK_COLUMNS):
            raise BadWorkClaim(f"{what} phase {k} must have {len(WORK_COLUMNS)} times ({', '.join(WORK_COLUMNS)})")
        for column, t in zip(WORK_COLUMNS, phase):
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t >= 0):
                raise BadWorkClaim(f"{what} phase {k} {column}: a time must be a finite number >= 0, got {t!r}")
        for level in range(deepest + 1, 4):
            if phase[level + 1] > 0:
                raise BadWorkClaim(f"{what} phase {k}: work at the {WORK_COLUMNS[level + 1]} level, beyond the "
                                   f"allocation's (D1 level {deepest})")
        out.append(tuple(float(t) for t in phase))
    return tuple(out)  # type: ignore[return-value]


def check_claim(claim: object, held: int, level: int) -> WorkClaim:
    """``claim`` as the arbiter can use it for an app holding ``held`` GPUs at D1 locality
    ``level`` as the round opened, or :class:`BadWorkClaim` naming the first thing wrong."""
    if not isinstance(claim, WorkClaim):
        raise BadWorkClaim(f"a work claim must be a WorkClaim, got {type(claim).__name__}")
    b, d = claim.work_gpu_s, claim.demand_max
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not (math.isfinite(b) and b > 0):
        raise BadWorkClaim(f"work_gpu_s must be a finite number > 0, got {b!r}")
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise BadWorkClaim(f"demand_max must be an integer >= 1, got {d!r}")
    if held:
        if not claim.held:
            raise BadWorkClaim(f"the app holds {held} GPU(s) and claims no work on them")
        if claim.share:
            raise BadWorkClaim("a fair-share claim comes only from an app that holds nothing")
    elif claim.held:
        raise BadWorkClaim("a claim on held GPUs from an app that holds none")
    return WorkClaim(float(b), d, _phases(claim.held, "held", level),
                     _phases(claim.share, "share", _SHARE_LEVEL))


@dataclass(frozen=True)
class Pace:
    """How fast an app's claimed time left went down while it held the same GPUs (D29).

    Between two reports on exactly the same GPUs, an app that claims its work truthfully burns one
    second of claimed time left per second held (at the slowdowns the arbiter applies). The arbiter
    adds up the seconds it watched (``observed_s``) and the claimed time left they burned
    (``claimed_s``); their ratio is how far the claims are off, whatever the app says they are."""

    observed_s: float = 0.0
    claimed_s: float = 0.0
    last: tuple[float, frozenset[str], float] | None = None  # (time, GPUs held, claimed time left then)

    def after(self, now: float, held: frozenset[str], left: float) -> "Pace":
        """This pace with a report at ``now`` on ``held`` claiming ``left`` seconds (at the arbiter's
        slowdowns); an interval counts only when the app held the same GPUs at both ends."""
        observed, claimed = self.observed_s, self.claimed_s
        if self.last is not None and self.last[1] == held and now > self.last[0]:
            observed += now - self.last[0]
            claimed += self.last[2] - left
        return Pace(observed, claimed, (now, held, left) if held else None)

    def factor(self, enough_s: float) -> float:
        """By how much the app's claims are scaled: 1 until ``enough_s`` seconds have been watched
        and while the claims keep pace within PACE_BAND; else observed / claimed, within
        [1 / PACE_MAX, PACE_MAX] (a claim that never went down while the app held GPUs: PACE_MAX)."""
        if self.observed_s < enough_s:
            return 1.0
        ratio = self.observed_s / self.claimed_s if self.claimed_s > 0 else PACE_MAX
        ratio = min(PACE_MAX, max(1.0 / PACE_MAX, ratio))
        return 1.0 if abs(math.log(ratio)) <= math.log1p(PACE_BAND) else ratio


def time_left(phases: Sequence[PhaseWork], slowdown: Sequence[float]) -> float:
    """The time left under the claimed phases at placement slowdowns ``slowdown`` (D1 levels 0-3)."""
    s0, s1, s2, s3 = slowdown
    return sum(max(one, slot * s0, machine * s1, rack * s2, spread * s3)
               for one, slot, machine, rack, spread in phases)


def work_left_floor(claim: WorkClaim) -> float:
    """D31: GPU-seconds of work the claim itself says are left, at the least: per phase its slowest
    job's time at slowdown 1, which is at most that job's work (a job on n GPUs takes its work / n).
    B is all the app's work, done and left, so a B below this contradicts the claim it comes with."""
    return sum(max(phase) for phase in (claim.held or claim.share))


def measured_rho(claim: WorkClaim, slowdown: Sequence[float], *, held: int, demand: int, elapsed: float,
                 n_avg: float, cluster_size: int, pace: float = 1.0, work_floor: float = 0.0,
                 contention: float = 1.0) -> tuple[float, float]:
    """(rho, waiting rho) of an app from its checked ``claim`` at ``slowdown`` (D21): rho on what
    it holds (infinity when it holds nothing and has work left), and D13's waiting rho on its fair
    share when it holds nothing and wants GPUs (else 0). Both are kept within the arbiter's bounds
    on rho (D7).

    :class:`BadWorkClaim` when the claim's T_id is not a finite time > 0: a B that passes
    :func:`check_claim` can still underflow to 0 over the app's GPUs (5e-324 / 4; rho would divide by
    zero) or overflow (rho would be inf / inf), and neither is an app's ideal time.

    ``pace`` (D29, :meth:`Pace.factor`) scales the claimed time left, and above 1 the claimed work B
    too: claims that went down slower than the time the app held its GPUs were too small, all of
    them alike (an app that says it is a smaller app that has waited longer); claims that went down
    faster were too big, and only the time left is scaled down, never B up or down, so that a
    correction never ranks an app as worse off than its own claims.

    ``work_floor`` (D31) is the most work the app's claims have ever said was left
    (:func:`work_left_floor`): B is taken as at least that over 1 + WORK_FLOOR_BAND, so a B
    understated below the app's own claims buys at most the band. Honest claims stay below it: B is
    their work, done and left (for a search, planned at its trials' median speed).

    ``contention`` (D36, with a contention-aware policy) is the ratio the app's held jobs run at now
    by the shared contention table (D35; 1: none is slowed): its time left on what it holds is
    divided by it, as its own bid rows divide theirs (``agent.contention_pricing``)."""
    if not 0 < contention <= 1:
        raise ValueError(f"a contention ratio is in (0, 1], got {contention!r}")
    gpus = min(cluster_size, max(1, claim.demand_max))
    t_id = max(claim.work_gpu_s, work_floor / (1.0 + WORK_FLOOR_BAND)) * max(1.0, pace) / gpus * n_avg
    if not (math.isfinite(t_id) and t_id > 0):
        raise BadWorkClaim(f"work_gpu_s {claim.work_gpu_s!r} over {gpus} GPU(s) x N_avg {n_avg:g} gives T_id = "
                           f"{t_id!r}; it must be a finite time > 0 (Eq. 1)")
    since = max(0.0, elapsed)
    if held:
        return _bounded((since + pace * time_left(claim.held, slowdown) / contention) / t_id), 0.0
    if demand <= 0:
        return math.inf, 0.0
    left = pace * time_left(claim.share, slowdown)
    if left == 0:  # nothing left to run: no GPU changes its rho, as the agent's own figure says
        return _bounded(since / t_id), 0.0
    share = cluster_size / n_avg
    if share < 1:
        left /= share
    return math.inf, _bounded((since + left) / t_id)


def _bounded(rho: float) -> float:
    return min(RHO_MAX, max(RHO_MIN, rho))
