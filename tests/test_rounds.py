"""The round engine over many rounds (D5, D6, D9, D10), with agents made of the real fairness and
bidding code and apps that train on what they hold."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from agent.agent import Agent
from agent.appsched import JobInfo, SingleJobApp, SuccessiveHalvingApp
from agent.fairness import job_time, split_allocation
from agent.placement import load_profiles
from arbiter.cluster import load_cluster
from arbiter.policies import make_policy
from arbiter.policies.base import Policy
from arbiter.policies.themis import filter_worst
from arbiter.rounds import InvalidReport, RoundEngine
from protos.messages import BidTable, RhoReport

STEP = 20.0


def make_apps(rng: random.Random, n: int):
    profiles = load_profiles()
    out = []
    for k in range(n):
        jobs = rng.choice([4, 8, 16])
        out.append((
            f"app{k:02d}",
            k * 60.0,
            SuccessiveHalvingApp(
                [rng.uniform(1, 3) for _ in range(jobs)], [rng.choice([300, 500])] * jobs.bit_length(),
                job_demand_max=rng.choice([2, 4, 8]), slowdown=profiles[rng.choice(sorted(profiles))].slowdown,
                start_time=k * 60.0,
            ),
        ))
    return out


def train(app: SuccessiveHalvingApp, gpus, dt: float, rng: random.Random) -> None:
    for job, chunk in split_allocation(app.jobs_in_phase(app.current_phase(), gpus), gpus):
        app.advance(job.job_id, dt * job.iters_remaining / job_time(job, chunk))
    if app.phase_done():
        jobs = app.phase_jobs()
        rng.shuffle(jobs)
        app.end_phase(jobs[: max(1, len(jobs) // 2)])


def drive(seed: int, n_apps: int = 12, lease_s: float = 300.0, f: float = 0.8):
    rng = random.Random(seed)
    cluster = load_cluster("testbed-64")
    engine = RoundEngine(cluster, make_policy("themis", fairness_knob=f), lease_s=lease_s, seed=seed)
    pending = make_apps(rng, n_apps)
    apps = {name: app for name, _, app in pending}
    agents = {name: Agent(app) for name, app in apps.items()}
    holder: dict[str, str] = {}  # our own record of who holds each GPU, from grants/expiries/releases
    results = []
    held_after: dict[int, dict[str, frozenset[str]]] = {}
    now = 0.0
    while (pending or engine.apps) and now < 200_000:
        while pending and pending[0][1] <= now:
            engine.add_app(pending.pop(0)[0], now)
        if engine.round_due(now):
            r = engine.run_round(now, {a: agents[a] for a in engine.apps})
            for lease in r.expired:
                assert holder.pop(lease.gpu) == lease.app
            for g in r.grants:
                for gpu in g.gpus:
                    assert gpu not in holder, f"{gpu} granted to {g.app} while {holder.get(gpu)} holds it"
                    holder[gpu] = g.app
            results.append(r)
            held_after[r.round_id] = {a: engine.held(a) for a in engine.apps}
        for name in sorted(engine.apps):
            assert {g for g, a in holder.items() if a == name} == engine.held(name)
            held = [cluster.position(g) for g in sorted(engine.held(name))]
            if held:
                train(apps[name], held, STEP, rng)
                engine.set_demand(name, apps[name].demand_now(), now)
            if apps[name].finished():
                for gpu in engine.remove_app(name, now + STEP):
                    assert holder.pop(gpu) == name
        now += STEP
    return engine, apps, results, held_after


@pytest.fixture(scope="module")
def driven():
    return drive(seed=5)


@pytest.fixture(scope="module")
def run(driven):
    return driven[:3]


def test_every_app_finishes_and_rounds_happen(run):
    engine, apps, results = run
    assert not engine.apps
    assert all(app.finished() for app in apps.values())
    assert len(results) >= 20
    assert len(engine.leases) == 0


def test_no_gpu_idle_while_an_app_that_could_take_it_has_unmet_demand(driven):
    """D9: leftover GPUs go to every app that wants more and got nothing yet this round, inside the
    container of what it keeps (a GPU further out would slow its job down) -- except the apps
    queued in tier 1, which had their turn by their own rows."""
    engine, _, results, held_after = driven
    cluster = engine.cluster
    for r in results:
        if not (r.idle and r.unmet_after):
            continue
        got = {g.app for g in r.grants}
        auction = r.decision.auction if r.decision else None
        queued = set(r.bidders) - set(auction.contenders if auction else ())
        for app in set(r.unmet_after) - got - set(r.rejected) - queued:
            kept = {cluster.position(g) for g in held_after[r.round_id].get(app, ())}
            assert kept, f"round {r.round_id}: {app} holds nothing, wants more, and {len(r.idle)} GPUs are idle"
            depth = next((d for d in (3, 2, 1) if len({k[:d] for k in kept}) == 1), 0)  # its container
            for g in r.idle:
                p = cluster.position(g)
                assert not all(k[:depth] == p[:depth] for k in kept), \
                    f"round {r.round_id}: {g} idle inside the container of {app}'s GPUs"


def test_leases_expire_and_their_gpus_are_offered_again(run):
    _, _, results = run
    expiring = [r for r in results if r.expired]
    assert expiring
    for r in expiring:
        assert {lease.gpu for lease in r.expired} <= r.offered
        assert all(lease.expires_at <= r.now for lease in r.expired if lease not in r.reclaimed)
        assert set(r.reclaimed) <= set(r.expired)


def test_the_offer_goes_to_the_worst_rho_apps_and_a_reserve_after_them(run):
    """D6, D13, D14: the apps offered GPUs are a prefix of the rank order (rho, highest first); the
    first ceil((1 - f) N) are the auction's bidders, the rest a reserve whose demand, without its
    last app, fell short of the free GPUs."""
    _, _, results = run
    filtered = reserved = 0
    for r in results:
        if not r.bidders:
            continue
        others = [r.rho[a] for a in r.unmet if a not in r.bidders]
        assert all(r.rho[b] >= max(others, default=0) for b in r.bidders)
        assert [r.rho[b] for b in r.bidders] == sorted((r.rho[b] for b in r.bidders), reverse=True)
        stage = max(1, math.ceil(0.2 * len(r.unmet) - 1e-9))
        assert set(r.decision.auction.contenders) <= set(r.bidders[:stage])
        if len(r.bidders) > stage:
            assert sum(r.unmet[a] for a in r.bidders[stage:-1]) < len(r.offered)
            reserved += 1
        filtered += 1
    assert filtered > 10 and reserved > 0


def test_an_app_that_loses_its_leases_is_filtered_in(run):
    """Paper 3.3.2: losing rounds, an app loses its leases, its rho becomes unbounded and it bids."""
    _, _, results = run
    seen = 0
    for r in results:
        starving = sorted(a for a in r.unmet if math.isinf(r.rho[a]))
        if not starving or not r.offered:
            continue
        seen += 1
        slots = len(r.bidders)
        assert len(set(starving) & set(r.bidders)) == min(slots, len(starving))
    assert seen > 5


def test_no_app_waits_forever(run):
    _, _, results = run
    waiting: dict[str, int] = {}
    for r in results:
        served = {g.app for g in r.grants} | set(r.bidders)
        for app in r.unmet:
            waiting[app] = 0 if app in served else waiting.get(app, 0) + 1
            assert waiting[app] <= 12, f"{app} went {waiting[app]} rounds with unmet demand and no offer"


def test_the_same_seed_gives_the_same_rounds():
    _, _, a, _ = drive(seed=9, n_apps=6)
    _, _, b, _ = drive(seed=9, n_apps=6)
    assert [(r.now, r.grants) for r in a] == [(r.now, r.grants) for r in b]


# -- D5, D6, D10 by hand ------------------------------------------------------------------------


def small_engine(**kw):
    cluster = load_cluster("testbed-64").subcluster(["r0-m0", "r0-m4"])  # 2 + 4 GPUs
    return RoundEngine(cluster, make_policy("themis", **kw.pop("policy", {})), **kw)


def test_n_avg_is_the_time_weighted_number_of_apps():
    e = small_engine()
    e.add_app("a", 0)
    e.add_app("b", 100)
    e.add_app("c", 200)
    e.remove_app("b", 300)
    # a: 1 app for 100 s, 2 for 100 s, 3 for 100 s, 2 for 100 s -> 800 / 400
    assert e.n_avg("a", 400) == pytest.approx(2.0)
    assert e.n_avg("c", 400) == pytest.approx((3 * 100 + 2 * 100) / 200)
    assert e.n_avg("c", 200) == 2.0  # at arrival: the apps active now


def test_filter_takes_the_worst_fraction():
    rho = {f"a{k}": float(k) for k in range(10)}
    assert filter_worst(rho, 0.8) == ["a9", "a8"]
    assert filter_worst(rho, 0.0) == sorted(rho, key=lambda a: -rho[a])
    assert filter_worst({"x": 1.0}, 0.95) == ["x"]
    with pytest.raises(ValueError):
        filter_worst(rho, 1.0)


def test_rounds_are_due_on_events_after_the_coalescing_window():
    e = small_engine(coalesce_s=5, lease_s=100)
    assert e.next_wakeup() is None
    e.add_app("a", 10)  # arrival while GPUs are free
    assert e.next_wakeup() == 15 and not e.round_due(14) and e.round_due(15)
    agent = Agent(SingleJobApp(JobInfo(1000, 1.0, demand_max=2)))
    r = e.run_round(15, {"a": agent})
    assert [len(g.gpus) for g in r.grants] == [2]
    assert e.next_wakeup() == 115 + 10  # the lease expiry plus the expiry window (lease / 10, D10)
    e.release("a", list(e.held("a"))[:1], 50)
    assert e.next_wakeup() == 55


def any_placement(offer, want: int, rho: float) -> BidTable:
    """A bid of an app indifferent to placement: every set of ``want`` offered GPUs (at most what
    is offered) halves its rho. An offered app must bid to be leased GPUs (D22)."""
    k = min(want, len(offer.gpus))
    rows = tuple((frozenset(c), rho / 2) for c in itertools.combinations(sorted(offer.gpus), k)) if k > 0 else ()
    return BidTable(rho, rows)


class Scripted:
    """An agent that answers with fixed values (for hostile-input tests); by default it bids for
    its unmet demand anywhere (:func:`any_placement`)."""

    def __init__(self, rho=2.0, demand=2, bid=any_placement, fail=False):
        self.rho, self.demand, self.table, self.fail = rho, demand, bid, fail

    def report(self, request):
        if self.fail:
            raise RuntimeError("agent crashed")
        return RhoReport(self.rho, self.demand)

    def bid(self, offer):
        if self.table is any_placement:
            return any_placement(offer, self.demand - len(offer.held), self.rho)
        return self.table(offer) if callable(self.table) else self.table


def test_bad_bids_and_failing_agents_do_not_stop_the_round():
    e = small_engine(policy={"fairness_knob": 0.0})
    for app in ("good", "liar", "crash", "nan"):
        e.add_app(app, 0)
    agents = {
        "good": Scripted(rho=3.0, bid=lambda o: BidTable(3.0, ((frozenset(list(o.gpus)[:2]), 1.0),))),
        "liar": Scripted(rho=3.0, bid=BidTable(3.0, ((frozenset({"not-a-gpu"}), 0.1),))),
        "crash": Scripted(fail=True),
        "nan": Scripted(rho=3.0, bid=BidTable(float("nan"), ())),
    }
    r = e.run_round(1, agents)
    assert "not offered" in r.rejected["liar"]
    assert "crashed" in r.rejected["crash"]
    assert "rho_old" in r.rejected["nan"]
    assert {g.app for g in r.grants} >= {"good"}
    granted = [gpu for g in r.grants for gpu in g.gpus]
    assert len(granted) == len(set(granted))


def test_a_report_with_nan_rho_is_refused():
    e = small_engine()
    e.add_app("a", 0)
    r = e.run_round(1, {"a": Scripted(rho=float("nan"))})
    assert "rho must be > 0" in r.rejected["a"] and r.grants == ()


class Counting(Scripted):
    """A scripted agent that counts the rho requests it gets and keeps what they asked for."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.requests = []

    def report(self, request):
        self.requests.append(request)
        return super().report(request)


