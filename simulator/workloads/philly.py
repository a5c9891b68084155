"""Workload 1 (paper section 6.1): hyperparameter-search apps from a two-week Philly snapshot.

The paper takes "a two week snapshot" of Microsoft's Philly trace and keeps the "subset of jobs ...
that correspond to hyper-parameter exploration jobs", scaled down for its 256-GPU simulator. The
public trace (``data/philly/philly-jobs.csv``, see ``data/README.md``) has no user or experiment
column, so this module rebuilds apps as follows; every step is a knob of :func:`workload1`.

1. Window (``window_start``, ``window_days``): jobs submitted in the 14 days from 2017-10-09 00:00
   UTC, the densest two weeks of the trace (26,936 submissions; ``window_start="densest"``
   recomputes it with :func:`densest_window_start`).
2. Grouping (``gap_s``, :func:`group_into_apps`): a search submits its configurations together,
   to one virtual cluster, each with the same resources. So a job joins the open group of its
   (virtual cluster, GPU count) when it was submitted at most 10 minutes after that group's
   previous job; otherwise it opens a new group. Shorter gaps cut searches that submit in slow
   batches, longer ones merge distinct searches (in the default window: 768 multi-job groups at
   1 minute, 880 at 10, 497 at 30 minutes, holding 23.6k, 26.1k and 26.4k of the 26.9k jobs).
3. Searches only (``include_single``): groups of one job are not hyperparameter explorations and
   are dropped, as the paper does, unless ``include_single=True``.
4. Size cap (``max_jobs_per_app``): a few groups are bursts of hundreds of jobs (up to 1,106 in
   3.6 hours). Groups above 100 jobs are split into consecutive near-equal parts, each its own app:
   the paper's own trace study (section 2.2) sees searches of "as many as 100 jobs".
5. Scale-down (``max_apps``, ``arrival_scale``): the window yields 1,040 such apps (26,120 jobs,
   an offered load of 0.64 of 256 GPUs). By default 300 are drawn uniformly at random, and
   their arrival offsets are multiplied by 300 / 1,040 so the sample arrives at the full window's
   rate and so keeps about its load on a 256-GPU cluster (the paper's simulator size), over about
   4 days. ``arrival_scale=1`` keeps real times; ``max_apps=None`` keeps every app.
6. Long jobs (``max_duration_s``): durations are capped at one day (349 of the window's 26,120
   search jobs run longer, up to 32 days), so one job cannot stretch a scaled run by weeks.

Each app gets a model by paper Table 4's mix (10% CV, 60% NLP, 30% speech; a model uniformly
within its category, from the profile table) and each job a one-GPU iteration time (see
:data:`ITER_TIME_S`). A job's ``iterations`` is its GPU time (duration x GPUs) over that iteration
time, so on its trace GPU count at linear speedup (paper Eq. 1, S = 1) it runs for exactly its
trace duration; the iteration time only sets the granularity, not the work. Jobs are ``fixed``:
the trace records how long each configuration ran, and Hyperdrive's stopping decisions are already
in those durations. An app arrives when its first job was submitted.
"""

from __future__ import annotations

import functools
import math
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from pathlib import Path

from agent.placement import ModelProfile, load_profiles
from simulator.workload import AppSpec, JobSpec, Workload
from simulator.workloads import WorkloadError, register
from simulator.workloads.trace_csv import TraceError, check_header, data_lines, parse_count, parse_number

PHILLY_HEADER = ("timestamp", "duration", "num_gpus", "gpu_time", "cluster")
DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "data" / "philly" / "philly-jobs.csv"
DEFAULT_WINDOW_START = "2017-10-09"
DEFAULT_MAX_APPS = 300

#: Paper Table 4 / Appendix A: the category mix of the traces' models.
MODEL_MIX: Mapping[str, float] = {"cv": 0.10, "nlp": 0.60, "speech": 0.30}

