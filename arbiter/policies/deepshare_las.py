"""DeepShare's "las" as its simulator runs it (seeds/002; the facts in docs/contention.md): the job
with the *most* service goes first, placed by DeepShare's spread (``spread.py``).

DeepShare sorts its queue by the time each job has been scheduled (rounds x round length), largest
first -- the reverse of least attained service, so the label is swapped against the textbook
(``las.py``). With jobs of about equal length (DeepShare sizes them to an hour alone) the most-served
job is the one with the least time left, so this behaves like shortest remaining time first.

The time scheduled is the app's GPU-seconds held (``ctx.attained``) over its demand: an app gets its
whole demand or nothing (``spread.py``), so that is the time it has held GPUs.
"""

from __future__ import annotations

from arbiter.policies.base import RoundContext
from arbiter.policies.spread import SpreadPolicy


class DeepShareLasPolicy(SpreadPolicy):
    name = "deepshare-las"

    def priority(self, app: str, ctx: RoundContext) -> tuple[float, ...]:
        report = ctx.reports.get(app)
        demand = max(1, report.demand) if report is not None else 1
        return (-ctx.attained.get(app, 0.0) / demand,)