def test_only_apps_that_want_more_than_they_hold_are_asked_for_rho():
    """D6: the arbiter asks every active app with unmet demand; a satisfied app is not asked until
    it says its demand grew, and that (with GPUs free) is a resource-available event (D10)."""
    e = small_engine(coalesce_s=1, lease_s=1000)
    a, b = Counting(demand=2), Counting(demand=2)
    e.add_app("a", 0)
    e.add_app("b", 0)
    r = e.run_round(1, {"a": a, "b": b})
    assert sorted(r.rho) == ["a", "b"]  # nobody has said its demand yet: both asked
    assert sorted(len(g.gpus) for g in r.grants) == [2, 2]
    e.add_app("c", 5)
    c = Counting(demand=1)
    r = e.run_round(6, {"a": a, "b": b, "c": c})
    assert list(r.rho) == ["c"] and len(a.requests) == len(b.requests) == 1
    assert not e.round_due(50)
    a.demand = 3
    e.set_demand("a", 3, 50)
    assert e.next_wakeup() == 51 and e.round_due(51)
    r = e.run_round(51, {"a": a, "b": b, "c": c})
    assert list(r.rho) == ["a"]
    assert [(g.app, len(g.gpus), g.source) for g in r.grants] == [("a", 1, "auction")]  # the last free GPU
    with pytest.raises(ValueError, match="demand"):
        e.set_demand("a", -1, 52)
    with pytest.raises(KeyError):
        e.set_demand("nobody", 1, 52)


