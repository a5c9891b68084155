"""Finish-time fairness rho = T_sh / T_id (paper 3.2; Eq. 1 and Eq. 2; mechanism D2-D5).

Everything is a pure function of the app scheduler's answers (Figure 8), the allocation G the app
would hold (GPUs it keeps plus GPUs it wins, assumed to last until it finishes), the time ``now``
and N_avg, which the arbiter sends (D5). No clocks are read here.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence
from functools import lru_cache

from agent.appsched import (
    AppScheduler,
    CurveStoppingScheduler,
    JobInfo,
    SuccessiveHalvingScheduler,
)
from agent.placement import Position, Shape, ShapeOnTop, Slowdown, canonical_shape, slowdown_of
from protos.messages import WORK_COLUMNS, PhaseWork

INFINITY = math.inf
_EXACT_PACKING_JOBS = 10


def job_time(job: JobInfo, gpus: Sequence[Position]) -> float:
    """Eq. 1: iters_left * iter_time(G), iter_time = serial * S(G) / min(|G|, demand_max)."""
    if job.iters_remaining <= 0:
        return 0.0
    if not gpus:
        return INFINITY
    return job.iters_remaining * job.iter_time_serial * slowdown_of(job.slowdown, gpus) / min(
        len(gpus), job.demand_max
    )


def split_counts(jobs: Sequence[JobInfo], n_gpus: int) -> list[int]:
    """GPU counts per job when there are at least as many GPUs as jobs (D3).

    The phase's GPUs are split evenly (the paper's 4.3.3 example: 16 GPUs, 4 jobs -> 4 each), each
    job capped at its demand_max; what is left (the remainder of an uneven split, and the share of
    capped jobs) goes one GPU at a time to the jobs that would otherwise finish last.
    """
    counts = [min(n_gpus // len(jobs), j.demand_max) for j in jobs]
    spare = n_gpus - sum(counts)
    while spare > 0:
        open_jobs = [k for k in range(len(jobs)) if counts[k] < jobs[k].demand_max]
        if not open_jobs:
            break
        open_jobs.sort(key=lambda k: -jobs[k].iters_remaining * jobs[k].iter_time_serial / counts[k])
        for k in open_jobs[:spare]:
            counts[k] += 1
        spare -= min(spare, len(open_jobs))
    return counts


def _pack_makespan(durations: Sequence[float], n_bins: int) -> float:
    """Smallest makespan of running ``durations`` (one GPU each) queued on ``n_bins`` GPUs (D3).

    Exact branch and bound for up to 10 jobs, LPT (within 4/3 of optimal) beyond.
    """
    ordered = sorted(durations, reverse=True)
    loads = [0.0] * n_bins
    for d in ordered:
        loads[loads.index(min(loads))] += d
    best = max(loads)
    if len(ordered) > _EXACT_PACKING_JOBS:
        return best
    lower = max(ordered[0], sum(ordered) / n_bins)
    bins = [0.0] * n_bins

    def place(i: int) -> None:
        nonlocal best
        if best <= lower * (1 + 1e-12):
            return
        if i == len(ordered):
            best = min(best, max(bins))
            return
        seen: set[float] = set()
        for b in range(n_bins):
            load = bins[b]
            if load in seen or load + ordered[i] >= best:
                continue
            seen.add(load)
            bins[b] = load + ordered[i]
            place(i + 1)
            bins[b] = load

    place(0)
    return best


def densest_first(gpus: Sequence[Position]) -> list[Position]:
    """GPUs ordered rack by rack, machine by machine, slot by slot, biggest groups first.

    Contiguous runs of this order have the best locality the set allows. Groups of equal size are
    ordered by their inner structure, never by name, so the order -- and so rho -- depends only on
    the set's shape (``agent.placement.canonical_shape``).
    """
    tree: dict[str, dict[str, dict[str, list[Position]]]] = {}
    for p in gpus:
        tree.setdefault(p[0], {}).setdefault(p[1], {}).setdefault(p[2], []).append(p)
    racks = []
    for rack in tree.values():
        machines = []
        for machine in rack.values():
            slots = sorted(machine.values(), key=len, reverse=True)
            machines.append(((sum(map(len, slots)), tuple(map(len, slots))), slots))
        machines.sort(key=lambda m: m[0], reverse=True)
        racks.append(((sum(m[0][0] for m in machines), tuple(m[0] for m in machines)), machines))
    racks.sort(key=lambda r: r[0], reverse=True)
    return [p for _, machines in racks for _, slots in machines for slot in slots for p in slot]


def phase_time(jobs: Sequence[JobInfo], gpus: Sequence[Position], *, ordered: bool = False,
               least: bool = False) -> float:
    """Time for ``jobs`` to all finish on ``gpus`` (D3): T_sh(i) = max over jobs.

    With at least as many GPUs as jobs, each job gets a contiguous run of the densest-first order
    (``ordered=True`` says ``gpus`` already is in that order); with fewer GPUs than jobs, jobs queue
    one GPU each, packed for the smallest makespan. With ``least``, each job runs at the least
    slowdown it has whatever its run's level: a lower bound over every placement of len(gpus).
    """
    order = gpus if ordered or len(gpus) <= 1 else densest_first(gpus)
    split = phase_split(jobs, order)
    return split if isinstance(split, float) else time_of_split(split, order_ends(order), least=least)


Runs = tuple[tuple[int, float, int, Slowdown], ...]


def phase_split(jobs: Sequence[JobInfo], gpus: Sequence[Position]) -> float | Runs:
    """What :func:`phase_time` knows of ``jobs`` on ``len(gpus)`` GPUs before it looks at where
    they are: the time itself when no job runs, none can, or jobs queue one per GPU (a job on one
    GPU runs at slowdown 1, D1); otherwise D3's split as runs in the order they take the GPUs, each
    (GPUs, work at slowdown 1, GPUs it can use, slowdown). The split depends only on the GPU count,
    so a round that prices many shapes of one count splits once (``TimeLeftCache``)."""
    live = [j for j in jobs if j.iters_remaining > 0]
    if not live:
        return 0.0
    if not gpus:
        return INFINITY
    if len(gpus) < len(live):
        return _pack_makespan([job_time(j, gpus[:1]) for j in live], len(gpus))
    counts = split_counts(live, len(gpus))
    return tuple((counts[k], live[k].iters_remaining * live[k].iter_time_serial,
                  min(counts[k], live[k].demand_max), live[k].slowdown)
                 for k in sorted(range(len(live)), key=lambda k: -counts[k]))


def time_of_split(split: float | Runs, ends: Ends, *, least: bool = False) -> float:
    """:func:`phase_time` of a :func:`phase_split` on GPUs whose densest-first order has the
    blocks ``ends`` (:func:`order_ends`, :func:`shape_ends`): each run is slowed by the D1 level of
    its stretch of the order (its least slowdown with ``least``)."""
    if isinstance(split, float):
        return split
    worst, start = 0.0, 0
    for n, work, usable, slowdown in split:
        if n > 1:
            factor = min(slowdown) if least else slowdown[_level_in(ends, start, start + n - 1)]
        else:
            factor = 1.0
        start += n
        worst = max(worst, work * factor / usable)
    return worst


Ends = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def _level_in(ends: Ends, first: int, last: int) -> int:
    """D1 level of the stretch ``first..last`` of a densest-first order with blocks ``ends``: the
    first of slot, machine and rack whose block holding ``first`` also holds ``last``."""
    for level, block_ends in enumerate(ends):
        if last < block_ends[bisect.bisect_right(block_ends, first)]:
            return level
    return 3


def order_ends(order: Sequence[Position]) -> Ends:
    """Where each slot, machine and rack of a densest-first ``order`` ends (exclusive indices):
    slots, machines and racks are contiguous blocks of that order, so a run's level is read from
    the blocks its ends fall in."""
    slots: list[int] = []
    machines: list[int] = []
    racks: list[int] = []
    for i in range(1, len(order)):
        a, b = order[i - 1], order[i]
        if a != b:
            slots.append(i)
            if a[:2] != b[:2]:
                machines.append(i)
                if a[0] != b[0]:
                    racks.append(i)
    if order:
        for block_ends in (slots, machines, racks):
            block_ends.append(len(order))
    return tuple(slots), tuple(machines), tuple(racks)


@lru_cache(maxsize=65536)
def shape_ends(shape: Shape) -> Ends:
    """:func:`order_ends` of :func:`shape_order` (``shape``), from the slot sizes alone: racks,
    machines and slots sorted by the same keys as :func:`densest_first`, where groups of equal key
    have the same inside, so the blocks are the same whichever comes first. A shape's order has as
    many positions as GPUs and its blocks as many numbers as slots: pricing a row reads only these
    (the order was 36 s of a 330 s Workload 2 run, built for 287,000 shapes)."""
    racks = []
    for rack in shape:
        machines = sorted(((sum(sizes), sizes) for sizes in rack), reverse=True)
        racks.append((sum(m[0] for m in machines), tuple(machines)))
    racks.sort(reverse=True)
    slots: list[int] = []
    machine_ends: list[int] = []
    rack_ends: list[int] = []
    at = 0
    for _, machines in racks:
        for _, sizes in machines:
            for size in sizes:
                at += size
                slots.append(at)
            machine_ends.append(at)
        rack_ends.append(at)
    return tuple(slots), tuple(machine_ends), tuple(rack_ends)


def phase_work(jobs: Sequence[JobInfo], gpus: Sequence[Position], *, ordered: bool = False) -> PhaseWork:
    """:func:`phase_time` taken apart by what slows each job down (D21, ``WorkClaim``): per column of
    ``WORK_COLUMNS``, the time at slowdown 1 of the slowest job whose run is on one GPU or spans a
    slot, machine, rack or racks. ``phase_time`` is then max(one_gpu, slot * S[0], ..., cluster *
    S[3]) for the jobs' slowdown S: the split (D3) and the runs' levels do not depend on S. Jobs
    queued one per GPU (fewer GPUs than jobs) run on one GPU each."""
    live = [j for j in jobs if j.iters_remaining > 0]
    work = [0.0] * len(WORK_COLUMNS)
    if not live:
        return (work[0], work[1], work[2], work[3], work[4])
    if not gpus:
        raise ValueError("no work to claim on no GPUs: the app's rho is infinite")
    if len(gpus) >= len(live):
        order = list(gpus) if ordered else densest_first(gpus)
        counts = split_counts(live, len(order))
        start = 0
        for k in sorted(range(len(live)), key=lambda k: -counts[k]):
            job, n = live[k], counts[k]
            column = _run_level(order[start], order[start + n - 1]) + 1 if n > 1 else 0
            start += n
            work[column] = max(work[column], job.iters_remaining * job.iter_time_serial / min(n, job.demand_max))
    else:
        work[0] = _pack_makespan([j.iters_remaining * j.iter_time_serial for j in live], len(gpus))
    return (work[0], work[1], work[2], work[3], work[4])


def work_of_shape(app: AppScheduler, shape: Shape) -> tuple[PhaseWork, ...]:
    """:func:`time_left_of_shape` taken apart per phase with :func:`phase_work` (D21). A search
    past its last phase claims one phase of no work (time left 0, as its rho says): an empty claim
    on held GPUs is refused (``arbiter.rank.check_claim``), and a finished search can still hold
    GPUs and be asked for rho before its demand of 0 reaches the arbiter."""
    order = shape_order(shape)
    if isinstance(app, SuccessiveHalvingScheduler):
        return tuple(phase_work(app.jobs_in_phase(phase, order), order, ordered=True)
                     for phase in range(app.current_phase(), app.num_phases() + 1)) or (phase_work((), order),)
    if isinstance(app, CurveStoppingScheduler):
        return (phase_work(app.jobs_remaining(order), order, ordered=True),)
    raise TypeError(f"{type(app).__name__} is neither a successive-halving nor a curve-stopping scheduler")


def _run_level(first: Position, last: Position) -> int:
    """D1 level of a contiguous run of the densest-first order, from its two ends: slots, machines
    and racks are contiguous blocks of that order, so the ends share exactly what the run shares."""
    if first == last:
        return 0
    if first[:2] == last[:2]:
        return 1
    if first[0] == last[0]:
        return 2
    return 3


def split_allocation(
    jobs: Sequence[JobInfo], gpus: Sequence[Position], *, ordered: bool = False
) -> list[tuple[JobInfo, list[Position]]]:
    """Which GPUs each job runs on now (D3): an even split in contiguous runs of the densest-first
    order when there are at least as many GPUs as jobs; otherwise the longest jobs get one GPU each
    and the rest wait. Jobs that get nothing are left out."""
    live = [j for j in jobs if j.iters_remaining > 0]
    order = list(gpus) if ordered else densest_first(gpus)
    if not live or not order:
        return []
    if len(order) < len(live):
        longest = sorted(live, key=lambda j: -j.iters_remaining * j.iter_time_serial)
        return [(job, [g]) for job, g in zip(longest, order)]
    counts = split_counts(live, len(order))
    out, start = [], 0
    for k in sorted(range(len(live)), key=lambda k: -counts[k]):
        out.append((live[k], order[start : start + counts[k]]))
        start += counts[k]
    return out


_ONE_SLOT = (0,)


@lru_cache(maxsize=16384)
def shape_order(shape: Shape) -> tuple[Position, ...]:
    """A GPU set of ``shape`` (``agent.placement.canonical_shape``) in densest-first order.

    rho depends on an allocation only through its shape (D1), so every allocation of one shape
    is computed on this one representative, and its order is sorted once. It is
    :func:`densest_first` of the shape's stand-in positions (one per GPU, listed rack by rack,
    machine by machine, slot by slot), with the same keys and the same stable sorts, computed on
    the slot sizes instead of on one position at a time: on Workload 2 a run asks for 500,000 orders
    of 260,000 different shapes (no cache keeps them), and grouping their positions one by one was
    36 s of a 297 s run."""
    racks = []
    for i, rack in enumerate(shape):
        machines = []
        for j, sizes in enumerate(rack):
            if len(sizes) == 1:
                machines.append(((sizes[0], sizes), j, _ONE_SLOT))
                continue
            slots = sorted(range(len(sizes)), key=sizes.__getitem__, reverse=True)
            machines.append(((sum(sizes), tuple(sizes[k] for k in slots)), j, slots))
        machines.sort(key=lambda m: m[0], reverse=True)
        racks.append(((sum(m[0][0] for m in machines), tuple(m[0] for m in machines)), i, machines))
    racks.sort(key=lambda r: r[0], reverse=True)
    out: list[Position] = []
    for _, i, machines in racks:
        rack = shape[i]
        for _, j, slots in machines:
            sizes = rack[j]
            for k in slots:
                out += [_stand_in(i, j, k)] * sizes[k]
    return tuple(out)


@lru_cache(maxsize=None)
def _stand_in(rack: int, machine: int, slot: int) -> Position:
    """One shared position per (rack, machine, slot) index, so cached orders hold references."""
    return (f"r{rack}", f"m{machine}", f"s{slot}")


def shared_time_left(app: AppScheduler, gpus: Sequence[Position], *, later: dict | None = None) -> float:
    """T_sh minus the time already elapsed: what is left to run under allocation ``gpus``.

    ``later`` caches the successive-halving phases after the current one by shape, then phase; its
    owner must empty it when ``app.plan_version`` changes (``TimeLeftCache`` does)."""
    return time_left_of_shape(app, canonical_shape(gpus), later=later)


def time_left_of_shape(app: AppScheduler, shape: Shape, *, later: dict | None = None,
                       splits: dict | None = None, later_splits: dict | None = None) -> float:
    """:func:`shared_time_left` of a shape. ``splits`` and ``later_splits`` cache the current
    phase's and the later phases' splits by GPU count (:func:`phase_split`); their owner must empty
    them when ``app.version`` and ``app.plan_version`` change (``TimeLeftCache`` does)."""
    if isinstance(app, SuccessiveHalvingScheduler):
        current = app.current_phase()
        total = 0.0
        ends = shape_ends(shape)
        kept = None if later is None else later.get(shape)
        if later is not None and kept is None:
            kept = later[shape] = {}
        for phase in range(current, app.num_phases() + 1):
            if phase == current or kept is None:
                t = _split_time(app, phase, shape, splits if phase == current else later_splits, ends=ends)
            else:
                t = kept.get(phase)
                if t is None:
                    t = kept[phase] = _split_time(app, phase, shape, later_splits, ends=ends)
            if t and phase > current and app.start_up_s:  # D30: the phase's jobs start again
                t += app.start_up_s
            total += t
            if total == INFINITY:
                break
        return total
    if isinstance(app, CurveStoppingScheduler):
        return _split_time(app, 0, shape, splits)
    raise TypeError(f"{type(app).__name__} is neither a successive-halving nor a curve-stopping scheduler")


def _split_time(app: AppScheduler, phase: int, shape: Shape, splits: dict | None, *,
                least: bool = False, ends: Ends | None = None) -> float:
    """Phase ``phase`` (0: a curve-stopping app's running jobs) on a GPU set of ``shape``, its
    split taken from ``splits`` when the app's jobs do not depend on the allocation: the split
    needs only the GPU count and the time only the shape's blocks (:func:`shape_ends`), so the
    shape's order is not built. ``ends`` is ``shape_ends(shape)`` when the caller has it."""
    if splits is None or app.work_depends_on_allocation:
        order = shape_order(shape)
        return phase_time(_jobs_of(app, phase, order), order, ordered=True, least=least)
    if ends is None:
        ends = shape_ends(shape)
    n = ends[0][-1] if ends[0] else 0
    key = (phase, n)
    split = splits.get(key)
    if split is None:
        order = shape_order((((n,),),)) if n else ()
        split = splits[key] = phase_split(_jobs_of(app, phase, order), order)
    return time_of_split(split, ends, least=least)


def _jobs_of(app: AppScheduler, phase: int, order: tuple[Position, ...]) -> list[JobInfo]:
    """The jobs of ``phase`` (0: a curve-stopping app's running jobs) on ``order``."""
    return app.jobs_remaining(order) if phase == 0 else app.jobs_in_phase(phase, order)


def least_time_left(app: AppScheduler, n: int, *, splits: dict | None = None,
                    later_splits: dict | None = None) -> float:
    """A lower bound on the time left under every allocation of ``n`` GPUs: D3's split depends only
    on n, and a job's time on its run's level only through its slowdown, so every job at its least
    slowdown bounds all placements (given ``app.work_depends_on_allocation`` is False). A bid uses
    it to skip GPU counts no placement of which beats rho_old (``agent.bidding.make_bid``).
    ``splits`` and ``later_splits`` as in :func:`time_left_of_shape`."""
    shape = (((n,),),) if n else ()
    if isinstance(app, SuccessiveHalvingScheduler):
        total = 0.0
        current = app.current_phase()
        for phase in range(current, app.num_phases() + 1):
            t = _split_time(app, phase, shape, splits if phase == current else later_splits, least=True)
            if t and phase > current and app.start_up_s:  # D30, as in time_left_of_shape
                t += app.start_up_s
            total += t
            if total == INFINITY:
                break
        return total
    if isinstance(app, CurveStoppingScheduler):
        return _split_time(app, 0, shape, splits, least=True)
    raise TypeError(f"{type(app).__name__} is neither a successive-halving nor a curve-stopping scheduler")


class TimeLeftCache:
    """One app's remaining time by allocation shape, reused while its work is unchanged.

    A round asks an app for rho under many allocations (its report, every bid row), all of the
    same progress, and allocations of one shape have one answer (D1). Within a successive-halving
    phase the later phases' times stay valid as the phase progresses (``plan_version``)."""

    def __init__(self, app: AppScheduler):
        self.app = app
        self._now: dict[Shape, float] = {}
        self._least: dict[int, float] = {}
        self._later: dict = {}
        self._splits: dict = {}
        self._later_splits: dict = {}
        self._version = self._plan_version = -1

    def _sync(self) -> None:
        app = self.app
        if self._version != app.version:
            self._now.clear()
            self._least.clear()
            self._splits.clear()
            self._version = app.version
            if self._plan_version != app.plan_version:
                self._later.clear()
                self._later_splits.clear()
                self._plan_version = app.plan_version

    def __call__(self, gpus: Sequence[Position]) -> float:
        self._sync()
        return self._of_shape(_shape_of(gpus))

    def on_top(self, held: Sequence[Position]) -> Callable[[Sequence[Position]], float]:
        """The time left on ``held`` plus each set of positions it is given: a bid's rows, whose
        shapes are made from the held GPUs' shape (``agent.placement.ShapeOnTop``)."""
        shape_of = _shapes_on_top(held)

        def left(extra: Sequence[Position]) -> float:
            self._sync()
            return self._of_shape(shape_of(extra))

        return left

    def _of_shape(self, shape: Shape) -> float:
        left = self._now.get(shape)
        if left is None:
            left = self._now[shape] = time_left_of_shape(self.app, shape, later=self._later, splits=self._splits,
                                                         later_splits=self._later_splits)
        return left

    def least(self, n: int) -> float:
        """``least_time_left(app, n)``, kept like the rest while the app is unchanged."""
        self._sync()
        left = self._least.get(n)
        if left is None:
            left = self._least[n] = least_time_left(self.app, n, splits=self._splits,
                                                     later_splits=self._later_splits)
        return left


_SHAPES: dict[tuple[Position, ...], Shape] = {}
_SHAPES_KEPT = 200_000


def _shape_of(gpus: Sequence[Position]) -> Shape:
    """``canonical_shape`` remembered by the positions in their order. An app's bid rows repeat
    from round to round (the same picks of the offer on top of the same held GPUs), so at 1,024
    GPUs x 150 apps 94% of the calls are repeats; the memory is emptied when it grows past
    ``_SHAPES_KEPT`` sets."""
    key = tuple(gpus)
    shape = _SHAPES.get(key)
    if shape is None:
        if len(_SHAPES) >= _SHAPES_KEPT:
            _SHAPES.clear()
        shape = _SHAPES[key] = canonical_shape(key)
    return shape


_HELD: dict[tuple[Position, ...], tuple[int, ShapeOnTop]] = {}
_HELD_KEPT = 20_000
_ON_TOP: dict[tuple[int, tuple[Position, ...]], Shape] = {}
_HELD_IDS = itertools.count()


def _shapes_on_top(held: Sequence[Position]) -> Callable[[Sequence[Position]], Shape]:
    """``_shape_of(held + extra)`` for each ``extra``, remembered by (the held set, the extra
    positions in their order) as ``_shape_of`` remembers whole sets: rows repeat from round to
    round on the same held GPUs. A held set's number is never given to another, so emptying the
    memories (past ``_HELD_KEPT`` held sets, ``_SHAPES_KEPT`` shapes) cannot mix two sets up."""
    key = tuple(held)
    got = _HELD.get(key)
    if got is None:
        if len(_HELD) >= _HELD_KEPT:
            _HELD.clear()
        got = _HELD[key] = (next(_HELD_IDS), ShapeOnTop(key))
    number, on_top = got

    def shape_of(extra: Sequence[Position]) -> Shape:
        k = (number, tuple(extra))
        shape = _ON_TOP.get(k)
        if shape is None:
            if len(_ON_TOP) >= _SHAPES_KEPT:
                _ON_TOP.clear()
            shape = _ON_TOP[k] = on_top(k[1])
        return shape

    return shape_of


def ideal_time(app: AppScheduler, *, n_avg: float, cluster_size: int) -> float:
    """T_id = T_cluster * N_avg, T_cluster = B / min(R_C, app_demand_max) (Eq. 1, 2; D5), B with the
    start-ups the app pays even alone (D30)."""
    if n_avg < 1 or not math.isfinite(n_avg):
        raise ValueError(f"N_avg must be a finite number >= 1 (D5), got {n_avg!r}")
    if cluster_size < 1:
        raise ValueError(f"cluster size must be >= 1, got {cluster_size}")
    return app.total_work() / min(cluster_size, max(1, app.demand_max())) * n_avg


def ideal_times(app: AppScheduler, *, n_avg: float, cluster_size: int) -> Callable[[], float]:
    """:func:`ideal_time` computed on first use and kept: for callers that price many allocations
    of one app at one N_avg while its work does not change (``agent.bidding.make_bid``)."""
    kept: list[float] = []

    def t_id() -> float:
        if not kept:
            kept.append(ideal_time(app, n_avg=n_avg, cluster_size=cluster_size))
        return kept[0]

    return t_id


def finish_time_fairness(
    app: AppScheduler,
    gpus: Sequence[Position],
    *,
    now: float,
    n_avg: float,
    cluster_size: int,
    left: float | None = None,
    t_id: Callable[[], float] | None = None,
) -> float:
    """rho(G) = T_sh(G) / T_id (paper 3.2). Infinite when the app would hold no GPU and has work.

    ``left`` is ``shared_time_left(app, gpus)`` when the caller already knows it (agents reuse it
    while the app's work is unchanged: it does not depend on the clock); ``t_id`` gives
    ``ideal_time(app, n_avg=n_avg, cluster_size=cluster_size)`` when the caller keeps it (a bid
    prices every row at one N_avg: ``ideal_times``)."""
    if left is None:
        left = shared_time_left(app, gpus)
    if left == INFINITY:
        return INFINITY
    t_id = t_id() if t_id is not None else ideal_time(app, n_avg=n_avg, cluster_size=cluster_size)
    return (max(0.0, now - app.start_time) + left) / t_id


def waiting_rho(
    app: AppScheduler,
    *,
    now: float,
    n_avg: float,
    cluster_size: int,
    time_left: Callable[[Sequence[Position]], float],
    packed: Callable[[int], Sequence[Position]],
) -> float:
    """D13: the rho an app that holds nothing would reach if it got its fair share of the cluster
    from now on: R_C / N_avg GPUs (at least one, at most its demand, well placed), time-sliced when
    the share is below one GPU. Finite, and it grows while the app waits, so it orders the apps
    that all have rho = infinity: the one that has waited longest relative to its size goes first.
    ``packed(n)`` gives n well-placed GPU positions."""
    share = cluster_size / n_avg
    gpus = max(1, min(app.demand_now(), math.floor(share)))
    left = time_left(packed(gpus))
    if share < 1:
        left /= share
    if left == INFINITY:
        return INFINITY
    t_id = ideal_time(app, n_avg=n_avg, cluster_size=cluster_size)
    return (max(0.0, now - app.start_time) + left) / t_id
