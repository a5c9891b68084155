"""Does lying pay in one Themis round? A strategy-proofness benchmark (issue 10 item 6; D12, D15).

Each case is one realistic round on ``sim-256``: 4-12 apps of models from the shipped profile table
(single jobs and successive-halving searches, some holding GPUs and some not, part-way through
their work), a fragmented set of 8-64 free GPUs, the rest of the cluster busy. Agents report and
bid with the real code (``agent.agent.Agent``); the round runs through the real engine and policy
(``arbiter.rounds.RoundEngine`` with ``themis``: rank, filter, auction, lottery, leftover).

For each liar (up to three apps per case) and each lie -- every strategy of
``simulator/strategic.py`` at a few sizes, which covers scaling the rows' rho by 0.5-1.5, inflating
rho_old, hiding rows, only the biggest rows, only 1-GPU rows, reporting infinity, sending no
bid, and the work claim's own numbers (its total work B, its demand_max, its stated demand) -- the liar's *true* expected utility after the round, E[1/rho(what it holds then)] computed
with its true app, is compared with what telling the truth gives. The expectation is exact over the liar's own lottery
draw and the other winners' (D15, D38: the round is run once for each set of rows the lottery can
keep -- for D38's lottery, each piece of its shared draw u on which the winners are the same --
weighted by its probability) and averaged over ``--draws`` seeds for everything else (ties in the
rank, the other draws of the round), with the same seeds for truth and lie. ``--lottery
independent`` measures the lottery before D38 (a draw of its own per winner) the same way, over
its 2^m outcomes. A lie "pays" when it raises that expectation by more than 1e-9.

Every lie is tried under both ranks of D21: the liar ranked by the rho it reports (``reported``, the
paper's rank, and the service's for an app bound to no model) and by the rho the arbiter computes
from its claimed work at its model's slowdowns (``measured``, the service's for an app bound to a
model); truthful apps rank the same either way.

    python benchmarks/strategyproof.py [--cases 60] [--draws 4] [--workers 2] [--ranks reported,measured]
        [--lottery rotated|independent] [--min-bidders 1|2] [--out FILE]

Prints a table per rank and writes JSON (``benchmarks/results/strategyproof.json`` by default).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from machine import machine_info
from offers import fragmented_free
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

# Run as a script, this folder comes first on sys.path, and its simulator.py would hide the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import arbiter.auction as auction  # noqa: E402
import arbiter.lottery as lottery  # noqa: E402
from agent.agent import Agent  # noqa: E402
from agent.appsched import AppScheduler, JobInfo, SingleJobApp, SuccessiveHalvingApp  # noqa: E402
from agent.fairness import finish_time_fairness  # noqa: E402
from agent.placement import load_profiles  # noqa: E402
from arbiter.cluster import load_cluster  # noqa: E402
from arbiter.policies import make_policy  # noqa: E402
from arbiter.rank import RANKS, check_claim, check_rank, work_left_floor  # noqa: E402
from arbiter.rounds import WORK, RoundEngine  # noqa: E402
from protos.messages import RhoRequest  # noqa: E402
from simulator.strategic import StrategicAgent, make_strategy  # noqa: E402

CLUSTER = "sim-256"
NOW = 4 * 3600.0
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "strategyproof.json"
LIES: list[tuple[str, float]] = [
    ("overreport-spread", 25), ("overreport-spread", 50), ("overreport-spread", 100),
    ("underreport-dense", 25), ("underreport-dense", 50),
    ("misreport-work", 25), ("misreport-work", 100),
    ("hide-rows", 25), ("hide-rows", 50), ("hide-rows", 75),
    ("noisy", 10), ("noisy", 20),
    ("understate-rho", 10), ("understate-rho", 25), ("understate-rho", 50),
    ("overstate-rho", 10), ("overstate-rho", 25), ("overstate-rho", 50),
    ("inflate-rho-old", 20), ("inflate-rho-old", 50), ("inflate-rho-old", 200),
    ("biggest-rows", 0), ("single-gpu-rows", 0), ("report-inf", 0),
    ("withhold-bid", 0),
    ("understate-budget", 50), ("understate-budget", 90), ("understate-work", 90),
    ("overstate-demand-max", 100), ("overstate-demand-max", 300), ("overstate-demand", 100),
]


@dataclass(frozen=True)
class AppPlan:
    """How to build one app of a case afresh (apps are mutable, so every run gets new ones)."""

    name: str
    model: str
    kind: str  # "job" or "halving"
    jobs: int
    demand: int
    iter_time: float
    iterations: float
    done: float  # share of its work done by NOW
    held: tuple[str, ...]

    def build(self) -> AppScheduler:
        slowdown = load_profiles()[self.model].slowdown
        if self.kind == "job":
            app: AppScheduler = SingleJobApp(JobInfo(self.iterations, self.iter_time, slowdown, self.demand, "job0"))
            app.advance("job0", self.done * self.iterations)
            return app
        phases = max(1, self.jobs.bit_length())
        app = SuccessiveHalvingApp([self.iter_time * (1 + 0.1 * k) for k in range(self.jobs)],
                                   [self.iterations] * phases, job_demand_max=self.demand, slowdown=slowdown,
                                   grow_demand=True)
        for job in app.phase_jobs():
            app.advance(job, self.done * self.iterations)
        return app


@dataclass(frozen=True)
class Case:
    seed: int
    free: frozenset[str]
    apps: tuple[AppPlan, ...]


def make_case(seed: int) -> Case:
    rng = random.Random(f"strategyproof:{seed}")
    cluster = load_cluster(CLUSTER)
    models = sorted(load_profiles())
    free = fragmented_free(cluster, rng.choice([8, 16, 32, 64]), rng)
    busy = [g for g in sorted(cluster.gpu_ids) if g not in free]
    rng.shuffle(busy)
    plans = []
    for k in range(rng.randint(4, 12)):
        kind = rng.choice(["job", "halving"])
        jobs = 1 if kind == "job" else rng.choice([2, 4, 8])
        demand = rng.choice([1, 2, 4, 8, 16]) if kind == "job" else rng.choice([1, 2, 4])
        holds = rng.random() < 0.5
        n_held = min(len(busy), rng.randint(1, max(1, jobs * demand - 1))) if holds and jobs * demand > 1 else 0
        held = tuple(sorted(busy[:n_held]))
        busy = busy[n_held:]
        plans.append(AppPlan(f"app{k}", rng.choice(models), kind, jobs, demand, rng.uniform(0.2, 2.0),
                             rng.uniform(2_000, 40_000), rng.uniform(0.0, 0.6), held))
    return Case(seed, free, tuple(plans))


@contextmanager
def forced_outcome(kept: frozenset[str]) -> Iterator[None]:
    """The auction's lottery made to keep exactly the rows of ``kept`` (D15): their draws are 0, every
    other winner's is above its c_i."""
    original = auction.auction_draws
    auction.auction_draws = lambda seed, apps: {a: 0.0 if a in kept else 1.0 - 1e-12 for a in sorted(apps)}
    try:
        yield
    finally:
        auction.auction_draws = original