def test_a_request_names_the_report_fields_the_policy_reads():
    for policy, extras in (("themis", set()), ("optimus", {"remaining_s"}), ("gandiva", {"slowdown"}),
                           ("slaq", {"loss_decrease"}), ("fifo", set())):
        cluster = load_cluster("testbed-64").subcluster(["r0-m0"])
        e = RoundEngine(cluster, make_policy(policy))
        e.add_app("a", 0)
        agent = Counting(demand=1)
        e.run_round(1, {"a": agent})
        assert agent.requests[0].extras == extras, policy
    app = Agent(SingleJobApp(JobInfo(100, 1.0, demand_max=2)))
    e = RoundEngine(load_cluster("testbed-64").subcluster(["r0-m0"]), make_policy("themis"))
    e.add_app("a", 0)
    themis_request = e.open_round(1).requests[0]
    assert math.isinf(app.report(themis_request).remaining_s)  # not computed when not asked for
    e._closed()
    e2 = RoundEngine(load_cluster("testbed-64").subcluster(["r0-m0"]), make_policy("optimus"))
    e2.add_app("a", 0)
    assert app.report(e2.open_round(1).requests[0]).remaining_s == pytest.approx(50.0)


def test_expiries_wait_for_each_other_but_leases_run_on_until_their_round():
    """D10: an expiry's round waits ``expiry_window_s`` for other expiries to join; until that
    round the expired lease still holds its GPUs, so the wait leaves nothing idle."""
    e = small_engine(coalesce_s=1, lease_s=100, expiry_window_s=30)
    a, b = Counting(demand=2), Counting(demand=4)
    e.add_app("a", 0)
    e.run_round(1, {"a": a})  # a's lease ends at 101
    e.add_app("b", 20)
    e.run_round(21, {"a": a, "b": b})  # b's lease ends at 121
    assert e.next_wakeup() == 101 + 30 and not e.round_due(130)
    assert len(e.held("a")) == 2  # past its expiry, still held until the round
    r = e.run_round(131, {"a": a, "b": b})
    assert sorted(lease.app for lease in r.expired) == ["a", "a", "b", "b", "b", "b"]
    with pytest.raises(ValueError, match="expiry window"):
        small_engine(expiry_window_s=-1)


