"""The loop DeepShare's LAS and SRTF share (seeds/002; its simulator, read for these facts): serve
jobs in the order of a key, each spread over as many machines as it can be, until one cannot be placed.

DeepShare's baselines differ from the paper-6.1 greedy loop (``greedy.py``) in where a job goes and
when serving stops, not in the idea of an order; this module holds that loop once and each policy
(``las.py``, ``srtf.py``, ``deepshare_las.py``, ``deepshare_srtf.py``) is one ordering key on it:

- gang: an app gets its whole unmet demand or nothing (DeepShare's jobs run on all their GPUs);
- spread: over n machines with demand / n GPUs each, n the largest divisor of the demand from 2 up to
  the machines with that many free GPUs, tried from the most machines down (DeepShare's 4-node
  testbed: 2 GPUs on 2 nodes, 4 on 4 then 2, 8 on 4 then 2; never one node). A demand with no such
  divisor (one GPU) goes on one machine. The machines are the first in the cluster's order with
  enough free GPUs, as DeepShare takes the lowest-numbered nodes;
- head-of-line: serving stops at the first app that cannot be placed (DeepShare's loop ends there);
- every job is re-queued every round: with leases as long as a round and no restart cost (DeepShare's
  setting, ``themis-sim experiment deepshare``) each round re-places every job from scratch.

Contention (D35) is not looked at: these are the contention-unaware baselines DeepShare compares with.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence

from arbiter.policies.base import Decision, RoundContext
from arbiter.policies.greedy import GreedyPolicy
from protos.messages import BidTable, Position


def _natural(text: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text))


def spread_choices(demand: int, machines: int) -> list[int]:
    """The machine counts to try for ``demand`` GPUs, most first: its divisors from 2 up to
    ``machines``; [1] when it has none there."""
    return [n for n in range(min(demand, machines), 1, -1) if demand % n == 0] or [1]


def spread_placement(
    demand: int, free: Iterable[str], position: Callable[[str], Position], previous: frozenset[str] = frozenset()
) -> frozenset[str] | None:
    """``demand`` of the ``free`` GPUs spread as DeepShare's LAS and SRTF place a job (module
    docstring), or None when no spread fits. Within a machine the app's previous GPUs go first."""
    by_machine: dict[tuple[str, str], list[str]] = {}
    for gpu in free:
        by_machine.setdefault(position(gpu)[:2], []).append(gpu)
    order = sorted(by_machine, key=lambda m: (_natural(m[0]), _natural(m[1])))
    for n in spread_choices(demand, len(order)):
        per = demand // n
        chosen = [m for m in order if len(by_machine[m]) >= per][:n]
        if len(chosen) == n:
            gpus: list[str] = []
            for m in chosen:
                gpus += sorted(by_machine[m], key=lambda g: (g not in previous, _natural(g)))[:per]
            return frozenset(gpus)
    return None


def serve_spread(order: Sequence[str], free: Iterable[str], wanted: Mapping[str, int],
                 position: Callable[[str], Position],
                 previous: Mapping[str, frozenset[str]] | None = None) -> dict[str, frozenset[str]]:
    """Serve ``order`` front to back, each app its whole ``wanted`` spread, until one does not fit."""
    left = set(free)
    granted: dict[str, frozenset[str]] = {}
    for app in order:
        want = wanted.get(app, 0)
        if want <= 0:
            continue
        gpus = spread_placement(want, left, position, (previous or {}).get(app, frozenset()))
        if gpus is None:
            break
        granted[app] = gpus
        left -= gpus
    return granted


def placeable(want: int, gpus: Iterable[str], position: Callable[[str], Position]) -> int:
    """The most of ``want`` GPUs a spread can ever place on ``gpus`` (the GPUs not held by the app
    itself): what the gang asks for. DeepShare's jobs always fit its testbed; a workload whose app
    asks for more than any spread of the cluster holds would otherwise stop every app behind it for
    good (head-of-line)."""
    gpus = list(gpus)
    for w in range(min(want, len(gpus)), 0, -1):
        if spread_placement(w, gpus, position) is not None:
            return w
    return 0


class SpreadPolicy(GreedyPolicy):
    """A DeepShare baseline: an ordering key (``priority``, smallest first) over :func:`serve_spread`."""

    def allocate(self, ctx: RoundContext, bids: Mapping[str, BidTable]) -> Decision:
        everything = set(ctx.free).union(*ctx.held.values())
        wanted = {app: placeable(want, everything - ctx.held.get(app, frozenset()), ctx.position)
                  for app, want in ctx.unmet.items() if want > 0}
        return Decision(serve_spread(self.order(ctx), ctx.free, wanted, ctx.position, ctx.previous))
