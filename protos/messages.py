"""Plain values exchanged between the arbiter and agents (paper Figure 7, mechanism D7).

Both sides import these and nothing else of each other, so the simulator can hand the same objects
across that the service sends over gRPC.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

Position = tuple[str, str, str]  # (rack, machine, slot) of a GPU


@dataclass(frozen=True)
class BidTable:
    """An app's bid (D7): rows of (GPU subset of the offer, rho if it won that subset on top of
    what it holds). ``rho_old`` is the empty row: rho with what it holds now, infinite if it holds
    nothing."""

    rho_old: float
    rows: Sequence[tuple[frozenset[str], float]] = ()


@dataclass(frozen=True)
class Neighbour:
    """A job already running on a machine of an offer, as much as network contention depends on
    (D35) and no more: its model's contention class, its GPUs and how many machines they span. No
    app names: an agent prices the contention a row would suffer, the arbiter the harm it would do."""

    cls: str
    gpus: int
    machines: int


@dataclass(frozen=True)
class RunningJob:
    """One of an app's jobs as it runs (D35, while the arbiter models contention): its GPUs, its
    contention class, and the contention ratio its agent's profiler measured (0: not measured)."""

    job: str
    gpus: frozenset[str]
    cls: str = ""
    ratio: float = 0.0


@dataclass(frozen=True)
class Offer:
    """A round's non-binding offer (paper 4.2.2 step 2): the free GPUs with their place in the
    hierarchy, the time, and the app's N_avg (D5)."""

    round_id: int
    gpus: Mapping[str, Position]
    now: float
    n_avg: float
    cluster_size: int
    deadline: float = math.inf
    held: Mapping[str, Position] = field(default_factory=dict)
    previous: Mapping[str, Position] = field(default_factory=dict)  # its GPUs whose lease just ran out
    neighbourhood: Mapping[str, tuple[Neighbour, ...]] = field(default_factory=dict)  # machine -> who runs there


@dataclass(frozen=True)
class RhoRequest:
    """Paper 4.2.2 step 1: "the Arbiter asks all apps for current finish-time fair metric estimates"
    -- all apps that want more GPUs than they hold (D6). ``held`` is what the app held as the round
    opened, leases that ran out at this round included: it still runs on them until the round
    decides (D13). ``extras`` names the report fields beyond
    rho and demand that the round's policy reads, so agents compute only those. ``neighbourhood``
    (D43, from a contention-aware arbiter only) lists the other apps' jobs on the machines of the
    held GPUs, as an offer does for its own (D36), so the rho an app reports prices the contention
    it runs under."""

    round_id: int
    app: str
    now: float
    n_avg: float
    cluster_size: int
    held: Mapping[str, Position]
    extras: frozenset[str] = frozenset()  # RhoReport fields beyond rho and demand the policy reads
    commitment: str = ""  # SHA-256 of the round's seed, revealed after the round (D24)
    neighbourhood: Mapping[str, tuple[Neighbour, ...]] = field(default_factory=dict)  # machine -> who runs there


@dataclass(frozen=True)
class RhoReport:
    """An app's answer: rho with what it held as the round opened (D13), and how many GPUs it could
    use in all. An app that held nothing reports rho = infinity and ``rho_wait``, the rho it would
    reach with its fair share of the cluster from now on, which orders the apps that wait (D13;
    0 when not given: such an app goes after those that say).

    The other fields are what the baseline policies allocate by (paper 6.1: "all apps report X"):
    ``remaining_s``, the time the app still needs if it got its whole demand, well placed
    (Optimus's SRTF); ``slowdown``, its placement sensitivity by D1 level (Gandiva); and
    ``loss_decrease``, the loss it expects to shed per GPU-second (SLAQ). Themis reads only rho.
    """

    rho: float
    demand: int
    remaining_s: float = math.inf
    slowdown: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0)
    loss_decrease: float = 0.0
    rho_wait: float = 0.0
    work: WorkClaim | None = None  # when the request asks for "work" (D21): rho's parts without slowdowns


#: The columns of one phase's work in a :class:`WorkClaim` (D21): the time, at slowdown 1, of the
#: phase's slowest job among those on one GPU (no slowdown applies) and among those whose GPUs span
#: one slot, one machine, one rack, or several racks (the D1 levels 0-3).
WORK_COLUMNS = ("one_gpu", "slot", "machine", "rack", "racks")
#: The most phases a WorkClaim may list, in ``held`` and in ``share`` each. It bounds a claim's size,
#: not a search: Hyperband lists every bracket's rungs as phases, (s_max + 1)(s_max + 2) / 2 of them
#: (66 for R = 1,024 and eta = 2, which a first bound of 64 starved); 1,024 admit s_max up to 43.
MAX_PHASES = 1024
PhaseWork = tuple[float, float, float, float, float]


@dataclass(frozen=True)
class WorkClaim:
    """What an app's rho is made of, with its placement slowdowns left out, so that the arbiter can
    apply slowdowns it knows instead of the app's word (D21). For a fixed allocation D3's split and
    each job's locality level do not depend on the slowdowns, so the time left is the sum over
    phases of max(one_gpu, slot * S[0], machine * S[1], rack * S[2], cluster * S[3]).

    ``held``: per phase (the current one first), on what the app held as the round opened; empty
    when it held nothing. ``share``: per phase, on its fair share of the cluster (D13's waiting rho:
    max(1, min(demand, floor(R_C / N_avg))) GPUs on one machine, time-sliced below one GPU); empty
    when it holds GPUs. ``work_gpu_s`` and ``demand_max`` give T_id (Eq. 1: B / min(R_C, demand_max)
    x N_avg). Every figure here is the app's claim: work left is what no arbiter can measure."""

    work_gpu_s: float
    demand_max: int
    held: tuple[PhaseWork, ...] = ()
    share: tuple[PhaseWork, ...] = ()
