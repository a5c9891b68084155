"""Offer -> bid table (D7): bounded, valid, best-locality candidates, rho from the real code."""

from __future__ import annotations

import math
import random
import zlib
from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.appsched import JobInfo, SingleJobApp, SuccessiveHalvingApp
from agent.bidding import SINGLE_ROWS, candidate_sets, make_bid, useful_counts
from agent.fairness import finish_time_fairness
from agent.placement import model_slowdown
from arbiter.auction import validate_bid
from arbiter.cluster import load_cluster
from protos.messages import Offer

CLUSTER = load_cluster("sim-256")


def offer_of(gpus, held=(), now=0.0, n_avg=2.0):
    return Offer(1, {g: CLUSTER.position(g) for g in gpus}, now, n_avg, CLUSTER.size,
                 held={g: CLUSTER.position(g) for g in held})


def vgg_job(demand):
    return SingleJobApp(JobInfo(10_000, 1.0, model_slowdown("vgg16"), demand))


def test_useful_counts_are_bounded():
    assert useful_counts(5) == [1, 2, 3, 4, 5]
    big = useful_counts(256)
    assert big[:8] == list(range(1, 9)) and big[-1] == 256 and len(big) <= 18
    assert all(len(useful_counts(n)) <= 18 for n in range(1, 257))


def test_rows_are_valid_bounded_and_better_than_rho_old():
    rng = random.Random(4)
    free = rng.sample(CLUSTER.gpu_ids, 100)
    app = SuccessiveHalvingApp([1.0 + k / 10 for k in range(16)], [100] * 5, job_demand_max=4,
                               slowdown=model_slowdown("lm"))
    offer = offer_of(free)
    bid = make_bid(app, offer)
    validate_bid("lm-app", bid, frozenset(free))
    assert math.isinf(bid.rho_old)
    assert 0 < len(bid.rows) <= 11 * len(useful_counts(app.demand_now()))  # 100 GPUs: no D18 rows
    assert all(rho < bid.rho_old for _, rho in bid.rows)
    for gpus, rho in bid.rows:
        positions = [CLUSTER.position(g) for g in gpus]
        assert rho == pytest.approx(finish_time_fairness(app, positions, now=0, n_avg=2.0, cluster_size=256))


def test_a_free_machine_yields_a_one_machine_row():
    free = list(CLUSTER.machines["r0-m0"]) + ["r1-m4-g0", "r2-m8-g0", "r3-m12-g0", "r4-m16-g0"]
    bid = make_bid(vgg_job(8), offer_of(free))
    eights = [(g, r) for g, r in bid.rows if len(g) == 8]
    assert any(g == frozenset(CLUSTER.machines["r0-m0"]) for g, _ in eights)
    best = min(eights, key=lambda row: row[1])
    assert best[0] == frozenset(CLUSTER.machines["r0-m0"])  # the consolidated row has the lowest rho


def test_alternatives_span_distinct_machines():
    free = list(CLUSTER.machines["r0-m0"]) + list(CLUSTER.machines["r0-m1"]) + list(CLUSTER.machines["r1-m4"])
    sets = candidate_sets({g: CLUSTER.position(g) for g in free}, {}, [8], alternatives=2)
    one_machine = [s for s in sets if len({CLUSTER.gpus[g].machine for g in s}) == 1]
    assert len({CLUSTER.gpus[next(iter(s))].machine for s in one_machine}) >= 2
    assert len(sets) == len(set(sets))


def test_held_gpus_pull_candidates_to_their_machine():
    held = list(CLUSTER.machines["r5-m22"])[:4]
    free = list(CLUSTER.machines["r5-m22"])[4:] + list(CLUSTER.machines["r0-m0"])
    sets = candidate_sets({g: CLUSTER.position(g) for g in free}, {g: CLUSTER.position(g) for g in held}, [4], 1)
    assert sets[0] == frozenset(list(CLUSTER.machines["r5-m22"])[4:])


def test_rho_old_is_finite_when_holding_and_rows_extend_it():
    held = list(CLUSTER.machines["r0-m0"])[:2]
    free = list(CLUSTER.machines["r0-m0"])[2:]
    app = vgg_job(8)
    bid = make_bid(app, offer_of(free, held=held))
    assert math.isfinite(bid.rho_old)
    assert bid.rho_old == pytest.approx(finish_time_fairness(
        app, [CLUSTER.position(g) for g in held], now=0, n_avg=2.0, cluster_size=256))
    assert max(len(g) for g, _ in bid.rows) == 6  # never beyond the remaining demand


