"""Strategy-proofness of contention-aware Themis (D36): lies about contention in one round.

Each case is a round on DeepShare's 4 x 8-GPU testbed (``deepshare-4x8``) with D35's contention on
(the shipped table): 1-4 spread jobs of random classes and shapes already run (and a few one-machine
jobs), the other GPUs are offered to 2-5 apps that hold nothing, each of a random class with one or
two jobs of 2, 4 or 8 GPUs, ranked in a random order, at a fairness knob of 0, 0.5 or 0.8. Offers
carry the neighbourhood, the arbiter charges each row's harm (computed from the app's true class,
which is bound to its model), and ``themis-aware``'s allocation runs as in the simulator.

For each bidder as liar, the lies: pricing contention as each other class would (a heavy
communicator claiming to be light, a light one claiming to be heavy to keep its neighbours away, and
the rest), and not pricing it at all. The liar's *true* expected value, E = P(keep) x V_true(row), is
exact over its own draws: a PF winner keeps its row with probability c_i (D15, D36: c_i includes the
harm it does), a queued app (D9's first tier) takes its best row by value x harm and keeps it with
probability h; V_true is 1 / rho of the row under the liar's true contention. The other apps' draws
are averaged over ``--draws`` round seeds, the same for truth and lie. A lie "pays" when it raises E
by more than 1e-9, and "pays beyond D16" when by more than the auction's quantisation can (a factor
exp(4 n / 1024) for n bidders: weights are rounded to 1/1024 of a log unit). What a loser gets later
(D9's last tier) is not counted: the PA argument prices the auction, and that tier is D26's.

Goal (issue 34): no lie pays in more than 0.5% of cases.
Run ``python benchmarks/contention_lies.py [--cases 100] [--draws 4] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from machine import machine_info, write_results
from rich.console import Console
from rich.table import Table

# Run as a script, this folder comes first on sys.path, and its simulator.py would hide the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from agent.agent import Agent  # noqa: E402
from agent.appsched import FixedJobsApp, JobInfo  # noqa: E402
from agent.contention_pricing import ContentionPricing  # noqa: E402
from arbiter.auction import QUANTUM, row_value  # noqa: E402
from arbiter.cluster import load_cluster  # noqa: E402
from arbiter.contention import FLOOR, Placed, job_ratios, load_table  # noqa: E402
from arbiter.contention_aware import harm_of, neighbourhood_of  # noqa: E402
from arbiter.leftover import best_row, serve_queue  # noqa: E402
from arbiter.policies.base import RoundContext  # noqa: E402
from arbiter.policies.themis import ContentionAwareThemisPolicy, filtered  # noqa: E402
from protos.messages import BidTable, Offer, RhoReport  # noqa: E402

CLUSTER = load_cluster("deepshare-4x8")
TABLE = load_table("deepshare")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "contention_lies.json"
GOAL = 0.005


def sensitivity(cls: str) -> float:
    """How much a class suffers from neighbours: the mean of its rows' cells (lower: heavier)."""
    keys = [k for k in TABLE._ratios if k[0] == cls]
    return statistics.fmean(v for k in keys for v in TABLE._ratios[k].values())


ORDER = sorted(TABLE.classes, key=sensitivity)  # heaviest communicator first


class View:
    """A hand-made :class:`arbiter.policies.base.ContentionView` over the case's running jobs."""

    def __init__(self, running: Mapping[str, Placed], classes: Mapping[str, str]):
        self.running = dict(running)
        self.classes = dict(classes)
        self.ratios = job_ratios(TABLE, self.running)

    def kind(self, app: str) -> str | None:
        return self.classes.get(app)

    def ratio(self, app: str) -> float:
        return 1.0

    def ratio_if(self, app: str, gpus: Iterable[str]) -> float:
        return 1.0

    def neighbourhood(self, app: str, machines: Iterable[str]):
        return neighbourhood_of(self.running.values(), machines)

    def harm(self, app: str, gpus: Iterable[str]) -> float:
        row = Placed.on(self.classes[app], (CLUSTER.position(g)[1] for g in gpus))
        return harm_of(TABLE, row, [(p, self.ratios[j]) for j, p in self.running.items()], FLOOR)