def lottery_outcomes(c: dict[str, float], kind: str = "rotated") -> list[tuple[frozenset[str], float]]:
    """Every set of rows the auction's lottery can keep, with its probability, exactly: D38's pieces
    of the shared draw u (``rotated``, pieces with the same winners merged), or the 2^m outcomes of
    independent draws for the m winners with 0 < c_i < 1 (``independent``, the lottery before D38)."""
    if kind == "independent":
        sure = frozenset(a for a in c if c[a] >= 1.0)
        torn = sorted(a for a in c if 0.0 < c[a] < 1.0)
        return [(sure | frozenset(a for a, k in zip(torn, bits) if k),
                 math.prod(c[a] if k else 1.0 - c[a] for a, k in zip(torn, bits)))
                for bits in itertools.product((0, 1), repeat=len(torn))]
    merged: dict[frozenset[str], float] = {}
    for u, w in lottery.cells(c):
        draws = lottery.rotated_draws(u, c)
        kept = frozenset(a for a in c if draws[a] < c[a])
        merged[kept] = merged.get(kept, 0.0) + w
    return list(merged.items())


def run_round(case: Case, seed: int, liar: str | None = None, lie: tuple[str, float] | None = None,
              rank: str = "reported", min_bidders: int = 1, history: str = "none"):
    """One round of the case; returns (engine, result, true apps). ``history="arrival"`` gives a
    measured rank what a live arbiter would have kept from each app's claim at its arrival (D31's
    floor on B), the only history the case's made-up past is consistent with."""
    cluster = load_cluster(CLUSTER)
    # reclaim=False: the "busy" app stands for the rest of the cluster, not an app above its share
    # whose leases D27 would end; which GPUs are free is the case's design
    engine = RoundEngine(cluster, make_policy("themis", min_bidders=min_bidders), lease_s=600, expiry_window_s=0, coalesce_s=0, seed=seed,
                         rank=rank, reclaim=False)
    apps = {p.name: p.build() for p in case.apps}
    engine.add_app("busy", 0.0)
    engine.set_demand("busy", 0, 0.0)
    profiles = load_profiles()
    for p in case.apps:
        engine.add_app(p.name, 0.0, slowdown=profiles[p.model].slowdown)
    held = {g for p in case.apps for g in p.held}
    engine.leases.grant("busy", [g for g in cluster.gpu_ids if g not in case.free and g not in held],
                        now=0.0, expires_at=NOW * 10, round_id=0)
    for p in case.apps:
        if p.held:
            engine.leases.grant(p.name, p.held, now=0.0, expires_at=NOW * 10, round_id=0)
    agents: dict[str, Agent] = {}
    for name, app in apps.items():
        agents[name] = _agent(app, name, seed, liar, lie)
    if history == "arrival" and rank == "measured":
        for p in case.apps:
            fresh = replace(p, done=0.0).build()
            held = {g: cluster.position(g) for g in p.held}
            asked = RhoRequest(0, p.name, 0.0, float(len(case.apps) + 1), cluster.size, held, WORK)
            claim = _agent(fresh, p.name, seed, liar, lie).report(asked).work
            checked = check_claim(claim, len(held), cluster.locality(held) if held else 0)
            engine.work_floor[p.name] = work_left_floor(checked)
    result = engine.run_round(NOW, {**agents, "busy": _Idle()})
    return engine, result, apps


