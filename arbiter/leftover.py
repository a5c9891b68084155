"""Leftover allocation: work conservation after the auction (paper 3.3.2; mechanism D9).

Leftover GPUs go at random to apps that did not bid this round and still have unmet demand, never
beyond an app's demand; if none remain, to any app with unmet demand. An app drawn takes what it
still wants at once, its own previous GPUs first, then best-placed (D1), so a GPU stays idle only
when no app wants it.

"Did not bid" means not offered: the apps the fairness filter kept out (D6). An app that was
offered GPUs and did not bid -- silent, crashed, or its bid refused -- comes last, after the
bidders: otherwise not bidding would pay, and a dead agent would be leased GPUs it cannot use.
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
    offered: Iterable[str] = (),
) -> dict[str, frozenset[str]]:
    """Grants of leftover GPUs (D9). ``unmet`` is each app's demand after the auction's grants;
    ``offered`` the apps that got this round's offer (those of them not in ``bidders`` come last)."""
    pool = sorted(leftover)
    want = {app: n for app, n in unmet.items() if n > 0}
    bid = set(bidders)
    silent = set(offered) - bid
    grants: dict[str, frozenset[str]] = {}
    tiers = (
        sorted(a for a in want if a not in bid and a not in silent),
        sorted(a for a in want if a in bid),
        sorted(a for a in want if a in silent),
    )
    for eligible in tiers:
        rng.shuffle(eligible)
        for app in eligible:
            if not pool:
                return grants
            take = take_gpus(pool, min(want[app], len(pool)), position, (previous or {}).get(app, frozenset()))
            grants[app] = grants.get(app, frozenset()) | take
            want[app] -= len(take)
            pool = [g for g in pool if g not in take]
    return grants