def test_no_rows_when_demand_is_met():
    held = list(CLUSTER.machines["r0-m0"])[:2]
    bid = make_bid(vgg_job(2), offer_of(list(CLUSTER.machines["r0-m1"]), held=held))
    assert bid.rows == ()


def test_fragments_are_offered_besides_the_consolidated_machine():
    """An app can bid for 8 GPUs spread over small machines, leaving the 8-GPU machine to others."""
    free = list(CLUSTER.machines["r0-m0"]) + [g for m in ("r6-m24", "r6-m25") for g in CLUSTER.machines[m]]
    sets = candidate_sets({g: CLUSTER.position(g) for g in free}, {}, [8], alternatives=2)
    big = set(CLUSTER.machines["r0-m0"])
    assert any(s == big for s in sets)
    assert any(len(s) == 8 and not (s & big) for s in sets)


def test_previous_gpus_come_first():
    """GPUs whose lease just ran out are offered back first (D10: won back, no restart)."""
    prev = list(CLUSTER.machines["r3-m13"])[:4]
    free = list(CLUSTER.machines["r0-m0"]) + list(CLUSTER.machines["r3-m13"])
    sets = candidate_sets({g: CLUSTER.position(g) for g in free}, {}, [4], 2,
                          previous={g: CLUSTER.position(g) for g in prev})
    assert sets[0] == frozenset(prev)


def test_a_row_that_moves_the_app_carries_one_restart_and_winning_back_its_gpus_none():
    """D17: an app whose lease just ran out bids for its own GPUs at the rho it runs at, and for any
    other GPUs of the same shape at that rho plus one restart, so it moves only when moving pays."""
    prev = sorted(CLUSTER.machines["r0-m0"])[:4]
    other = sorted(CLUSTER.machines["r0-m1"])[:4]
    free = prev + other
    offer = Offer(1, {g: CLUSTER.position(g) for g in free}, 0.0, 2.0, CLUSTER.size, held={},
                  previous={g: CLUSTER.position(g) for g in prev})
    app = vgg_job(4)
    plain = dict(make_bid(app, offer).rows)
    costly = dict(make_bid(app, offer, restart_s=300.0).rows)
    back, move = frozenset(prev), frozenset(other)
    assert back in costly and move in costly
    assert costly[back] == pytest.approx(plain[back])  # no restart to win back what it runs on
    assert costly[move] > plain[move] and costly[move] > costly[back]
    assert plain[move] == pytest.approx(plain[back])  # same shape, same rho without the cost


@pytest.mark.parametrize("previous, demand", [(10, 24), (20, 32), (13, 40)])
def test_an_app_can_always_bid_to_win_back_exactly_what_it_runs_on(previous, demand):
    """D10, D17: above 16 GPUs of remaining demand useful_counts skips sizes (10, 13, 20, ...), and an
    app running on such a number of GPUs had no row without a restart: every row moved it."""
    machines = sorted(CLUSTER.machines)
    prev = [g for m in machines[:4] for g in sorted(CLUSTER.machines[m])][:previous]
    free = prev + [g for m in machines[4:10] for g in sorted(CLUSTER.machines[m])]
    assert previous not in useful_counts(demand)
    offer = Offer(1, {g: CLUSTER.position(g) for g in free}, 0.0, 2.0, CLUSTER.size, held={},
                  previous={g: CLUSTER.position(g) for g in prev})
    table = make_bid(vgg_job(demand), offer, restart_s=300.0)
    rows = dict(table.rows)
    assert frozenset(prev) in rows
    same_size = [rho for gpus, rho in rows.items() if len(gpus) == previous and gpus != frozenset(prev)]
    assert all(rho > rows[frozenset(prev)] for rho in same_size)  # the one row without a restart
    validate_bid("a", table, frozenset(free), max_rows=303)