#: One-GPU iteration time range (seconds) per model, on a P100-class GPU.
#: [G] Gavel's measured single-GPU P100 throughputs (data/profiles/gavel-simulation-throughputs.json)
#: over its batch sizes: ResNet-50 16-128, Transformer 16-256, LM 5-80.
#: [F] No measurement: the ResNet-50 range scaled by forward FLOPs per image relative to ResNet-50's
#: 4.1 G (Inception-v3 5.7 G, x1.4; AlexNet 0.72 G, x0.18; VGG16 15.5 G, x3.8; VGG19 19.6 G, x4.8).
#: [A] No measurement and no close proxy: the Transformer range, as a generic sequence model.
#: Since iterations are derived from durations, these ranges change a job's granularity and the
#: spread of speeds inside an app, never its work.
ITER_TIME_S: Mapping[str, tuple[float, float]] = {
    "resnet50": (0.11, 0.63),  # [G]
    "transformer": (0.10, 0.60),  # [G]
    "lm": (0.011, 0.047),  # [G]
    "inception-v3": (0.15, 0.88),  # [F]
    "alexnet": (0.020, 0.11),  # [F]
    "vgg16": (0.42, 2.4),  # [F]
    "vgg19": (0.53, 3.0),  # [F]
    "bidaf": (0.10, 0.60),  # [A]
    "gnmt": (0.10, 0.60),  # [A]
    "wavenet": (0.10, 0.60),  # [A]
    "deepspeech": (0.10, 0.60),  # [A]
}
#: For models a user adds to the profile table without an entry above.
FALLBACK_ITER_TIME_S = (0.10, 1.0)
#: Jobs of one search differ in speed by up to this factor either way (paper 4.3.3's example app
#: has 80, 100, 100 and 120 s iterations; its footnote 2: batch size and similar knobs change it).
JOB_SPEED_SPREAD = 0.2


# --- reading the trace ------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceJob:
    """One Philly row: ``submit_s`` is POSIX seconds (UTC); ``line`` its line in the file."""

    line: int
    submit_s: float
    duration_s: float
    gpus: int
    cluster: str


def has_philly_header(path: Path) -> bool:
    """Whether the file's first record is the Philly header (to tell it from a user trace)."""
    try:
        first = next(data_lines(path), None)
    except TraceError:
        return False
    return first is not None and tuple(first[1]) == PHILLY_HEADER


