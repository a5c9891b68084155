"""The loop every "greedy by X" baseline shares (paper 6.1).

The paper implements each baseline the same way: "on any resource availability, all apps report X
and we allocate resources" by X. Gandiva, Tiresias, Optimus, SLAQ and FIFO differ only in X, the
order in which apps are served; serving is the same for all of them: walk the apps in that order
and give each its whole unmet demand from the free GPUs, best locality first (D1), until the free
GPUs or the unmet demand run out. So this module holds the loop once, and each baseline is a
subclass that defines :meth:`GreedyPolicy.priority`.

There is no auction: :meth:`GreedyPolicy.bidders` makes no offers, and the policy decides from the
round's reports and the engine's bookkeeping alone.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence

from arbiter.auction import take_gpus
from arbiter.policies.base import Decision, Policy, RoundContext
from protos.messages import BidTable, Position


def allocate_in_order(
    order: Sequence[str],
    free: Iterable[str],
    wanted: Mapping[str, int],
    position: Callable[[str], Position],
    previous: Mapping[str, frozenset[str]] | None = None,
) -> dict[str, frozenset[str]]:
    """Serve ``order`` front to back: each app gets ``wanted[app]`` of the GPUs still free (or all
    that are left), its previous GPUs first, then the best locality (D1). Apps granted nothing are
    left out.

    Work conserving by construction: it stops only when no GPU or no wanted GPU is left.
    """
    left = set(free)
    granted: dict[str, frozenset[str]] = {}
    for app in order:
        if not left:
            break
        k = min(wanted.get(app, 0), len(left))
        if k <= 0:
            continue
        gpus = take_gpus(sorted(left), k, position, (previous or {}).get(app, frozenset()))
        granted[app] = gpus
        left -= gpus
    return granted


def arrival_then_name(app: str, ctx: RoundContext) -> tuple[float, str]:
    """The deterministic tie-break every baseline uses: earlier arrival first, then app name (an
    app the engine has no arrival time for goes after those it has)."""
    return (ctx.arrived.get(app, math.inf), app)


def unless_nan(value: float, instead: float) -> float:
    """``value`` for sorting, ``instead`` if it is NaN. The engine validates only rho and demand,
    and a NaN key would make ``sorted`` order the apps arbitrarily."""
    return instead if isinstance(value, float) and math.isnan(value) else value


class GreedyPolicy(Policy):
    """A baseline that serves apps one after another in the order of a key (smallest first)."""

    def bidders(self, rho: Mapping[str, float], ctx: RoundContext) -> list[str]:
        return []  # no offers: the baseline allocates from the reports in ctx alone

    @abstractmethod
    def priority(self, app: str, ctx: RoundContext) -> tuple[float, ...]:
        """The app's sort key in this round; smaller is served first. Ties fall to
        :func:`arrival_then_name`."""

    def order(self, ctx: RoundContext) -> list[str]:
        """The apps with unmet demand, in the order they are served this round."""
        return sorted(ctx.unmet, key=lambda app: (*self.priority(app, ctx), *arrival_then_name(app, ctx)))

    def allocate(self, ctx: RoundContext, bids: Mapping[str, BidTable]) -> Decision:
        return Decision(allocate_in_order(self.order(ctx), ctx.free, ctx.unmet, ctx.position, ctx.previous))
