"""Ideal average app completion time baseline: Optimus (paper 6.1).

What Optimus does: it fits an online model of each job's convergence (steps left) and of its
training speed as a function of parameter servers and workers, and allocates resources greedily by
marginal gain, which amounts to Shortest Remaining Time First (SRTF).

Here, as in the paper: "all apps report their remaining time with allocations from the available
resources and we allocate these resources using the SRTF policy". The app with the smallest
reported ``remaining_s`` goes first and takes its whole unmet demand, best locality first.

Simplified: Optimus's resource-speed model is replaced by the agent's own remaining-time report
(the time it still needs with its whole demand, well placed), so the remaining time does not depend
on which free GPUs are on offer; no parameter-server/worker split is modelled. An app that reports
no (or a NaN) remaining time goes last.
"""

from __future__ import annotations

import math

from arbiter.policies.base import RoundContext
from arbiter.policies.greedy import GreedyPolicy, unless_nan


class OptimusPolicy(GreedyPolicy):
    name = "optimus"
    report_extras = frozenset({"remaining_s"})

    def priority(self, app: str, ctx: RoundContext) -> tuple[float, ...]:
        report = ctx.reports.get(app)
        return (unless_nan(float(report.remaining_s), math.inf) if report is not None else math.inf,)
