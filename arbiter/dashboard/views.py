"""The round engine's values as the dashboard's views: the layout of a ``Cluster``, a ``RoundResult``
with its ``AuctionOutcome`` as a :class:`RoundView`, a round's events, a fairness point.

Pure functions of what the engine already returns, so the live arbiter and the simulator build the
same views from the same round (the simulator records them, ``arbiter.dashboard.recording``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from functools import lru_cache

from arbiter.cluster import Cluster
from arbiter.dashboard.model import (
    ClusterLayout,
    Contender,
    EventView,
    FairnessPoint,
    FairnessSeries,
    GpuPlace,
    LeaseView,
    Placed,
    Ranked,
    RoundView,
)
from arbiter.leases import Lease
from arbiter.rounds import RoundResult

#: why each tier placed GPUs, in an event's words (D8, D9, D14, D15, D26)
TIER_REASONS = {
    "auction": "won its lottery in the auction (draw < c_i)",
    "queue": "its own bid row, in rank order, from what the auction left (D9, D14)",
    "leftover": "left over, handed out in rank order (D9, D26)",
    "policy": "the policy's own order",
}
TOP_APPS = 10  # apps drawn apart in the GPUs-per-app chart; the rest are "others"


@lru_cache(maxsize=1 << 16)
def natural(name: str) -> tuple:
    """Sort key that puts r2-m9-g1 before r10-m40-g0 (numbers by value)."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _gpus(gpus: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted(gpus, key=natural))


def layout_of(cluster: Cluster, drained: Iterable[str] = ()) -> ClusterLayout:
    gpus = tuple(GpuPlace(g, cluster.gpus[g].rack, cluster.gpus[g].machine, cluster.gpus[g].slot)
                 for g in cluster.gpu_ids)
    return ClusterLayout(cluster.name, gpus, tuple(sorted(drained)))


def lease_view(lease: Lease) -> LeaseView:
    return LeaseView(lease.app, lease.expires_at, lease.granted_at, lease.round_id)


def rank_order(result: RoundResult, rho_wait: Mapping[str, float] | None = None) -> list[str]:
    """The apps that reported, worst off first (D13): the offered apps in the policy's order, then
    the others by rho, those at infinity by waiting rho, then by name."""
    waits = rho_wait or {}
    offered = [a for a in result.bidders if a in result.rho]
    rest = [a for a in result.rho if a not in set(offered)]

    def key(app: str) -> tuple[float, float, str]:
        rho = result.rho[app]
        return (-rho, -(waits.get(app, 0.0) if math.isinf(rho) else 0.0), app)

    return offered + sorted(rest, key=key)


def round_view(result: RoundResult, *, trigger: str = "", policy: str = "", silent: Iterable[str] | None = None,
               rho_wait: Mapping[str, float] | None = None) -> RoundView:
    """A closed round as the page shows it. ``silent``: the offered apps that sent no valid bid (the
    engine's ``silent`` right after the round, D22); without it an offered app counts as having bid
    unless its bid was refused. ``rho_wait``: the waiting rho of apps that reported infinity (D13),
    when the caller has their reports."""
    offered = set(result.bidders)
    quiet = set(silent) if silent is not None else {a for a in offered if a in result.rejected}
    waits = rho_wait or {}
    ranked = tuple(
        Ranked(app, float(result.rho[app]), waits.get(app) if math.isinf(result.rho[app]) else None,
               int(result.unmet.get(app, 0)), app in offered, app in offered and app not in quiet)
        for app in rank_order(result, waits)
    )
    outcome = result.decision.auction if result.decision is not None else None
    contenders: tuple[Contender, ...] = ()
    left: tuple[str, ...] = ()
    canonical = True
    if outcome is not None:
        draws = getattr(outcome, "draws", {}) or {}
        contenders = tuple(
            Contender(
                app,
                admitted=app in outcome.admitted,
                shadow=app in outcome.shadows,
                pf_row=_gpus(outcome.pf.get(app, ())),
                pf_rho=outcome.pf_rho.get(app),
                c=outcome.hidden_payment.get(app) if app in outcome.pf else None,
                draw=draws.get(app),
                won=app in outcome.granted,
                c_bounds=outcome.payment_bounds.get(app),
            )
            for app in outcome.contenders
        )
        left = _gpus(outcome.leftover)
        canonical = outcome.canonical
    placed = tuple(Placed(g.app, g.source, _gpus(g.gpus), g.expires_at) for g in result.grants)
    return RoundView(
        round_id=result.round_id,
        now=result.now,
        trigger=trigger,
        policy=policy,
        offered=_gpus(result.offered),
        ranked=ranked,
        contenders=contenders,
        placed=placed,
        auction_left=left,
        idle=_gpus(result.idle),
        expired=tuple((x.gpu, x.app) for x in result.expired),
        reclaimed=tuple((x.gpu, x.app) for x in result.reclaimed),
        waiting=tuple(result.waiting),
        refused=dict(result.rejected),
        seed=result.seed,
        commitment=result.commitment,
        canonical=canonical,
    )


