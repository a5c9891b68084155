"""Leftover allocation: work conservation after the auction (paper 3.3.2; mechanism D9).

Leftover GPUs go at random to apps that did not bid this round and still have unmet demand, never
beyond an app's demand; if none remain, to any app with unmet demand. An app drawn takes what it
still wants at once, its own previous GPUs first, then best-placed (D1), so a GPU stays idle only
when no app wants it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping

from arbiter.auction import take_gpus
from protos.messages import Position


def hand_out_leftover(
    leftover: Iterable[str],
    unmet: Mapping[str, int],
    bidders: Iterable[str],
    *,
    rng: random.Random,
    position: Callable[[str], Position],
    previous: Mapping[str, frozenset[str]] | None = None,
) -> dict[str, frozenset[str]]:
    """Grants of leftover GPUs (D9). ``unmet`` is each app's demand after the auction's grants."""
    pool = sorted(leftover)
    want = {app: n for app, n in unmet.items() if n > 0}
    bid = set(bidders)
    grants: dict[str, frozenset[str]] = {}
    for eligible in (sorted(a for a in want if a not in bid), sorted(a for a in want if a in bid)):
        rng.shuffle(eligible)
        for app in eligible:
            if not pool:
                return grants
            take = take_gpus(pool, min(want[app], len(pool)), position, (previous or {}).get(app, frozenset()))
            grants[app] = grants.get(app, frozenset()) | take
            want[app] -= len(take)
            pool = [g for g in pool if g not in take]
    return grants
