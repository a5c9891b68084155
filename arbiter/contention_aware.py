"""What a contention-aware arbiter tells and charges (mechanism D36), as pure functions of the jobs
running and the contention rule (D35, ``arbiter.contention``).

- **The neighbourhood** an offer carries: per machine, the jobs of other apps running there, as
  ``protos.messages.Neighbour`` (class, GPUs, machines spanned; no app names). An agent prices the
  contention a row would suffer from it (``agent.contention_pricing``).
- **The harm** of a row: a row that puts a job across machines slows the spread jobs already running
  on them. h(row) = product over those jobs of (their ratio with the row's job added / their ratio
  now), in (0, 1]; 1 for a row on one machine (it sends nothing over a NIC, D35). The auction
  maximises prod V x prod h and a winner keeps its row with probability c_i x h_i (D36,
  ``arbiter.auction.run_auction``'s ``harm``).

The row's job is the row's GPUs as one job of the bidder's class: the arbiter does not know how
the app splits them (D3), and a split that keeps each job on one machine harms nobody, so this is
the harm the row can do at most. A job is counted as running when its app still holds its GPUs
(a lease that ran out at this round is not a neighbour to come).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from arbiter.contention import FLOOR, ContentionTable, JobKind, Placed
from protos.messages import Neighbour


def neighbourhood_of(jobs: Iterable[Placed], machines: Iterable[str]) -> dict[str, tuple[Neighbour, ...]]:
    """Per machine of ``machines``, the jobs of ``jobs`` with a GPU there (an offer's
    ``neighbourhood``, D36); machines where nothing runs are left out. Order: largest spread first,
    then class, so that the same jobs always read the same."""
    wanted = set(machines)
    out: dict[str, list[Neighbour]] = {}
    for job in jobs:
        for m in job.machines & wanted:
            out.setdefault(m, []).append(Neighbour(job.kind.cls, job.kind.gpus, job.kind.machines))
    return {m: tuple(sorted(v, key=lambda n: (-n.machines, -n.gpus, n.cls))) for m, v in sorted(out.items())}


def suffered(table: ContentionTable, kind: JobKind, machines: Iterable[str],
             neighbourhood: Mapping[str, Iterable[Neighbour]], floor: float = FLOOR) -> float:
    """D35's ratio a job of ``kind`` on ``machines`` would run at next to the spread jobs that the
    neighbourhood lists on those machines (1 on one machine or with no spread neighbour)."""
    if not kind.spread:
        return 1.0
    worst = 1.0
    for m in machines:
        for n in neighbourhood.get(m, ()):
            if n.machines >= 2:
                worst = min(worst, table.pair(kind, JobKind(n.cls, n.gpus, n.machines)))
    return max(floor, worst)


def harm_of(table: ContentionTable, row: Placed, running: Iterable[tuple[Placed, float]],
            floor: float = FLOOR) -> float:
    """D36's harm factor of ``row`` (the row's GPUs as one job of the bidder's class) on the
    ``running`` jobs of other apps, each given with its ratio now: the product over the spread ones
    that share a machine with the row of min(1, max(floor, pair(job, row)) / ratio now). Under D35's
    min rule a neighbour lowers a job's ratio only below what it already is."""
    if not row.kind.spread:
        return 1.0
    h = 1.0
    for job, now in running:
        if job.kind.spread and job.machines & row.machines:
            after = min(now, max(floor, table.pair(job.kind, row.kind)))
            h *= after / now
    return h