def test_single_gpu_rows_cover_a_small_offer_only():
    """D18: every GPU of an offer of at most SINGLE_ROWS GPUs is a 1-GPU row, so any contenders
    that take one GPU can all be served; a bigger offer gets no extra rows (the auction's cost)."""
    rng = random.Random(7)
    small = rng.sample(CLUSTER.gpu_ids, 8)
    bid = make_bid(vgg_job(4), offer_of(small), salt="a")
    assert {g for gpus, _ in bid.rows if len(gpus) == 1 for g in gpus} == set(small)
    big = rng.sample(CLUSTER.gpu_ids, SINGLE_ROWS + 1)
    bid = make_bid(vgg_job(4), offer_of(big), salt="a")
    assert len({g for gpus, _ in bid.rows if len(gpus) == 1 for g in gpus}) < SINGLE_ROWS


def test_apps_alternatives_spread_over_containers_when_one_fits_tighter():
    """D19: eight 8-GPU machines with 1, 2, ..., 8 free GPUs (36, too many for D18's single rows).
    Ranking every alternative by fit made all apps name the same tightest containers: twenty apps
    named 8 single GPUs in all, and in a 256-GPU service round all 98 bidders shared 65.
    Now each app lists the tightest container first and then containers in its own order."""
    machines = [m for m, gs in sorted(CLUSTER.machines.items()) if len(gs) == 8][:8]
    free = [g for k, m in enumerate(machines) for g in sorted(CLUSTER.machines[m])[: k + 1]]
    assert len(free) == 36 > SINGLE_ROWS
    offer = {g: CLUSTER.position(g) for g in free}
    tightest = sorted(CLUSTER.machines[machines[0]])[0]  # the only free GPU of the first machine
    singles = set()
    for k in range(20):
        sets = [s for s in candidate_sets(offer, {}, [1], salt=f"app{k}") if len(s) == 1]
        assert frozenset([tightest]) in sets  # the best fit is still every app's first choice
        singles |= {g for s in sets for g in s}
    assert len(singles) >= 14  # 18 now; ranked by fit alone, all twenty named the same 8


def test_an_apps_own_order_is_the_crc_of_its_name_and_the_container():
    """D19's order after the best fit is pinned, so runs stay reproducible across versions: the
    alternatives are the containers with the smallest crc32 of "<app name>|<container>". (The bid
    code computes the crc continued from the name's, once per container and bid; this checks it
    against the plain formula.) Machines of 8 free GPUs, none held: the tightest fit for 8 GPUs is
    any of them, so the best is the app's first machine in that order too."""
    machines = sorted(m for m, gs in CLUSTER.machines.items() if len(gs) == 8)
    offer = {g: CLUSTER.position(g) for m in machines for g in CLUSTER.machines[m]}
    for app in ("app0", "syn-0042", "ß-üñí"):
        by_hash = sorted(machines, key=lambda m: (zlib.crc32(f"{app}|{CLUSTER.position(CLUSTER.machines[m][0])[:2]}"
                                                             .encode()), m))
        sets = [s for s in candidate_sets(offer, {}, [8], alternatives=3, salt=app)
                if len({CLUSTER.position(g)[:2] for g in s}) == 1][:3]  # the machine level's rows
        assert [next(iter({CLUSTER.position(g)[:2] for g in s})) for s in sets] == \
            [CLUSTER.position(CLUSTER.machines[m][0])[:2] for m in by_hash[:3]]


def test_one_read_only_offer_is_shaped_once_and_a_mutable_one_every_time():
    """A round hands every bidder one read-only mapping (MappingProxyType), so the offer's shape is
    built once and reused; a plain dict may change between calls, so it is never reused."""
    free = sorted(CLUSTER.gpu_ids)[:40]
    plain = {g: CLUSTER.position(g) for g in free}
    shared = MappingProxyType(dict(plain))
    for k in range(5):  # the same rows from the shared mapping as from a fresh copy
        assert candidate_sets(shared, {}, [1, 2, 4], salt=f"a{k}") == candidate_sets(dict(plain), {}, [1, 2, 4],
                                                                                     salt=f"a{k}")
    candidate_sets(plain, {}, [1, 2, 4], salt="a")
    gone = free[:20]
    for g in gone:
        del plain[g]
    after = candidate_sets(plain, {}, [1, 2, 4], salt="a")
    assert after and not {g for s in after for g in s} & set(gone)


@settings(max_examples=300, deadline=None)
@given(frees=st.dictionaries(st.tuples(st.sampled_from("abc"), st.integers(0, 30)), st.integers(1, 8), min_size=1,
                             max_size=40),
       data=st.data(), salt=st.sampled_from(["", "app0", "syn-0042"]), need=st.integers(1, 9),
       alternatives=st.integers(0, 4))
