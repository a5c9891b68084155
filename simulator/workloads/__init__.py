"""Workloads the simulator can replay, by name or from a CSV file (paper section 6.1).

``load_workload("workload1")`` (alias ``philly``) is the paper's Workload 1 from the Philly trace,
``workload2`` (alias ``hyperband``) its successive-halving variant, ``synthetic`` a Poisson
generator, ``small`` a bundled 24-app workload for quick runs; a path to a ``.csv`` file loads a
user trace (``trace_csv``) or, when its header is the Philly one, Workload 1 from that file.

Adding a workload is one new module in this package that decorates its builder::

    @register("mine", "alias")
    def mine(*, seed: int = 0, size: int = 10) -> Workload: ...

Every module here is imported on first use, so the decorator is all the wiring there is. A builder
takes ``seed`` and keyword-only knobs; ``load_workload`` rejects knobs it does not declare.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from simulator.workload import Workload

Builder = Callable[..., Workload]


class WorkloadError(ValueError):
    """An unknown workload name or knob."""


@dataclass(frozen=True)
class WorkloadEntry:
    name: str
    build: Builder
    aliases: tuple[str, ...]
    knobs: tuple[str, ...]  # keyword arguments the builder accepts besides ``seed``

    @property
    def summary(self) -> str:
        doc = inspect.getdoc(self.build) or ""
        return doc.splitlines()[0] if doc else ""


_ENTRIES: dict[str, WorkloadEntry] = {}  # name and every alias -> entry
_DISCOVERED = False


def _declared_knobs(build: Builder) -> tuple[str, ...]:
    params = inspect.signature(build).parameters.values()
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name != "seed")


def register(name: str, *aliases: str, knobs: tuple[str, ...] | None = None) -> Callable[[Builder], Builder]:
    """Decorator: make ``build`` loadable as ``name`` (and its aliases).

    ``knobs`` defaults to the builder's keyword-only parameters; a builder that forwards
    ``**kwargs`` names the knobs it forwards here so unknown ones are still caught early.
    """

    def wrap(build: Builder) -> Builder:
        entry = WorkloadEntry(name, build, tuple(aliases), knobs if knobs is not None else _declared_knobs(build))
        for key in (name, *aliases):
            other = _ENTRIES.get(key)
            if other is not None and other.build is not build:
                raise WorkloadError(f"workload name {key!r} is already registered by {other.name!r}")
            _ENTRIES[key] = entry
        return build

    return wrap


def _discover() -> None:
    """Import every module of this package once, so each registers its workloads."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    _DISCOVERED = True


def known_workloads() -> list[str]:
    """Every name ``load_workload`` accepts (names and aliases), sorted."""
    _discover()
    return sorted(_ENTRIES)


def workload_entries() -> list[WorkloadEntry]:
    """One entry per workload (aliases folded), sorted by name: for listings."""
    _discover()
    return sorted({e.name: e for e in _ENTRIES.values()}.values(), key=lambda e: e.name)


def split_workload(text: str) -> tuple[str, dict[str, str]]:
    """``NAME:FILE`` -> (NAME, {"path": FILE}) for a workload whose builder takes a ``path`` knob
    (``deepshare:trace.json``); anything else -> (text, {})."""
    _discover()
    name, sep, rest = text.partition(":")
    entry = _ENTRIES.get(name)
    if sep and rest and text not in _ENTRIES and entry is not None and "path" in entry.knobs:
        return name, {"path": rest}
    return text, {}


def load_workload(name_or_path: str, *, seed: int = 0, **knobs) -> Workload:
    """The workload named ``name_or_path`` (or ``NAME:FILE``, :func:`split_workload`), or the CSV
    trace at that path.

    ``seed`` fixes every random draw (models, iteration times, sampling, arrivals), so the same
    name, seed and knobs give the same workload.
    """
    _discover()
    name_or_path, given = split_workload(name_or_path)
    if given and "path" in knobs:
        raise WorkloadError(f"workload {name_or_path!r}: give the file as NAME:FILE or as the path knob, not both")
    knobs = {**knobs, **given}
    entry = _ENTRIES.get(name_or_path)
    if entry is not None:
        unknown = sorted(set(knobs) - set(entry.knobs))
        if unknown:
            raise WorkloadError(f"workload {entry.name!r} has no knob {', '.join(map(repr, unknown))}; "
                                f"its knobs: {', '.join(entry.knobs) or '(none)'}")
        _check_knob_types(entry, knobs)
        try:
            return entry.build(seed=seed, **knobs)
        except TypeError as exc:  # a knob of a type the builder cannot use, found deep inside it
            given = ", ".join(f"{k}={v!r}" for k, v in sorted(knobs.items())) or "no knobs"
            raise WorkloadError(f"workload {entry.name!r} ({given}): {exc}") from None
    path = Path(name_or_path)
    if path.suffix.lower() == ".csv" or path.is_file():
        return _load_csv(path, seed=seed, **knobs)
    raise WorkloadError(f"unknown workload {name_or_path!r}; known: {', '.join(known_workloads())}, "
                        "or the path of a CSV trace")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_knob_types(entry: WorkloadEntry, knobs: dict) -> None:
    """A knob whose default is a number takes a number or a list of numbers (app_size=[2,8]); one
    whose default is a string, a string or a list of strings. Anything else went into the builder
    and came out as a TypeError from deep inside it ("'<' not supported ...")."""
    params = inspect.signature(entry.build).parameters
    for name, value in knobs.items():
        default = params[name].default if name in params else None
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if _is_number(default) and not (items and all(_is_number(v) for v in items)):
            raise WorkloadError(f"workload {entry.name!r}: knob {name} wants a number (or a list of numbers), "
                                f"got {value!r}")
        if isinstance(default, str) and not (items and all(isinstance(v, str) for v in items)):
            raise WorkloadError(f"workload {entry.name!r}: knob {name} wants a string, got {value!r}")


def _load_csv(path: Path, *, seed: int, **knobs) -> Workload:
    """A Philly-format file becomes Workload 1 over that file; anything else is a user trace."""
    from simulator.workloads import philly, trace_csv

    if not path.is_file():
        raise WorkloadError(f"{path}: no such trace file")
    if philly.has_philly_header(path):
        return load_workload("workload1", seed=seed, trace=str(path), **knobs)
    if knobs:
        raise WorkloadError(f"a user trace takes no knobs, got {', '.join(sorted(knobs))}")
    return trace_csv.load_trace_csv(path, seed=seed)
