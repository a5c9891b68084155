"""Shortest remaining time first, the textbook order, placed as DeepShare places its baselines
(``spread.py``).

The remaining time is what the app reports (``RhoReport.remaining_s``: the time it still needs on
its whole demand, well placed), least first. ``optimus`` is the same key with the project's own
placement; this one spreads and gangs jobs like DeepShare's, so that it differs from
``deepshare-srtf`` only in its key (DeepShare's "srtf" serves the least *progress* first). An app
that reports no (or a NaN) remaining time goes last.
"""

from __future__ import annotations

import math

from arbiter.policies.base import RoundContext
from arbiter.policies.greedy import unless_nan
from arbiter.policies.spread import SpreadPolicy


class SrtfPolicy(SpreadPolicy):
    name = "srtf"
    report_extras = frozenset({"remaining_s"})

    def priority(self, app: str, ctx: RoundContext) -> tuple[float, ...]:
        report = ctx.reports.get(app)
        return (unless_nan(float(report.remaining_s), math.inf) if report is not None else math.inf,)
