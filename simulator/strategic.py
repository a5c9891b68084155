"""Strategic bidding: agents that send something other than their truthful report and bids (D12).

A strategy is one small subclass of :class:`BiddingStrategy`, registered by name, that turns the
agent's truthful view into what it sends, at a lie size ``level`` in percent. The built-in ones:

* ``overreport-spread``: S at levels 2-3 (machines of a rack, racks) inflated by X% (paper 6.3).
* ``underreport-dense``: S at levels 0-1 (one slot, one machine) shrunk by X% (paper 6.3).
* ``misreport-work``: remaining iterations inflated by X% (it claims more work left).
* ``hide-rows``: drops the X% of its bid rows it likes least (bids only for what it wants most).
* ``noisy``: every rho it sends is off by a uniform random error within +-X% (paper Fig. 14's
  bid estimation error; not a lie, an inaccurate profiler).
* ``understate-rho`` / ``overstate-rho``: every row's rho scaled by (1 - X%) / (1 + X%).
* ``inflate-rho-old``: the bid's empty row claims a rho X% worse than the truth.
* ``biggest-rows`` / ``single-gpu-rows``: only the rows with the most GPUs / with one GPU.
* ``report-inf``: reports rho = infinity and bids rho_old = infinity (the arbiter refuses both from
  an app that holds GPUs, D13).
* ``withhold-bid``: reports truthfully, then sends no bid (as an agent that misses the deadline;
  D22 leases such an app nothing that round).
* ``understate-budget``: claims a total work B X% smaller (T_id of Eq. 1 shrinks by as much).
* ``understate-work``: claims all its work X% smaller, done and left alike (B and every remaining
  iteration): a smaller app that has waited as long, which ranks worse off (D29 watches its pace).
* ``overstate-demand-max``: claims a demand_max X% bigger (the most GPUs it could use at once).
* ``overstate-demand``: states a demand, and claims a demand_max, X% bigger than it can use (the lie
  D28 leaves: a measured rank takes demand_max only up to the demands an app has stated).

Lies change only what the agent says: the simulator still runs its jobs at their true speed.
``run_strategic`` is the study of paper Figure 15: K liars among truthful apps, per level.

Where the rank's rho comes from is the simulation's ``rank`` (D21, ``arbiter.rank``): ``reported``
(the default) takes the agent's rho as it is; with ``measured`` the round engine computes the rho
that ranks an app (D13) from the work the agent claims in its report and the slowdowns of the app's
model, which the arbiter knows (the service: the model an admin bound to the app's token): a lie
about slowdowns then reaches only its bids, where the auction prices it (D15).
"""

from __future__ import annotations

import math
import random
from abc import ABC
from collections.abc import Sequence
from dataclasses import replace
from typing import ClassVar

from agent.agent import Agent
from agent.appsched import AppScheduler, CurveStoppingScheduler, JobInfo, SuccessiveHalvingScheduler
from agent.bidding import make_bid
from agent.fairness import TimeLeftCache
from agent.placement import Position, Slowdown
from protos.messages import BidTable, Offer, RhoReport, RhoRequest
from simulator.workload import AppSpec

STRATEGIES: dict[str, type["BiddingStrategy"]] = {}


def strategy(cls: type["BiddingStrategy"]) -> type["BiddingStrategy"]:
    STRATEGIES[cls.name] = cls
    return cls


