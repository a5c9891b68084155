"""An agent's price for network contention in its bid rows (mechanism D36).

An offer from a contention-aware arbiter lists, per machine of the offered and held GPUs, the jobs
of other apps running there (``Offer.neighbourhood``: class, GPUs, machines spanned). A row's rho
is then the app's rho on that allocation with its jobs slowed by the contention they would suffer
(D35's rule, ``arbiter.contention_aware.suffered``): the allocation split among the current phase's
jobs as the app splits it (D3, contiguous runs of the densest-first order), each job that spans
machines at the ratio its spread neighbours there leave it (the other apps' jobs the offer lists,
and the app's own other jobs that span machines, as D35 counts them), and the app's time left
divided by the lowest of those ratios (a phase ends with its slowest job; the neighbours are taken to stay, as
rho takes the allocation to last).

The app's class comes from its model (``arbiter.contention.ClassMap``): the arbiter binds the same
class to the app for the harm it charges, so what an agent claims here moves only its own rows'
values, which the auction prices (D15, D36). An app without a model prices no contention.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agent.appsched import AppScheduler, CurveStoppingScheduler, JobInfo, SuccessiveHalvingScheduler
from agent.fairness import split_allocation
from agent.placement import Position
from arbiter.contention import FLOOR, ContentionTable, JobKind
from arbiter.contention_aware import suffered
from protos.messages import Neighbour


@dataclass(frozen=True)
class ContentionPricing:
    """What an agent needs to price contention: the shared table, its class and D35's floor."""

    table: ContentionTable
    cls: str
    floor: float = FLOOR

    def factor(self, jobs: Sequence[JobInfo], positions: Sequence[Position],
               neighbourhood: Mapping[str, Sequence[Neighbour]]) -> float:
        """The lowest ratio among ``jobs`` split over ``positions`` next to ``neighbourhood`` and
        each other (1 when no job spans machines or none has a spread neighbour)."""
        if len({p[1] for p in positions}) < 2:
            return 1.0  # every job on one machine
        spread = []
        for _, run in split_allocation(jobs, sorted(positions)):  # sorted: ties split the same way every run
            machines = {p[1] for p in run}
            if len(machines) >= 2:
                spread.append((JobKind(self.cls, len(run), len(machines)), machines))
        worst = 1.0
        for i, (kind, machines) in enumerate(spread):
            worst = min(worst, suffered(self.table, kind, machines, neighbourhood, self.floor))
            for j, (other, where) in enumerate(spread):  # its own other jobs are neighbours too (D35)
                if j != i and machines & where:
                    worst = min(worst, max(self.floor, self.table.pair(kind, other)))
        return worst

    def time_left(self, left: float, jobs: Sequence[JobInfo], positions: Sequence[Position],
                  neighbourhood: Mapping[str, Sequence[Neighbour]]) -> float:
        """``left``, the time left running alone, at the contention ``jobs`` would suffer on
        ``positions``: divided by :meth:`factor` (0 and infinity stay as they are). A bid's rows,
        rho_old included, and the report (D43) price by this one rule."""
        if not left or not math.isfinite(left):
            return left
        return left / self.factor(jobs, positions, neighbourhood)


def current_jobs(app: AppScheduler, positions: Sequence[Position]) -> list[JobInfo]:
    """The jobs the app runs now (its current phase, or its remaining jobs)."""
    if isinstance(app, SuccessiveHalvingScheduler):
        return app.jobs_in_phase(app.current_phase(), positions)
    if isinstance(app, CurveStoppingScheduler):
        return list(app.jobs_remaining(positions))
    return []


def quiet_sets(gpus: Mapping[str, Position], neighbourhood: Mapping[str, Sequence[Neighbour]],
               counts: Sequence[int]) -> list[frozenset[str]]:
    """One candidate per count that spans machines: the offered GPUs taken from the machines with
    the fewest spread neighbours first (then the fullest), so that a row avoiding contention is
    there to be priced; the locality candidates (``agent.bidding.candidate_sets``) fill machines by
    free GPUs alone. Counts that fit on one machine need none (a one-machine job is untouched)."""
    by_machine: dict[str, list[str]] = {}
    for g in sorted(gpus):
        by_machine.setdefault(gpus[g][1], []).append(g)
    biggest = max((len(v) for v in by_machine.values()), default=0)
    noise = {m: sum(1 for n in neighbourhood.get(m, ()) if n.machines >= 2) for m in by_machine}
    order = sorted(by_machine, key=lambda m: (noise[m], -len(by_machine[m]), m))
    out = []
    for k in counts:
        if k <= biggest or k > len(gpus):
            continue
        take: list[str] = []
        for m in order:
            take.extend(by_machine[m][: k - len(take)])
            if len(take) == k:
                break
        out.append(frozenset(take))
    return out
