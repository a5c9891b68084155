"""Placement slowdown S(G) per model and locality level (mechanism D1).

S depends only on the locality level of the GPU set (0 one slot, 1 one machine, 2 one rack,
3 across racks) and is 1 for a single GPU. Values come from the profile table
(``agent/profiles/slowdowns.toml``, read by ``arbiter.profiles``, which the arbiter reads too and
this module re-exports: ``load_profiles``, ``use_profiles``, ``ModelProfile``, ...).

An *allocation* here is what an agent can see of a GPU set: each GPU's (rack, machine, slot).
Offers carry exactly that (D7), so agents never need the arbiter's cluster object.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from arbiter.profiles import (
    ENTRY_KEYS,
    NO_SLOWDOWN,
    PROFILES_ENV,
    SHIPPED_TABLE,
    ModelProfile,
    ProfileError,
    Slowdown,
    known_models_hint,
    load_profiles,
    model_slowdown,
    override_notes,
    profiles_with,
    use_profiles,
    user_profile_paths,
)

__all__ = ["ENTRY_KEYS", "NO_SLOWDOWN", "PROFILES_ENV", "SHIPPED_TABLE", "ModelProfile", "Position", "ProfileError",
           "Shape", "ShapeOnTop", "Slowdown", "canonical_shape", "known_models_hint", "load_profiles", "locality_of",
           "model_slowdown", "override_notes", "profiles_with", "slowdown_of", "use_profiles", "user_profile_paths"]

Position = tuple[str, str, str]  # (rack, machine, slot)


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


class ShapeOnTop:
    """``canonical_shape(held + extra)`` for many ``extra`` on one ``held``: a bid prices every row
    as the app's held GPUs plus a pick of the offer, and a pick touches a rack or a few, so the
    racks it does not touch keep the held set's shape and, in a rack it touches, only the machines
    it touches are counted again. Equal to :func:`canonical_shape` of the concatenation
    (``tests/test_placement.py``)."""

    def __init__(self, held: Iterable[Position]):
        self._slots: dict[tuple[str, str], dict[str, int]] = {}
        for (rack, machine, slot), n in Counter(held).items():
            self._slots.setdefault((rack, machine), {})[slot] = n
        self._machines: dict[str, dict[str, tuple[int, ...]]] = {}
        for (rack, machine), slots in self._slots.items():
            self._machines.setdefault(rack, {})[machine] = tuple(sorted(slots.values(), reverse=True))
        self._racks = {rack: tuple(sorted(ms.values(), reverse=True)) for rack, ms in self._machines.items()}
        self.held: Shape = tuple(sorted(self._racks.values()))

    def __call__(self, extra: Iterable[Position]) -> Shape:
        touched: dict[str, dict[str, dict[str, int]]] = {}
        for rack, machine, slot in extra:
            machines = touched.setdefault(rack, {})
            slots = machines.get(machine)
            if slots is None:
                slots = machines[machine] = dict(self._slots.get((rack, machine), {}))
            slots[slot] = slots.get(slot, 0) + 1
        if not touched:
            return self.held
        racks = [shape for rack, shape in self._racks.items() if rack not in touched]
        for rack, machines in touched.items():
            sizes = [s for m, s in self._machines.get(rack, {}).items() if m not in machines]
            sizes += [tuple(sorted(slots.values(), reverse=True)) for slots in machines.values()]
            racks.append(tuple(sorted(sizes, reverse=True)))
        return tuple(sorted(racks))
