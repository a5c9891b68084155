"""Ideal aggregate model quality baseline: SLAQ (paper 6.1).

What SLAQ does: it predicts each job's loss curve online and, at every scheduling epoch, hands out
resources unit by unit to the jobs whose next iterations would reduce normalized loss the most,
maximising aggregate quality improvement.

Here, as in the paper: "all apps report the decrease in loss value with allocations from the
available resources and we allocate these resources in a greedy highest loss first manner". The
app with the largest reported ``loss_decrease`` goes first and takes its whole unmet demand, best
locality first.

Simplified: SLAQ's per-iteration, per-unit marginal loss-reduction scheduling is approximated by
one number per app, its expected loss decrease per GPU-second, and whole unmet demands are served
in that order (no diminishing returns as an app gets more GPUs). An app that reports no (or a NaN)
loss decrease goes last.
"""

from __future__ import annotations

import math

from arbiter.policies.base import RoundContext
from arbiter.policies.greedy import GreedyPolicy, unless_nan


class SlaqPolicy(GreedyPolicy):
    name = "slaq"
    report_extras = frozenset({"loss_decrease"})

    def priority(self, app: str, ctx: RoundContext) -> tuple[float, ...]:
        report = ctx.reports.get(app)
        gain = unless_nan(float(report.loss_decrease), -math.inf) if report is not None else -math.inf
        return (-gain,)
