"""Who holds which GPU until when (paper 4.2.2: "each GPU ... has a lease"; mechanism D10).

The lease table is the one place that says a GPU is taken, so it refuses to grant a GPU that is
held: no GPU can ever be held by two apps, whatever the caller does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass


class LeaseConflict(ValueError):
    """A grant for a GPU that someone already holds, or a release of a GPU not held."""


@dataclass(frozen=True, slots=True)
class Lease:
    gpu: str
    app: str
    granted_at: float
    expires_at: float
    round_id: int


_NONE: frozenset[str] = frozenset()


class LeaseTable:
    def __init__(self, leases: Iterable[Lease] = ()):
        self._by_gpu: dict[str, Lease] = {}
        self._by_app: dict[str, set[str]] = {}
        self._frozen: dict[str, frozenset[str]] = {}  # held_by's answers, dropped when the app's GPUs change
        for lease in leases:
            self._add(lease)

    def _add(self, lease: Lease) -> None:
        held = self._by_gpu.get(lease.gpu)
        if held is not None:
            raise LeaseConflict(f"GPU {lease.gpu} is already leased to {held.app!r} until {held.expires_at}")
        self._by_gpu[lease.gpu] = lease
        self._by_app.setdefault(lease.app, set()).add(lease.gpu)
        self._frozen.pop(lease.app, None)

    def _remove(self, gpu: str) -> Lease:
        lease = self._by_gpu.pop(gpu)
        owned = self._by_app[lease.app]
        owned.discard(gpu)
        self._frozen.pop(lease.app, None)
        if not owned:
            del self._by_app[lease.app]
        return lease

    def grant(self, app: str, gpus: Iterable[str], *, now: float, expires_at: float, round_id: int) -> list[Lease]:
        """Lease ``gpus`` to ``app``; all or nothing."""
        gpus = sorted(set(gpus))
        taken = [g for g in gpus if g in self._by_gpu]
        if taken:
            holders = sorted({self._by_gpu[g].app for g in taken})
            raise LeaseConflict(f"cannot grant {taken[:5]} to {app!r}: already leased to {holders}")
        if not (math.isfinite(now) and math.isfinite(expires_at)) or expires_at <= now:
            raise ValueError(f"a lease must expire at a finite time after it is granted ({expires_at} <= {now})")
        leases = [Lease(g, app, now, expires_at, round_id) for g in gpus]
        for lease in leases:
            self._add(lease)
        return leases

    def restore(self, lease: Lease) -> None:
        """Put back a lease exactly as it was (a round that failed after expiring it); refuses a
        GPU someone holds, like every grant."""
        self._add(lease)

    def release(self, app: str, gpus: Iterable[str] | None = None) -> frozenset[str]:
        """Give back ``gpus`` (all of the app's GPUs when None) before their leases run out."""
        owned = self._by_app.get(app, set())
        wanted = set(owned) if gpus is None else set(gpus)
        foreign = sorted(g for g in wanted if g not in owned)
        if foreign:
            raise LeaseConflict(f"{app!r} cannot release {foreign[:5]}: it does not hold them")
        for g in wanted:
            self._remove(g)
        return frozenset(wanted)

    def expire(self, now: float) -> list[Lease]:
        """Remove and return every lease that has run out by ``now``."""
        done = [lease for lease in self._by_gpu.values() if lease.expires_at <= now]
        for lease in done:
            self._remove(lease.gpu)
        return done

    def holder(self, gpu: str) -> str | None:
        lease = self._by_gpu.get(gpu)
        return lease.app if lease else None

    def held_by(self, app: str) -> frozenset[str]:
        """The app's GPUs; a round asks this for every app many times between changes."""
        got = self._frozen.get(app)
        if got is None:
            owned = self._by_app.get(app)
            if not owned:
                return _NONE
            got = self._frozen[app] = frozenset(owned)
        return got

    def lease(self, gpu: str) -> Lease | None:
        return self._by_gpu.get(gpu)

    def next_expiry(self) -> float | None:
        return min((lease.expires_at for lease in self._by_gpu.values()), default=None)

    def taken(self) -> frozenset[str]:
        return frozenset(self._by_gpu)

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._by_gpu.values()))

    def __len__(self) -> int:
        return len(self._by_gpu)
