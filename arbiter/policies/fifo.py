"""First-in first-out: apps are served in arrival order (the classic cluster-scheduler default;
paper 6.1's recipe "all apps report X and the arbiter allocates by X" with X the arrival time).

What FIFO schedulers (e.g. YARN's default queue) do: run jobs in submission order, each to its
full request. Here the arrival time is the engine's ``ctx.arrived``; the earliest app takes its
whole unmet demand, best locality first, then the next. Simplified: there is no head-of-line
blocking -- a later app whose demand fits is served from what the earlier ones left (the baselines
are all work conserving), and nothing is queued across rounds beyond the engine's leases.
"""

from __future__ import annotations

from arbiter.policies.base import RoundContext
from arbiter.policies.greedy import GreedyPolicy


class FifoPolicy(GreedyPolicy):
    name = "fifo"

    def priority(self, app: str, ctx: RoundContext) -> tuple[float, ...]:
        return ()  # the shared tie-break is exactly arrival, then name
