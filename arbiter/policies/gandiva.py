"""Ideal efficiency baseline: Gandiva (paper 6.1).

What Gandiva does: it packs jobs on as few machines as possible, profiles each job to learn its
placement preference, and migrates and time-slices jobs to meet those preferences. The paper's
version: "on any resource availability, all apps report their placement preferences and we
allocate resources in a greedy highest preference first manner", which tends to maximise the
average placement score.

Here an app's placement preference is its reported ``slowdown`` (S by D1 level): the app that
loses most when spread goes first, compared at the cluster level (S[3]), then rack (S[2]), then
machine (S[1]), then slot (S[0]). Each app takes its whole unmet demand from the free GPUs with the
best locality, so the most sensitive app gets the most consolidated free GPUs.

Simplified: time-slicing, packing several jobs on one GPU and migration are not modelled (the paper
leaves them out too: they could help Themis as much as Gandiva). The preference is the app's
profile, not what it would lose on these particular free GPUs, so an app whose unmet demand is one
GPU (always well placed) still ranks by its profile.
"""

from __future__ import annotations

from arbiter.policies.base import RoundContext
from arbiter.policies.greedy import GreedyPolicy, unless_nan


class GandivaPolicy(GreedyPolicy):
    name = "gandiva"
    report_extras = frozenset({"slowdown"})

    def priority(self, app: str, ctx: RoundContext) -> tuple[float, ...]:
        report = ctx.reports.get(app)
        slowdown = report.slowdown if report is not None else (1.0, 1.0, 1.0, 1.0)
        # most spread level first; a NaN entry counts as no sensitivity
        return tuple(-unless_nan(float(s), 1.0) for s in reversed(tuple(slowdown)))
