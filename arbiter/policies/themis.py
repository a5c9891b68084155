"""Themis's finish-time fair policy (paper Pseudocode 1, roundByRoundAuctions; D6, D8, D9, D13, D14).

Rank: apps by their current rho, worst first; apps holding nothing (rho = infinity) first, in the
order of their waiting rho, which grows while they wait (D13). Filter: the worst ceil((1 - f) N)
are the auction's bidders, at least one (D6), at least ``min_bidders`` with D41's option. The offer
also goes to the next apps in rank order
until their own unmet demand covers the free GPUs (D14), so that what the auction leaves -- its
hidden payments, GPUs nobody's row took -- is placed by bids too. Auction: the
partial-allocation mechanism over the filtered apps in rank order (D8, D15). Leftover: the reserve,
in rank order, each take the row of their bid they value most among what is left; only what
nobody's bid takes goes to the other apps at random (D9).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from arbiter.auction import DEFAULT_SOLVER, run_auction
from arbiter.leftover import hand_out_leftover, serve_queue
from arbiter.policies.base import Decision, Policy, RoundContext
from protos.messages import BidTable

DEFAULT_FAIRNESS_KNOB = 0.8


def worst_first(
    rho: Mapping[str, float], rng: random.Random | None = None, waiting: Mapping[str, float] | None = None
) -> list[str]:
    """D13: apps by rho, highest first; among apps at rho = infinity (holding nothing), by waiting
    rho, highest first. Exact ties are broken by a seeded draw, so no app wins every tie because of
    its name."""
    waiting = waiting or {}
    draw = {app: (rng.random() if rng is not None else 0.0) for app in sorted(rho)}

    def key(app: str) -> tuple[float, float, float, str]:
        wait = waiting.get(app, 0.0) if math.isinf(rho[app]) else 0.0
        return (-rho[app], -wait, draw[app], app)

    return sorted(rho, key=key)


def check_knob(fairness_knob: float) -> None:
    if not 0 <= fairness_knob < 1:
        raise ValueError(f"the fairness knob f must be in [0, 1), got {fairness_knob}")


def filter_worst(
    rho: Mapping[str, float],
    fairness_knob: float,
    rng: random.Random | None = None,
    waiting: Mapping[str, float] | None = None,
    min_bidders: int = 1,
) -> list[str]:
    """D6: the first :func:`filtered` apps of :func:`worst_first`."""
    check_knob(fairness_knob)
    ranked = worst_first(rho, rng, waiting)
    return ranked[: filtered(len(ranked), fairness_knob, min_bidders)]


def fill_offer(chosen: Sequence[str], ranked: Sequence[str], unmet: Mapping[str, int], free: int) -> list[str]:
    """D14: after the filtered apps, the next ones in rank order get the offer too until their own
    unmet demand covers the free GPUs (or no app is left): enough to place the whole offer by bids
    even if the auction's lotteries keep none of it."""
    out = list(chosen)
    wanted = 0
    for app in ranked[len(out):]:
        if wanted >= free:
            break
        out.append(app)
        wanted += unmet.get(app, 0)
    return out


def filtered(ranked_count: int, fairness_knob: float, min_bidders: int = 1) -> int:
    """D6: how many apps the auction takes, ceil((1 - f) N), at least one; at least ``min_bidders``
    of the N where there are that many (D41: with 2, no auction has a single bidder, who would take
    everything it can use at c = 1)."""
    return min(ranked_count, max(min_bidders, math.ceil((1 - fairness_knob) * ranked_count - 1e-9)))


