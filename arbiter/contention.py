"""Network contention between jobs that share machines (mechanism D35).

A job spread over several machines sends its gradients (or shards, or tokens) over those machines'
network, and so does every other such job placed there. DeepShare (seeds/002) measured 36 kinds of
distributed jobs -- six models at 2, 4 and 8 GPUs spread over 2, 4 or 8 nodes -- in pairs on a
4 x 8-GPU testbed: the *ratio* of a target job's throughput next to a neighbour to its throughput alone
(``profiles/contention_deepshare.csv``, copied unchanged; attribution and licence in
``profiles/README-deepshare.md`` and ``profiles/LICENSE-deepshare``). A contention table is any CSV
of that form: a square matrix whose rows (target) and columns (neighbour) are keyed
``"<class>,<GPUs>,<machines>"``.

D35, the combination rule (DeepShare's own, with what we keep and why in docs/mechanism.md):

- a job on one machine uses no network and is untouched (ratio 1); it slows nobody;
- a job on several machines has ratio = max(FLOOR, min over the other multi-machine jobs that share
  any of its machines of the table's pairwise ratio), 1 when it has no such neighbour;
- a (GPUs, machines) pair the table does not list is read at the nearest listed one (GPUs, then
  machines, nearest on a log2 scale, ties to the larger).

A model of the profile tables belongs to one of the table's classes by communication profile
(``profiles/contention_classes.toml``, each mapping with its source): a model named like a class
is that class; otherwise the file's ``[models.<name>]`` entry; otherwise its category's entry.

Pure functions of placements given as machine names: the simulator calls them with its GPUs'
machines, an agent (later) with the ``(rack, machine)`` of the positions in its offer.
"""

from __future__ import annotations

import csv
import functools
import importlib.util
import io
import math
import tomllib
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

#: D35: the lowest ratio a job can fall to, whatever its neighbours (DeepShare's simulator's floor).
FLOOR = 0.35
#: DeepShare preempts a job whose ratio falls to this or below (an option of the simulator).
PREEMPT_AT = 0.6
#: The shipped table, by the name ``--contention`` also accepts.
SHIPPED = {"deepshare": "contention_deepshare.csv"}
CLASSES_FILE = "contention_classes.toml"

K = TypeVar("K", bound=Hashable)


class ContentionError(ValueError):
    """A contention table or class mapping that cannot be used; the message names the file and where."""


@dataclass(frozen=True, slots=True)
class JobKind:
    """What contention depends on and what a neighbour can see of a job: its class (one of the
    table's, e.g. ``MoE``), its GPUs and how many machines they span."""

    cls: str
    gpus: int
    machines: int

    @property
    def spread(self) -> bool:
        """Whether the job uses the network at all (D35: one machine is untouched)."""
        return self.machines >= 2


@dataclass(frozen=True, slots=True)
class Placed:
    """A job where it runs: its kind and the names of the machines its GPUs are on."""

    kind: JobKind
    machines: frozenset[str]

    @staticmethod
    def on(cls: str, machines_of_gpus: Iterable[str]) -> "Placed":
        """A job of class ``cls`` on GPUs whose machines are ``machines_of_gpus`` (one entry per GPU)."""
        names = list(machines_of_gpus)
        where = frozenset(names)
        return Placed(JobKind(cls, len(names), len(where)), where)


def _nearest(value: int, choices: Iterable[int]) -> int:
    """The choice nearest ``value`` on a log2 scale, ties to the larger."""
    return min(choices, key=lambda c: (abs(math.log2(c) - math.log2(max(1, value))), -c))


