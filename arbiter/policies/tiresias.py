"""Ideal fairness baseline: Tiresias (paper 6.1).

What Tiresias does: its service metric is the GPU-time a job has received, and it schedules by
Least Attained Service (LAS) so all jobs get equal service over time; the full system uses a
discretized two-dimensional LAS with priority queues and, when job sizes are known, a Gittins index.

Here, as in the paper: "on any resource availability, all apps report their service metric and we
allocate the resource to apps that have the least GPU service". The service is the engine's
``ctx.attained`` (GPU-seconds held since arrival), the app with the least goes first and takes its
whole unmet demand, best locality first.

Simplified: plain LAS per app, without the Gittins index (the paper drops it too; it trades
fairness for completion time, which Optimus stands for) and without discretized queues, so apps
are compared by exact attained service every round.
"""

from __future__ import annotations

from arbiter.policies.base import RoundContext
from arbiter.policies.greedy import GreedyPolicy


class TiresiasPolicy(GreedyPolicy):
    name = "tiresias"

    def priority(self, app: str, ctx: RoundContext) -> tuple[float, ...]:
        return (ctx.attained.get(app, 0.0),)
