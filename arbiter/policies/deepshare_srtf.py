"""DeepShare's "srtf" as its simulator runs it (seeds/002; the facts in docs/contention.md): the job
with the *least progress* goes first, placed by DeepShare's spread (``spread.py``).

DeepShare sorts its queue by samples trained over samples to train, smallest first -- least
progress, not least remaining time, so the label is swapped against the textbook (``srtf.py``):
with jobs of about equal length it behaves like least attained service, every job taking turns.

Progress is 1 - (remaining time now) / (remaining time when the app first reported): an app
reports its remaining time on its whole demand (``RhoReport.remaining_s``), and its first report
comes before it has run. The policy remembers each app's first report for as long as the app is
active; an app that reports no (or a NaN) remaining time goes last.
"""

from __future__ import annotations

import math

from arbiter.policies.base import RoundContext
from arbiter.policies.greedy import unless_nan
from arbiter.policies.spread import SpreadPolicy


class DeepShareSrtfPolicy(SpreadPolicy):
    name = "deepshare-srtf"
    report_extras = frozenset({"remaining_s"})

    def __init__(self) -> None:
        self.first: dict[str, float] = {}  # app -> remaining time at its first report

    def priority(self, app: str, ctx: RoundContext) -> tuple[float, ...]:
        report = ctx.reports.get(app)
        left = unless_nan(float(report.remaining_s), math.inf) if report is not None else math.inf
        if not math.isfinite(left):
            return (math.inf,)
        total = self.first[app] = max(self.first.get(app, left), left)
        return (1.0 - left / total if total > 0 else 1.0,)

    def order(self, ctx: RoundContext) -> list[str]:
        for gone in set(self.first) - set(ctx.held):
            del self.first[gone]
        return super().order(ctx)