def _agent(app: AppScheduler, name: str, seed: int, liar: str | None, lie: tuple[str, float] | None) -> Agent:
    if name == liar and lie is not None:
        return StrategicAgent(app, make_strategy(lie[0], lie[1], seed=f"{seed}:{name}"), name)
    return Agent(app, name=name)


class _Idle:
    def report(self, request):  # never asked: it wants nothing more
        raise AssertionError("the busy app has no unmet demand")

    def bid(self, offer):
        raise AssertionError("the busy app has no unmet demand")


def utility(case: Case, liar: str, draws: int, lie: tuple[str, float] | None,
            rank: str = "reported", kind: str = "rotated", min_bidders: int = 1,
            history: str = "none") -> tuple[float, tuple]:
    """E[1/rho] of what the liar holds after the round, exact over the auction's lottery (D15, D38), and where
    the round's rank put the liar (its place among the offered apps, and whether it bid in the
    auction): a lie can pay through the rank (step 1), which the auction does not see."""
    total = 0.0
    place: tuple = ()
    for seed in range(draws):
        engine, result, apps = run_round(case, seed, liar, lie, rank, min_bidders, history)
        if seed == 0:
            auction_ = result.decision.auction if result.decision else None
            place = (result.bidders.index(liar) if liar in result.bidders else None,
                     bool(auction_ and liar in auction_.contenders))
        outcome = result.decision.auction if result.decision is not None else None
        c = {a: outcome.hidden_payment[a] for a in outcome.pf} if outcome else {}
        outcomes = lottery_outcomes(c, kind)
        if len(outcomes) <= 1:
            total += _value(engine, apps[liar], liar)
            continue
        for kept, weight in outcomes:
            with forced_outcome(kept):
                engine, _, apps = run_round(case, seed, liar, lie, rank, min_bidders, history)
            total += weight * _value(engine, apps[liar], liar)
    return total / draws, place


def _value(engine: RoundEngine, app: AppScheduler, name: str) -> float:
    cluster = engine.cluster
    positions = [cluster.position(g) for g in sorted(engine.held(name))]
    rho = finish_time_fairness(app, positions, now=NOW, n_avg=engine.n_avg(name, NOW), cluster_size=cluster.size)
    return 0.0 if math.isinf(rho) else 1.0 / rho


