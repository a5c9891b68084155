"""A policy from outside the simulator: shortest remaining GPU time first (issue 13 item 6).

Apps report the time they still need with their whole demand (``remaining_s``, the report Optimus
uses); this policy serves the app with the least remaining GPU time (remaining_s x demand) first,
its whole unmet demand, best locality first. Run it beside the paper's policies with

    themis-sim compare --plugin examples/plugins/srgt.py --policies themis,optimus,srgt \\
        --workload contended --cluster testbed-64 --seeds 3 --out results/srgt

Copy this file anywhere: ``--plugin`` takes any path, and nothing in the repository changes.
"""

from __future__ import annotations

import math

from arbiter.policies import register_policy
from arbiter.policies.base import RoundContext
from arbiter.policies.greedy import GreedyPolicy, unless_nan


@register_policy
class ShortestRemainingGpuTime(GreedyPolicy):
    name = "srgt"
    report_extras = frozenset({"remaining_s"})

    def priority(self, app: str, ctx: RoundContext) -> tuple[float, ...]:
        report = ctx.reports.get(app)
        if report is None:
            return (math.inf,)
        return (unless_nan(float(report.remaining_s), math.inf) * max(1, report.demand),)