class BiddingStrategy(ABC):
    """How an agent bends its bids. ``level`` is the lie size in percent."""

    name: ClassVar[str]
    #: the strategy also reports rho = infinity in step 1 (D13 refuses that from a holder)
    claims_infinity: ClassVar[bool] = False
    #: False: the agent sends no bid when offered GPUs (D22)
    sends_bid: ClassVar[bool] = True
    #: the largest lie that still describes an app (100: a rho, a slowdown or work scaled by 1 - x)
    max_level: ClassVar[float] = math.inf

    def __init__(self, level: float, seed: int | str = 0):
        if not (isinstance(level, (int, float)) and 0 <= level <= self.max_level) or math.isnan(level):
            most = "" if math.isinf(self.max_level) else f" and at most {self.max_level:g}"
            raise ValueError(f"strategy {self.name}: a lie size is a percentage >= 0{most}, got {level!r}")
        self.level = level
        self.x = level / 100.0
        self.rng = random.Random(f"{self.name}:{seed}")

    def edit(self, job: JobInfo) -> JobInfo:
        """One job as the agent describes it (default: as it is). A pure function of the job: the
        agent keeps what it computed from the edited jobs until the app's work changes."""
        return job

    def budget(self, b: float) -> float:
        """The total work B the agent claims, given its true B (default: the truth)."""
        return b

    def demand_max(self, d: int) -> int:
        """The demand_max the agent claims, given its true one (default: the truth)."""
        return d

    def demand(self, d: int) -> int:
        """The demand the agent states in its reports, given its true one (default: the truth)."""
        return d

    def view(self, app: AppScheduler) -> AppScheduler:
        """The app as the agent describes it in its reports and bids: every job through ``edit``,
        its B, demand_max and demand through the hooks above. Under a measured rank (D21) only this
        view's work reaches the rank, not its slowdowns."""
        cls = type(self)
        plain = all(getattr(cls, hook) is getattr(BiddingStrategy, hook)
                    for hook in ("edit", "budget", "demand_max", "demand"))
        return app if plain else described(app, self)

    def adjust(self, bid: BidTable) -> BidTable:
        """Edit the finished bid table (default: send it as computed)."""
        return bid


class _SlowdownLie(BiddingStrategy):
    levels: ClassVar[tuple[int, ...]]
    sign: ClassVar[float]

    def lie(self, s: Slowdown) -> Slowdown:
        factor = 1 + self.sign * self.x
        out = [v * factor if k in self.levels else v for k, v in enumerate(s)]
        return (out[0], out[1], out[2], out[3])

    def edit(self, job: JobInfo) -> JobInfo:
        return replace(job, slowdown=self.lie(job.slowdown))


@strategy
class OverreportSpread(_SlowdownLie):
    name = "overreport-spread"
    levels = (2, 3)
    sign = 1.0


@strategy
class UnderreportDense(_SlowdownLie):
    name = "underreport-dense"
    max_level = 100.0
    levels = (0, 1)
    sign = -1.0


@strategy
class MisreportWork(BiddingStrategy):
    name = "misreport-work"

    def edit(self, job: JobInfo) -> JobInfo:
        return replace(job, iters_remaining=job.iters_remaining * (1 + self.x))


@strategy
class HideRows(BiddingStrategy):
    name = "hide-rows"
    max_level = 100.0

    def adjust(self, bid: BidTable) -> BidTable:
        keep = round(len(bid.rows) * (1 - self.x))
        return BidTable(bid.rho_old, tuple(sorted(bid.rows, key=lambda r: r[1])[:keep]))


@strategy
class Noisy(BiddingStrategy):
    name = "noisy"
    max_level = 100.0

    def adjust(self, bid: BidTable) -> BidTable:
        rows = tuple((g, rho * (1 + self.rng.uniform(-self.x, self.x))) for g, rho in bid.rows)
        return BidTable(bid.rho_old, rows)


