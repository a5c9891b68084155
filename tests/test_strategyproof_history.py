"""The one-round benchmark's ``--history arrival`` (benchmarks/strategyproof.py): a measured rank that
kept each app's claim at its arrival raises a B understated now to D31's floor, and leaves a truthful
app's rank as it is. The floor is the slowest job's time, a job's work over its GPUs, so on several
GPUs it takes back only part of what the lie bought (session 24). Real engine, real agents, the benchmark's own cases."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import strategyproof as sp  # noqa: E402

LIE = ("understate-budget", 90)


def holder_case() -> tuple[sp.Case, str]:
    """The first case with a one-job app that holds several GPUs (a holder's measured rho is finite)."""
    for seed in range(20):
        case = sp.make_case(seed)
        for plan in case.apps:
            if plan.kind == "job" and len(plan.held) > 1:
                return case, plan.name
    raise AssertionError("no case with a holder")


def plan_of(case: sp.Case, name: str) -> sp.AppPlan:
    return next(p for p in case.apps if p.name == name)


def rho_of(case: sp.Case, app: str, liar: str | None, history: str) -> tuple[float, float]:
    engine, result, _ = sp.run_round(case, 0, liar, LIE if liar else None, "measured", history=history)
    return result.rho[app], engine.work_floor.get(app, 0.0)


def test_the_arrival_claim_holds_an_understated_budget_to_the_floor_and_spares_the_truthful():
    case, name = holder_case()
    truthful_now, _ = rho_of(case, name, None, "none")
    truthful_then, floor = rho_of(case, name, None, "arrival")
    assert truthful_then == pytest.approx(truthful_now)  # an honest B is above its own arrival floor
    assert floor > 0
    lied_now, _ = rho_of(case, name, name, "none")
    lied_then, lied_floor = rho_of(case, name, name, "arrival")
    assert math.isfinite(lied_now) and lied_now > truthful_now  # the lie ranks it as worse off...
    assert lied_floor == pytest.approx(floor)  # ... its arrival claim said all its work was left ...
    assert truthful_now < lied_then < lied_now  # ... so the floor takes back part of what the lie bought
    assert floor < plan_of(case, name).iterations * plan_of(case, name).iter_time  # a job's time, not its work
