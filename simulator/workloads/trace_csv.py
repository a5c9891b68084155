"""User traces: one CSV row per job; an app is a hyperparameter search or a set of fixed jobs.

The header is one of (the first is the original form and still means what it did)::

    app,job,arrival_s,gpus,iterations,iter_time_s,model
    app,job,arrival_s,gpus,iterations,iter_time_s,model,kind
    app,job,arrival_s,gpus,iterations,iter_time_s,model,kind,phases

- ``app``, ``job``: names; (app, job) pairs are unique. The rows of an app need not be adjacent.
- ``arrival_s``: when the app arrives, seconds from the start (>= 0). The jobs of an app arrive
  together (a hyperparameter search submits its configurations at once, paper 2.1), so every row of
  an app must give the same value.
- ``gpus``: the job's maximum GPU demand (``job_demand_max`` of paper Eq. 1), an integer >= 1.
- ``iterations`` (> 0) and ``iter_time_s`` (> 0): the work, as iterations of the given one-GPU
  (serial) iteration time.
- ``model``: a model of the profile table (``agent/profiles/slowdowns.toml`` plus any user tables
  given with ``--profiles``, see ``agent.placement.use_profiles``), which sets the placement
  slowdown; every row of an app names the same model.
- ``kind`` (optional column; issue 13 item 6): how the app's search stops its jobs, the same on
  every row of an app; an empty cell means ``fixed``.

  - ``fixed``: every job runs its ``iterations`` (a trace says what ran). Without the column every
    app is ``fixed``.
  - ``curve_stopping``: each job stops when its loss curve flattens (paper 4.3.3), at most at its
    ``iterations`` (the cap).
  - ``successive_halving``: the jobs are the configurations of one halving search (paper 4.3.2):
    in phase 1 every job runs ``phases[0]`` iterations, then the better half runs ``phases[1]``
    more, and so on. ``iterations`` is the phase-1 work and must equal ``phases[0]``, so a reader
    of the first seven columns alone still sees each job's certain work. An app of ``n`` jobs can
    have at most ``floor(log2 n) + 1`` phases. Its jobs run at the app's largest ``gpus``.
- ``phases`` (optional column after ``kind``): for ``successive_halving`` apps, the per-phase
  iterations per job, ``;``-separated (``3;9;27``), each > 0, the same on every row of the app;
  empty for every other kind.

Example (``examples/trace_searches.csv`` has more)::

    app,job,arrival_s,gpus,iterations,iter_time_s,model,kind,phases
    grid,g0,0,2,500,0.4,resnet50,fixed,
    sh,c0,60,1,30,0.2,lm,successive_halving,30;60
    sh,c1,60,1,30,0.2,lm,successive_halving,30;60
    cs,t0,120,4,2000,0.3,bidaf,curve_stopping,

Blank lines and lines starting with ``#`` are ignored. Apps become AppSpecs of their kind, sorted
by arrival then first appearance. Any bad line raises :class:`TraceError` naming the file, the
line and the reason.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from agent.placement import ModelProfile, known_models_hint, load_profiles
from simulator.workload import KINDS, AppSpec, JobSpec, Workload

HEADER = ("app", "job", "arrival_s", "gpus", "iterations", "iter_time_s", "model")
HEADERS = (HEADER, (*HEADER, "kind"), (*HEADER, "kind", "phases"))  # the accepted forms
PHASE_SEPARATOR = ";"


class TraceError(ValueError):
    """A trace file that cannot be used; the message starts with ``<file>:<line>:``."""

    def __init__(self, path: str | Path, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path = str(path)
        self.line = line
        self.reason = reason


def data_lines(path: Path) -> Iterator[tuple[int, list[str]]]:
    """(line number, fields) of every CSV record that is not blank or a ``#`` comment.

    Fields are whitespace-stripped. Traces are one record per line (no quoted newlines), so the
    reader's line number is the record's line.
    """
    try:
        handle = path.open(newline="", encoding="utf-8-sig")
    except OSError as exc:
        raise TraceError(path, 0, f"cannot read: {exc.strerror}") from None
    with handle:
        reader = csv.reader(handle)
        try:
            for fields in reader:
                blank = len(fields) <= 1 and not "".join(fields).strip()
                if blank or fields[0].lstrip().startswith("#"):
                    continue
                yield reader.line_num, [f.strip() for f in fields]
        except (csv.Error, UnicodeDecodeError) as exc:
            raise TraceError(path, reader.line_num + 1, f"unreadable CSV: {exc}") from None


def check_header(path: Path, lines: Iterator[tuple[int, list[str]]], expected: tuple[str, ...],
                 *more: tuple[str, ...]) -> tuple[str, ...]:
    """The header line's columns, which must be ``expected`` or one of the ``more`` forms."""
    forms = (expected, *more)
    wanted = " or ".join(",".join(form) for form in forms)
    first = next(lines, None)
    if first is None:
        raise TraceError(path, 1, f"empty trace; expected the header {wanted}")
    line, fields = first
    if tuple(fields) not in forms:
        raise TraceError(path, line, f"header must be exactly {wanted}, got {','.join(fields)}")
    return tuple(fields)