class ThemisPolicy(Policy):
    name = "themis"

    def __init__(self, fairness_knob: float = DEFAULT_FAIRNESS_KNOB, solver: str = DEFAULT_SOLVER,
                 fill: bool = True, max_contenders: int | None = None, exact_payments: bool = True,
                 canonical: bool = True, min_bidders: int = 1):
        """``exact_payments`` False (D39, the service's setting): the auction re-solves for c_i only
        where the lottery needs it and reports the other winners' c_i as bounds; grants are the same.
        ``canonical`` False (D40, the service's setting): the PF allocation is the first optimum found,
        not D16's canonical one among the optima. ``min_bidders`` (D41): the auction takes at least
        that many of the ranked apps (1, the default, is D6 as the paper has it; 2 is D41's option)."""
        check_knob(fairness_knob)
        if isinstance(min_bidders, bool) or not isinstance(min_bidders, int) or min_bidders < 1:
            raise ValueError(f"min_bidders must be an integer of at least 1, got {min_bidders!r}")
        if max_contenders is not None and max_contenders < 1:
            raise ValueError(f"max_contenders must be at least 1 (or None for no cap), got {max_contenders}")
        self.fairness_knob = fairness_knob
        self.solver = solver
        if solver == "highs":
            import highspy  # noqa: F401 -- loaded now (0.1 s), not in the first big round's auction
        self.fill = fill
        self.max_contenders = max_contenders
        self.exact_payments = exact_payments
        self.canonical = canonical
        self.min_bidders = min_bidders

    def bidders(self, rho: Mapping[str, float], ctx: RoundContext) -> list[str]:
        waiting = {a: ctx.reports[a].rho_wait for a in rho if a in ctx.reports}
        ranked = worst_first(rho, ctx.rng, waiting)
        chosen = ranked[: filtered(len(ranked), self.fairness_knob, self.min_bidders)]
        return fill_offer(chosen, ranked, ctx.unmet, len(ctx.free)) if self.fill else chosen

    def ranking(self, ctx: RoundContext) -> list[str]:
        """Every app that reported this round, worst off first (D13): the offered apps in the
        order they were offered, then the others by rho, exact ties broken by a draw of their own
        from the round's seed (D24), so that no app wins every tie by its name and the order does
        not depend on which other apps tied."""
        offered = [a for a in ctx.offered if a in ctx.reports]
        rest = {a: r.rho for a, r in ctx.reports.items() if a not in set(offered)}
        waiting = {a: ctx.reports[a].rho_wait for a in rest}

        def key(app: str) -> tuple[float, float, float, str]:
            wait = waiting[app] if math.isinf(rest[app]) else 0.0
            return (-rest[app], -wait, random.Random(f"{ctx.round_seed}:rank:{app}").random(), app)

        return offered + sorted(rest, key=key)

    def allocate(self, ctx: RoundContext, bids: Mapping[str, BidTable]) -> Decision:
        stage = set(ctx.offered[: filtered(ctx.ranked or len(ctx.unmet), self.fairness_knob, self.min_bidders)])
        priority = [a for a in ctx.offered if a in bids and a in stage]
        # D20: the auction takes the worst max_contenders bidders with a useful row (D8); the
        # others are queued below.
        harm = self._harms(bids) if self.contention_aware and self.contention is not None else None
        outcome = run_auction(ctx.free, {a: bids[a] for a in priority}, seed=ctx.seed, solver=self.solver,
                              position=ctx.position, priority=priority, max_contenders=self.max_contenders,
                              harm={a: harm[a] for a in priority} if harm else None,
                              exact_payments=self.exact_payments, canonical=self.canonical)
        unmet = {app: n - len(outcome.granted.get(app, ())) for app, n in ctx.unmet.items()}
        # In rank order, every offered app that did not contend: bidders past the first |offered|
        # with useful rows, then the reserve (D14). A contender has had its auction (D8); letting it
        # take what is left without a lottery would pay it to lose there (hiding rows, overstating rho).
        contended = set(outcome.contenders)
        queued = [a for a in ctx.offered if a in bids and a not in contended]
        first = serve_queue(outcome.leftover, queued, unmet, bids, harm=harm, seed=ctx.seed)
        pool = outcome.leftover - frozenset().union(*first.values()) if first else outcome.leftover
        for app, gpus in first.items():
            unmet[app] -= len(gpus)
        # Tier 1 was the queued apps' turn, by their own rows; a queued app none of whose rows fit
        # gets no random gift after it: a gift of its whole unmet demand would pay it to bid rows
        # that cannot fit (only its biggest rows, overstated rho) and skip its turn (D9).
        extra = hand_out_leftover(pool, unmet, bids, order=self.ranking(ctx), position=ctx.position,
                                  previous=ctx.previous, offered=ctx.offered,
                                  served=set(outcome.granted) | set(queued), held=ctx.held)
        granted = dict(outcome.granted)
        for part in (first, extra):
            for app, gpus in part.items():
                granted[app] = granted.get(app, frozenset()) | gpus
        return Decision(granted, outcome, extra, queue_granted=first)

    def _harms(self, bids: Mapping[str, BidTable]) -> dict[str, list[float]]:
        """D36: per bidder, per row, what the row would leave of the running jobs' speed."""
        view = self.contention
        assert view is not None
        out: dict[str, list[float]] = {}
        for app, bid in bids.items():
            seen: dict[frozenset[str], float] = {}
            row_harms = []
            for gpus, _ in bid.rows:
                key = frozenset(gpus)
                if key not in seen:
                    seen[key] = view.harm(app, key)
                row_harms.append(seen[key])
            out[app] = row_harms
        return out


class ContentionAwareThemisPolicy(ThemisPolicy):
    """Themis with network contention priced (D36): where a contention model is on, offers list who
    runs on the offered machines so that bids price the contention they would suffer, and the
    auction and the reserve's turn count the slowdown a row does to the jobs already running (the
    incumbents as passive participants of the Nash product). Without a contention view it is
    ``themis``, outcome for outcome."""

    name = "themis-aware"
    contention_aware = True