def test_engine_state_round_trips_through_the_journal(tmp_path):
    """A restarted arbiter restores apps, leases with their expiries, N_avg's history, drained and
    added machines, and the round counter (the service's durable state)."""
    from arbiter.rounds import EngineState
    from arbiter.store import Store, StoreError

    e = small_engine(lease_s=100)
    e.add_app("a", 0)
    e.add_app("b", 10)
    e.run_round(11, {"a": Counting(demand=2), "b": Counting(demand=3)})
    e.set_demand("a", 4, 12)
    machine = e.add_machine("r9", 2, 1, 20)
    e.drain("r0-m0")
    store = Store(tmp_path / "j.db")
    store.bind_cluster(e.cluster.name)
    store.save(e.state(), settings={"policy": "themis"}, rho={"a": math.inf, "b": 1.5})
    store.close()
    store = Store(tmp_path / "j.db")
    state, settings = store.load()
    assert settings == {"policy": "themis"} and store.last_rho() == {"a": math.inf, "b": 1.5}
    fresh = small_engine(lease_s=100)
    fresh.restore(state)
    from dataclasses import replace

    assert fresh.state() == replace(e.state(), pending_since=state.clock)  # a restart is an event (D10)
    assert machine in fresh.cluster.machines and fresh.drained == {"r0-m0"}
    assert fresh.n_avg("a", 50) == e.n_avg("a", 50) and fresh.round_due(state.clock + fresh.coalesce_s)
    assert not any(fresh.cluster.gpus[g].machine == "r0-m0" for g in fresh.free_gpus())
    with pytest.raises(RuntimeError):
        fresh.restore(state)  # only into a fresh engine
    bad = EngineState(0, 0, 0, None, {}, tuple(state.leases))
    with pytest.raises(ValueError, match="unknown apps"):
        small_engine().restore(bad)
    with pytest.raises(StoreError, match="belongs to cluster"):
        store.bind_cluster("another-cluster")
    import sqlite3

    with pytest.raises(sqlite3.IntegrityError):  # the journal itself cannot hold one GPU twice
        lease = state.leases[0]
        store.db.execute("INSERT INTO leases VALUES (?, ?, ?, ?, ?)", (lease.gpu, "other", 0, 1, 1))