class ContentionTable:
    """Pairwise throughput ratios keyed by (class, GPUs, machines); see the module docstring."""

    def __init__(self, ratios: Mapping[tuple[str, int, int], Mapping[tuple[str, int, int], float]], source: str):
        self.source = source
        self._ratios = {k: dict(v) for k, v in ratios.items()}
        self.classes: tuple[str, ...] = tuple(dict.fromkeys(k[0] for k in self._ratios))
        self._shapes: dict[str, tuple[tuple[int, int], ...]] = {
            c: tuple(sorted((g, n) for cc, g, n in self._ratios if cc == c)) for c in self.classes}
        self._keys: dict[JobKind, tuple[str, int, int]] = {}

    def __repr__(self) -> str:
        return f"ContentionTable({self.source!r}, {len(self._ratios)} kinds)"

    def key(self, kind: JobKind) -> tuple[str, int, int]:
        """The table's row for ``kind``: exact, else the nearest listed GPUs, then machines (D35)."""
        known = self._keys.get(kind)
        if known is None:
            known = self._keys[kind] = self._nearest_key(kind)
        return known

    def _nearest_key(self, kind: JobKind) -> tuple[str, int, int]:
        shapes = self._shapes.get(kind.cls)
        if not shapes:
            raise ContentionError(f"{self.source}: no class {kind.cls!r}; the table has {', '.join(self.classes)}")
        gpus = _nearest(kind.gpus, {g for g, _ in shapes})
        machines = _nearest(kind.machines, {n for g, n in shapes if g == gpus})
        return (kind.cls, gpus, machines)

    def pair(self, target: JobKind, neighbour: JobKind) -> float:
        """The target's throughput next to ``neighbour`` over its throughput alone (the table's cell)."""
        return self._ratios[self.key(target)][self.key(neighbour)]


def ratio_of(table: ContentionTable, job: Placed, neighbours: Iterable[Placed], floor: float = FLOOR) -> float:
    """D35 for one job: 1 on one machine; else max(floor, min pairwise ratio over the multi-machine
    neighbours that share one of its machines), 1 without such a neighbour."""
    if not job.kind.spread:
        return 1.0
    worst = 1.0
    for other in neighbours:
        if other.kind.spread and other.machines & job.machines:
            worst = min(worst, table.pair(job.kind, other.kind))
    return max(floor, worst)


def job_ratios(table: ContentionTable, placed: Mapping[K, Placed], floor: float = FLOOR) -> dict[K, float]:
    """D35 for every job of ``placed`` (any hashable ids) against all the others."""
    by_machine: dict[str, list[K]] = {}
    for job, where in placed.items():
        if where.kind.spread:
            for machine in where.machines:
                by_machine.setdefault(machine, []).append(job)
    out: dict[K, float] = {}
    for job, where in placed.items():
        if not where.kind.spread:
            out[job] = 1.0
            continue
        near = {other for machine in where.machines for other in by_machine[machine] if other != job}
        out[job] = ratio_of(table, where, (placed[other] for other in near), floor)
    return out


# -- files -----------------------------------------------------------------------------------------


def _parse_key(text: str, where: str) -> tuple[str, int, int]:
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 3 or not parts[0]:
        raise ContentionError(f"{where}: a job kind is \"<class>,<GPUs>,<machines>\", got {text!r}")
    try:
        gpus, machines = int(parts[1]), int(parts[2])
    except ValueError:
        raise ContentionError(f"{where}: GPUs and machines must be whole numbers, got {text!r}") from None
    if gpus < 1 or machines < 1 or machines > gpus:
        raise ContentionError(f"{where}: need 1 <= machines <= GPUs, got {text!r}")
    return (parts[0], gpus, machines)


def parse_table(text: str, source: str) -> ContentionTable:
    """A contention table from CSV text (DeepShare's ``shared_thp_ratio.csv`` form)."""
    rows = [r for r in csv.reader(io.StringIO(text.lstrip("\ufeff"))) if r and any(c.strip() for c in r)]
    if len(rows) < 2:
        raise ContentionError(f"{source}: needs a header row of job kinds and one row per kind")
    header = [_parse_key(c, f"{source}: line 1, column {i + 2}") for i, c in enumerate(rows[0][1:])]
    if len(set(header)) != len(header):
        raise ContentionError(f"{source}: line 1 names a job kind twice")
    ratios: dict[tuple[str, int, int], dict[tuple[str, int, int], float]] = {}
    for line, row in enumerate(rows[1:], start=2):
        key = _parse_key(row[0], f"{source}: line {line}")
        if len(row) - 1 != len(header):
            raise ContentionError(f"{source}: line {line} has {len(row) - 1} ratios, the header {len(header)} kinds")
        cells = {}
        for col, (kind, cell) in enumerate(zip(header, row[1:]), start=2):
            try:
                value = float(cell)
            except ValueError:
                raise ContentionError(f"{source}: line {line}, column {col}: not a number: {cell!r}") from None
            if not 0 < value <= 1:
                raise ContentionError(f"{source}: line {line}, column {col}: a ratio is in (0, 1], got {value}")
            cells[kind] = value
        if key in ratios:
            raise ContentionError(f"{source}: line {line}: job kind {row[0]!r} has a row already")
        ratios[key] = cells
    if set(ratios) != set(header):
        missing = sorted(set(header) ^ set(ratios))
        raise ContentionError(f"{source}: rows and columns must list the same job kinds; differ in {missing[:4]}")
    return ContentionTable(ratios, source)