def test_the_ranked_containers_are_d19s_definition(frees, data, salt, need, alternatives):
    """The bid code ranks a level's containers with a per-round numbering and walks one sorted order
    for every GPU count; this checks it against D19's definition written out plainly: of the
    containers with room, the best by (not next to held GPUs, tightest fit, the app's crc, the
    container), then the others by (not near, crc, container). An empty salt makes every crc 0, so
    ties fall to the container."""
    from agent.bidding import _Containers, _Level

    near = frozenset(data.draw(st.lists(st.sampled_from(sorted(frees)), max_size=4)))

    def crc(c):
        return zlib.crc32(f"{salt}|{c}".encode()) if salt else 0

    fits = [c for c in frees if frees[c] >= need]
    want = []
    if fits and alternatives >= 1:
        best = min(fits, key=lambda c: (c not in near, frees[c], crc(c), c))
        rest = sorted((c for c in fits if c != best), key=lambda c: (c not in near, crc(c), c))
        want = [best, *rest[: alternatives - 1]]
    assert _Level(_Containers(frees), near, salt).ranked(need, alternatives) == want


@settings(max_examples=150, deadline=None)
@given(data=st.data(), phases=st.integers(1, 3), jobs=st.integers(1, 8), demand_max=st.sampled_from([1, 2, 4, 8]),
       slowdown=st.lists(st.floats(0.5, 3.0), min_size=4, max_size=4), edited=st.booleans(),
       restart_s=st.sampled_from([0.0, 35.0]), now=st.floats(0, 5_000), n_avg=st.floats(1.0, 8.0))
def test_skipping_counts_that_cannot_beat_rho_old_leaves_the_table_as_it_was(
        data, phases, jobs, demand_max, slowdown, edited, restart_s, now, n_avg):
    """A GPU count is skipped when even its best conceivable placement is no better than rho_old
    (``agent.fairness.least_time_left``); the table must be exactly the one built row by row. The
    edited view gives every job an arbitrary slowdown tuple (a liar's, not necessarily monotone)."""
    from dataclasses import replace

    from simulator.strategic import BiddingStrategy, described

    class Lie(BiddingStrategy):
        name = "test-slowdown-lie"

        def edit(self, job):
            return replace(job, slowdown=lie)

    rng = random.Random(data.draw(st.integers(0, 10**6)))
    jobs = max(jobs, 2 ** (phases - 1))  # each phase halves the jobs
    app = SuccessiveHalvingApp([rng.uniform(0.2, 2.0) for _ in range(jobs)],
                               [rng.randint(5, 400) for _ in range(phases)], job_demand_max=demand_max,
                               slowdown=model_slowdown("vgg16"), grow_demand=rng.random() < 0.5)
    for job in app.phase_jobs():
        if rng.random() < 0.5:
            app.advance(job, rng.uniform(0, 300))
    lie = tuple(slowdown)
    view = described(app, Lie(0)) if edited else app
    gpus = sorted(CLUSTER.gpus)
    free = rng.sample(gpus, rng.randint(1, 40))
    held = rng.sample([g for g in gpus if g not in free], rng.randint(0, 6))
    previous = {g: CLUSTER.position(g) for g in free if rng.random() < 0.1}
    offer = Offer(1, {g: CLUSTER.position(g) for g in free}, now, n_avg, CLUSTER.size,
                  held={g: CLUSTER.position(g) for g in held}, previous=previous)
    skipping = make_bid(view, offer, salt="app7", restart_s=restart_s)
    app.work_depends_on_allocation = True  # the view forwards it: every count is built row by row
    row_by_row = make_bid(view, offer, salt="app7", restart_s=restart_s)
    assert skipping == row_by_row


def test_the_least_time_left_is_kept_only_while_the_app_is_unchanged():
    from agent.fairness import TimeLeftCache, least_time_left

    app = SuccessiveHalvingApp([1.0, 1.5, 0.8, 1.2], [100, 200], job_demand_max=2, slowdown=model_slowdown("vgg16"))
    cache = TimeLeftCache(app)
    before = cache.least(4)
    assert before == least_time_left(app, 4) > 0
    for job in app.phase_jobs():
        app.advance(job, 50)
    assert cache.least(4) == least_time_left(app, 4) < before
