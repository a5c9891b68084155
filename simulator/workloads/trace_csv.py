"""User traces: one CSV row per job, every job runs to completion.

Header, exactly::

    app,job,arrival_s,gpus,iterations,iter_time_s,model

- ``app``, ``job``: names; (app, job) pairs are unique. The rows of an app need not be adjacent.
- ``arrival_s``: when the app arrives, seconds from the start (>= 0). The jobs of an app arrive
  together (a hyperparameter search submits its configurations at once, paper 2.1), so every row of
  an app must give the same value.
- ``gpus``: the job's maximum GPU demand (``job_demand_max`` of paper Eq. 1), an integer >= 1.
- ``iterations`` (> 0) and ``iter_time_s`` (> 0): the work, as iterations of the given one-GPU
  (serial) iteration time.
- ``model``: a model of the profile table (``agent/profiles/slowdowns.toml``), which sets the
  placement slowdown; every row of an app names the same model.

Blank lines and lines starting with ``#`` are ignored. Apps become ``fixed`` AppSpecs (a trace
says what ran, not how a tuner would have stopped it), sorted by arrival then first appearance.
Any bad line raises :class:`TraceError` naming the file, the line and the reason.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from agent.placement import ModelProfile, load_profiles
from simulator.workload import AppSpec, JobSpec, Workload

HEADER = ("app", "job", "arrival_s", "gpus", "iterations", "iter_time_s", "model")


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


def check_header(path: Path, lines: Iterator[tuple[int, list[str]]], expected: tuple[str, ...]) -> None:
    first = next(lines, None)
    if first is None:
        raise TraceError(path, 1, f"empty trace; expected the header {','.join(expected)}")
    line, fields = first
    if tuple(fields) != expected:
        raise TraceError(path, line, f"header must be exactly {','.join(expected)}, got {','.join(fields)}")


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


def parse_row(path: Path, line: int, fields: list[str], profiles: Mapping[str, ModelProfile]) -> TraceRow:
    if len(fields) != len(HEADER):
        raise TraceError(path, line, f"expected {len(HEADER)} columns ({','.join(HEADER)}), got {len(fields)}")
    app, job, arrival, gpus, iterations, iter_time, model = fields
    if not app or not job:
        raise TraceError(path, line, "app and job must not be empty")
    if model not in profiles:
        raise TraceError(path, line, f"unknown model {model!r}; known: {', '.join(sorted(profiles))}")
    return TraceRow(
        line=line,
        app=app,
        job=job,
        arrival_s=parse_number(path, line, "arrival_s", arrival, minimum=0.0, strict=False),
        gpus=parse_count(path, line, "gpus", gpus),
        iterations=parse_number(path, line, "iterations", iterations, minimum=0.0, strict=True),
        iter_time_s=parse_number(path, line, "iter_time_s", iter_time, minimum=0.0, strict=True),
        model=model,
    )


def read_rows(path: str | Path, profiles: Mapping[str, ModelProfile] | None = None) -> list[TraceRow]:
    """Every job row of a user trace, validated one by one and against each other."""
    path = Path(path)
    table = profiles if profiles is not None else load_profiles()
    lines = data_lines(path)
    check_header(path, lines, HEADER)
    rows: list[TraceRow] = []
    seen: dict[tuple[str, str], int] = {}
    first_of_app: dict[str, TraceRow] = {}
    for line, fields in lines:
        row = parse_row(path, line, fields, table)
        key = (row.app, row.job)
        if key in seen:
            raise TraceError(path, line,
                             f"duplicate job {row.job!r} of app {row.app!r} (first on line {seen[key]})")
        seen[key] = line
        first = first_of_app.setdefault(row.app, row)
        if row.arrival_s != first.arrival_s:
            raise TraceError(path, line, f"app {row.app!r} arrives at {first.arrival_s:g} s on line {first.line} "
                                         f"but at {row.arrival_s:g} s here; an app's jobs arrive together")
        if row.model != first.model:
            raise TraceError(path, line, f"app {row.app!r} is model {first.model!r} on line {first.line} "
                                         f"but {row.model!r} here; an app has one model")
        rows.append(row)
    if not rows:
        raise TraceError(path, 1, "the trace has a header but no jobs")
    return rows


def apps_from_rows(rows: list[TraceRow], seed: int) -> tuple[AppSpec, ...]:
    """Group rows into ``fixed`` apps, sorted by arrival (ties: order of first appearance).

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
            kind="fixed",
            jobs=tuple(JobSpec(f"{r.app}/{r.job}", r.iterations, r.iter_time_s, r.gpus) for r in group),
            seed=rng.randrange(2**31),
        )
        for group in ordered
    )


def load_trace_csv(path: str | Path, *, seed: int = 0) -> Workload:
    """A user trace file as a workload (see the module docstring for the format)."""
    rows = read_rows(path)
    apps = apps_from_rows(rows, seed)
    source = f"user trace {path} ({len(apps)} apps, {len(rows)} jobs)"
    return Workload(name=Path(path).stem, apps=apps, source=source)
