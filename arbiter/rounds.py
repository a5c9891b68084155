"""The pure round engine: Pseudocode 1's ``roundByRoundAuctions`` without sockets or clocks.

Time is a number the caller passes in. The simulator drives the engine with a virtual clock, the
service with the wall clock; both go through the same steps (paper 4.2.2, Figure 7):

1. :meth:`RoundEngine.open_round` expires leases, collects the free GPUs and asks every active
   app with unmet demand for its current rho (:class:`RhoRequest`, carrying N_avg, D5; D6) --
   every app the admission policy has let in (``arbiter.admission``, D33; by default all);
2. :meth:`OpenRound.report` takes each :class:`RhoReport` (rho and the app's current demand);
3. :meth:`OpenRound.offers` filters the worst apps (the policy; D6) and makes their offers;
4. :meth:`OpenRound.bid` validates each bid (D7); a bad bid is rejected with a reason and that app
   is treated as not bidding;
5. :meth:`OpenRound.close` lets the policy allocate (auction, leftover; D8, D9) and turns its
   decision into leases (D10), returning a :class:`RoundResult` with the grants.

:meth:`RoundEngine.run_round` does all five in one call against in-process agents. When a round is
due (D10) is answered by :meth:`RoundEngine.round_due` and :meth:`RoundEngine.next_wakeup`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Protocol

from arbiter.admission import AdmissionContext, AdmissionPolicy, WaitingApp, make_admission
from arbiter.auction import RHO_MAX, RHO_MIN, InvalidBid, keep_best_locality, validate_bid
from arbiter.cluster import Cluster
from arbiter.leases import Lease, LeaseTable
from arbiter.lottery import RoundSeeds, commitment
from arbiter.policies.base import Decision, Policy, RoundContext
from arbiter.rank import BadWorkClaim, Pace, check_claim, check_rank, measured_rho, time_left, work_left_floor
from protos.messages import BidTable, Neighbour, Offer, Position, RhoReport, RhoRequest

DEFAULT_LEASE_S = 600.0
DEFAULT_COALESCE_S = 1.0
EXPIRY_WINDOW_SHARE = 0.1  # of the lease: how long an expiry waits for others to join its round
WORK = frozenset({"work"})  # the report field a measured rank needs (D21)
REASON_MAX = 300  # characters of a refusal's reason kept in a round's result (journal, events, history)


def cut_reason(reason: str) -> str:
    """A refusal's reason as a round keeps it: reasons quote what an agent sent, and a round's
    result is journaled, published and served by RoundHistory, so none may grow with the input."""
    return reason if len(reason) <= REASON_MAX else f"{reason[:REASON_MAX]}... ({len(reason)} characters)"


class UnknownApp(KeyError):
    def __str__(self) -> str:
        return f"unknown app {self.args[0]!r}"


@dataclass(frozen=True)
class Grant:
    app: str
    gpus: frozenset[str]
    expires_at: float
    round_id: int
    source: str  # "auction", "queue" (unserved bidders in rank order, D9), "leftover" (D9), or "policy"


@dataclass(frozen=True)
class RoundResult:
    round_id: int
    now: float
    offered: frozenset[str]
    rho: Mapping[str, float]
    bidders: tuple[str, ...]
    rejected: Mapping[str, str]
    grants: tuple[Grant, ...]
    decision: Decision | None
    idle: frozenset[str]  # free GPUs nobody got this round
    unmet: Mapping[str, int] = field(default_factory=dict)  # demand beyond holdings as the round opened
    unmet_after: Mapping[str, int] = field(default_factory=dict)
    expired: tuple[Lease, ...] = ()  # leases that ran out when the round opened (reclaimed ones included)
    reclaimed: tuple[Lease, ...] = ()  # of those, leases beyond a fair share ended early for starving apps (D27)
    granted_by: Mapping[str, int] = field(default_factory=dict)  # GPUs per source (Decision.granted_by)
    seed: str = ""  # the round's seed, every draw's source (D24): revealed once the round has closed
    commitment: str = ""  # SHA-256 of ``seed``, sent with the rho requests before anyone bid (D24)
    waiting: tuple[str, ...] = ()  # apps not admitted yet as the round opened, longest waiting first (D33)


@dataclass(frozen=True)
class AppRecord:
    """An app as the engine keeps it: when it arrived, the contention integral then (D5), the
    GPU-seconds it has held, the demand it last stated, and the most GPUs it has stated it could use
    or held at once (what a measured rank takes as its demand_max at most, D28)."""

    arrived: float
    contention_at_arrival: float
    attained: float
    demand: int | None
    most: int = 0


@dataclass(frozen=True)
class EngineState:
    """Everything a restarted arbiter needs to go on where it stopped: the clock and contention
    integral behind N_avg (D5), the round counter, the apps, every lease with its expiry, the
    drained machines and the machines added at run time (rack, machine, gpus, slots)."""

    clock: float
    contention: float
    round_id: int
    pending_since: float | None
    apps: Mapping[str, AppRecord]
    leases: tuple[Lease, ...]
    drained: frozenset[str] = frozenset()
    added_machines: tuple[tuple[str, str, int, int], ...] = ()
    idle: frozenset[str] = frozenset()  # apps gone quiet: not counted in N_avg, not asked (the service)
    waiting: frozenset[str] = frozenset()  # apps the admission policy has not let in yet (D33)


class AgentPort(Protocol):
    """How :meth:`RoundEngine.run_round` reaches an in-process agent."""

    def report(self, request: RhoRequest) -> RhoReport: ...

    def bid(self, offer: Offer) -> BidTable: ...


@dataclass
class _AppState:
    arrived: float
    contention_at_arrival: float
    attained: float = 0.0  # GPU-seconds held up to the engine's clock
    demand: int | None = None  # GPUs it could use, as it last said; None until it says
    most: int = 0  # the most GPUs it has said it could use, or held, at once (D28)

    def said(self, demand: int, held: int) -> None:
        self.demand = demand
        self.most = max(self.most, demand, held)


class RoundEngine:
    """Leases, apps, N_avg and rounds over one cluster, with a pluggable policy."""

    def __init__(
        self,
        cluster: Cluster,
        policy: Policy,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        coalesce_s: float = DEFAULT_COALESCE_S,
        expiry_window_s: float | None = None,
        seed: int = 0,
        rank: str = "reported",
        secret: bytes | None = None,
        reclaim: bool = True,
        admission: AdmissionPolicy | None = None,
    ):
        check_rank(rank)
        if not lease_s > 0:
            raise ValueError(f"lease length must be > 0 seconds, got {lease_s}")
        if not coalesce_s >= 0:
            raise ValueError(f"coalescing window must be >= 0 seconds, got {coalesce_s}")
        if expiry_window_s is None:
            expiry_window_s = lease_s * EXPIRY_WINDOW_SHARE
        if not expiry_window_s >= 0:
            raise ValueError(f"expiry window must be >= 0 seconds, got {expiry_window_s}")
        self.cluster = cluster
        self.policy = policy
        self.lease_s = lease_s
        self.coalesce_s = coalesce_s
        self.expiry_window_s = max(coalesce_s, expiry_window_s)
        self.seed = seed
        #: D24: each round's seed, from ``seed`` (public: a simulation) or a ``secret`` (a service)
        self.seeds = RoundSeeds(seed, secret)
        self.leases = LeaseTable()
        self.apps: dict[str, _AppState] = {}
        self.round_id = 0
        self._pending_since: float | None = None
        self._clock = 0.0  # last time the contention integral was advanced
        self._contention = 0.0  # integral of (number of active apps) dt
        self._open: OpenRound | None = None
        self.drained: set[str] = set()  # machines that get no new grants (their leases run out)
        #: apps that went quiet (the service: no agent connected and nothing held for a while): not
        #: counted in anyone's N_avg and not asked for rho until they come back
        self.idle: set[str] = set()
        self.added_machines: list[tuple[str, str, int, int]] = []
        self.silent: frozenset[str] = frozenset()  # offered in the last round and sent no valid bid (D22)
        #: D21: "measured" ranks an app whose placement slowdowns are in ``slowdowns`` by its claimed
        #: work at those slowdowns (``arbiter.rank``); "reported" by the rho it reports.
        self.rank = rank
        self.slowdowns: dict[str, tuple[float, float, float, float]] = {}
        #: D27: a round ends the leases an app holds beyond its fair share when apps that hold
        #: nothing would otherwise wait for an expiry -- once for each such app until it holds GPUs
        self.reclaim = reclaim
        self.reclaimed_for: set[str] = set()
        #: D29: how fast each app ranked by its work has burned its claimed time left (measured rank)
        self.pace: dict[str, Pace] = {}
        #: D31: the most work (GPU-seconds) each app ranked by its work has claimed to have left
        self.work_floor: dict[str, float] = {}
        #: D33: who is let in (Blox's admission block; accept-all by default). A waiting app counts
        #: in N_avg from its arrival but is not asked, offered, granted or reclaimed for.
        self.admission = admission or make_admission()
        self.waiting: set[str] = set()
        self.admitted_at: dict[str, float] = {}  # when each app was let in (reporting only)

    # -- durable state and a changing cluster ------------------------------------------------

    def state(self) -> EngineState:
        """A snapshot to journal (the service writes one after every change)."""
        return EngineState(
            clock=self._clock,
            contention=self._contention,
            round_id=self.round_id,
            pending_since=self._pending_since,
            apps={a: AppRecord(s.arrived, s.contention_at_arrival, s.attained, s.demand, s.most)
                  for a, s in self.apps.items()},
            leases=tuple(sorted(self.leases, key=lambda lease: lease.gpu)),
            drained=frozenset(self.drained),
            added_machines=tuple(self.added_machines),
            idle=frozenset(self.idle),
            waiting=frozenset(self.waiting),
        )

    def restore(self, state: EngineState) -> None:
        """Go on from ``state`` (a fresh engine over the cluster as it was started). Machines
        added at run time are added again under the same names; every lease comes back with its
        expiry, through the lease table, so no GPU can end up held twice."""
        if self.apps or len(self.leases) or self.round_id:
            raise RuntimeError("restore() needs a fresh engine")
        for rack, machine, gpus, slots in state.added_machines:
            self.cluster, name = self.cluster.with_machine(rack, gpus, slots)
            if name != machine:
                raise ValueError(f"journal names added machine {machine!r} but the cluster would call it {name!r}")
            self.added_machines.append((rack, machine, gpus, slots))
        unknown = sorted({lease.gpu for lease in state.leases} - set(self.cluster.gpus))
        if unknown:
            raise ValueError(f"journal has leases on GPUs this cluster does not have: {unknown[:5]}")
        strays = sorted({lease.app for lease in state.leases} - set(state.apps))
        if strays:
            raise ValueError(f"journal has leases held by unknown apps: {strays[:5]}")
        self._clock, self._contention = state.clock, state.contention
        # A restart is a resource-available event (D10): a round that was open at the crash is lost,
        # and its free GPUs must not wait for the next lease expiry.
        self.round_id, self._pending_since = state.round_id, state.clock
        for app, rec in state.apps.items():
            self.apps[app] = _AppState(rec.arrived, rec.contention_at_arrival, rec.attained, rec.demand,
                                       max(rec.most, rec.demand or 0))
        self.leases = LeaseTable(state.leases)
        self.drained = set(state.drained) & set(self.cluster.machines)
        self.idle = set(state.idle) & set(self.apps)
        self.waiting = set(state.waiting) & set(self.apps)

    def add_machine(self, rack: str, gpus: int, slots: int, now: float) -> str:
        """Grow the cluster by one machine; its GPUs are free at once (a resource-available
        event, D10). Returns the machine's name."""
        self._advance(now)
        self._before_add = self.cluster
        self.cluster, name = self.cluster.with_machine(rack, gpus, slots)
        self.added_machines.append((rack, name, gpus, slots or 1))
        self._note(now)
        return name

    def undo_add_machine(self, name: str) -> None:
        """Take back the machine :meth:`add_machine` just added (the service, when the journal could
        not record it): only the latest one, and only while none of its GPUs is leased."""
        if not self.added_machines or self.added_machines[-1][1] != name:
            raise ValueError(f"{name!r} is not the machine added last")
        if any(self.leases.holder(g) for g in self.cluster.machines[name]):
            raise ValueError(f"{name!r} has leased GPUs")
        self.cluster = self._before_add
        self.added_machines.pop()
        self.drained.discard(name)

    def drain(self, machine: str) -> None:
        """No new grants on ``machine``; the leases on it run out as usual."""
        if machine not in self.cluster.machines:
            raise KeyError(f"unknown machine {machine!r}")
        self.drained.add(machine)

    def resume(self, machine: str, now: float) -> None:
        """Grants on a drained ``machine`` again. Its free GPUs come back at once: a
        resource-available event (D10), like an added machine, so a round follows instead of the
        GPUs waiting for some unrelated event."""
        if machine not in self.cluster.machines:
            raise KeyError(f"unknown machine {machine!r}")
        if machine in self.drained:
            self._advance(now)
            self.drained.discard(machine)
            if any(self.leases.holder(g) is None for g in self.cluster.machines[machine]):
                self._note(now)

    # -- apps and N_avg (D5) -------------------------------------------------------------

    @property
    def clock(self) -> float:
        """The latest time the engine has been told (its clock never goes back)."""
        return self._clock

    def _advance(self, now: float) -> None:
        """Move the engine's clock, integrating contention (D5) and attained GPU service."""
        if not math.isfinite(now):
            raise ValueError(f"the time must be a finite number, got {now!r}")
        if now < self._clock:
            raise ValueError(f"time went backwards: {now} < {self._clock}")
        dt = now - self._clock
        if dt:
            self._contention += (len(self.apps) - len(self.idle)) * dt
            for app, state in self.apps.items():
                state.attained += len(self.leases.held_by(app)) * dt
        self._clock = now

    def add_app(self, app: str, now: float, slowdown: tuple[float, float, float, float] | None = None) -> None:
        """An app arrives (a resource-available event if GPUs are free, D10). ``slowdown``: its
        placement slowdowns by D1 level, when the arbiter knows them (its model's, D21)."""
        if app in self.apps:
            raise ValueError(f"app {app!r} is already registered")
        if slowdown is not None:
            self.set_slowdown(app, slowdown)
        self._advance(now)
        self.apps[app] = _AppState(now, self._contention)
        self.waiting.add(app)
        self._admit(now)
        if app not in self.waiting and (self.free_gpus() or self.borrowed()):
            self._note(now)

    def set_slowdown(self, app: str, slowdown: tuple[float, float, float, float] | None) -> None:
        """The placement slowdowns the arbiter knows for ``app`` (D1 levels 0-3), or None to forget
        them: with ``rank="measured"`` its rank is its claimed work at these (D21)."""
        if slowdown is None:
            self.slowdowns.pop(app, None)
            return
        values = tuple(slowdown)
        if len(values) != 4 or not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 1 for v in values):
            raise ValueError(f"{app!r}: a slowdown is 4 finite numbers >= 1 (D1 levels 0-3), got {slowdown!r}")
        self.slowdowns[app] = (float(values[0]), float(values[1]), float(values[2]), float(values[3]))

    def remove_app(self, app: str, now: float) -> frozenset[str]:
        """An app finishes or fails: its GPUs return to the pool (D10)."""
        if app not in self.apps:
            raise UnknownApp(app)
        if self._open is not None:  # the round holds the app's report and bid: it would lease to no one
            raise RuntimeError(f"app {app!r} cannot leave while round {self._open.round_id} is open; "
                               "remove it once the round has closed")
        self._advance(now)
        del self.apps[app]
        self.slowdowns.pop(app, None)
        self.pace.pop(app, None)
        self.work_floor.pop(app, None)
        self.idle.discard(app)
        self.waiting.discard(app)
        self.admitted_at.pop(app, None)
        freed = self.leases.release(app)
        admitted = self._admit(now)
        if freed or admitted:
            self._note(now)
        return freed

    def release(self, app: str, gpus, now: float) -> frozenset[str]:
        """The app gives GPUs back before their leases end (its jobs finished)."""
        if app not in self.apps:
            raise UnknownApp(app)
        self._advance(now)
        freed = self.leases.release(app, gpus)
        if freed:
            self._note(now)
        return freed

    def attained(self, app: str, now: float) -> float:
        """GPU-seconds the app has held since it arrived (Tiresias's attained service)."""
        state = self.apps.get(app)
        if state is None:
            raise UnknownApp(app)
        return state.attained + len(self.leases.held_by(app)) * max(0.0, now - self._clock)

    def n_avg(self, app: str, now: float) -> float:
        """D5: time-weighted average number of active apps (itself included) since it arrived."""
        state = self.apps.get(app)
        if state is None:
            raise UnknownApp(app)
        span = now - state.arrived
        if span <= 0:
            return float(len(self.apps))
        total = self._contention + (len(self.apps) - len(self.idle)) * (now - self._clock) - state.contention_at_arrival
        return max(1.0, total / span)

    # -- when rounds run (D10) -----------------------------------------------------------

    def _note(self, now: float) -> None:
        if self._pending_since is None or now < self._pending_since:
            self._pending_since = now

    def set_demand(self, app: str, demand: int, now: float) -> None:
        """The app says how many GPUs it could use in all (e.g. a new phase of its search). Rounds
        ask only apps that want more than they hold (D6), so an app must say when its demand
        changes; wanting more while GPUs are free is a resource-available event (D10)."""
        state = self.apps.get(app)
        if state is None:
            raise UnknownApp(app)
        if isinstance(demand, bool) or not isinstance(demand, int) or demand < 0:
            raise ValueError(f"{app!r}: demand must be an integer >= 0, got {demand!r}")
        before = state.demand
        held = len(self.leases.held_by(app))
        state.said(demand, held)
        if self._admit(now) and (self.free_gpus() or self.borrowed()):
            self._note(now)
        if app in self.waiting:
            return
        if demand > held and (before is None or before <= held or demand > before) and (
                self.free_gpus() or (not held and self.borrowed())):
            self._note(now)

    def note_ready(self, app: str, now: float) -> None:
        """The app's agent (re)connected: if it wants more than it holds while GPUs are free, that
        is a resource-available event (D10), as for an arriving app -- e.g. after an arbiter
        restart, when the agents come back after the restart's own round."""
        if app not in self.apps:
            raise UnknownApp(app)
        if self.wants_more(app) and (self.free_gpus() or (not self.held(app) and self.borrowed())):
            self._note(now)

    def wants_more(self, app: str) -> bool:
        """Whether a round should ask the app for rho: it wants more GPUs than it holds, or has
        not said what it wants yet (D6)."""
        state = self.apps[app]
        return state.demand is None or state.demand > len(self.leases.held_by(app))

    def set_idle(self, app: str, idle: bool, now: float) -> None:
        """An app goes quiet (its agent gone, nothing held, for a while) or comes back. A quiet app
        counts in no one's N_avg (D5: the apps contending) and is not asked for rho; coming back with
        GPUs free is a resource-available event, as an arrival is (D10)."""
        if app not in self.apps:
            raise UnknownApp(app)
        self._advance(now)
        if idle:
            self.idle.add(app)
        elif app in self.idle:
            self.idle.discard(app)
            self.note_ready(app, now)
        if self._admit(now):
            self._note(now)

    # -- admission (D33) -------------------------------------------------------------------

    def waiting_apps(self) -> list[str]:
        """The apps waiting for admission, longest waiting first (arrival, then name)."""
        return sorted(self.waiting, key=lambda a: (self.apps[a].arrived, a))

    def _admit(self, now: float) -> list[str]:
        """Let in the waiting apps the admission policy admits now (D33); returns them. Apps gone
        quiet neither wait in line nor count as admitted."""
        if not self.waiting:
            return []
        line = [WaitingApp(a, self.apps[a].arrived, self.apps[a].demand)
                for a in self.waiting_apps() if a not in self.idle]
        inside = [s for a, s in self.apps.items() if a not in self.waiting and a not in self.idle]
        ctx = AdmissionContext(self.cluster.size, sum(s.demand or 0 for s in inside), len(inside))
        chosen = self.admission.admit(line, ctx) if line else []
        strays = sorted(set(chosen) - {w.app for w in line})
        if strays:
            raise RuntimeError(f"admission policy {self.admission.name} admitted apps that were not waiting: "
                               f"{strays[:5]}")
        for app in chosen:
            self.waiting.discard(app)
            self.admitted_at[app] = now
        return chosen

    def starving(self) -> list[str]:
        """The apps that hold nothing and want GPUs (or have not said what they want), by name."""
        return sorted(a for a in self.apps if not self.leases.held_by(a) and self.wants_more(a) and a not in self.idle
                      and a not in self.waiting)

    def borrowed(self) -> list[Lease]:
        """D27: the leases a round opening now would end early, so that the apps that hold nothing
        get up to their fair share without waiting for an expiry.

        An app's fair share is the cluster over the apps, R_C / N (D13's waiting rho assumes the
        same). A lease protects what an app holds up to its share for the whole lease; what it
        holds beyond that it was lent because nobody else wanted it (work conservation), and it
        keeps that only while nobody who holds nothing is waiting. The starving apps' need -- each
        its demand, at most its share and at least one GPU -- less the free GPUs is taken from the
        apps furthest above their share first (ties by name), each keeping its best-placed GPUs
        (D1); never a GPU on a drained machine, which would free nothing. The round then
        re-auctions those GPUs like expired ones: their holder bids for them as its previous GPUs
        (D10, D17), so a GPU the starving apps do not take goes back without a restart. Each
        starving app is reclaimed for once, until it holds GPUs again: an app the round then did
        not serve (it lost the lottery, or a baseline's order passed it over) waits for an expiry
        like any other, and no GPU is moved round after round for it."""
        if not self.reclaim:
            return []
        starving = [a for a in self.starving() if a not in self.reclaimed_for]
        if not starving:
            return []
        share = self.cluster.size / (len(self.apps) - len(self.waiting))  # D33: among the admitted apps
        per_app = max(1, math.floor(share))
        need = sum(min(per_app, max(1, self.apps[a].demand or per_app)) for a in starving) - len(self.free_gpus())
        if need <= 0:
            return []
        cap = math.ceil(share)
        donors = sorted((a for a in self.apps if len(self.leases.held_by(a)) > cap),
                        key=lambda a: (-len(self.leases.held_by(a)), a))
        out: list[Lease] = []
        for app in donors:
            if need <= 0:
                break
            held = self.leases.held_by(app)
            mine = sorted(g for g in held if self.cluster.gpus[g].machine not in self.drained)
            k = min(len(held) - cap, need, len(mine))
            if k <= 0:
                continue
            kept = keep_best_locality(mine, len(mine) - k, self.cluster.position)
            out.extend(self.leases.lease(g) for g in mine if g not in kept)
            need -= k
        return out

    def next_wakeup(self) -> float | None:
        """The earliest time a round may be due (D10): a pending event plus the coalescing window,
        or the next lease expiry plus the expiry window. A lease runs on until the round that
        re-auctions it, so waiting for other expiries to join costs no idle GPU time; it makes
        rounds fewer and bigger (better packing, fewer restarts, D11)."""
        events = []
        if self._pending_since is not None:
            events.append(self._pending_since + self.coalesce_s)
        expiry = self.leases.next_expiry()
        if expiry is not None:
            events.append(expiry + self.expiry_window_s)
        return min(events) if events else None

    def round_due(self, now: float) -> bool:
        wake = self.next_wakeup()
        return wake is not None and now >= wake and self._open is None

    def free_gpus(self) -> frozenset[str]:
        """GPUs nobody holds, on machines that are not drained."""
        free = frozenset(self.cluster.gpus) - self.leases.taken()
        if self.drained:
            free = frozenset(g for g in free if self.cluster.gpus[g].machine not in self.drained)
        return free

    def held(self, app: str) -> frozenset[str]:
        return self.leases.held_by(app)

    # -- one round -----------------------------------------------------------------------

    def open_round(self, now: float) -> "OpenRound":
        if self._open is not None:
            raise RuntimeError(f"round {self._open.round_id} is still open")
        self._advance(now)
        self._admit(now)
        ran_out = self.leases.expire(now)
        reclaimed = self.borrowed()
        starving = set(self.starving())
        self.reclaimed_for = (self.reclaimed_for & starving) | (starving if reclaimed else set())
        for lease in reclaimed:
            self.leases.release(lease.app, [lease.gpu])
        expired = tuple(sorted(ran_out + reclaimed, key=lambda lease: lease.gpu))
        self._pending_since = None
        self.round_id += 1
        self._open = OpenRound(self, self.round_id, now, expired, tuple(sorted(reclaimed, key=lambda x: x.gpu)))
        return self._open

    def _closed(self) -> None:
        self._open = None

    def run_round(self, now: float, ports: Mapping[str, AgentPort]) -> RoundResult:
        """A whole round against in-process agents; an agent that raises is treated as silent."""
        rnd = self.open_round(now)
        for request in rnd.requests:
            port = ports.get(request.app)
            if port is None:
                continue
            try:
                rnd.report(request.app, port.report(request))
            except Exception as exc:  # an agent's failure must not stop the round
                rnd.note_failure(request.app, f"rho report failed: {exc}")
        for app, offer in rnd.offers().items():
            port = ports.get(app)
            if port is None:
                continue
            try:
                table = port.bid(offer)
            except Exception as exc:
                rnd.note_failure(app, f"bid failed: {exc}")
                continue
            try:
                rnd.bid(app, table)
            except InvalidBid:
                pass  # recorded in the round's rejected
            except Exception as exc:  # a malformed bid must not leave the round open
                rnd.note_failure(app, f"bid refused: {exc}")
        return rnd.close()


