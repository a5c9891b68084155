"""What the service allows before and around authentication (issue 32): rates per key, in numbers.

An arbiter has to read a stream's first message to know who sends it, and a Register or a Hello costs
it a journal lookup (and a new app a journal write). Without bounds a client with no credential
could make it buffer megabytes per stream, and one app's reconnect loop could keep it busy for
everyone. The limits are plain numbers, named in every refusal, set on :class:`Limits`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Limits", "TokenBucket"]


@dataclass(frozen=True)
class Limits:
    """The service's bounds. ``unauthenticated`` streams are read at once at most (a credential the
    arbiter does not know is refused after its first message is read, or after ``first_message_s``);
    an authenticated stream must send its Hello within ``hello_s``; each app may send ``hellos`` Hellos
    and ``registers`` Registers in a burst, refilled at ``per_s`` a second."""

    unauthenticated: int = 4
    first_message_s: float = 5.0
    hello_s: float = 10.0
    hellos: int = 20
    registers: int = 20
    per_s: float = 2.0

    def check(self) -> None:
        for name in ("unauthenticated", "hellos", "registers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"limit {name} must be an integer >= 1, got {value!r}")
        for name in ("first_message_s", "hello_s", "per_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"limit {name} must be a number > 0, got {value!r}")


class TokenBucket:
    """``burst`` tokens per key, refilled at ``per_s`` a second; :meth:`take` spends one or says no.
    Keys idle long enough to be full again are forgotten, so the table stays as small as the keys
    that are busy now."""

    def __init__(self, burst: int, per_s: float, clock: Callable[[], float] = time.monotonic):
        self.burst, self.per_s, self.clock = burst, per_s, clock
        self._level: dict[str, tuple[float, float]] = {}  # key -> (tokens, when)

    def take(self, key: str) -> bool:
        now = self.clock()
        tokens, when = self._level.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - when) * self.per_s)
        if len(self._level) > 4096:  # forget the full ones
            self._level = {k: v for k, v in self._level.items()
                           if v[0] + (now - v[1]) * self.per_s < self.burst}
        if tokens < 1.0:
            self._level[key] = (tokens, now)
            return False
        self._level[key] = (tokens - 1.0, now)
        return True
