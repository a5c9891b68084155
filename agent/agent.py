"""The agent: an app's representative in rounds (paper 4.2.2 steps 1-3, 5; Figure 7).

It answers the arbiter's rho requests and offers with the real fairness (``agent.fairness``) and
bidding (``agent.bidding``) code, from what its app scheduler says (Figure 8). The simulator and
tests call it in-process; the gRPC client (issue 4) wraps the same object.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.appsched import AppScheduler
from agent.bidding import DEFAULT_ALTERNATIVES, make_bid
from agent.fairness import finish_time_fairness
from protos.messages import BidTable, Offer, RhoReport, RhoRequest


@dataclass
class Agent:
    app: AppScheduler
    alternatives: int = DEFAULT_ALTERNATIVES

    def report(self, request: RhoRequest) -> RhoReport:
        rho = finish_time_fairness(
            self.app,
            list(request.held.values()),
            now=request.now,
            n_avg=request.n_avg,
            cluster_size=request.cluster_size,
        )
        return RhoReport(rho, self.app.demand_now())

    def bid(self, offer: Offer) -> BidTable:
        return make_bid(self.app, offer, alternatives=self.alternatives)
