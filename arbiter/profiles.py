"""The profile table: each model's placement slowdown S by locality level (D1), with its source.

Read by the arbiter -- a measured rank applies a bound model's slowdowns to the app's claimed work
(D21), and ``IssueToken`` binds apps to its models -- and by agents, the simulator and the workload
builders. It lives in the lowest layer that reads it, so the arbiter needs nothing from the agent
package; ``agent.placement`` re-exports it for the agent's side.

The shipped values are ``agent/profiles/slowdowns.toml``, which says where every number comes from
(the one copy: agents' other tables sit beside it). Users add models (or, saying
``override = true``, replace one) with their own tables of the same form: :func:`use_profiles`
records them in the environment (``THEMIS_PROFILES``) so every ``load_profiles()`` -- the
simulator's, the profiler's, the workload builders', in worker processes too -- reads the shipped
table and then theirs.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType

Slowdown = tuple[float, float, float, float]  # S by D1 level 0..3
NO_SLOWDOWN: Slowdown = (1.0, 1.0, 1.0, 1.0)
ENTRY_KEYS = ("category", "slowdown", "source", "override")
SHIPPED_TABLE = "agent/profiles/slowdowns.toml"
PROFILES_ENV = "THEMIS_PROFILES"  # os.pathsep-separated user tables, read after the shipped one


class ProfileError(ValueError):
    """A profile table that cannot be used; the message names the file and the key."""


@dataclass(frozen=True, slots=True)
class ModelProfile:
    name: str
    category: str  # cv, nlp or speech (paper Table 4)
    slowdown: Slowdown
    source: str
    table: str = SHIPPED_TABLE  # the file this row comes from
    overrides: str = ""  # the table whose row of the same name this one replaces, if any


def _profile_from(name: str, entry: Mapping, label: str) -> ModelProfile:
    where = f"{label}: models.{name}"
    if not isinstance(entry, Mapping):
        raise ProfileError(f"{where} must be a table")
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise ProfileError(f"{where} has unknown key(s) {', '.join(unknown)}; known: {', '.join(ENTRY_KEYS)}")
    values = entry.get("slowdown")
    if not isinstance(values, list) or len(values) != 4:
        raise ProfileError(f"{where}.slowdown must be a list of 4 numbers (levels slot, machine, rack, cluster)")
    s: list[float] = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 1.0 or v == float("inf"):
            raise ProfileError(f"{where}.slowdown[{i}] must be a number >= 1 (and finite), got {v!r}")
        s.append(float(v))
    if any(a > b for a, b in zip(s, s[1:])):
        raise ProfileError(f"{where}.slowdown must not decrease with the level, got {s}")
    source = entry.get("source")
    if not isinstance(source, str) or not source.strip():
        raise ProfileError(f"{where}.source must say where the numbers come from")
    category = entry.get("category", "")
    if category not in {"cv", "nlp", "speech", "other"}:
        raise ProfileError(f"{where}.category must be one of cv, nlp, speech, other")
    if not isinstance(entry.get("override", False), bool):
        raise ProfileError(f"{where}.override must be true or false, got {entry['override']!r}")
    return ModelProfile(name, category, (s[0], s[1], s[2], s[3]), source.strip(), table=label)


def _read_table(text: str, label: str) -> tuple[dict[str, ModelProfile], set[str]]:
    """The models of one TOML table and the names it marks ``override = true``."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{label}: invalid TOML: {exc}") from None
    models = data.get("models")
    if not isinstance(models, Mapping) or not models:
        raise ProfileError(f"{label}: needs a non-empty [models] table")
    extra = sorted(set(data) - {"models"})
    if extra:
        raise ProfileError(f"{label}: unknown top-level key(s) {', '.join(extra)}; a table has only [models.<name>]")
    table = {name: _profile_from(name, entry, label) for name, entry in models.items()}
    return table, {name for name, entry in models.items() if entry.get("override") is True}


def _read_file(path: str | Path, label: str) -> tuple[dict[str, ModelProfile], set[str]]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileError(f"{label}: cannot read profile table: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{label}: not UTF-8 text: {exc}") from None
    return _read_table(text, label)