@strategy
class Misestimate(BiddingStrategy):
    """Paper 6.4 (Fig. 14): an agent whose estimates are wrong, not a liar. One error per app,
    drawn once and kept: its remaining iterations are off by a factor 1 + e_w and its placement
    slowdowns by 1 + e_s (never below 1, no placement beats the ideal one), e_w and e_s uniform
    in [-level%, +level%]. The error reaches everything the agent says -- its rho reports, which
    pick the bidders (D6, D13), and its bid tables -- unlike ``noisy``, which redraws per bid row."""

    name = "misestimate"
    max_level = 100.0

    def __init__(self, level: float, seed: int | str = 0):
        super().__init__(level, seed)
        self.work_error = self.rng.uniform(-self.x, self.x)
        self.slowdown_error = self.rng.uniform(-self.x, self.x)

    def _slowdown(self, s: Slowdown) -> Slowdown:
        out = [max(1.0, v * (1 + self.slowdown_error)) for v in s]
        return (out[0], out[1], out[2], out[3])

    def edit(self, job: JobInfo) -> JobInfo:
        return replace(job, iters_remaining=job.iters_remaining * (1 + self.work_error),
                       slowdown=self._slowdown(job.slowdown))


@strategy
class UnderstateRho(BiddingStrategy):
    name = "understate-rho"

    def adjust(self, bid: BidTable) -> BidTable:
        return BidTable(bid.rho_old, tuple((g, rho * max(0.01, 1 - self.x)) for g, rho in bid.rows))


@strategy
class OverstateRho(BiddingStrategy):
    name = "overstate-rho"

    def adjust(self, bid: BidTable) -> BidTable:
        return BidTable(bid.rho_old, tuple((g, rho * (1 + self.x)) for g, rho in bid.rows))


@strategy
class InflateRhoOld(BiddingStrategy):
    name = "inflate-rho-old"

    def adjust(self, bid: BidTable) -> BidTable:
        return BidTable(bid.rho_old * (1 + self.x), bid.rows)


@strategy
class UnderstateBudget(BiddingStrategy):
    name = "understate-budget"
    max_level = 99.0

    def budget(self, b: float) -> float:
        return b * (1 - self.x)


@strategy
class UnderstateWork(UnderstateBudget):
    name = "understate-work"

    def edit(self, job: JobInfo) -> JobInfo:
        return replace(job, iters_remaining=job.iters_remaining * (1 - self.x))


@strategy
class OverstateDemandMax(BiddingStrategy):
    name = "overstate-demand-max"

    def demand_max(self, d: int) -> int:
        return math.ceil(d * (1 + self.x))


@strategy
class OverstateDemand(OverstateDemandMax):
    name = "overstate-demand"

    def demand(self, d: int) -> int:
        return math.ceil(d * (1 + self.x)) if d else 0


@strategy
class BiggestRows(BiddingStrategy):
    name = "biggest-rows"

    def adjust(self, bid: BidTable) -> BidTable:
        most = max((len(g) for g, _ in bid.rows), default=0)
        return BidTable(bid.rho_old, tuple(r for r in bid.rows if len(r[0]) == most))


@strategy
class SingleGpuRows(BiddingStrategy):
    name = "single-gpu-rows"

    def adjust(self, bid: BidTable) -> BidTable:
        return BidTable(bid.rho_old, tuple(r for r in bid.rows if len(r[0]) == 1))


@strategy
class ReportInf(BiddingStrategy):
    name = "report-inf"
    claims_infinity = True

    def adjust(self, bid: BidTable) -> BidTable:
        return BidTable(math.inf, bid.rows)


@strategy
class WithholdBid(BiddingStrategy):
    name = "withhold-bid"
    sends_bid = False


class WithheldBid(RuntimeError):
    """What a ``withhold-bid`` agent raises when offered GPUs: the round records it as no bid."""


@strategy
class Truthful(BiddingStrategy):
    name = "truthful"


def described(app: AppScheduler, plan: "BiddingStrategy") -> AppScheduler:
    """A read-only stand-in for ``app`` as ``plan`` describes it (what a liar says)."""
    if isinstance(app, SuccessiveHalvingScheduler):
        return _DescribedHalving(app, plan)
    if isinstance(app, CurveStoppingScheduler):
        return _DescribedCurve(app, plan)
    raise TypeError(f"cannot describe {type(app).__name__}")


