"""Placement slowdown S(G) per model and locality level (mechanism D1).

S depends only on the locality level of the GPU set (0 one slot, 1 one machine, 2 one rack,
3 across racks) and is 1 for a single GPU. Values come from ``agent/profiles/slowdowns.toml``,
which says where every number comes from; users may pass their own table of the same form.

An *allocation* here is what an agent can see of a GPU set: each GPU's (rack, machine, slot).
Offers carry exactly that (D7), so agents never need the arbiter's cluster object.
"""

from __future__ import annotations

import tomllib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

Position = tuple[str, str, str]  # (rack, machine, slot)
Slowdown = tuple[float, float, float, float]  # S by D1 level 0..3
NO_SLOWDOWN: Slowdown = (1.0, 1.0, 1.0, 1.0)


class ProfileError(ValueError):
    """A profile table that cannot be used; the message names the file and the key."""


@dataclass(frozen=True, slots=True)
class ModelProfile:
    name: str
    category: str  # cv, nlp or speech (paper Table 4)
    slowdown: Slowdown
    source: str


def locality_of(positions: Sequence[Position]) -> int:
    """D1 level of a set of GPU positions (same rule as ``arbiter.cluster.locality_level``)."""
    if len(set(positions)) <= 1:
        return 0
    if len({p[:2] for p in positions}) == 1:
        return 1
    if len({p[0] for p in positions}) == 1:
        return 2
    return 3


def slowdown_of(slowdown: Slowdown, positions: Sequence[Position]) -> float:
    """S(G): 1 for zero or one GPU, else the profile's value at G's locality level (D1)."""
    if len(positions) <= 1:
        return 1.0
    return slowdown[locality_of(positions)]


def _profile_from(name: str, entry: Mapping, label: str) -> ModelProfile:
    where = f"{label}: models.{name}"
    if not isinstance(entry, Mapping):
        raise ProfileError(f"{where} must be a table")
    values = entry.get("slowdown")
    if not isinstance(values, list) or len(values) != 4:
        raise ProfileError(f"{where}.slowdown must be a list of 4 numbers (levels slot, machine, rack, cluster)")
    s: list[float] = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 1.0:
            raise ProfileError(f"{where}.slowdown[{i}] must be a number >= 1, got {v!r}")
        s.append(float(v))
    if any(a > b for a, b in zip(s, s[1:])):
        raise ProfileError(f"{where}.slowdown must not decrease with the level, got {s}")
    source = entry.get("source")
    if not isinstance(source, str) or not source.strip():
        raise ProfileError(f"{where}.source must say where the numbers come from")
    category = entry.get("category", "")
    if category not in {"cv", "nlp", "speech", "other"}:
        raise ProfileError(f"{where}.category must be one of cv, nlp, speech, other")
    return ModelProfile(name, category, (s[0], s[1], s[2], s[3]), source.strip())


def load_profiles(path: str | Path | None = None) -> dict[str, ModelProfile]:
    """The model -> slowdown table; the shipped one unless ``path`` names another TOML file."""
    if path is None:
        label = "agent/profiles/slowdowns.toml"
        text = (resources.files("agent") / "profiles" / "slowdowns.toml").read_text()
    else:
        label = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ProfileError(f"{label}: cannot read profile table: {exc.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{label}: invalid TOML: {exc}") from None
    models = data.get("models")
    if not isinstance(models, Mapping) or not models:
        raise ProfileError(f"{label}: needs a non-empty [models] table")
    return {name: _profile_from(name, entry, label) for name, entry in models.items()}


def model_slowdown(model: str, profiles: Mapping[str, ModelProfile] | None = None) -> Slowdown:
    table = profiles if profiles is not None else _shipped()
    try:
        return table[model].slowdown
    except KeyError:
        raise ProfileError(f"unknown model {model!r}; known: {', '.join(sorted(table))}") from None


_SHIPPED: dict[str, ModelProfile] | None = None


def _shipped() -> dict[str, ModelProfile]:
    global _SHIPPED
    if _SHIPPED is None:
        _SHIPPED = load_profiles()
    return _SHIPPED


Shape = tuple[tuple[tuple[int, ...], ...], ...]


def canonical_shape(positions: Iterable[Position]) -> Shape:
    """What an app can tell apart about a GPU set: per rack, per machine, the slot sizes.

    Two sets with the same shape give the same rho (S depends only on locality, D1), so bids and
    rho caches key on this instead of on GPU names.
    """
    machines: dict[tuple[str, str], list[int]] = {}
    for (rack, machine, _), n in Counter(positions).items():
        machines.setdefault((rack, machine), []).append(n)
    racks: dict[str, list[tuple[int, ...]]] = {}
    for (rack, _), sizes in machines.items():
        sizes.sort(reverse=True)
        racks.setdefault(rack, []).append(tuple(sizes))
    return tuple(sorted(tuple(sorted(ms, reverse=True)) for ms in racks.values()))
