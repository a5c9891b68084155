"""Instantaneous fair share: Dominant Resource Fairness (Ghodsi et al., NSDI'11), the fair
sharing the paper argues is placement-insensitive for ML apps (3.1.2: DRF "equalizes the dominant
resource share ... and allocates 4 GPUs to each ML app"; 7: "instantaneous resource-fairness (akin
to DRF)"), run through 6.1's recipe "all apps report X and the arbiter allocates by X", with X the
demand.

What DRF does: progressive filling over several resource types, always raising the share of the
user with the smallest dominant share. With GPUs as the only resource, the dominant share is the
GPU count, and DRF is max-min fairness on the number of GPUs held.

Here: progressive filling one GPU at a time to the app with unmet demand that holds the fewest
GPUs (held before the round plus granted so far this round; ties by arrival, then name), never
beyond its unmet demand, until no GPU or no demand is left. Then each app's share is placed with
the best locality (D1), biggest share first, since bigger sets have the most to lose when spread.

Simplified: one resource type; GPUs already held are never taken back (no preemption), so the
counts are only as equal as what is free allows; placement is chosen after the counts, so it never
trades a GPU of share for better locality.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from arbiter.policies.base import Decision, Policy, RoundContext
from arbiter.policies.greedy import allocate_in_order, arrival_then_name
from protos.messages import BidTable


def progressive_filling(free_count: int, ctx: RoundContext) -> dict[str, int]:
    """How many of ``free_count`` GPUs each app with unmet demand gets under max-min fairness."""
    share: dict[str, int] = {}
    heap = [
        (len(ctx.held.get(app, ())), arrival_then_name(app, ctx), app)
        for app, n in ctx.unmet.items()
        if n > 0
    ]
    heapq.heapify(heap)
    while free_count > 0 and heap:
        count, tie, app = heapq.heappop(heap)
        share[app] = share.get(app, 0) + 1
        free_count -= 1
        if share[app] < ctx.unmet[app]:
            heapq.heappush(heap, (count + 1, tie, app))
    return share


class DrfPolicy(Policy):
    name = "drf"

    def bidders(self, rho: Mapping[str, float], ctx: RoundContext) -> list[str]:
        return []  # no offers: the counts follow from holdings and demand alone

    def allocate(self, ctx: RoundContext, bids: Mapping[str, BidTable]) -> Decision:
        share = progressive_filling(len(ctx.free), ctx)
        order = sorted(share, key=lambda app: (-share[app], *arrival_then_name(app, ctx)))
        return Decision(allocate_in_order(order, ctx.free, share, ctx.position, ctx.previous))
