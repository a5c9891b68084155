"""The agent: an app's representative in rounds (paper 4.2.2 steps 1-3, 5; Figure 7).

It answers the arbiter's rho requests and offers with the real fairness (``agent.fairness``) and
bidding (``agent.bidding``) code, from what its app scheduler says (Figure 8). The simulator and
tests call it in-process; the gRPC client (issue 4) wraps the same object.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from agent.appsched import AppScheduler
from agent.bidding import DEFAULT_ALTERNATIVES, make_bid
from agent.contention_pricing import ContentionPricing, current_jobs
from agent.fairness import TimeLeftCache, finish_time_fairness, waiting_rho, work_of_shape
from agent.placement import NO_SLOWDOWN, Position, canonical_shape
from protos.messages import BidTable, Offer, RhoReport, RhoRequest, WorkClaim


def packed(n: int) -> list[Position]:
    """n GPUs on one machine, one slot each: the well-placed allocation SRTF's report assumes."""
    return [("r", "m", f"s{k}") for k in range(n)]


@dataclass
class Agent:
    app: AppScheduler
    alternatives: int = DEFAULT_ALTERNATIVES
    name: str = ""  # the app's name: orders equally good candidate containers its own way (D7)
    restart_s: float = 0.0  # what moving its jobs to other GPUs costs it (D11): bids carry it (D17)
    contention: ContentionPricing | None = None  # D36: its class and the table; prices Offer.neighbourhood
    _cache: TimeLeftCache | None = field(default=None, repr=False)

    def _left(self) -> TimeLeftCache:
        if self._cache is None or self._cache.app is not self.app:
            self._cache = TimeLeftCache(self.app)
        return self._cache

    def time_left(self, gpus: Sequence[Position]) -> float:
        """The app's remaining time under ``gpus``, reused across rounds while it is unchanged."""
        return self._left()(gpus)

    def report(self, request: RhoRequest) -> RhoReport:
        """Rho with what the app held as the round opened (D2-D4, D13), its demand, its waiting rho
        when it held nothing (D13), and whatever else the policy asks for (``request.extras``: what
        the baselines allocate by). With a contention price, its rho prices the contention it runs
        under -- next to the held GPUs' neighbourhood the request lists, and its own spread jobs next
        to each other -- as its bid's rho_old does (D43)."""
        held = list(request.held.values())
        left = self.time_left(held)
        if self.contention is not None and held:
            left = self.contention.time_left(left, current_jobs(self.app, held), held, request.neighbourhood)
        rho = finish_time_fairness(
            self.app, held, now=request.now, n_avg=request.n_avg, cluster_size=request.cluster_size, left=left,
        )
        demand = self.app.demand_now()
        extras = request.extras
        wait = 0.0
        if math.isinf(rho) and demand > 0:
            wait = waiting_rho(self.app, now=request.now, n_avg=request.n_avg, cluster_size=request.cluster_size,
                               time_left=self.time_left, packed=packed)
        return RhoReport(
            rho,
            demand,
            remaining_s=self.time_left(packed(demand)) if "remaining_s" in extras else math.inf,
            slowdown=self.app.placement_slowdown() if "slowdown" in extras else NO_SLOWDOWN,
            loss_decrease=self.app.loss_decrease_rate() if "loss_decrease" in extras else 0.0,
            rho_wait=wait,
            work=self.work_claim(held, request, demand) if "work" in extras else None,
        )

    def work_claim(self, held: Sequence[Position], request: RhoRequest, demand: int) -> WorkClaim:
        """Its rho taken apart without its slowdowns (D21): per phase on what it holds, or, when it
        holds nothing and wants GPUs, on the fair share its waiting rho assumes (D13)."""
        app = self.app
        mine = work_of_shape(app, canonical_shape(held)) if held else ()
        share = ()
        if not held and demand > 0:
            fair = max(1, min(demand, math.floor(request.cluster_size / request.n_avg)))
            share = work_of_shape(app, canonical_shape(packed(fair)))
        return WorkClaim(app.total_work(), app.demand_max(), mine, share)

    def bid(self, offer: Offer) -> BidTable:
        return make_bid(self.app, offer, alternatives=self.alternatives, time_left=self._left(), salt=self.name,
                        restart_s=self.restart_s, contention=self.contention)
