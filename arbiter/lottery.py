"""Where a round's randomness comes from: public in a simulation, secret and auditable in a service (D24).

Every draw a round makes -- the lottery of the auction (D15), ties in the rank (D13), the leftover
order (D9) -- comes from one generator seeded per round. A simulation seeds it from its run's
seed and the round id, which is what makes a run repeatable (D16) and keeps every published
figure as it was. A service cannot: an app sees the round ids, so a seed derived from public
numbers lets it predict its own draw, and an app that knows it will win the lottery can take a
lie that loses in expectation and wins this round.

So an arbiter that serves apps keeps a secret (32 random bytes from the operating system's CSPRNG,
made once and journaled, never sent) and seeds round ``r`` with HMAC-SHA256(secret, r): nobody
without the secret can tell it from random, and a restarted arbiter (or a replay of the journal)
draws the same numbers for the same round. As the round opens, the arbiter commits to the seed
(SHA-256 of it, sent with every rho request); after the round closes it reveals the seed (in the
round's summary: journal, MQTT, RoundHistory). An auditor checks that the revealed seed hashes to
the commitment the agents saw before they bid (:func:`verify`), and can then re-draw every number
of the round; the secret, and with it every later round's seed, stays hidden.

The auction's lottery itself (D38) makes one uniform draw u per auction and gives the k-th of its n
PF winners (in name order) the draw (u + k/n) mod 1; a winner keeps its row iff its draw is below
its c_i (D15). Each draw alone is uniform whatever the others are, so every winner keeps its row
with probability exactly c_i, as with independent draws; but the draws are spread evenly around
the circle, so the winners are not all lost at once: with every c_i >= 1/n at least one keeps its
row. :func:`cells` lists the pieces of u on which the outcome is constant, which lets a benchmark
take the exact expectation over the whole lottery.
"""

from __future__ import annotations

import hashlib
import hmac
import random
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["SECRET_BYTES", "RoundSeeds", "auction_draws", "cells", "commitment", "independent_draws", "new_secret",
           "rotated_draws", "shared_draw", "verify"]

SECRET_BYTES = 32


def new_secret() -> bytes:
    """A fresh secret from the operating system's CSPRNG."""
    return secrets.token_bytes(SECRET_BYTES)


def commitment(seed: str) -> str:
    """What an arbiter publishes before a round: SHA-256 of the round's seed, in hex."""
    return hashlib.sha256(seed.encode()).hexdigest()


def verify(seed: str, committed: str) -> bool:
    """Whether a revealed ``seed`` is the one ``committed`` to before the round."""
    return hmac.compare_digest(commitment(seed), committed)


@dataclass(frozen=True)
class RoundSeeds:
    """The seed of each round: ``f"{seed}:{round}"`` from a public ``seed`` (a simulation's, D16),
    or HMAC-SHA256 of the round under a ``secret`` (a service's). ``repr`` never shows the secret."""

    seed: int | str = 0
    secret: bytes | None = None

    def __post_init__(self) -> None:
        if self.secret is not None and len(self.secret) < 16:
            raise ValueError(f"a lottery secret needs at least 16 bytes, got {len(self.secret)}")

    def __repr__(self) -> str:
        return "RoundSeeds(secret)" if self.secret is not None else f"RoundSeeds(seed={self.seed!r})"

    @property
    def secret_kept(self) -> bool:
        """Whether the seeds are secret (a service's) rather than derived from public numbers."""
        return self.secret is not None

    def of(self, round_id: int) -> str:
        """Round ``round_id``'s seed."""
        if self.secret is None:
            return f"{self.seed}:{round_id}"
        return hmac.new(self.secret, f"themis-round:{round_id}".encode(), hashlib.sha256).hexdigest()


def shared_draw(seed: int) -> float:
    """The auction's one uniform draw u in [0, 1) (D38), from the seed the round gives the auction."""
    return random.Random(f"lottery:{seed}").random()


def rotated_draws(u: float, apps: Iterable[str]) -> dict[str, float]:
    """D38: the k-th of the n ``apps`` in name order draws (u + k/n) mod 1. For u uniform each draw
    is uniform (a rotation of the circle keeps its measure), so a winner keeps its row with
    probability exactly c_i; jointly the n draws sit 1/n apart, one in each n-th of the circle."""
    ordered = sorted(apps)
    n = len(ordered)
    return {app: (u + k / n) % 1.0 for k, app in enumerate(ordered)}


def auction_draws(seed: int, apps: Iterable[str]) -> dict[str, float]:
    """Each PF winner's lottery draw (D15, D38): it keeps its row iff its draw is below its c_i."""
    return rotated_draws(shared_draw(seed), apps)


def independent_draws(seed: int, apps: Iterable[str]) -> dict[str, float]:
    """The lottery before D38, kept to measure against: one independent stream per app."""
    return {app: random.Random(f"lottery:{seed}:{app}").random() for app in sorted(apps)}


def cells(c: Mapping[str, float]) -> list[tuple[float, float]]:
    """The pieces of u in [0, 1) on which :func:`rotated_draws` keeps the same winners, as (a u inside
    the piece, its length); the lengths sum to 1. Winner k of n keeps its row for u in the arc
    [-k/n, c_k - k/n) mod 1 of length c_k, so the pieces are cut where an arc starts or ends and
    an expectation over the lottery is exactly the sum over the pieces, each weighted by its length."""
    ordered = sorted(c)
    n = len(ordered)
    cuts = {0.0, 1.0}
    for k, app in enumerate(ordered):
        if 0.0 < c[app] < 1.0:
            cuts.add((-k / n) % 1.0)
            cuts.add((c[app] - k / n) % 1.0)
    edges = sorted(cuts)
    return [((lo + hi) / 2, hi - lo) for lo, hi in zip(edges, edges[1:]) if hi > lo]
