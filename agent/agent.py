"""The agent: an app's representative in rounds (paper 4.2.2 steps 1-3, 5; Figure 7).

It answers the arbiter's rho requests and offers with the real fairness (``agent.fairness``) and
bidding (``agent.bidding``) code, from what its app scheduler says (Figure 8). The simulator and
tests call it in-process; the gRPC client (issue 4) wraps the same object.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.appsched import AppScheduler
from agent.bidding import DEFAULT_ALTERNATIVES, make_bid
from agent.fairness import finish_time_fairness, shared_time_left
from agent.placement import Position
from protos.messages import BidTable, Offer, RhoReport, RhoRequest


def packed(n: int) -> list[Position]:
    """n GPUs on one machine, one slot each: the well-placed allocation SRTF's report assumes."""
    return [("r", "m", f"s{k}") for k in range(n)]


@dataclass
class Agent:
    app: AppScheduler
    alternatives: int = DEFAULT_ALTERNATIVES

    def report(self, request: RhoRequest) -> RhoReport:
        """Rho with what the app holds (D2-D4), its demand, and what the baselines ask for."""
        rho = finish_time_fairness(
            self.app,
            list(request.held.values()),
            now=request.now,
            n_avg=request.n_avg,
            cluster_size=request.cluster_size,
        )
        demand = self.app.demand_now()
        return RhoReport(
            rho,
            demand,
            remaining_s=shared_time_left(self.app, packed(demand)),
            slowdown=self.app.placement_slowdown(),
            loss_decrease=self.app.loss_decrease_rate(),
        )

    def bid(self, offer: Offer) -> BidTable:
        return make_bid(self.app, offer, alternatives=self.alternatives)
