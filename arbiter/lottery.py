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
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

__all__ = ["SECRET_BYTES", "RoundSeeds", "commitment", "new_secret", "verify"]

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
