"""Themis's finish-time fair policy (paper Pseudocode 1, roundByRoundAuctions; D6, D8, D9).

Filter: the worst ceil((1 - f) N) apps by current rho bid, at least one (D6). Auction: the
partial-allocation mechanism (D8). Leftover: at random to the apps that did not bid (D9).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

from arbiter.auction import DEFAULT_SOLVER, run_auction
from arbiter.leftover import hand_out_leftover
from arbiter.policies.base import Decision, Policy, RoundContext
from protos.messages import BidTable

DEFAULT_FAIRNESS_KNOB = 0.8


def filter_worst(rho: Mapping[str, float], fairness_knob: float, rng: random.Random | None = None) -> list[str]:
    """D6: apps sorted worst (highest rho) first; the first ceil((1 - f) N), at least one.

    Ties (typically several starving apps at rho = infinity) are broken by a seeded draw, so no
    app wins every tie because of its name.
    """
    if not 0 <= fairness_knob < 1:
        raise ValueError(f"the fairness knob f must be in [0, 1), got {fairness_knob}")
    if not rho:
        return []
    draw = {app: (rng.random() if rng is not None else 0.0) for app in sorted(rho)}
    ranked = sorted(rho, key=lambda app: (-rho[app], draw[app], app))
    return ranked[: max(1, math.ceil((1 - fairness_knob) * len(ranked) - 1e-9))]


class ThemisPolicy(Policy):
    name = "themis"

    def __init__(self, fairness_knob: float = DEFAULT_FAIRNESS_KNOB, solver: str = DEFAULT_SOLVER):
        filter_worst({}, fairness_knob)
        self.fairness_knob = fairness_knob
        self.solver = solver

    def bidders(self, rho: Mapping[str, float], ctx: RoundContext) -> list[str]:
        return filter_worst(rho, self.fairness_knob, ctx.rng)

    def allocate(self, ctx: RoundContext, bids: Mapping[str, BidTable]) -> Decision:
        outcome = run_auction(ctx.free, bids, seed=ctx.seed, solver=self.solver, position=ctx.position)
        unmet = {app: n - len(outcome.granted.get(app, ())) for app, n in ctx.unmet.items()}
        extra = hand_out_leftover(outcome.leftover, unmet, bids, rng=ctx.rng, position=ctx.position,
                                  previous=ctx.previous, offered=ctx.offered)
        granted = dict(outcome.granted)
        for app, gpus in extra.items():
            granted[app] = granted.get(app, frozenset()) | gpus
        return Decision(granted, outcome, extra)