def test_a_drained_machine_gets_no_new_grants_and_an_added_one_is_offered():
    e = small_engine(lease_s=100)
    e.drain("r0-m4")
    e.add_app("a", 0)
    r = e.run_round(1, {"a": Counting(demand=6)})
    got = {g for grant in r.grants for g in grant.gpus}
    assert got == set(e.cluster.machines["r0-m0"])
    name = e.add_machine("r0", 4, 2, 5)
    assert name == "r0-m5" and e.round_due(6)
    e.add_app("b", 6)
    r = e.run_round(7, {"a": Counting(demand=6), "b": Counting(demand=4, rho=5.0)})  # b the worse off
    assert set(e.cluster.machines[name]) <= r.offered
    assert {g.app: g.gpus for g in r.grants} == {"b": frozenset(e.cluster.machines[name])}
    with pytest.raises(KeyError):
        e.drain("nowhere")
    with pytest.raises(ValueError):
        e.add_machine("r0", 3, 2, 7)  # 3 GPUs cannot split over 2 slots


def test_resuming_a_drained_machine_with_free_gpus_makes_a_round_due():
    """A resumed machine's free GPUs are a resource-available event (D10), like an added machine:
    before, with every machine drained, they sat idle until some unrelated event."""
    e = small_engine(lease_s=100)
    for machine in e.cluster.machines:
        e.drain(machine)
    e.add_app("a", 0)
    r = e.run_round(1, {"a": Counting(demand=4)})
    assert not r.grants and e.next_wakeup() is None and not e.round_due(50)
    e.resume("r0-m4", 10)
    assert e.round_due(10 + e.coalesce_s)
    r = e.run_round(10 + e.coalesce_s, {"a": Counting(demand=4)})
    assert {g for grant in r.grants for g in grant.gpus} <= set(e.cluster.machines["r0-m4"]) and r.grants
    e.resume("r0-m4", 20)  # not drained any more: nothing happens
    assert not e.round_due(20 + e.coalesce_s)
    with pytest.raises(KeyError):
        e.resume("nowhere", 21)


def test_an_abandoned_round_leaves_the_engine_ready_for_the_next():
    e = small_engine(lease_s=100)
    e.add_app("a", 0)
    rnd = e.open_round(1)
    rnd.abandon()
    assert e.round_due(2)  # the free GPUs are still waiting for a round
    r = e.run_round(2, {"a": Counting(demand=2)})
    assert r.round_id == 2 and sum(len(g.gpus) for g in r.grants) == 2


def test_a_round_that_fails_takes_nothing_away_and_grants_nothing():
    """A policy error mid-round (or a failed journal write before close) must not drop the expired
    leases unannounced nor keep half-made grants: the round is undone and a new one is due."""

    class Exploding(Policy):
        name = "exploding"
        report_extras = frozenset()

        def bidders(self, rho, ctx):
            return []

        def allocate(self, ctx, bids):
            raise RuntimeError("boom")

    e = small_engine(lease_s=10, expiry_window_s=0)
    e.add_app("a", 0)
    e.run_round(1, {"a": Counting(demand=2)})
    held = e.held("a")
    e.add_app("b", 2)
    e.policy = Exploding()
    with pytest.raises(RuntimeError, match="boom"):
        e.run_round(12, {"a": Counting(demand=2), "b": Counting(demand=4)})
    assert e.held("a") == held and not e.held("b")  # a's expired lease is back: it was never told otherwise
    assert e.round_due(13)
    rnd = e.open_round(13)
    assert {lease.gpu for lease in rnd.expired} == held
    rnd.abandon()
    assert e.held("a") == held and e.round_due(14)