def parse_number(path: Path, line: int, column: str, text: str, *, minimum: float, strict: bool) -> float:
    """A finite float > minimum (``strict``) or >= minimum, else a TraceError for that column."""
    try:
        value = float(text)
    except ValueError:
        raise TraceError(path, line, f"{column} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise TraceError(path, line, f"{column} must be finite, got {text!r}")
    if value < minimum or (strict and value == minimum):
        relation = ">" if strict else ">="
        raise TraceError(path, line, f"{column} must be {relation} {minimum:g}, got {text!r}")
    return value


def parse_count(path: Path, line: int, column: str, text: str) -> int:
    """An integer >= 1 (GPU counts), else a TraceError for that column."""
    try:
        value = int(text)
    except ValueError:
        raise TraceError(path, line, f"{column} must be a whole number, got {text!r}") from None
    if value < 1:
        raise TraceError(path, line, f"{column} must be >= 1, got {text!r}")
    return value


@dataclass(frozen=True)
class TraceRow:
    line: int
    app: str
    job: str
    arrival_s: float
    gpus: int
    iterations: float
    iter_time_s: float
    model: str
    kind: str = "fixed"
    phases: tuple[float, ...] = ()  # successive_halving only: iterations per job per phase


def parse_phases(path: Path, line: int, text: str) -> tuple[float, ...]:
    parts = text.split(PHASE_SEPARATOR)
    return tuple(parse_number(path, line, f"phases[{i}]", part.strip(), minimum=0.0, strict=True)
                 for i, part in enumerate(parts))


def parse_kind(path: Path, line: int, kind: str, phases_text: str, iterations: float) -> tuple[str, tuple[float, ...]]:
    """The row's kind (empty: ``fixed``) and its phases, checked against each other."""
    kind = kind or "fixed"
    if kind not in KINDS:
        raise TraceError(path, line, f"kind must be one of {', '.join(KINDS)} (or empty for fixed), got {kind!r}")
    if kind != "successive_halving":
        if phases_text:
            raise TraceError(path, line, f"phases are for successive_halving apps only; this row is {kind}, "
                                         f"so leave phases empty (got {phases_text!r})")
        return kind, ()
    if not phases_text:
        raise TraceError(path, line, "a successive_halving row needs phases, the iterations per job of each phase "
                                     "(e.g. 3;9;27), in a phases column after kind")
    phases = parse_phases(path, line, phases_text)
    if iterations != phases[0]:
        raise TraceError(path, line, f"a successive_halving job's iterations is its phase-1 work and must equal "
                                     f"phases[0] = {phases[0]:g}, got {iterations:g}")
    return kind, phases


def parse_row(path: Path, line: int, fields: list[str], profiles: Mapping[str, ModelProfile],
              header: tuple[str, ...] = HEADER) -> TraceRow:
    if len(fields) != len(header):
        raise TraceError(path, line, f"expected {len(header)} columns ({','.join(header)}), got {len(fields)}")
    app, job, arrival, gpus, iterations_text, iter_time, model, *extra = fields
    if not app or not job:
        raise TraceError(path, line, "app and job must not be empty")
    if model not in profiles:
        raise TraceError(path, line, f"unknown model {model!r}; {known_models_hint(profiles)}")
    iterations = parse_number(path, line, "iterations", iterations_text, minimum=0.0, strict=True)
    kind, phases = parse_kind(path, line, extra[0] if extra else "", extra[1] if len(extra) > 1 else "", iterations)
    return TraceRow(
        line=line,
        app=app,
        job=job,
        arrival_s=parse_number(path, line, "arrival_s", arrival, minimum=0.0, strict=False),
        gpus=parse_count(path, line, "gpus", gpus),
        iterations=iterations,
        iter_time_s=parse_number(path, line, "iter_time_s", iter_time, minimum=0.0, strict=True),
        model=model,
        kind=kind,
        phases=phases,
    )


def check_same_as_first(path: Path, row: TraceRow, first: TraceRow) -> None:
    """What every row of an app shares: arrival (jobs of a search are submitted at once, paper
    2.1), model, kind and phases."""
    if row.arrival_s != first.arrival_s:
        raise TraceError(path, row.line, f"app {row.app!r} arrives at {first.arrival_s:g} s on line {first.line} "
                                         f"but at {row.arrival_s:g} s here; an app's jobs arrive together")
    if row.model != first.model:
        raise TraceError(path, row.line, f"app {row.app!r} is model {first.model!r} on line {first.line} "
                                         f"but {row.model!r} here; an app has one model")
    if row.kind != first.kind:
        raise TraceError(path, row.line, f"app {row.app!r} is {first.kind} on line {first.line} "
                                         f"but {row.kind} here; an app has one kind")
    if row.phases != first.phases:
        shown = PHASE_SEPARATOR.join(f"{x:g}" for x in first.phases)
        raise TraceError(path, row.line, f"app {row.app!r} has phases {shown} on line {first.line} but "
                                         f"{PHASE_SEPARATOR.join(f'{x:g}' for x in row.phases)} here; "
                                         "every row of a successive_halving app gives the same phases")


def check_halving(path: Path, rows: list[TraceRow]) -> None:
    """A halving app of n jobs can halve floor(log2 n) times (``AppSpec``'s rule, said per line)."""
    counts: dict[str, int] = {}
    first: dict[str, TraceRow] = {}
    for row in rows:
        counts[row.app] = counts.get(row.app, 0) + 1
        first.setdefault(row.app, row)
    for app, row in first.items():
        halvings = len(row.phases) - 1
        if row.kind == "successive_halving" and counts[app] < 2 ** halvings:
            raise TraceError(path, row.line, f"successive_halving app {app!r} has {counts[app]} jobs, too few to "
                                             f"halve {halvings} times for its {len(row.phases)} phases "
                                             f"(needs >= {2 ** halvings} jobs, or fewer phases)")


def read_rows(path: str | Path, profiles: Mapping[str, ModelProfile] | None = None) -> list[TraceRow]:
    """Every job row of a user trace, validated one by one and against each other."""
    path = Path(path)
    table = profiles if profiles is not None else load_profiles()
    lines = data_lines(path)
    header = check_header(path, lines, *HEADERS)
    rows: list[TraceRow] = []
    seen: dict[tuple[str, str], int] = {}
    first_of_app: dict[str, TraceRow] = {}
    for line, fields in lines:
        row = parse_row(path, line, fields, table, header)
        key = (row.app, row.job)
        if key in seen:
            raise TraceError(path, line,
                             f"duplicate job {row.job!r} of app {row.app!r} (first on line {seen[key]})")
        seen[key] = line
        check_same_as_first(path, row, first_of_app.setdefault(row.app, row))
        rows.append(row)
    if not rows:
        raise TraceError(path, 1, "the trace has a header but no jobs")
    check_halving(path, rows)
    return rows


def apps_from_rows(rows: list[TraceRow], seed: int) -> tuple[AppSpec, ...]:
    """Group rows into apps of their kind, sorted by arrival (ties: order of first appearance).

    Each app's loss seed is drawn from ``seed`` in that order, so a trace replays identically.
    """
    by_app: dict[str, list[TraceRow]] = {}
    for row in rows:
        by_app.setdefault(row.app, []).append(row)
    ordered = sorted(by_app.values(), key=lambda group: (group[0].arrival_s, group[0].line))
    rng = random.Random(seed)
    return tuple(
        AppSpec(
            app_id=group[0].app,
            arrival_s=group[0].arrival_s,
            model=group[0].model,
            kind=group[0].kind,
            jobs=tuple(JobSpec(f"{r.app}/{r.job}", r.iterations, r.iter_time_s, r.gpus) for r in group),
            phase_iterations=group[0].phases,
            seed=rng.randrange(2**31),
        )
        for group in ordered
    )


def load_trace_csv(path: str | Path, *, seed: int = 0) -> Workload:
    """A user trace file as a workload (see the module docstring for the format)."""
    rows = read_rows(path)
    apps = apps_from_rows(rows, seed)
    kinds = sorted({a.kind for a in apps})
    source = f"user trace {path} ({len(apps)} apps of kind {', '.join(kinds)}; {len(rows)} jobs)"
    return Workload(name=Path(path).stem, apps=apps, source=source)
