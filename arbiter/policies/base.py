"""What a cross-app scheduling policy is (paper 6.1: "on any resource availability, all apps
report X and the arbiter allocates by X").

The round engine (``arbiter.rounds``) owns the lease table, the clock it is handed and the
conversation with agents; a policy only decides, from the round's context and the apps' reports and
bids, which apps get an offer and who gets which free GPU. A new policy is one file with one
subclass, registered by name in ``arbiter.policies``.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from arbiter.auction import AuctionOutcome
from protos.messages import BidTable, Neighbour, Position, RhoReport


@dataclass(frozen=True)
class RoundContext:
    """What a policy may look at in one round."""

    round_id: int
    now: float
    free: frozenset[str]
    unmet: Mapping[str, int]  # active apps' demand beyond what they hold
    held: Mapping[str, frozenset[str]]
    position: Callable[[str], Position]
    rng: random.Random
    seed: int
    reports: Mapping[str, RhoReport] = field(default_factory=dict)  # this round's reports
    attained: Mapping[str, float] = field(default_factory=dict)  # GPU-seconds held so far (LAS)
    arrived: Mapping[str, float] = field(default_factory=dict)  # arrival times (FIFO)
    previous: Mapping[str, frozenset[str]] = field(default_factory=dict)  # GPUs whose lease just ran out
    offered: tuple[str, ...] = ()  # apps that got this round's offer, in the policy's order (D6, D13)
    ranked: int = 0  # apps ranked when the offer went out (N of D6; fixed for the round)
    round_seed: str = ""  # the round's seed (D24), for draws that must not depend on the others'


@dataclass(frozen=True)
class Decision:
    """A policy's answer for one round: grants per app, and how they came about: won in the
    auction, taken by unserved bidders in rank order (``queue_granted``, D9's first tier), or handed
    out at random (``leftover_granted``)."""

    granted: Mapping[str, frozenset[str]]
    auction: AuctionOutcome | None = None
    leftover_granted: Mapping[str, frozenset[str]] = field(default_factory=dict)
    queue_granted: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def granted_by(self) -> dict[str, int]:
        """GPUs granted per source: ``auction``, ``queue``, ``leftover`` and ``policy`` (a
        baseline's own order)."""
        won = self.auction.granted if self.auction else {}
        counts = {"auction": sum(map(len, won.values())),
                  "queue": sum(map(len, self.queue_granted.values())),
                  "leftover": sum(map(len, self.leftover_granted.values()))}
        counts["policy"] = sum(map(len, self.granted.values())) - sum(counts.values())
        return counts


class ContentionView(Protocol):
    """What a contention-aware policy may ask about network contention (D35, D36), where a contention
    model is on (the simulator's ``--contention``; ``simulator.contention.ContentionTracker``)."""

    def kind(self, app: str) -> str | None:
        """The app's contention class (a class of the contention table, e.g. ``MoE``)."""

    def ratio(self, app: str) -> float:
        """The lowest contention ratio among the app's placed jobs now (1: none is slowed)."""

    def ratio_if(self, app: str, gpus: Iterable[str]) -> float:
        """The ratio one job of the app would run at on ``gpus``, every other job where it is."""

    def neighbourhood(self, app: str, machines: Iterable[str]) -> Mapping[str, tuple[Neighbour, ...]]:
        """D36, what an offer to ``app`` carries: per machine of ``machines``, the jobs of the other
        apps running there (their GPUs still held), as class, GPUs and machines spanned
        (``arbiter.contention_aware.neighbourhood_of`` computes it from the running jobs)."""

    def harm(self, app: str, gpus: Iterable[str]) -> float:
        """D36: what a row of ``app`` on ``gpus`` (one job of its class) would leave of the running
        jobs' speed, in (0, 1] (``arbiter.contention_aware.harm_of``, with their ratios now)."""


class Policy(ABC):
    name: ClassVar[str]
    #: the RhoReport fields beyond rho and demand this policy allocates by (sent in RhoRequest)
    report_extras: ClassVar[frozenset[str]] = frozenset()
    #: D35: set by a simulator with a contention model on; None where contention is not modelled
    contention: ContentionView | None = None
    #: D36: whether offers carry the neighbourhood and allocations charge the harm (with ``contention``)
    contention_aware: bool = False

    @abstractmethod
    def bidders(self, rho: Mapping[str, float], ctx: RoundContext) -> list[str]:
        """Which of the apps with unmet demand get this round's offer (none: the policy allocates
        from the reports in ``ctx`` alone)."""

    @abstractmethod
    def allocate(self, ctx: RoundContext, bids: Mapping[str, BidTable]) -> Decision:
        """Turn the free GPUs and the (already validated) bids into grants."""