def parse_timestamp(path: Path, line: int, text: str) -> float:
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise TraceError(path, line, f"timestamp must be 'YYYY-MM-DD HH:MM:SS', got {text!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)  # the trace is in UTC
    return when.timestamp()


def parse_philly_row(path: Path, line: int, cells: list[str]) -> TraceJob:
    if len(cells) != len(PHILLY_HEADER):
        raise TraceError(path, line, f"expected {len(PHILLY_HEADER)} columns ({','.join(PHILLY_HEADER)}), "
                                     f"got {len(cells)}")
    timestamp, duration, num_gpus, gpu_time, cluster = cells
    submit_s = parse_timestamp(path, line, timestamp)
    duration_s = parse_number(path, line, "duration", duration, minimum=0.0, strict=True)
    gpus = parse_count(path, line, "num_gpus", num_gpus)
    total = parse_number(path, line, "gpu_time", gpu_time, minimum=0.0, strict=True)
    if abs(total - duration_s * gpus) > 1e-6 * total:
        raise TraceError(path, line, f"gpu_time {gpu_time} is not duration x num_gpus ({duration_s * gpus:g})")
    if not cluster:
        raise TraceError(path, line, "cluster must not be empty")
    return TraceJob(line, submit_s, duration_s, gpus, cluster)


def read_philly(path: str | Path = DEFAULT_TRACE) -> tuple[TraceJob, ...]:
    """Every job of a Philly-format trace, each line validated (a bad one raises TraceError with
    file, line and reason). Parsed once per file version: the real trace has 82,247 rows."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError as exc:
        raise TraceError(path, 0, f"cannot read: {exc.strerror}") from None
    return _read_philly(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _read_philly(path_text: str, _mtime_ns: int, _size: int) -> tuple[TraceJob, ...]:
    path = Path(path_text)
    lines = data_lines(path)
    check_header(path, lines, PHILLY_HEADER)
    return tuple(parse_philly_row(path, line, cells) for line, cells in lines)


# --- window, grouping, selection ----------------------------------------------------------------


def densest_window_start(jobs: Iterable[TraceJob], days: int = 14) -> datetime:
    """Midnight (UTC) of the first day of the ``days``-day window with the most submissions."""
    per_day = Counter(datetime.fromtimestamp(j.submit_s, UTC).date() for j in jobs)
    if not per_day:
        raise WorkloadError("the trace has no jobs")
    first, last = min(per_day), max(per_day)
    starts = [first + timedelta(d) for d in range((last - first).days + 1)]
    best = max(starts, key=lambda s: (sum(per_day[s + timedelta(d)] for d in range(days)), -s.toordinal()))
    return datetime(best.year, best.month, best.day, tzinfo=UTC)


def window_start_s(jobs: Sequence[TraceJob], window_start: str, days: int) -> float:
    """POSIX seconds of ``window_start``: an ISO date or datetime (UTC), or ``"densest"``."""
    if window_start == "densest":
        return densest_window_start(jobs, days).timestamp()
    try:
        when = datetime.fromisoformat(window_start)
    except ValueError:
        raise WorkloadError(f"window_start must be an ISO date like {DEFAULT_WINDOW_START!r} or 'densest', "
                            f"got {window_start!r}") from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def group_into_apps(jobs: Iterable[TraceJob], gap_s: float = 600.0) -> list[tuple[TraceJob, ...]]:
    """Apps as groups of jobs with the same (virtual cluster, GPU count), each submitted at most
    ``gap_s`` after the group's previous job (step 2 of the module docstring).

    Jobs are taken in submission order (ties by line); groups come out ordered by their first job.
    """
    open_groups: dict[tuple[str, int], list[TraceJob]] = {}
    groups: list[list[TraceJob]] = []
    for job in sorted(jobs, key=lambda j: (j.submit_s, j.line)):
        key = (job.cluster, job.gpus)
        group = open_groups.get(key)
        if group is not None and job.submit_s - group[-1].submit_s <= gap_s:
            group.append(job)
        else:
            group = [job]
            open_groups[key] = group
            groups.append(group)
    return [tuple(g) for g in groups]


def split_group(group: tuple[TraceJob, ...], max_jobs: int | None) -> list[tuple[TraceJob, ...]]:
    """``group`` cut into consecutive near-equal parts of at most ``max_jobs`` jobs."""
    if max_jobs is None or len(group) <= max_jobs:
        return [group]
    parts = math.ceil(len(group) / max_jobs)
    size, extra = divmod(len(group), parts)
    out, start = [], 0
    for k in range(parts):
        end = start + size + (1 if k < extra else 0)
        out.append(group[start:end])
        start = end
    return out


@dataclass(frozen=True)
class PhillyOptions:
    """The knobs of Workload 1 and their defaults (module docstring, steps 1-6)."""

    trace: str | Path = DEFAULT_TRACE
    window_start: str = DEFAULT_WINDOW_START
    window_days: int = 14
    gap_s: float = 600.0
    include_single: bool = False
    max_jobs_per_app: int | None = 100
    max_gpus: int | None = None
    max_apps: int | None = DEFAULT_MAX_APPS
    arrival_scale: float | None = None
    max_duration_s: float | None = 86_400.0

    def __post_init__(self) -> None:
        checks = [
            (self.window_days >= 1, "window_days must be >= 1"),
            (self.gap_s >= 0, "gap_s must be >= 0"),
            (self.max_jobs_per_app is None or self.max_jobs_per_app >= 1, "max_jobs_per_app must be >= 1"),
            (self.max_gpus is None or self.max_gpus >= 1, "max_gpus must be >= 1"),
            (self.max_apps is None or self.max_apps >= 1, "max_apps must be >= 1"),
            (self.arrival_scale is None or self.arrival_scale > 0, "arrival_scale must be > 0"),
            (self.max_duration_s is None or self.max_duration_s > 0, "max_duration_s must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise WorkloadError(message)


#: Workload 1's knobs (Workload 2 forwards them).
PHILLY_KNOBS: tuple[str, ...] = tuple(f.name for f in fields(PhillyOptions))


@dataclass(frozen=True)
class Selection:
    """The apps picked from the trace, with what scaling needs to know."""

    groups: tuple[tuple[TraceJob, ...], ...]  # in arrival order
    candidates: int  # search apps in the window before sampling
    start_s: float  # window start, POSIX seconds
    arrival_scale: float


def select_apps(options: PhillyOptions, rng: random.Random) -> Selection:
    """Steps 1-5: window, grouping, searches only, size cap, sampling."""
    jobs = read_philly(options.trace)
    start_s = window_start_s(jobs, options.window_start, options.window_days)
    end_s = start_s + options.window_days * 86_400
    in_window = [j for j in jobs if start_s <= j.submit_s < end_s
                 and (options.max_gpus is None or j.gpus <= options.max_gpus)]
    min_jobs = 1 if options.include_single else 2
    groups = [part
              for group in group_into_apps(in_window, options.gap_s) if len(group) >= min_jobs
              for part in split_group(group, options.max_jobs_per_app) if len(part) >= min_jobs]
    groups.sort(key=lambda g: (g[0].submit_s, g[0].line))  # parts of a split group arrive later
    if not groups:
        raise WorkloadError(f"{options.trace}: no apps in the {options.window_days}-day window from "
                            f"{options.window_start}")
    keep = sorted(rng.sample(range(len(groups)), options.max_apps)) if (
        options.max_apps is not None and options.max_apps < len(groups)) else range(len(groups))
    scale = options.arrival_scale if options.arrival_scale is not None else len(keep) / len(groups)
    return Selection(tuple(groups[i] for i in keep), len(groups), start_s, scale)


# --- models and iteration times (shared with Workload 2 and the generator) ----------------------


@functools.cache
def shipped_profiles() -> Mapping[str, ModelProfile]:
    """The shipped table alone: a named workload and seed draw the same models whatever tables a
    user adds with ``--profiles`` (those reach the engine and traces, not the generators)."""
    return load_profiles(user=False)


def models_by_category(profiles: Mapping[str, ModelProfile]) -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {}
    for name, profile in profiles.items():
        out.setdefault(profile.category, []).append(name)
    return {category: tuple(sorted(names)) for category, names in out.items()}


def draw_model(rng: random.Random, profiles: Mapping[str, ModelProfile] | None = None) -> str:
    """A model by Table 4's mix: the category by :data:`MODEL_MIX`, then uniformly within it."""
    by_category = models_by_category(profiles if profiles is not None else shipped_profiles())
    categories = [c for c in MODEL_MIX if by_category.get(c)]
    category = rng.choices(categories, weights=[MODEL_MIX[c] for c in categories])[0]
    return rng.choice(by_category[category])


def draw_iter_times(rng: random.Random, model: str, count: int) -> list[float]:
    """``count`` one-GPU iteration times for the jobs of one app of ``model``: a base drawn
    log-uniformly from the model's range, each job within +-20% of it (:data:`JOB_SPEED_SPREAD`)."""
    lo, hi = ITER_TIME_S.get(model, FALLBACK_ITER_TIME_S)
    base = math.exp(rng.uniform(math.log(lo), math.log(hi)))
    return [base * rng.uniform(1 - JOB_SPEED_SPREAD, 1 + JOB_SPEED_SPREAD) for _ in range(count)]


# --- the workload -------------------------------------------------------------------------------


def trace_app(app_id: str, group: Sequence[TraceJob], arrival_s: float, model: str, iter_times: Sequence[float],
              max_duration_s: float | None, seed: int) -> AppSpec:
    """One ``fixed`` app: each job's work is its (capped) GPU time at the drawn iteration time."""
    jobs = []
    for k, (job, iter_time) in enumerate(zip(group, iter_times, strict=True)):
        duration = job.duration_s if max_duration_s is None else min(job.duration_s, max_duration_s)
        jobs.append(JobSpec(f"{app_id}/j{k}", duration * job.gpus / iter_time, iter_time, job.gpus))
    return AppSpec(app_id, arrival_s, model, "fixed", tuple(jobs), seed=seed)


def shown_path(path: str | Path) -> str:
    """``path`` relative to the repository when inside it, for workload summaries."""
    try:
        return str(Path(path).resolve().relative_to(DEFAULT_TRACE.parents[2]))
    except ValueError:
        return str(path)


@register("workload1", "philly", knobs=PHILLY_KNOBS)
def workload1(*, seed: int = 0, **knobs) -> Workload:
    """Paper Workload 1: hyperparameter-search apps of a two-week Philly snapshot, scaled down."""
    options = PhillyOptions(**knobs)
    selection = select_apps(options, random.Random(f"{seed}:sample"))
    model_rng, time_rng, seed_rng = (random.Random(f"{seed}:{s}") for s in ("models", "iter-times", "app-seeds"))
    apps = []
    for i, group in enumerate(selection.groups):
        model = draw_model(model_rng)
        arrival = (group[0].submit_s - selection.start_s) * selection.arrival_scale
        apps.append(trace_app(f"w1-{i:04d}", group, arrival, model, draw_iter_times(time_rng, model, len(group)),
                              options.max_duration_s, seed_rng.randrange(2**31)))
    jobs = sum(len(a.jobs) for a in apps)
    source = (f"Philly trace {shown_path(options.trace)}: {options.window_days} days from {options.window_start}, "
              f"apps = same cluster and GPU count within {options.gap_s:g} s, {len(apps)} of "
              f"{selection.candidates} apps ({jobs} jobs), arrivals x{selection.arrival_scale:.4g}, seed {seed}")
    return Workload("workload1", tuple(apps), source)