def round_events(view: RoundView) -> list[EventView]:
    """What a round did to each app, as events: leases that ran out, leases ended early (D27),
    refused reports and bids with their reasons, grants with the tier that placed them."""
    out: list[EventView] = []
    reclaimed = {gpu for gpu, _ in view.reclaimed}
    for kind, pairs, reason in (
        ("expiry", [(g, a) for g, a in view.expired if g not in reclaimed], "lease ran out"),
        ("revocation", list(view.reclaimed),
         "held beyond its fair share while an app holding nothing waited (D27)"),
    ):
        by_app: dict[str, list[str]] = {}
        for gpu, app in pairs:
            by_app.setdefault(app, []).append(gpu)
        out.extend(EventView(0, view.now, kind, app, view.round_id, _gpus(g), reason)
                   for app, g in sorted(by_app.items()))
    out.extend(EventView(0, view.now, "refusal", app, view.round_id, (), reason)
               for app, reason in sorted(view.refused.items()))
    out.extend(EventView(0, view.now, "grant", p.app, view.round_id, p.gpus, TIER_REASONS.get(p.tier, p.tier))
               for p in view.placed)
    return out


def fairness_point(round_id: int, t: float, rho: Mapping[str, float], held: Mapping[str, int],
                   cluster_size: int) -> FairnessPoint:
    """The cluster after a round: max, p99 (nearest rank) and Jain's index of the apps' finite rho,
    how many apps held nothing (rho infinite), and the share of GPUs leased."""
    finite = sorted(r for r in rho.values() if math.isfinite(r))
    starving = sum(1 for r in rho.values() if math.isinf(r))
    if finite:
        p99 = finite[max(0, math.ceil(0.99 * len(finite)) - 1)]
        squares = sum(r * r for r in finite)
        jain = sum(finite) ** 2 / (len(finite) * squares) if squares > 0 else None
        top = finite[-1]
    else:
        p99 = jain = top = None
    used = sum(held.values())
    return FairnessPoint(round_id, t, top, p99, jain, starving, used / cluster_size if cluster_size else 0.0,
                         {a: n for a, n in held.items() if n})


def fairness_series(points: list[FairnessPoint], limit: int, top: int = TOP_APPS) -> FairnessSeries:
    """At most ``limit`` of ``points``, evenly thinned with the latest kept; the GPUs of the ``top``
    apps that held the most GPU-rounds over the shown points, the rest summed as others."""
    if limit < 1:
        raise ValueError(f"points must be at least 1, got {limit}")
    if len(points) > limit:
        step = len(points) / limit
        chosen = [points[min(len(points) - 1, math.floor(k * step))] for k in range(limit - 1)] + [points[-1]]
    else:
        chosen = points
    totals: dict[str, int] = {}
    for p in chosen:
        for app, n in p.gpus.items():
            totals[app] = totals.get(app, 0) + n
    apps = tuple(sorted(totals, key=lambda a: (-totals[a], a))[:top])
    rows = [tuple(p.gpus.get(a, 0) for p in chosen) for a in apps]
    named = set(apps)
    rows.append(tuple(sum(n for a, n in p.gpus.items() if a not in named) for p in chosen))
    return FairnessSeries(
        round_id=tuple(p.round_id for p in chosen),
        t=tuple(p.t for p in chosen),
        max_rho=tuple(p.max_rho for p in chosen),
        p99_rho=tuple(p.p99_rho for p in chosen),
        jain=tuple(p.jain for p in chosen),
        starving=tuple(p.starving for p in chosen),
        utilisation=tuple(p.utilisation for p in chosen),
        apps=apps,
        gpus=tuple(rows),
    )