def shipped_path() -> Path:
    """Where the shipped table is: ``agent/profiles/``, beside the other tables agents read, found
    as the installed package's data without importing that package (it sits a layer up)."""
    spec = importlib.util.find_spec("agent")
    if spec is None or not spec.submodule_search_locations:
        raise ProfileError(f"{SHIPPED_TABLE}: the agent package's data is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "profiles" / "slowdowns.toml"


def _shipped_table() -> dict[str, ModelProfile]:
    return _read_file(shipped_path(), SHIPPED_TABLE)[0]


def user_profile_paths() -> tuple[str, ...]:
    """The user tables in :data:`PROFILES_ENV`, in the order they apply."""
    return tuple(p for p in os.environ.get(PROFILES_ENV, "").split(os.pathsep) if p.strip())


def _merge(table: dict[str, ModelProfile], path: str | Path, label: str) -> None:
    """Add ``path``'s models to ``table``. Replacing a model already there must be asked for with
    ``override = true`` in its entry (issue 13 item 6), so a name clash is never silent; the new
    row records which table it replaced (:func:`override_notes`)."""
    added, overrides = _read_file(path, label)
    for name, profile in added.items():
        before = table.get(name)
        if before is not None and name not in overrides:
            raise ProfileError(f"{label}: models.{name} is already in {before.table}; set override = true in "
                               f"[models.{name}] to replace its slowdowns, or pick another name")
        if before is None and name in overrides:
            raise ProfileError(f"{label}: models.{name} says override = true but no earlier table has {name!r} "
                               f"(known: {', '.join(sorted(table))})")
        table[name] = replace(profile, overrides=before.table) if before is not None else profile


def load_profiles(path: str | Path | None = None, *, user: bool = True) -> dict[str, ModelProfile]:
    """The model -> slowdown table.

    ``path`` given: that TOML file alone. Otherwise the shipped table, then (``user``) each file of
    :data:`PROFILES_ENV` in order (set by :func:`use_profiles`): the environment, not a module
    global, so the simulator's worker processes see the same table as the parent (issue 13 item 6).
    """
    if path is not None:
        return _read_file(path, str(path))[0]
    table = _shipped_table()
    if user:
        for extra in user_profile_paths():
            try:
                _merge(table, extra, extra)
            except ProfileError as exc:
                raise ProfileError(f"{exc} (a table listed in {PROFILES_ENV})") from None
    return table


def use_profiles(*paths: str | Path) -> dict[str, ModelProfile]:
    """Add the models of ``paths`` (TOML files shaped like the shipped table) to every later
    :func:`load_profiles` call in this process and in processes it starts; no paths: shipped table only.

    Files are checked now (a bad one raises :class:`ProfileError` naming the file and the model or
    key, and changes nothing) and recorded as absolute paths, so a worker with another working
    directory reads the same files. Returns the resulting table; :func:`override_notes` lists the
    shipped rows it replaces.
    """
    table = _shipped_table()
    absolute = [str(Path(p).expanduser().resolve()) for p in paths]
    for resolved in absolute:
        _merge(table, resolved, resolved)
    if absolute:
        os.environ[PROFILES_ENV] = os.pathsep.join(absolute)
    else:
        os.environ.pop(PROFILES_ENV, None)
    return table


def profiles_with(*paths: str | Path) -> dict[str, ModelProfile]:
    """:func:`load_profiles` plus the models of ``paths``, checked as :func:`use_profiles` checks
    them, without changing the environment (the arbiter's table, D21)."""
    table = load_profiles()
    for path in paths:
        resolved = str(Path(path).expanduser().resolve())
        _merge(table, resolved, resolved)
    return table


def override_notes(table: Mapping[str, ModelProfile]) -> list[str]:
    """One line per model whose row replaces an earlier table's, for run summaries and logs."""
    return [f"model {p.name!r}: slowdowns from {p.table} replace those of {p.overrides}"
            for p in sorted(table.values(), key=lambda p: p.name) if p.overrides]


def known_models_hint(table: Mapping[str, ModelProfile]) -> str:
    """What to say about an unknown model: the known ones and how to add one."""
    return (f"known: {', '.join(sorted(table))}; add a model with a profile table "
            f"(themis-sim --profiles FILE, or the environment variable {PROFILES_ENV} for any program), "
            f"same form as {SHIPPED_TABLE}")


def model_slowdown(model: str, profiles: Mapping[str, ModelProfile] | None = None) -> Slowdown:
    table = profiles if profiles is not None else _default_table(os.environ.get(PROFILES_ENV, ""))
    try:
        return table[model].slowdown
    except KeyError:
        raise ProfileError(f"unknown model {model!r}; {known_models_hint(table)}") from None


@functools.lru_cache(maxsize=8)
def _default_table(env: str) -> Mapping[str, ModelProfile]:
    """``load_profiles()`` for one value of :data:`PROFILES_ENV` (the argument is the cache key)."""
    return MappingProxyType(load_profiles())


def model_slowdowns(extra: tuple[str | Path, ...] = ()) -> dict[str, Slowdown]:
    """Model -> placement slowdowns: the shipped table, the tables in THEMIS_PROFILES and ``extra``
    (later files replace a model only where they say ``override = true``): what an admin may bind
    an app to when issuing its token, and what the arbiter's measured rank applies (D21)."""
    return {name: profile.slowdown for name, profile in profiles_with(*extra).items()}
