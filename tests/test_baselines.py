"""The paper's baselines (6.1) as policies: each one's ordering rule by hand, the rules they all
share (only free GPUs, at most the unmet demand, work conserving), and the engine driving them."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import replace

import pytest

from arbiter.cluster import Cluster, load_cluster
from arbiter.policies import POLICIES, Decision, RoundContext, make_policy
from arbiter.policies.greedy import GreedyPolicy
from arbiter.rounds import RoundEngine
from protos.messages import RhoReport

BASELINES = ("gandiva", "tiresias", "optimus", "slaq", "fifo", "drf")
TESTBED = load_cluster("testbed-64")


def context(
    cluster: Cluster,
    unmet: Mapping[str, int],
    *,
    free=None,
    reports: Mapping[str, RhoReport] | None = None,
    held: Mapping[str, frozenset[str]] | None = None,
    attained: Mapping[str, float] | None = None,
    arrived: Mapping[str, float] | None = None,
) -> RoundContext:
    return RoundContext(
        round_id=1,
        now=100.0,
        free=frozenset(cluster.gpus if free is None else free),
        unmet=dict(unmet),
        held=dict(held or {}),
        position=cluster.position,
        rng=random.Random(0),
        seed=0,
        reports=dict(reports or {}),
        attained=dict(attained or {}),
        arrived=dict(arrived if arrived is not None else {app: 0.0 for app in unmet}),
    )


def counts(decision: Decision) -> dict[str, int]:
    return {app: len(gpus) for app, gpus in decision.granted.items() if gpus}


def report(**kw) -> RhoReport:
    return RhoReport(kw.pop("rho", 1.0), kw.pop("demand", 1), **kw)


def test_every_baseline_is_registered_makes_no_offers_and_takes_no_options():
    ctx = context(TESTBED, {"a": 1})
    for name in BASELINES:
        policy = make_policy(name)
        assert POLICIES[name] is type(policy) and policy.name == name
        assert policy.bidders({"a": 2.0}, ctx) == []
        with pytest.raises(TypeError):
            make_policy(name, fairness_knob=0.8)


# -- each ordering rule --------------------------------------------------------------------------

FOUR = TESTBED.subcluster(["r0-m4"])  # one machine of 4 GPUs


def test_tiresias_serves_least_attained_service_first():
    ctx = context(FOUR, {"a": 2, "b": 2, "c": 2}, attained={"a": 500.0, "b": 10.0, "c": 90.0})
    policy = make_policy("tiresias")
    assert policy.order(ctx) == ["b", "c", "a"]
    assert counts(policy.allocate(ctx, {})) == {"b": 2, "c": 2}


def test_optimus_serves_shortest_remaining_time_first_and_unknown_last():
    reports = {
        "a": report(remaining_s=300.0),
        "b": report(remaining_s=math.inf),
        "c": report(remaining_s=20.0),
        "d": report(remaining_s=float("nan")),
    }
    ctx = context(FOUR, {"a": 2, "b": 2, "c": 2, "d": 2}, reports=reports, arrived={"a": 3, "b": 0, "c": 1, "d": 2})
    policy = make_policy("optimus")
    assert policy.order(ctx) == ["c", "a", "b", "d"]  # b and d both last: by arrival
    assert counts(policy.allocate(ctx, {})) == {"c": 2, "a": 2}


def test_slaq_serves_largest_loss_decrease_first():
    reports = {"a": report(loss_decrease=0.1), "b": report(loss_decrease=5.0), "c": report(loss_decrease=0.7)}
    ctx = context(FOUR, {"a": 2, "b": 2, "c": 2}, reports=reports)
    policy = make_policy("slaq")
    assert policy.order(ctx) == ["b", "c", "a"]
    assert counts(policy.allocate(ctx, {})) == {"b": 2, "c": 2}


def test_fifo_serves_earliest_arrival_first():
    ctx = context(FOUR, {"a": 2, "b": 2, "c": 2}, arrived={"a": 50.0, "b": 70.0, "c": 5.0})
    policy = make_policy("fifo")
    assert policy.order(ctx) == ["c", "a", "b"]
    assert counts(policy.allocate(ctx, {})) == {"c": 2, "a": 2}


def test_gandiva_serves_the_most_spread_sensitive_first_level_by_level():
    reports = {
        "flat": report(slowdown=(1.0, 1.0, 1.0, 1.0)),
        "rack": report(slowdown=(1.0, 1.1, 1.5, 2.0)),
        "machine": report(slowdown=(1.0, 1.3, 1.4, 2.0)),  # same S[3] as rack, less at rack level
        "cluster": report(slowdown=(1.0, 1.0, 1.0, 3.0)),
    }
    ctx = context(FOUR, {app: 1 for app in reports}, reports=reports)
    assert make_policy("gandiva").order(ctx) == ["cluster", "rack", "machine", "flat"]


def test_ties_break_by_arrival_then_name_for_every_greedy_baseline():
    ctx = context(FOUR, {"b": 1, "a": 1, "c": 1}, arrived={"a": 9.0, "b": 9.0, "c": 1.0})
    for name in ("gandiva", "tiresias", "optimus", "slaq", "fifo"):
        policy = make_policy(name)
        assert isinstance(policy, GreedyPolicy)
        assert policy.order(ctx) == ["c", "a", "b"], name


def test_gandiva_gives_the_most_placement_sensitive_app_the_consolidated_machine():
    # free: one 4-GPU machine and two 2-GPU machines; two apps each want 4
    cluster = TESTBED.subcluster(["r0-m0", "r0-m1", "r0-m4"])
    reports = {
        "sensitive": report(slowdown=(1.0, 1.0, 1.6, 2.5)),
        "tolerant": report(slowdown=(1.0, 1.0, 1.05, 1.1)),
    }
    # the tolerant app arrived first and is named first, so only the preference can put sensitive first
    ctx = context(cluster, {"tolerant": 4, "sensitive": 4}, reports=reports, arrived={"tolerant": 0, "sensitive": 5})
    granted = make_policy("gandiva").allocate(ctx, {}).granted
    assert granted["sensitive"] == frozenset(cluster.machines["r0-m4"])
    assert cluster.locality(granted["sensitive"]) == 1
    assert cluster.locality(granted["tolerant"]) == 2  # what is left: two machines of one rack
    fifo = make_policy("fifo").allocate(ctx, {}).granted
    assert fifo["tolerant"] == frozenset(cluster.machines["r0-m4"])  # the contrast: arrival order


# -- drf ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", BASELINES)
def test_every_baseline_gives_an_app_its_previous_gpus_first(policy):
    """D10: after its lease runs out an app that gets GPUs again gets its own back (no restart,
    D11) when they are free; DRF placed it by locality alone and moved it."""
    prev = frozenset(sorted(TESTBED.machines["r0-m4"])[-1:])
    ctx = replace(context(TESTBED, {"a": 1}, reports={"a": report(rho=2.0, demand=1, remaining_s=100.0)}),
                  previous={"a": prev})
    assert make_policy(policy).allocate(ctx, {}).granted["a"] == prev


def test_drf_fills_the_app_holding_fewest_until_counts_are_equal():
    cluster = TESTBED.subcluster(["r0-m0", "r0-m1", "r0-m4", "r0-m5"])  # 12 GPUs
    held = {"a": frozenset(cluster.machines["r0-m0"]) | frozenset(cluster.machines["r0-m1"])}  # a holds 4
    free = frozenset(cluster.gpus) - held["a"]  # 8 free
    ctx = context(cluster, {"a": 10, "b": 10, "c": 10}, free=free, held=held, arrived={"a": 0, "b": 1, "c": 2})
    decision = make_policy("drf").allocate(ctx, {})
    total = {app: len(held.get(app, ())) + len(decision.granted.get(app, ())) for app in ctx.unmet}
    assert total == {"a": 4, "b": 4, "c": 4}  # 4 + 4 + 4 = 12: a gets nothing more
    # each share is placed on one machine, not scattered
    assert all(cluster.locality(g) == 1 for g in decision.granted.values())


def test_drf_caps_at_demand_and_gives_the_rest_to_others():
    cluster = TESTBED.subcluster(["r0-m4", "r0-m5"])  # 8 GPUs
    ctx = context(cluster, {"small": 1, "big": 10, "mid": 3}, arrived={"small": 0, "big": 1, "mid": 2})
    assert counts(make_policy("drf").allocate(ctx, {})) == {"small": 1, "mid": 3, "big": 4}


def test_drf_places_the_biggest_share_first():
    cluster = TESTBED.subcluster(["r0-m4", "r0-m5"])
    free = frozenset({"r0-m4-g0", "r0-m4-g1", "r0-m4-g2", "r0-m5-g0"})
    ctx = context(cluster, {"one": 1, "three": 3}, free=free, arrived={"one": 0, "three": 1})
    granted = make_policy("drf").allocate(ctx, {}).granted
    # the single GPU best-fits into r0-m4's half-free slot if placed first, splitting "three"
    assert granted["three"] == {"r0-m4-g0", "r0-m4-g1", "r0-m4-g2"}
    assert granted["one"] == {"r0-m5-g0"}


def test_drf_breaks_count_ties_by_arrival():
    ctx = context(FOUR, {"x": 4, "y": 4, "z": 4}, free=frozenset(sorted(FOUR.gpus)[:1]), arrived={"x": 2, "y": 0, "z": 1})
    assert counts(make_policy("drf").allocate(ctx, {})) == {"y": 1}


# -- the shared rules, on random rounds ---------------------------------------------------------


def random_round(rng: random.Random) -> RoundContext:
    machines = rng.sample(sorted(TESTBED.machines), rng.randint(1, 8))
    cluster = TESTBED.subcluster(machines)
    gpus = sorted(cluster.gpus)
    free = frozenset(rng.sample(gpus, rng.randint(1, len(gpus))))
    taken = [g for g in gpus if g not in free]
    apps = [f"app{k}" for k in range(rng.randint(1, 6))]
    held: dict[str, frozenset[str]] = {}
    for g in taken:
        app = rng.choice(apps)
        held[app] = held.get(app, frozenset()) | {g}
    unmet = {app: rng.randint(1, 9) for app in apps}
    reports = {
        app: RhoReport(
            rng.uniform(0.5, 3),
            unmet[app] + len(held.get(app, ())),
            remaining_s=rng.choice([rng.uniform(1, 1000), math.inf]),
            slowdown=(1.0, rng.uniform(1, 1.5), rng.uniform(1.5, 2), rng.uniform(2, 3)),
            loss_decrease=rng.uniform(0, 2),
        )
        for app in apps
    }
    return context(
        cluster,
        unmet,
        free=free,
        held=held,
        reports=reports,
        attained={app: rng.uniform(0, 1e4) for app in apps},
        arrived={app: float(rng.randint(0, 5)) for app in apps},
    )


@pytest.mark.parametrize("name", BASELINES)
def test_only_free_gpus_at_most_unmet_and_work_conserving(name):
    rng = random.Random(f"baselines:{name}")
    policy = make_policy(name)
    for _ in range(300):
        ctx = random_round(rng)
        decision = policy.allocate(ctx, {})
        given: set[str] = set()
        for app, gpus in decision.granted.items():
            assert gpus <= ctx.free
            assert not gpus & given
            given |= gpus
            assert len(gpus) <= ctx.unmet[app]
        assert len(given) == min(len(ctx.free), sum(ctx.unmet.values()))


@pytest.mark.parametrize("name", BASELINES)
def test_the_same_round_gives_the_same_grants(name):
    a = make_policy(name).allocate(random_round(random.Random(7)), {})
    b = make_policy(name).allocate(random_round(random.Random(7)), {})
    assert a.granted == b.granted


# -- through the round engine -------------------------------------------------------------------


class Scripted:
    """An agent with fixed reports; it must never be asked to bid (baselines make no offers)."""

    def __init__(self, demand: int, remaining_s: float, slowdown: tuple[float, ...], loss_decrease: float):
        self.demand = demand
        self.fields = dict(remaining_s=remaining_s, slowdown=slowdown, loss_decrease=loss_decrease)
        self.bids = 0

    def report(self, request):
        return RhoReport(1.0, self.demand, **self.fields)

    def bid(self, offer):
        self.bids += 1
        raise AssertionError("a baseline made an offer")


# round 1: who is served first; round 2 (all leases expired): who is served first now
FIRST = {
    "fifo": ("a", "a"),
    "tiresias": ("a", "c"),  # round 2: c attained nothing in round 1
    "optimus": ("b", "b"),
    "gandiva": ("b", "b"),
    "slaq": ("c", "c"),
}


@pytest.mark.parametrize("name", BASELINES)
def test_the_engine_runs_each_baseline_by_name(name):
    cluster = TESTBED.subcluster(["r0-m0", "r0-m4"])  # 2 + 4 GPUs
    engine = RoundEngine(cluster, make_policy(name), lease_s=10.0, coalesce_s=0.0, expiry_window_s=0.0)
    agents = {
        "a": Scripted(4, remaining_s=500.0, slowdown=(1.0, 1.0, 1.0, 1.0), loss_decrease=1.0),
        "b": Scripted(4, remaining_s=100.0, slowdown=(1.0, 1.0, 2.0, 3.0), loss_decrease=0.5),
        "c": Scripted(4, remaining_s=300.0, slowdown=(1.0, 1.2, 1.5, 2.0), loss_decrease=2.0),
    }
    for t, app in enumerate(agents):
        engine.add_app(app, float(t))
    machine4 = frozenset(cluster.machines["r0-m4"])
    firsts = []
    for now in (2.0, 12.0):
        assert engine.round_due(now)
        r = engine.run_round(now, agents)
        assert r.bidders == () and r.rejected == {}
        assert not r.idle  # 12 GPUs wanted, 6 free: all go out
        assert all(len(g.gpus) <= r.unmet[g.app] for g in r.grants)
        got = {g.app: g.gpus for g in r.grants}
        if name == "drf":
            assert {app: len(g) for app, g in got.items()} == {"a": 2, "b": 2, "c": 2}
        else:
            (first,) = [app for app, g in got.items() if g == machine4]
            firsts.append(first)
            assert sorted(len(g) for g in got.values()) == [2, 4]
    if name != "drf":
        assert tuple(firsts) == FIRST[name]
    # two apps leave; the one left wants 4 of 6: it gets 4 and 2 stay idle
    engine.remove_app("a", 13.0)
    engine.remove_app("c", 13.0)
    r = engine.run_round(23.0, {"b": agents["b"]})
    assert [(g.app, len(g.gpus)) for g in r.grants] == [("b", 4)] and len(r.idle) == 2 and not r.unmet_after
    assert all(agent.bids == 0 for agent in agents.values())
