"""The agent: an app's representative in rounds (paper 4.2.2 steps 1-3, 5; Figure 7).

It answers the arbiter's rho requests and offers with the real fairness (``agent.fairness``) and
bidding (``agent.bidding``) code, from what its app scheduler says (Figure 8). The simulator and
tests call it in-process; the gRPC client (issue 4) wraps the same object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agent.appsched import AppScheduler
from agent.bidding import DEFAULT_ALTERNATIVES, make_bid
from agent.fairness import finish_time_fairness, shared_time_left
from agent.placement import Position, canonical_shape
from protos.messages import BidTable, Offer, RhoReport, RhoRequest


def packed(n: int) -> list[Position]:
    """n GPUs on one machine, one slot each: the well-placed allocation SRTF's report assumes."""
    return [("r", "m", f"s{k}") for k in range(n)]


@dataclass
class Agent:
    app: AppScheduler
    alternatives: int = DEFAULT_ALTERNATIVES
    _lefts: dict = field(default_factory=dict, repr=False)  # shape -> remaining time
    _version: int = -1

    def lefts(self) -> dict:
        """Remaining times by allocation shape, valid while the app's work is unchanged."""
        if self._version != self.app.version:
            self._lefts.clear()
            self._version = self.app.version
        return self._lefts

    def report(self, request: RhoRequest) -> RhoReport:
        """Rho with what the app holds (D2-D4), its demand, and what the baselines ask for."""
        held = list(request.held.values())
        lefts = self.lefts()
        key = canonical_shape(held)
        if key not in lefts:
            lefts[key] = shared_time_left(self.app, held)
        rho = finish_time_fairness(
            self.app, held, now=request.now, n_avg=request.n_avg, cluster_size=request.cluster_size,
            left=lefts[key],
        )
        demand = self.app.demand_now()
        return RhoReport(
            rho,
            demand,
            remaining_s=self._remaining(demand),
            slowdown=self.app.placement_slowdown(),
            loss_decrease=self.app.loss_decrease_rate(),
        )

    def bid(self, offer: Offer) -> BidTable:
        return make_bid(self.app, offer, alternatives=self.alternatives, lefts=self.lefts())

    def _remaining(self, demand: int) -> float:
        lefts = self.lefts()
        key = ("packed", demand)
        if key not in lefts:
            lefts[key] = shared_time_left(self.app, packed(demand))
        return lefts[key]