@dataclass
class Case:
    seed: int
    free: list[str]
    running: dict[str, Placed]
    classes: dict[str, str]  # bidder -> true class
    apps: dict[str, FixedJobsApp]
    order: list[str]
    knob: float


def make_case(seed: int) -> Case:
    rng = random.Random(seed)
    machines = sorted(CLUSTER.machines)
    free = {m: list(CLUSTER.machines[m]) for m in machines}
    running: dict[str, Placed] = {}
    for k in range(rng.randint(1, 4)):
        gpus = rng.choice((2, 4, 8))
        spread = rng.choice([n for n in (2, 4) if n <= gpus])
        room = [m for m in machines if len(free[m]) >= gpus // spread]
        if len(room) < spread:
            continue
        taken = []
        for m in rng.sample(room, spread):
            taken += [free[m].pop() for _ in range(gpus // spread)]
        running[f"job{k}"] = Placed.on(rng.choice(ORDER), (CLUSTER.position(g)[1] for g in taken))
    for k in range(rng.randint(0, 2)):  # one-machine jobs: they only take GPUs
        m = rng.choice(machines)
        n = min(len(free[m]), rng.choice((2, 4)))
        if n:
            running[f"one{k}"] = Placed.on(rng.choice(ORDER), [m] * n)
            del free[m][:n]
    offered = sorted(g for m in machines for g in free[m])
    apps, classes = {}, {}
    for a in range(rng.randint(2, 5)):
        jobs = [JobInfo(rng.uniform(2_000, 20_000), 1.0, demand_max=rng.choice((2, 4, 8)), job_id=f"j{j}")
                for j in range(rng.randint(1, 2))]
        apps[f"app{a}"] = FixedJobsApp(jobs)
        classes[f"app{a}"] = rng.choice(ORDER)
    order = list(apps)
    rng.shuffle(order)
    return Case(seed, offered, running, classes, apps, order, rng.choice((0.0, 0.5, 0.8)))


def bids_of(case: Case, view: View, liar: str | None, claim: str | None) -> tuple[dict[str, BidTable], dict]:
    gpus = MappingProxyType({g: CLUSTER.position(g) for g in case.free})
    machines = {p[1] for p in gpus.values()}
    bids, true_rho = {}, {}
    for app in case.order:
        offer = Offer(1, gpus, 0.0, float(len(case.apps)), CLUSTER.size,
                      neighbourhood=view.neighbourhood(app, machines))
        truth = Agent(case.apps[app], name=app, contention=ContentionPricing(TABLE, case.classes[app]))
        bids[app] = truth.bid(offer)
        true_rho[app] = {frozenset(g): rho for g, rho in bids[app].rows}
        if app == liar:
            pricing = None if claim is None else ContentionPricing(TABLE, claim)
            bids[app] = Agent(case.apps[app], name=app, contention=pricing).bid(offer)
    return bids, true_rho


def expected(case: Case, liar: str, bids: Mapping[str, BidTable], true_rho: Mapping, seed: int) -> float:
    """The liar's true E = P(keep) x V_true(row), exact over its own draws (module docstring)."""
    view = View(case.running, case.classes)
    policy = ContentionAwareThemisPolicy(fairness_knob=case.knob)
    policy.contention = view
    demand = {a: case.apps[a].demand_now() for a in case.apps}
    ctx = RoundContext(round_id=1, now=0.0, free=frozenset(case.free), unmet=demand,
                       held={a: frozenset() for a in case.apps}, position=CLUSTER.position,
                       rng=random.Random(seed), seed=seed,
                       reports={a: RhoReport(math.inf, demand[a]) for a in case.apps},
                       offered=tuple(case.order), ranked=len(case.order), round_seed=str(seed))
    decision = policy.allocate(ctx, bids)
    outcome = decision.auction

    def value(gpus: frozenset[str]) -> float:
        return row_value(true_rho[liar][gpus], math.inf)

    if outcome is not None and liar in outcome.pf:
        return outcome.hidden_payment[liar] * value(outcome.pf[liar])
    stage = set(case.order[: filtered(len(case.order), case.knob)])
    contended = set(outcome.contenders) if outcome else set()
    queued = [a for a in case.order if a in bids and a not in contended]
    if liar in stage & contended or liar not in queued:
        return 0.0
    harm = policy._harms(bids)
    unmet = {a: n - len(outcome.granted.get(a, ())) for a, n in demand.items()}
    before = queued[: queued.index(liar)]
    first = serve_queue(outcome.leftover, before, unmet, bids, harm=harm, seed=seed)
    left = set(outcome.leftover) - set().union(*first.values()) if first else set(outcome.leftover)
    row = best_row(bids[liar], left, unmet[liar], harm[liar])
    if row is None:
        return 0.0
    h = next(harm[liar][k] for k, (g, _) in enumerate(bids[liar].rows) if frozenset(g) == row)
    return h * value(row)


def kind_of_lie(true: str, claim: str | None) -> str:
    if claim is None:
        return "prices no contention"
    return "heavier claims lighter" if ORDER.index(claim) > ORDER.index(true) else "lighter claims heavier"


def study(case: Case, draws: int) -> list[dict[str, Any]]:
    view = View(case.running, case.classes)
    out = []
    for liar in case.order:
        truth_bids, true_rho = bids_of(case, view, None, None)
        truth = statistics.fmean(expected(case, liar, truth_bids, true_rho, s) for s in range(draws))
        for claim in [c for c in ORDER if c != case.classes[liar]] + [None]:
            bids, _ = bids_of(case, view, liar, claim)
            lie = statistics.fmean(expected(case, liar, bids, true_rho, s) for s in range(draws))
            slack = math.exp(4 * len(case.order) / QUANTUM)
            out.append({"case": case.seed, "liar": liar, "true": case.classes[liar], "claim": claim,
                        "kind": kind_of_lie(case.classes[liar], claim), "truth": truth, "lie": lie,
                        "pays": lie > truth * (1 + 1e-9) + 1e-12, "changes": abs(lie - truth) > 1e-9 * max(truth, 1e-12), "pays_beyond_d16": lie > truth * slack + 1e-12,
                        "gain": lie / truth - 1 if truth > 0 else (math.inf if lie > 0 else 0.0)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=100)
    p.add_argument("--draws", type=int, default=4)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    t0, cpu0 = time.perf_counter(), time.process_time()
    rows = [r for seed in range(args.cases) for r in study(make_case(seed), args.draws)]
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    summary = {}
    table = Table(title=f"contention lies (D36): {args.cases} cases, {args.draws} draws each")
    for col in ("lie", "tries", "changes E", "pays", "pays beyond D16", "worst gain"):
        table.add_column(col, justify="right")
    for kind in sorted({r["kind"] for r in rows}) + ["all"]:
        rs = [r for r in rows if kind in ("all", r["kind"])]
        paid = [r for r in rs if r["pays"]]
        beyond = [r for r in rs if r["pays_beyond_d16"]]
        worst = max((r["gain"] for r in paid), default=0.0)
        moved = sum(r["changes"] for r in rs) / len(rs)
        summary[kind] = {"tries": len(rs), "changes": moved, "pays": len(paid) / len(rs),
                         "pays_beyond_d16": len(beyond) / len(rs), "worst_gain": worst}
        table.add_row(kind, str(len(rs)), f"{100 * moved:.1f}%", f"{100 * len(paid) / len(rs):.2f}%", f"{100 * len(beyond) / len(rs):.2f}%",
                      f"{100 * worst:+.2f}%")
    Console().print(table)
    goal = summary["all"]["pays"] <= GOAL
    Console().print(f"goal: no lie pays in more than {100 * GOAL:.1f}% of cases: {'met' if goal else 'missed'} "
                    f"({wall:.0f} s wall, {cpu:.0f} s CPU)")
    write_results(args.out, {"benchmark": "contention_lies", "cases": args.cases, "draws": args.draws,
                             "goal": GOAL, "goal_met": goal, "summary": summary, "wall_s": wall, "cpu_s": cpu,
                             "machine": machine_info(), "rows_that_changed_e": [r for r in rows if r["changes"]]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
