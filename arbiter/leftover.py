"""Leftover allocation: work conservation after the auction (paper 3.3.2; mechanism D9).

First, the reserve -- the apps offered GPUs beyond the auction's bidders (D14) -- take what is left
in rank order, worst first, each the row of its own bid it values most among those that fit
(:func:`serve_queue`): a winner's hidden payment goes to the next starving apps in rank order
before anyone else, and by their bids, not by a draw.
Then the rest goes, in rank order (worst off first, D26), to apps that were not offered GPUs this
round and still have unmet demand, never beyond an app's demand; if none remain, to the apps that
bid and got nothing yet this round. An app drawn takes what it still wants at once, its own previous GPUs first, then
best-placed (D1), inside the slot, machine or rack of what it keeps, so that a gift never spreads
(and slows) its job. A GPU stays idle only when every app that wants more got GPUs this round, has
no room for it there, or was offered GPUs and sent no valid bid.

An app that was offered GPUs and sent no valid bid -- silent, crashed, or its bid refused -- takes
nothing here (D22), as if it had bid an empty table: when it came last among the takers it still
took its whole unmet demand whenever GPUs were left, which beat bidding truthfully for holders in
7.2% of the strategy-proofness benchmark's cases, up to +59%. The round engine gives such an app
one follow-up round (D10), so an agent that missed a deadline does not wait for a lease expiry.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence

from arbiter.auction import row_value, take_gpus
from protos.messages import BidTable, Position


def best_row(bid: BidTable, left: set[str], want: int, harm: Sequence[float] | None = None) -> frozenset[str] | None:
    """The row of ``bid`` the app values most (D15) among those inside ``left`` and within ``want``
    GPUs (ties: the GPU ids' order), or None when none fits or helps. With ``harm`` (D36, one
    factor per row), the row with the most value times harm: the running jobs' loss counts."""
    k = _best_index(bid, left, want, harm)
    return None if k is None else frozenset(bid.rows[k][0])


def _best_index(bid: BidTable, left: set[str], want: int, harm: Sequence[float] | None) -> int | None:
    fits = [(row_value(rho, bid.rho_old) * (harm[k] if harm else 1.0), sorted(gpus), k)
            for k, (gpus, rho) in enumerate(bid.rows) if len(gpus) <= want and left.issuperset(gpus)]
    fits = [f for f in fits if f[0] > 0]
    return min(fits, key=lambda f: (-f[0], f[1]))[2] if fits else None


def harm_draw(seed: int, app: str) -> float:
    """The app's own uniform draw for keeping a harmful row in the first tier (D36), a stream apart
    from the auction's lottery (D15)."""
    return random.Random(f"harm:{seed}:{app}").random()


def serve_queue(
    pool: Iterable[str],
    queued: Sequence[str],
    unmet: Mapping[str, int],
    bids: Mapping[str, BidTable],
    harm: Mapping[str, Sequence[float]] | None = None,
    seed: int = 0,
) -> dict[str, frozenset[str]]:
    """D9's first tier: the offered apps that did not contend, in rank order (``queued``: bidders
    past the auction's contenders, then the reserve of D14), each takes its :func:`best_row`
    among what is left; an app none of whose rows fits takes nothing here.

    A serial dictatorship over the apps' own rows in a fixed order: hiding or misvaluing rows only
    removes an app's own options, so no bidder gains by it. With ``harm`` (D36) the app's turn is a
    one-bidder auction with the running jobs as passive participants: it takes the row with the
    most value x harm and keeps it with probability h (its hidden payment, :func:`harm_draw`), so its
    expected gain V x h is what the row is chosen by and no lie raises it; a row lost to the draw
    stays in the pool for the apps after it."""
    left = set(pool)
    grants: dict[str, frozenset[str]] = {}
    for app in queued:
        if not left:
            break
        want, bid = unmet.get(app, 0), bids.get(app)
        if want <= 0 or bid is None:
            continue
        factors = harm.get(app) if harm else None
        k = _best_index(bid, left, want, factors)
        if k is None or (factors and harm_draw(seed, app) >= factors[k]):
            continue
        take = frozenset(bid.rows[k][0])
        grants[app] = take
        left -= take
    return grants


def hand_out_leftover(
    leftover: Iterable[str],
    unmet: Mapping[str, int],
    bids: Mapping[str, BidTable],
    *,
    order: Sequence[str],
    position: Callable[[str], Position],
    previous: Mapping[str, frozenset[str]] | None = None,
    offered: Iterable[str] = (),
    served: Iterable[str] = (),
    held: Mapping[str, frozenset[str]] | None = None,
) -> dict[str, frozenset[str]]:
    """Grants of leftover GPUs (D9), tier by tier, each in ``order`` (the round's rank, worst off
    first, D26): the apps that got no offer, then the apps that bid; an app offered GPUs that did
    not bid takes nothing (D22). ``unmet``
    is each app's demand after the earlier grants; apps in ``served`` take nothing here (Themis
    passes those that got GPUs this round and those that had their turn in tier 1). An app takes what it still wants at once, its previous
    GPUs first, then best-placed (D1), but only inside the smallest slot, machine or rack that holds
    what it keeps (``held``): under D1 more GPUs at the same locality level cannot slow an app down,
    while one GPU further out can (a gang-scheduled job runs at its slowest link)."""
    pool = sorted(leftover)
    done = set(served) | (set(offered) - set(bids))
    want = {app: n for app, n in unmet.items() if n > 0 and app not in done}
    grants: dict[str, frozenset[str]] = {}
    place = {app: k for k, app in enumerate(order)}
    ranked = sorted(want, key=lambda a: (place.get(a, len(place)), a))
    tiers = ([a for a in ranked if a not in bids], [a for a in ranked if a in bids])
    for eligible in tiers:
        for app in eligible:
            if not pool:
                return grants
            room = within(pool, (held or {}).get(app, frozenset()), position)
            take = take_gpus(room, min(want[app], len(room)), position, (previous or {}).get(app, frozenset()))
            if take:
                grants[app] = take
                pool = [g for g in pool if g not in take]
    return grants


def within(pool: Sequence[str], kept: frozenset[str], position: Callable[[str], Position]) -> list[str]:
    """The GPUs of ``pool`` inside the smallest container (slot, machine, rack, D1) of ``kept``;
    all of them when the app keeps nothing or its GPUs already span racks."""
    if not kept:
        return list(pool)
    places = {position(g) for g in kept}
    for depth in (3, 2, 1):  # one slot, one machine, one rack
        if len({p[:depth] for p in places}) == 1:
            prefix = next(iter(places))[:depth]
            return [g for g in pool if position(g)[:depth] == prefix]
    return list(pool)
