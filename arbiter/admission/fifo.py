"""FIFO admission above a load threshold (Blox, seeds/000, section 5.1, Figs. 12-13; D33).

Blox: "once the number of GPUs requested by admitted jobs crosses a threshold (e.g. 1.5x the
number of GPUs available in the cluster), we enqueue newly arriving jobs in the admission control
block. Jobs are released for scheduling in a FIFO manner as resources become available."

Here: while the admitted apps' stated demand is at most ``threshold`` x the cluster's GPUs, the
longest-waiting app goes in (its demand added), then the next. As in Blox the last app let in may
take the total past the threshold -- so an app larger than the threshold still gets in once the
cluster has room -- and the queue is strict: an app that has not said its demand yet holds the
ones behind it (an agent says it in its first message, so that is brief).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from arbiter.admission.base import AdmissionContext, AdmissionPolicy, WaitingApp


class FifoAdmission(AdmissionPolicy):
    name = "fifo"

    def __init__(self, threshold: float = 1.0):
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
                or not math.isfinite(threshold) or threshold <= 0:
            raise ValueError(f"fifo admission: the threshold is a multiple of the cluster's GPUs > 0 "
                             f"(e.g. fifo:1.2), got {threshold!r}")
        self.threshold = float(threshold)

    def admit(self, waiting: Sequence[WaitingApp], ctx: AdmissionContext) -> list[str]:
        limit = self.threshold * ctx.cluster_size
        demand = ctx.admitted_demand
        out = []
        for w in waiting:
            if w.demand is None or demand > limit:
                break
            out.append(w.app)
            demand += w.demand
        return out

    def spec(self) -> str:
        return f"{self.name}:{self.threshold:g}"