class InvalidReport(ValueError):
    """A rho report that cannot be used (NaN or non-positive rho, negative demand)."""


class OpenRound:
    """One round between :meth:`RoundEngine.open_round` and :meth:`close`."""

    def __init__(self, engine: RoundEngine, round_id: int, now: float, expired: tuple[Lease, ...] = (),
                 reclaimed: tuple[Lease, ...] = ()):
        self.engine = engine
        self.expired = expired
        self.reclaimed = reclaimed
        self.round_id = round_id
        self.now = now
        self.seed = engine.seeds.of(round_id)  # D24: every draw of the round comes from it
        self.commitment = commitment(self.seed)
        self.free = engine.free_gpus()
        self.waiting = tuple(engine.waiting_apps())  # D33: after this round's admission
        previous: dict[str, set[str]] = {}
        for lease in expired:
            if lease.app in engine.apps:
                previous.setdefault(lease.app, set()).add(lease.gpu)
        self.previous = {app: frozenset(g) for app, g in previous.items()}
        cluster = engine.cluster
        # The round keeps the policy it opened with: a settings change mid-round (the service's
        # UpdateSettings) applies from the next round, never between the offer and the allocation.
        self.policy = engine.policy
        extras = self.policy.report_extras
        # D21: the apps this round ranks by their claimed work, and at which slowdowns; fixed as the
        # round opens, like its policy
        self.by_work = {a: s for a, s in engine.slowdowns.items() if a in engine.apps} \
            if engine.rank == "measured" else {}
        self.requests = [
            RhoRequest(
                round_id,
                app,
                now,
                engine.n_avg(app, now),
                cluster.size,
                {g: cluster.position(g) for g in sorted(self.held_at_open(app))},
                extras | WORK if app in self.by_work else extras,
                self.commitment,
                self._neighbourhood(app, {}),
            )
            for app in sorted(engine.apps)
            if engine.wants_more(app) and app not in engine.idle and app not in engine.waiting
        ]
        # D21: what each app is asked on -- the GPUs it held as the round opened, its N_avg, the
        # cluster's size -- which a measured rank uses too, as the agent's claim does: an app that
        # connects, or a Release, before the report must not move them between the two
        self._asked = {r.app: r for r in self.requests}
        self._reports: dict[str, RhoReport] = {}
        self._offers: dict[str, Offer] | None = None
        self._ranked = 0
        self._bids: dict[str, BidTable] = {}
        self._paces: dict[str, Pace] = {}  # D29: what this round's reports add, kept when it closes
        self._floors: dict[str, float] = {}  # D31: the same for the work the claims say is left
        self.rejected: dict[str, str] = {}
        self._rng = random.Random(self.seed)

    def held_at_open(self, app: str) -> frozenset[str]:
        """What the app held as the round opened: its leases, and those that ran out at this round
        (it runs on them until the round decides, D13)."""
        return self.engine.held(app) | self.previous.get(app, frozenset())

    def report(self, app: str, report: RhoReport) -> None:
        if app not in self.engine.apps:
            raise UnknownApp(app)
        if self._offers is not None:
            raise InvalidReport(f"round {self.round_id}: reports are closed, offers went out")
        demand = report.demand
        if isinstance(demand, bool) or not isinstance(demand, int) or demand < 0:
            raise InvalidReport(f"{app!r}: demand must be an integer >= 0, got {demand!r}")
        if app in self.by_work:
            report = self._rank_by_work(app, report)
        rho = report.rho
        if not isinstance(rho, (int, float)) or math.isnan(rho) or not rho > 0:
            raise InvalidReport(f"{app!r}: rho must be > 0 (or infinity), got {rho!r}")
        if math.isfinite(rho) and not RHO_MIN <= rho <= RHO_MAX:
            raise InvalidReport(f"{app!r}: rho must be within [{RHO_MIN:g}, {RHO_MAX:g}] (or infinity), got {rho!r}")
        held = len(self.held_at_open(app))
        if math.isinf(rho) and held:
            raise InvalidReport(f"{app!r}: rho must be finite for an app that holds {held} GPU(s) (D13); "
                                "infinity means holding nothing")
        wait = report.rho_wait
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= RHO_MAX:
            raise InvalidReport(f"{app!r}: rho_wait must be a number within [0, {RHO_MAX:g}] (D13: finite), "
                                f"got {wait!r}")
        self._reports[app] = report
        self.engine.apps[app].said(demand, len(self.held_at_open(app)))

    def _rank_by_work(self, app: str, report: RhoReport) -> RhoReport:
        """The report with the rho and waiting rho the arbiter computes from the app's claimed work
        at the slowdowns it knows (D21, ``arbiter.rank``); the agent's own figures are not used."""
        if report.work is None:
            raise InvalidReport(f"{app!r}: the arbiter ranks by measured slowdowns (D21); the report must "
                                "carry the app's work (an agent too old to send it?)")
        engine = self.engine
        asked = self._asked.get(app)
        if asked is not None:  # the request's, which the claim was computed on
            held, n_avg, size = frozenset(asked.held), asked.n_avg, asked.cluster_size
        else:
            held, n_avg, size = self.held_at_open(app), engine.n_avg(app, self.now), engine.cluster.size
        try:
            claim = check_claim(report.work, len(held), engine.cluster.locality(held) if held else 0)
            # D28: Eq. 1's demand_max is the most GPUs the app can use at once; the arbiter takes at
            # most what it has asked for (its stated demands) or held, not a number it only claims
            most = max(engine.apps[app].most, report.demand, len(held))
            if claim.demand_max > most:
                claim = replace(claim, demand_max=max(1, most))
            # D29: the claims held to the pace at which they went down while the app held its GPUs
            slowdown = self.by_work[app]
            pace = engine.pace.get(app, Pace()).after(self.now, frozenset(held), time_left(claim.held, slowdown))
            self._paces[app] = pace
            # D31: B is at least the most work the app's own claims have said was left
            floor = self._floors[app] = max(engine.work_floor.get(app, 0.0), work_left_floor(claim))
            rho, wait = measured_rho(claim, slowdown, held=len(held), demand=report.demand,
                                     elapsed=self.now - engine.apps[app].arrived, n_avg=n_avg, cluster_size=size,
                                     pace=pace.factor(engine.lease_s), work_floor=floor,
                                     contention=self._ratio_now(app) if held else 1.0)
        except BadWorkClaim as exc:
            raise InvalidReport(f"{app!r}: work claim: {exc}") from None
        return replace(report, rho=rho, rho_wait=wait, work=claim)

    def _ratio_now(self, app: str) -> float:
        """D36: the contention ratio the app's jobs run at now, where the policy prices contention
        and has a view of it (1 otherwise: D35's unaware runs rank as they did)."""
        view = self.policy.contention
        return view.ratio(app) if view is not None and self.policy.contention_aware else 1.0

    def note_failure(self, app: str, reason: str) -> None:
        self.rejected[app] = cut_reason(reason)

    def _unmet(self) -> dict[str, int]:
        out = {}
        for app, r in self._reports.items():
            n = r.demand - len(self.engine.held(app))
            if n > 0:
                out[app] = n
        return out

    def _context(self) -> RoundContext:
        cluster = self.engine.cluster
        return RoundContext(
            round_id=self.round_id,
            now=self.now,
            free=self.free,
            unmet=self._unmet(),
            held={app: self.engine.held(app) for app in self.engine.apps},
            position=cluster.position,
            rng=self._rng,
            seed=self._rng.randrange(2**31),
            reports=dict(self._reports),
            attained={app: self.engine.attained(app, self.now) for app in self.engine.apps},
            arrived={app: state.arrived for app, state in self.engine.apps.items()},
            previous=self.previous,
            offered=tuple(self._offers or ()),
            ranked=self._ranked,
            round_seed=self.seed,
        )

    def offers(self) -> dict[str, Offer]:
        """Step 2: the same offer of the free GPUs to the apps the policy lets bid (D6)."""
        if self._offers is None:
            unmet = self._unmet()
            if not self.free or not unmet:
                self._offers = {}
                return {}
            ctx = self._context()
            self._ranked = len(unmet)
            chosen = self.policy.bidders({a: self._reports[a].rho for a in unmet}, ctx)
            cluster = self.engine.cluster
            # one read-only mapping for every bidder: agents in this process shape it once (D7)
            gpus = MappingProxyType({g: cluster.position(g) for g in sorted(self.free)})
            self._offers = {
                app: Offer(
                    self.round_id,
                    gpus,
                    self.now,
                    self.engine.n_avg(app, self.now),
                    cluster.size,
                    held={g: cluster.position(g) for g in sorted(self.engine.held(app))},
                    previous={g: cluster.position(g) for g in sorted(self.previous.get(app, ()))},
                    neighbourhood=self._neighbourhood(app, gpus),
                )
                for app in chosen
            }
        return dict(self._offers)

    def _neighbourhood(self, app: str, gpus: Mapping[str, Position]) -> Mapping[str, tuple[Neighbour, ...]]:
        """D36: with a contention-aware policy and a contention view, who runs on the machines of
        the offered GPUs and of the app's own (held and just expired); otherwise nothing (D35's
        unaware runs stay as they were). With no GPUs offered, the rho request's (D43)."""
        view = self.policy.contention
        if view is None or not self.policy.contention_aware:
            return {}
        machines = {p[1] for p in gpus.values()}
        machines |= {self.engine.cluster.position(g)[1] for g in self.held_at_open(app)}
        return view.neighbourhood(app, sorted(machines))

    def bid(self, app: str, table: BidTable) -> None:
        """Step 3: a bid, validated (D7). Raises InvalidBid (and records why) when it is bad."""
        if self._offers is None:
            raise InvalidBid(app, f"round {self.round_id} has made no offers yet")
        if app not in self._offers:
            reason = "not offered in this round" if app in self.engine.apps else "unknown app"
            self.rejected[app] = reason
            raise InvalidBid(app, reason)
        try:
            validate_bid(app, table, self.free)
            held = len(self.engine.held(app))
            if held and math.isinf(table.rho_old):
                raise InvalidBid(app, f"rho_old must be finite for an app that holds {held} GPU(s) (D13)")
            unmet = self._reports[app].demand - held
            for k, (gpus, _) in enumerate(table.rows):
                if len(gpus) > unmet:  # the leftover tiers cap rows at unmet demand; so does the auction
                    raise InvalidBid(app, f"row {k} asks for {len(gpus)} GPUs, more than the app still wants: "
                                          f"demand {self._reports[app].demand} reported, {held} held")
        except InvalidBid as exc:
            self.rejected[app] = cut_reason(exc.reason)
            raise
        self._bids[app] = table

    def abandon(self) -> None:
        """Give up on the round (the service calls this when something failed before it closed):
        nothing is granted, the leases that expired at its opening are put back -- their holders
        were never told -- and a new round is due, so no GPU waits for an unrelated event."""
        if self.engine._open is self:
            self._undo([])
            self.engine._closed()

    def _undo(self, granted: list[tuple[str, frozenset[str]]]) -> None:
        for app, gpus in granted:
            self.engine.leases.release(app, gpus)
        for lease in self.expired:
            if lease.app in self.engine.apps and self.engine.leases.holder(lease.gpu) is None:
                self.engine.leases.restore(lease)
        self.engine._note(self.now)

    def close(self) -> RoundResult:
        """Steps 4-5: allocate and lease. The round's GPUs were free when it opened and nothing
        else grants GPUs meanwhile, so the lease table's all-or-nothing grant cannot conflict."""
        made: list[tuple[str, frozenset[str]]] = []
        try:
            offers = self.offers()
            ctx = self._context()
            decision: Decision | None = None
            grants: list[Grant] = []
            if self.free and ctx.unmet:
                decision = self.policy.allocate(ctx, self._bids)
                expires = self.now + self.engine.lease_s
                given: set[str] = set()
                for app in sorted(decision.granted):
                    gpus = frozenset(decision.granted[app])
                    if not gpus:
                        continue
                    if not gpus <= self.free or gpus & given:
                        raise RuntimeError(f"policy {self.policy.name} granted GPUs that were not free: {app}")
                    given |= gpus
                    self.engine.leases.grant(app, gpus, now=self.now, expires_at=expires, round_id=self.round_id)
                    made.append((app, gpus))
                    won = decision.auction.granted if decision.auction else {}
                    source = ("auction" if app in won else "queue" if app in decision.queue_granted
                              else "leftover" if app in decision.leftover_granted else "policy")
                    grants.append(Grant(app, gpus, expires, self.round_id, source))
            taken = frozenset().union(*(g.gpus for g in grants)) if grants else frozenset()
            unmet_after = {a: n - len(decision.granted.get(a, ())) if decision else n for a, n in ctx.unmet.items()}
            silent = frozenset(a for a in offers if a not in self._bids)
            # D22: an offered app that sent no valid bid was leased nothing; if it wants GPUs that
            # stay idle, it gets one more round (an agent that missed a deadline), not one per round.
            retry = any(unmet_after.get(a, 0) > 0 for a in silent - self.engine.silent)
            if self.free - taken and ((grants and any(n > 0 for n in unmet_after.values())) or retry):
                # GPUs left idle while apps want more is a resource-available event (D10): the next
                # round offers them again, to bids made for exactly them, instead of waiting for a
                # lease to expire (D9 gives queued apps no random gift). Only after a round that
                # granted something or first found an app silent, so follow-ups end.
                self.engine._note(self.now)
            self.engine.silent = silent
            self.engine.pace.update((a, p) for a, p in self._paces.items() if a in self.engine.apps)
            self.engine.work_floor.update((a, f) for a, f in self._floors.items() if a in self.engine.apps)
            return RoundResult(
                round_id=self.round_id,
                now=self.now,
                offered=self.free,
                rho={a: r.rho for a, r in self._reports.items()},
                bidders=tuple(offers),  # in the policy's order: worst rho first for Themis (D13)
                rejected=dict(self.rejected),
                grants=tuple(grants),
                decision=decision,
                idle=self.free - taken,
                unmet=dict(ctx.unmet),
                unmet_after={a: n for a, n in unmet_after.items() if n > 0},
                expired=self.expired,
                reclaimed=self.reclaimed,
                granted_by=decision.granted_by() if decision else {},
                seed=self.seed,
                commitment=self.commitment,
                waiting=self.waiting,
            )
        except BaseException:
            self._undo(made)  # a failed round grants nothing and takes nothing away
            raise
        finally:
            self.engine._closed()