def _profiles_dir() -> Path:
    """``agent/profiles/``, where the tables agents read live, found as the installed package's data
    without importing that package (it sits a layer up), as ``arbiter.profiles`` finds its table."""
    spec = importlib.util.find_spec("agent")
    if spec is None or not spec.submodule_search_locations:
        raise ContentionError("agent/profiles: the agent package's data is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "profiles"


def shipped_path(name: str) -> Path:
    return _profiles_dir() / SHIPPED[name]


def load_table(name_or_path: str | Path = "deepshare") -> ContentionTable:
    """A shipped table by name (``deepshare``) or any CSV file of that form by path."""
    if isinstance(name_or_path, str) and name_or_path in SHIPPED:
        path = shipped_path(name_or_path)
        label = f"agent/profiles/{SHIPPED[name_or_path]}"
    else:
        path = Path(name_or_path)
        label = str(path)
    return _load_table(str(path), label)


@functools.lru_cache(maxsize=8)
def _load_table(path: str, label: str) -> ContentionTable:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        known = ", ".join(SHIPPED)
        raise ContentionError(f"{label}: cannot read contention table ({exc.strerror}); give a CSV file or "
                              f"one of: {known}") from None
    return parse_table(text, label)


@dataclass(frozen=True)
class ClassMap:
    """Which class of a contention table each model belongs to (``profiles/contention_classes.toml``)."""

    models: Mapping[str, str]
    categories: Mapping[str, str]
    sources: Mapping[str, str]
    label: str = CLASSES_FILE

    def class_of(self, model: str, category: str, table: ContentionTable) -> str:
        """The model's class in ``table``: itself when it names one, else its entry, else its
        category's; a clear error when none applies or the class is not in the table."""
        if model in table.classes:
            return model
        cls = self.models.get(model) or self.categories.get(category)
        if cls is None:
            raise ContentionError(f"model {model!r} (category {category!r}) has no contention class: add "
                                  f"[models.{model}] to {self.label} or name a class of {table.source} "
                                  f"({', '.join(table.classes)})")
        if cls not in table.classes:
            raise ContentionError(f"{self.label}: model {model!r} maps to {cls!r}, which {table.source} does "
                                  f"not list ({', '.join(table.classes)})")
        return cls


def parse_classes(text: str, label: str) -> ClassMap:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ContentionError(f"{label}: invalid TOML: {exc}") from None
    extra = sorted(set(data) - {"models", "categories"})
    if extra:
        raise ContentionError(f"{label}: unknown top-level key(s) {', '.join(extra)}; known: models, categories")
    models: dict[str, str] = {}
    categories: dict[str, str] = {}
    sources: dict[str, str] = {}
    for section, into in (("models", models), ("categories", categories)):
        for name, entry in (data.get(section) or {}).items():
            where = f"{label}: {section}.{name}"
            if not isinstance(entry, Mapping) or set(entry) != {"class", "source"}:
                raise ContentionError(f"{where} needs exactly class = \"...\" and source = \"...\"")
            if not isinstance(entry["class"], str) or not entry["class"]:
                raise ContentionError(f"{where}.class must name a class of the contention table")
            if not isinstance(entry["source"], str) or not entry["source"].strip():
                raise ContentionError(f"{where}.source must say where the mapping comes from")
            into[name] = entry["class"]
            sources[f"{section}.{name}"] = entry["source"].strip()
    return ClassMap(models, categories, sources, label)


@functools.cache
def load_classes() -> ClassMap:
    """The shipped class mapping."""
    text = (_profiles_dir() / CLASSES_FILE).read_text(encoding="utf-8")
    return parse_classes(text, f"agent/profiles/{CLASSES_FILE}")