def test_a_row_bigger_than_what_the_app_still_wants_is_refused():
    """The leftover tiers cap rows at unmet demand; the auction did not: an app that reported
    demand 1 and bid a 4-GPU row won all 4."""
    e = small_engine()
    e.add_app("a", 0)
    four = frozenset(g for g in e.free_gpus() if "-m4-" in g)
    r = e.run_round(1, {"a": Scripted(rho=math.inf, demand=1, bid=BidTable(math.inf, ((four, 1.0),)))})
    assert "row 0 asks for 4 GPUs, more than the app still wants: demand 1 reported, 0 held" in r.rejected["a"]
    assert not e.held("a")


@pytest.mark.parametrize("table", [
    BidTable(math.inf, None),  # type: ignore[arg-type]
    BidTable(math.inf, (((["r0-m0-g0"],), 1.0),)),  # an unhashable GPU id
    BidTable(math.inf, ((frozenset({7}), 1.0),)),  # a GPU id that is not a string
])
def test_a_malformed_in_process_bid_is_refused_and_the_engine_goes_on(table):
    """A TypeError from validating such a bid escaped run_round and left the round open for good:
    every later open_round raised "round 1 is still open"."""
    e = small_engine()
    e.add_app("a", 0)
    r = e.run_round(1, {"a": Scripted(rho=math.inf, demand=1, bid=table)})
    assert r.rejected["a"] and not e.held("a")
    e.set_demand("a", 1, 2)
    assert e.run_round(3, {"a": Scripted(rho=4.0, demand=1)}).grants  # the engine is not stuck


def test_an_app_cannot_leave_while_a_round_is_open():
    """The open round keeps the app's report and bid: it would lease GPUs to an app the engine no
    longer knows, which no release could free and the journal could not restore."""
    e = small_engine()
    e.add_app("a", 0)
    e.add_app("b", 0)
    rnd = e.open_round(1)
    for request in rnd.requests:
        rnd.report(request.app, RhoReport(4.0, 1))
    for app, offer in rnd.offers().items():
        rnd.bid(app, any_placement(offer, 1, 4.0))
    with pytest.raises(RuntimeError, match="cannot leave while round 1 is open"):
        e.remove_app("a", 1)
    rnd.close()
    e.remove_app("a", 2)
    assert set(e.apps) == {"b"} and {lease.app for lease in e.leases} <= {"b"}
    RoundEngine(e.cluster, make_policy("themis")).restore(e.state())  # the journal is consistent


@pytest.mark.parametrize("when", [float("nan"), float("inf")])
def test_a_time_that_is_not_finite_is_refused(when):
    """NaN passed ``now < clock``: N_avg silently became 1 and leases granted at NaN never expired."""
    e = small_engine()
    e.add_app("a", 0)
    with pytest.raises(ValueError, match="finite"):
        e.add_app("b", when)
    assert e.clock == 0 and set(e.apps) == {"a"}


def test_an_infinite_waiting_rho_is_refused():
    """D13's waiting rho is finite; infinity ranked a liar first among the apps that hold nothing."""
    e = small_engine()
    e.add_app("a", 0)
    rnd = e.open_round(1)
    with pytest.raises(InvalidReport, match="rho_wait"):
        rnd.report("a", RhoReport(math.inf, 1, rho_wait=math.inf))
    rnd.abandon()


def test_an_idle_app_counts_in_no_ones_n_avg_and_is_not_asked():
    """Issue 36: N_avg is the time-average of the apps contending (D5); an app gone quiet is not."""
    engine = RoundEngine(load_cluster("testbed-64"), make_policy("themis"))
    engine.add_app("a", 0.0)
    engine.add_app("b", 0.0)
    assert engine.n_avg("b", 100.0) == 2.0
    engine.set_idle("a", True, 100.0)
    assert engine.n_avg("b", 300.0) == pytest.approx((2 * 100 + 1 * 200) / 300)
    assert [r.app for r in engine.open_round(300.0).requests] == ["b"]