def study_case(args: tuple[int, int, int, tuple[str, ...], str, int, str]) -> list[dict[str, Any]]:
    seed, draws, liars, ranks, kind, min_bidders, history = args
    case = make_case(seed)
    rng = random.Random(f"liars:{seed}")
    chosen = rng.sample([p.name for p in case.apps], min(liars, len(case.apps)))
    rows = []
    for liar in chosen:
        holds = any(p.held for p in case.apps if p.name == liar)
        for rank in ranks:
            truth, place = utility(case, liar, draws, None, rank, kind, min_bidders, history)
            for lie in LIES:
                lied, lie_place = utility(case, liar, draws, lie, rank, kind, min_bidders, history)
                gain = (lied - truth) / truth if truth > 0 else (math.inf if lied > 0 else 0.0)
                rows.append({"case": seed, "liar": liar, "holds": holds, "lie": f"{lie[0]} {lie[1]:g}".strip(),
                             "rank": rank, "truth": truth, "lied": lied, "gain": gain,
                             "rank_moved": lie_place != place})
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for lie in dict.fromkeys(r["lie"] for r in rows):
        mine = [r for r in rows if r["lie"] == lie]
        paying = [r["gain"] for r in mine if r["lied"] > r["truth"] + 1e-9]
        same_rank = [r["gain"] for r in mine if r["lied"] > r["truth"] + 1e-9 and not r["rank_moved"]]
        finite = [g for g in paying if math.isfinite(g)]
        out[lie] = {"cases": len(mine), "pays": len(paying), "share_pays": len(paying) / len(mine),
                    "mean_gain": statistics.fmean(finite) if finite else 0.0,
                    "max_gain": max(paying) if paying else 0.0,
                    "pays_over_1pct": sum(1 for g in paying if g > 0.01) / len(mine),
                    "rank_moved": sum(1 for r in mine if r["rank_moved"]) / len(mine),
                    "pays_same_rank": len(same_rank) / len(mine),
                    "max_gain_same_rank": max(same_rank) if same_rank else 0.0}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=60)
    parser.add_argument("--draws", type=int, default=4, help="seeds for the randomness other than the liar's draw")
    parser.add_argument("--liars", type=int, default=3, help="liars tried per case")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="12 cases, 2 draws")
    parser.add_argument("--ranks", default=",".join(RANKS),
                        help="comma-separated: where the liar's rank comes from (D21)")
    parser.add_argument("--lottery", choices=("rotated", "independent"), default="rotated",
                        help="the auction's lottery: D38's (the code's) or independent draws (before D38), "
                             "either exact over its outcomes")
    parser.add_argument("--min-bidders", type=int, default=1,
                        help="the policy's least number of bidders (D41's option: 2; default %(default)s, D6)")
    parser.add_argument("--history", choices=("none", "arrival"), default="none",
                        help="what a measured rank knows of the apps' past: nothing (one round alone), or "
                             "each app's work claim at its arrival (D31's floor on B), as a live arbiter would")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.cases, args.draws = 12, 2
    ranks = tuple(r.strip() for r in args.ranks.split(",") if r.strip())
    for rank in ranks:
        check_rank(rank)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    jobs = [(seed, args.draws, args.liars, ranks, args.lottery, args.min_bidders, args.history)
            for seed in range(args.cases)]
    with Progress(TextColumn("cases"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("cases", total=len(jobs))
        with ProcessPoolExecutor(args.workers) as pool:
            for part in pool.map(study_case, jobs):
                rows.extend(part)
                bar.advance(task)

    def pct(x: float) -> str:
        return f"{x:+.2%}" if math.isfinite(x) else "inf"

    summaries: dict[str, Any] = {}
    for rank in ranks:
        mine = [r for r in rows if r["rank"] == rank]
        summary = summaries[rank] = summarize(mine)
        table = Table(title=f"Does lying pay? {args.cases} rounds on {CLUSTER}, {len(mine) // len(LIES)} liars, "
                            f"{rank} rank (D21), exact over the auction's lottery, {args.draws} draws otherwise")
        for col in ("lie", "cases", "pays", "share", "> 1%", "mean gain", "max gain", "rank moved",
                    "pays, same rank", "max, same rank"):
            table.add_column(col, justify="right")
        for lie, s in summary.items():
            table.add_row(lie, str(s["cases"]), str(s["pays"]), f"{s['share_pays']:.1%}", f"{s['pays_over_1pct']:.1%}",
                          pct(s["mean_gain"]), pct(s["max_gain"]), f"{s['rank_moved']:.1%}",
                          f"{s['pays_same_rank']:.1%}", pct(s["max_gain_same_rank"]))
        paying = [r for r in mine if r["lied"] > r["truth"] + 1e-9]
        same = [r for r in paying if not r["rank_moved"]]
        table.add_row("[b]all lies", str(len(mine)), str(len(paying)), f"{len(paying) / len(mine):.1%}", "", "",
                      pct(max((r["gain"] for r in paying), default=0.0)), "", f"{len(same) / len(mine):.1%}",
                      pct(max((r["gain"] for r in same), default=0.0)))
        Console(width=160).print(table)
    result = {"machine": machine_info(), "cases": args.cases, "draws": args.draws, "liars_per_case": args.liars,
              "lottery": args.lottery, **({"min_bidders": args.min_bidders} if args.min_bidders != 1 else {}),
              **({"history": args.history} if args.history != "none" else {}),
              "wall_seconds": time.perf_counter() - started, "ranks": list(ranks),
              "summary": summaries.get("reported", {}), "summary_by_rank": summaries,
              "paying": [r for r in rows if r["lied"] > r["truth"] + 1e-9]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    Console(stderr=True).print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
