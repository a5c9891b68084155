"""Between the plain values of ``protos.messages`` and the gRPC messages of ``themis.v1``.

The arbiter and the agents speak ``protos.messages`` inside (the simulator hands those across
directly); these functions are the only place that knows the wire shapes. Anything that comes off
the wire and cannot be a valid value raises :class:`WireError` with what is wrong, so the service
can reject it with a reason (INVALID_ARGUMENT) instead of failing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from protos import themis_pb2 as pb
from protos.messages import (
    MAX_PHASES,
    WORK_COLUMNS,
    BidTable,
    Neighbour,
    Offer,
    Position,
    RhoReport,
    RhoRequest,
    RunningJob,
    WorkClaim,
)


class WireError(ValueError):
    """A message that cannot be turned into a valid value."""


def places(gpus: Mapping[str, Position]) -> list[pb.GpuPlace]:
    return [pb.GpuPlace(gpu=g, rack=p[0], machine=p[1], slot=p[2]) for g, p in gpus.items()]


def positions(items: Iterable[pb.GpuPlace]) -> dict[str, Position]:
    out: dict[str, Position] = {}
    for p in items:
        if not p.gpu or p.gpu in out:
            raise WireError(f"GPU list has an empty or repeated id {p.gpu[:64]!r}")
        out[p.gpu] = (p.rack, p.machine, p.slot)
    return out


def lease_pb(lease) -> pb.Lease:
    """Any lease record with gpu, app, granted_at, expires_at and round_id (``arbiter.leases.Lease``)."""
    return pb.Lease(gpu=lease.gpu, app=lease.app, granted_at=lease.granted_at, expires_at=lease.expires_at,
                    round_id=lease.round_id)


def rho_request_pb(req: RhoRequest, deadline: float) -> pb.RhoRequest:
    return pb.RhoRequest(round_id=req.round_id, now=req.now, n_avg=req.n_avg, cluster_size=req.cluster_size,
                         held=places(req.held), extras=sorted(req.extras), deadline=deadline,
                         lottery_commitment=req.commitment, neighbours=neighbours_pb(req.neighbourhood))


def rho_request(msg: pb.RhoRequest, app: str) -> RhoRequest:
    return RhoRequest(msg.round_id, app, msg.now, msg.n_avg, msg.cluster_size, positions(msg.held),
                      frozenset(msg.extras), msg.lottery_commitment, neighbourhood(msg.neighbours))


MAX_NEIGHBOURS = 4096  # jobs listed around one offer: more than any cluster's machines hold jobs
MAX_CLASS_CHARS = 64


def offer_pb(offer: Offer) -> pb.Offer:
    return pb.Offer(round_id=offer.round_id, gpus=places(offer.gpus), now=offer.now, n_avg=offer.n_avg,
                    cluster_size=offer.cluster_size, deadline=offer.deadline, held=places(offer.held),
                    previous=places(offer.previous),
                    neighbours=[pb.Neighbour(machine=m, cls=n.cls, gpus=n.gpus, machines=n.machines)
                                for m, around in offer.neighbourhood.items() for n in around])


def neighbourhood(items: Iterable[pb.Neighbour]) -> dict[str, tuple[Neighbour, ...]]:
    """An offer's or a rho request's neighbours by machine; a count, class, GPU or machine number that cannot be a job
    raises :class:`WireError` naming the entry."""
    out: dict[str, list[Neighbour]] = {}
    for k, n in enumerate(items):
        if k >= MAX_NEIGHBOURS:
            raise WireError(f"more than {MAX_NEIGHBOURS} neighbours listed")
        if not n.machine or not n.cls or len(n.cls) > MAX_CLASS_CHARS:
            raise WireError(f"neighbour {k}: machine and class must be non-empty (class at most "
                            f"{MAX_CLASS_CHARS} characters), got {n.machine[:64]!r}, {n.cls[:64]!r}")
        if n.gpus < 1 or n.machines < 1:
            raise WireError(f"neighbour {k} on {n.machine[:64]!r}: gpus and machines must be >= 1, "
                            f"got {n.gpus} and {n.machines}")
        out.setdefault(n.machine, []).append(Neighbour(n.cls, n.gpus, n.machines))
    return {m: tuple(around) for m, around in out.items()}


def neighbours_pb(neighbourhood: Mapping[str, Iterable[Neighbour]]) -> list[pb.Neighbour]:
    return [pb.Neighbour(machine=m, cls=n.cls, gpus=n.gpus, machines=n.machines)
            for m, around in neighbourhood.items() for n in around]


MAX_JOBS = 4096  # jobs one app reports at once: more than any cluster has GPUs to run


def running_jobs_pb(app: str, jobs: Iterable[RunningJob]) -> pb.RunningJobs:
    return pb.RunningJobs(app=app, jobs=[pb.RunningJob(job=j.job, gpus=sorted(j.gpus), cls=j.cls, ratio=j.ratio)
                                         for j in jobs])


def running_jobs(msg: pb.RunningJobs) -> tuple[RunningJob, ...]:
    """An app's jobs (D35); a job without an id or GPUs, a GPU in two jobs, or a ratio that is not
    a number in [0, 1] (0: not measured; a measured ratio above 1 is sent as 1) raises :class:`WireError`."""
    out: list[RunningJob] = []
    seen: set[str] = set()
    ids: set[str] = set()
    for k, j in enumerate(msg.jobs):
        if k >= MAX_JOBS:
            raise WireError(f"more than {MAX_JOBS} running jobs")
        if not j.job or j.job in ids or not j.gpus or len(j.cls) > MAX_CLASS_CHARS:
            raise WireError(f"running job {k}: needs a unique non-empty id, GPUs, and a class of at most "
                            f"{MAX_CLASS_CHARS} characters; got {j.job[:64]!r} on {len(j.gpus)} GPUs")
        if not (0.0 <= j.ratio <= 1.0):  # NaN fails too
            raise WireError(f"running job {j.job[:64]!r}: ratio must be in [0, 1], got {j.ratio!r}")
        gpus = frozenset(j.gpus)
        if len(gpus) != len(j.gpus) or gpus & seen or "" in gpus:
            raise WireError(f"running job {j.job[:64]!r}: a GPU is empty, repeated or in another job")
        seen |= gpus
        ids.add(j.job)
        out.append(RunningJob(j.job, gpus, j.cls, j.ratio))
    return tuple(out)


def offer(msg: pb.Offer) -> Offer:
    return Offer(msg.round_id, positions(msg.gpus), msg.now, msg.n_avg, msg.cluster_size, msg.deadline,
                 positions(msg.held), positions(msg.previous), neighbourhood(msg.neighbours))


def report_pb(report: RhoReport, round_id: int, app: str) -> pb.RhoReport:
    msg = pb.RhoReport(round_id=round_id, app=app, rho=report.rho, demand=report.demand,
                       remaining_s=report.remaining_s, slowdown=list(report.slowdown),
                       loss_decrease=report.loss_decrease, rho_wait=report.rho_wait)
    if report.work is not None:
        w = report.work
        msg.work.CopyFrom(pb.WorkClaim(work_gpu_s=w.work_gpu_s, demand_max=w.demand_max,
                                       held=[pb.PhaseWork(seconds=list(p)) for p in w.held],
                                       share=[pb.PhaseWork(seconds=list(p)) for p in w.share]))
    return msg


def work_claim(msg: pb.WorkClaim) -> WorkClaim:
    """The claim as sent; its checks (five finite times >= 0 per phase, levels the allocation
    reaches) are the round's (``arbiter.rank.check_claim``). Only its size is checked here, whether
    or not the round reads it: an app the arbiter ranks by its report could otherwise send claims of
    megabytes that nobody looks at (issue 32)."""
    for part in ("held", "share"):
        phases = getattr(msg, part)
        if len(phases) > MAX_PHASES:
            raise WireError(f"work claim {part} has {len(phases)} phases, more than {MAX_PHASES}")
        if any(len(p.seconds) != len(WORK_COLUMNS) for p in phases):
            raise WireError(f"work claim {part}: every phase has {len(WORK_COLUMNS)} times ({', '.join(WORK_COLUMNS)})")
    return WorkClaim(msg.work_gpu_s, msg.demand_max, tuple(tuple(p.seconds) for p in msg.held),  # type: ignore[arg-type]
                     tuple(tuple(p.seconds) for p in msg.share))


def report(msg: pb.RhoReport) -> RhoReport:
    """The report; value checks (rho > 0, demand >= 0) are the round's (``OpenRound.report``)."""
    slowdown = tuple(msg.slowdown) or (1.0, 1.0, 1.0, 1.0)
    if len(slowdown) != 4 or any(not (s >= 1.0 and math.isfinite(s)) for s in slowdown):
        got = list(msg.slowdown[:4]) + (["..."] if len(msg.slowdown) > 4 else [])
        raise WireError(f"slowdown must be 4 finite numbers >= 1 (one per D1 level), got {len(msg.slowdown)}: {got}")
    return RhoReport(msg.rho, msg.demand, remaining_s=msg.remaining_s, slowdown=slowdown,  # type: ignore[arg-type]
                     loss_decrease=msg.loss_decrease, rho_wait=msg.rho_wait,
                     work=work_claim(msg.work) if msg.HasField("work") else None)


def bid_pb(table: BidTable, round_id: int, app: str) -> pb.Bid:
    return pb.Bid(round_id=round_id, app=app, rho_old=table.rho_old,
                  rows=[pb.BidRow(gpus=sorted(gpus), rho=rho) for gpus, rho in table.rows])


def bid(msg: pb.Bid) -> BidTable:
    """The table with each row's GPUs as a tuple, as sent: ``arbiter.auction.validate_bid`` must
    still see a GPU listed twice. :func:`frozen` turns a validated table into sets."""
    return BidTable(msg.rho_old, tuple((tuple(row.gpus), row.rho) for row in msg.rows))


def frozen(table: BidTable) -> BidTable:
    return BidTable(table.rho_old, tuple((frozenset(gpus), rho) for gpus, rho in table.rows))