class _Described:
    def __init__(self, app: AppScheduler, plan: "BiddingStrategy"):
        self.app, self.plan, self.edit = app, plan, plan.edit
        self.start_time = app.start_time

    @property
    def version(self) -> int:
        """The app's own: an edit is a pure function of a job, so the view changes when the app
        does, and an agent's ``TimeLeftCache`` on the view stays valid between rounds."""
        return self.app.version

    @property
    def plan_version(self) -> int:
        return self.app.plan_version

    @property
    def work_depends_on_allocation(self) -> bool:  # type: ignore[override]
        return self.app.work_depends_on_allocation

    def budget(self) -> float:
        return self.plan.budget(self.app.budget())

    def demand_max(self) -> int:
        return self.plan.demand_max(self.app.demand_max())

    def demand_now(self) -> int:
        return self.plan.demand(self.app.demand_now())

    def placement_slowdown(self) -> Slowdown:
        return self.app.placement_slowdown()

    def loss_decrease_rate(self) -> float:
        return self.app.loss_decrease_rate()


class _DescribedHalving(_Described, SuccessiveHalvingScheduler):
    def num_phases(self) -> int:
        return self.app.num_phases()

    def current_phase(self) -> int:
        return self.app.current_phase()

    def jobs_in_phase(self, phase: int, gpu_alloc: Sequence[Position]) -> list[JobInfo]:
        return [self.edit(j) for j in self.app.jobs_in_phase(phase, gpu_alloc)]


class _DescribedCurve(_Described, CurveStoppingScheduler):
    def jobs_remaining(self, gpu_alloc: Sequence[Position]) -> list[JobInfo]:
        return [self.edit(j) for j in self.app.jobs_remaining(gpu_alloc)]


class StrategicAgent(Agent):
    """An agent that reports and bids through a strategy (its jobs still run truthfully).

    Its reports and bids describe the app as the strategy does, lies included. Under the measured
    rank (D21, ``RoundEngine(rank="measured")``) the arbiter takes only the work from its report
    and applies slowdowns it knows, so a slowdown lie no longer reaches the rank and its own rho
    (a claim of infinity too) is not used; its bids still carry every lie."""

    def __init__(self, app: AppScheduler, plan: BiddingStrategy, name: str = "", restart_s: float = 0.0):
        super().__init__(app, name=name, restart_s=restart_s)
        self.plan = plan
        # The app as the agent describes it, with its remaining times kept between rounds while the
        # app is unchanged (as a truthful Agent keeps its own).
        self._bid_view = plan.view(app)
        self._bid_left = TimeLeftCache(self._bid_view)

    def report(self, request: RhoRequest) -> RhoReport:
        truthful = self.app, self._cache
        self.app, self._cache = self._bid_view, self._bid_left
        try:
            answer = super().report(request)
        finally:
            self.app, self._cache = truthful
        return replace(answer, rho=math.inf) if self.plan.claims_infinity else answer

    def bid(self, offer: Offer) -> BidTable:
        if not self.plan.sends_bid:
            raise WithheldBid(f"{self.name or 'the app'} withholds its bid")
        return self.plan.adjust(make_bid(self._bid_view, offer, alternatives=self.alternatives,
                                         time_left=self._bid_left, salt=self.name, restart_s=self.restart_s))


def make_strategy(name: str, level: float, seed: int | str = 0) -> BiddingStrategy:
    try:
        return STRATEGIES[name](level, seed)
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(sorted(STRATEGIES))}") from None


def liar_factory(liars: set[str], name: str, level: float, seed: int = 0):
    """An agent factory for ``Simulation``: the apps in ``liars`` report and bid through the strategy."""

    def make(spec: AppSpec, app: AppScheduler) -> Agent:
        if spec.app_id in liars:
            return StrategicAgent(app, make_strategy(name, level, seed=f"{seed}:{spec.app_id}"), spec.app_id)
        return Agent(app, name=spec.app_id)

    return make
