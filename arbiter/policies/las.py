"""Least attained service first, the textbook order (Nuyens and Wierman's foreground-background
queue; Tiresias's 1-D LAS), placed as DeepShare places its baselines (``spread.py``).

The service is the GPU-seconds the app has held (``ctx.attained``), least first: a new job runs
before those that have had their turn. ``tiresias`` is the same key with the project's own
placement (best locality, partial grants); this one spreads and gangs jobs like DeepShare's, so
that it differs from ``deepshare-las`` only in its key (DeepShare's "las" serves the *most* service
first).
"""

from __future__ import annotations

from arbiter.policies.base import RoundContext
from arbiter.policies.spread import SpreadPolicy


class LasPolicy(SpreadPolicy):
    name = "las"

    def priority(self, app: str, ctx: RoundContext) -> tuple[float, ...]:
        return (ctx.attained.get(app, 0.0),)
