"""Load an app description (TOML) into an app scheduler plus the arbiter's context for it.

    [app]
    kind = "successive_halving"      # or "single_job"
    model = "vgg16"                  # slowdown from agent/profiles (or: slowdown = [1, 1, 1.4, 1.9])
    iter_times = [80, 100, 100, 120] # serial s/iteration of the first phase's jobs
    iterations = [8, 16, 36]         # iterations per job in each phase
    job_demand_max = 8
    budget_gpu_seconds = 10000       # optional (default: planned work at median speed)
    start_time = 0

    [context]                        # what the arbiter would send with a rho request (D5)
    cluster_size = 16                # R_C (or: cluster = "testbed-64")
    n_avg = 4
    now = 0

Single-job apps give ``iterations`` (one number), ``iter_time`` and ``demand_max``. Every error
names the file and the key; an unknown key (a typo) is an error, not ignored.
"""

from __future__ import annotations

import difflib
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from agent.appsched import AppScheduler, JobInfo, SingleJobApp, SuccessiveHalvingApp
from agent.placement import NO_SLOWDOWN, ProfileError, Slowdown, model_slowdown


class AppConfigError(ValueError):
    """An app file that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class AppContext:
    cluster_size: int
    n_avg: float
    now: float
    model: str = ""  # the [app] model, if named: its contention class (D35) when the arbiter models it


def _number(table: Mapping, key: str, where: str, *, positive: bool = True, default=None) -> float:
    value = table.get(key, default)
    if value is None:
        raise AppConfigError(f"{where}: missing key '{key}'")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AppConfigError(f"{where}.{key} must be a number, got {value!r}")
    if positive and value <= 0:
        raise AppConfigError(f"{where}.{key} must be > 0, got {value!r}")
    return float(value)


def _int(table: Mapping, key: str, where: str, default=None) -> int:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AppConfigError(f"{where}.{key} must be a positive integer, got {value!r}")
    return value


def _numbers(table: Mapping, key: str, where: str) -> list[float]:
    values = table.get(key)
    if not isinstance(values, list) or not values:
        raise AppConfigError(f"{where}.{key} must be a non-empty list of numbers")
    return [_number({key: v}, key, f"{where}[{i}]") for i, v in enumerate(values)]


def _slowdown(app: Mapping, where: str) -> Slowdown:
    if "model" in app and "slowdown" in app:
        raise AppConfigError(f"{where}: give either 'model' or 'slowdown', not both")
    if "model" in app:
        try:
            return model_slowdown(str(app["model"]))
        except ProfileError as exc:
            raise AppConfigError(f"{where}.model: {exc}") from None
    if "slowdown" in app:
        s = app["slowdown"]
        if not isinstance(s, list) or len(s) != 4:
            raise AppConfigError(f"{where}.slowdown must be 4 numbers (slot, machine, rack, cluster)")
        values = [_number({"s": v}, "s", f"{where}.slowdown[{i}]") for i, v in enumerate(s)]
        if any(v < 1 for v in values):
            raise AppConfigError(f"{where}.slowdown values must be >= 1")
        if any(b < a for a, b in zip(values, values[1:])):  # D1: a wider placement is never faster
            raise AppConfigError(f"{where}.slowdown must not decrease from slot to cluster, got {s}")
        return (values[0], values[1], values[2], values[3])
    return NO_SLOWDOWN


_COMMON_KEYS = ("kind", "model", "slowdown", "start_time")
APP_KEYS = {
    "successive_halving": (*_COMMON_KEYS, "iter_times", "iterations", "job_demand_max", "budget_gpu_seconds"),
    "single_job": (*_COMMON_KEYS, "iterations", "iter_time", "demand_max", "name"),
}
CONTEXT_KEYS = ("cluster", "cluster_size", "n_avg", "now")
TABLES = ("app", "context")


def _known(table: Mapping, known: tuple[str, ...], where: str) -> None:
    """Issue 11: a misspelt key was silently ignored (a default took its place); name it instead."""
    for key in table:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise AppConfigError(f"{where}: unknown key '{key}'{hint}; known keys: {', '.join(known)}")


def app_from_mapping(data: Mapping, label: str) -> tuple[AppScheduler, AppContext]:
    _known(data, TABLES, label)
    app = data.get("app")
    if not isinstance(app, Mapping):
        raise AppConfigError(f"{label}: needs an [app] table")
    where = f"{label}: app"
    kind = app.get("kind")
    if not isinstance(kind, str) or kind not in APP_KEYS:
        raise AppConfigError(f"{where}.kind must be 'successive_halving' or 'single_job', got {kind!r}")
    _known(app, APP_KEYS[kind], f"{where} (kind {kind!r})")
    slowdown = _slowdown(app, where)
    start = _number(app, "start_time", where, positive=False, default=0.0)
    scheduler: AppScheduler
    try:
        if kind == "successive_halving":
            budget = app.get("budget_gpu_seconds")
            scheduler = SuccessiveHalvingApp(
                iter_times=_numbers(app, "iter_times", where),
                iterations=_numbers(app, "iterations", where),
                job_demand_max=_int(app, "job_demand_max", where, default=1),
                slowdown=slowdown,
                start_time=start,
                budget_gpu_seconds=None if budget is None else _number(app, "budget_gpu_seconds", where),
            )
        else:  # single_job
            job = JobInfo(
                _number(app, "iterations", where),
                _number(app, "iter_time", where),
                slowdown,
                _int(app, "demand_max", where, default=1),
                str(app.get("name", "job0")),
            )
            scheduler = SingleJobApp(job, start_time=start)
    except ValueError as exc:
        if isinstance(exc, AppConfigError):
            raise
        raise AppConfigError(f"{where}: {exc}") from None
    ctx = data.get("context", {})
    if not isinstance(ctx, Mapping):
        raise AppConfigError(f"{label}: [context] must be a table")
    cwhere = f"{label}: context"
    _known(ctx, CONTEXT_KEYS, cwhere)
    if "cluster" in ctx:
        from arbiter.cluster import ClusterFileError, load_cluster

        try:
            size = load_cluster(str(ctx["cluster"])).size
        except ClusterFileError as exc:
            raise AppConfigError(f"{cwhere}.cluster: {exc}") from None
    else:
        size = _int(ctx, "cluster_size", cwhere)
    n_avg = _number(ctx, "n_avg", cwhere, default=1.0)
    if n_avg < 1:
        raise AppConfigError(f"{cwhere}.n_avg must be >= 1 (D5), got {n_avg}")
    now = _number(ctx, "now", cwhere, positive=False, default=start)
    return scheduler, AppContext(size, n_avg, now, str(app.get("model", "")))


def load_app(path: str | Path) -> tuple[AppScheduler, AppContext]:
    label = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise AppConfigError(f"{label}: cannot read app file: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise AppConfigError(f"{label}: not UTF-8 text (byte {exc.start}): is it a TOML app file?") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise AppConfigError(f"{label}: invalid TOML: {exc}") from None
    return app_from_mapping(data, label)
