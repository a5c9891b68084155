"""D24: a round's randomness is public in a simulation and secret, committed and revealed in a service;
D38: the auction's lottery draws once and spreads that draw evenly over its winners.

The audit predicted the service's auction seed in 20 of 20 rounds: it followed from seed 0, the
round id and the number of ranked apps, all of which an app sees. These tests hold the engine and
a real arbiter to the decision: a secret from the CSPRNG, journaled (a restart draws as before),
SHA-256 of each round's seed sent with the rho requests, the seed revealed once the round closed.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random

import pytest

from agent.agent import Agent
from agent.appsched import SuccessiveHalvingApp
from agent.client import AgentClient
from arbiter.cluster import load_cluster
from arbiter.lottery import (
    RoundSeeds,
    auction_draws,
    cells,
    commitment,
    independent_draws,
    new_secret,
    rotated_draws,
    shared_draw,
    verify,
)
from arbiter.policies import make_policy
from arbiter.rounds import RoundEngine
from protos import themis_pb2 as pb
from protos.messages import BidTable, RhoReport
from tests.service_kit import admin_stub, arbiter, credential, halving_app, target, wait_for


class Coin:
    """Two starving apps want the one free GPU and value it alike: the lottery decides who gets it."""

    def __init__(self, wait: float):
        self.wait = wait

    def report(self, request):
        return RhoReport(math.inf, 1, rho_wait=self.wait)

    def bid(self, offer):
        return BidTable(math.inf, tuple((frozenset([g]), 1.0) for g in offer.gpus))


def _winners(seeds: RoundSeeds | None = None, secret: bytes | None = None, rounds: int = 24) -> list[str]:
    """Who of two equally starving apps gets a single free GPU, round after round."""
    cluster = load_cluster("testbed-64").subcluster(["r0-m0"])  # 2 GPUs
    out = []
    for r in range(rounds):
        engine = RoundEngine(cluster, make_policy("themis", fairness_knob=0.0, fill=False), seed=r, secret=secret,
                             reclaim=False)
        engine.round_id = r  # round r + 1 of an arbiter's life: the only number a secret's seed varies with
        engine.add_app("a", 0)
        engine.add_app("b", 0)
        engine.add_app("holder", 0)
        engine.leases.grant("holder", ["r0-m0-g0"], now=0, expires_at=1e9, round_id=0)
        result = engine.run_round(10, {"a": Coin(1.0), "b": Coin(1.0), "holder": Coin(1.0)})
        out.append(",".join(sorted(g.app for g in result.grants)))
    return out


def test_a_simulation_seeds_each_round_from_its_seed_and_the_round_id_as_before():
    """Every published figure was made with the round's generator seeded from "<seed>:<round>":
    the public seeds keep exactly that, so no figure moves because of D24."""
    seeds = RoundSeeds(7)
    assert seeds.of(3) == "7:3" and not seeds.secret_kept
    cluster = load_cluster("testbed-64").subcluster(["r0-m0"])
    engine = RoundEngine(cluster, make_policy("themis"), seed=7)
    engine.add_app("a", 0)
    rnd = engine.open_round(1)
    assert rnd.seed == "7:1"
    assert all(req.commitment == commitment("7:1") for req in rnd.requests)
    result = rnd.close()
    assert result.seed == "7:1" and verify(result.seed, result.commitment)


def test_a_secret_seed_is_not_the_public_one_and_the_same_secret_draws_the_same_outcome():
    secret = new_secret()
    seeds = RoundSeeds(0, secret)
    assert seeds.secret_kept and secret.hex() not in repr(seeds)
    assert seeds.of(5) != "0:5" and seeds.of(5) != seeds.of(6)
    assert seeds.of(5) == RoundSeeds(0, secret).of(5)  # a restart, or a replay of the journal
    assert RoundSeeds(0, new_secret()).of(5) != seeds.of(5)
    assert _winners(secret=secret) == _winners(secret=secret)
    assert verify(seeds.of(5), commitment(seeds.of(5))) and not verify(seeds.of(6), commitment(seeds.of(5)))


def test_the_lottery_under_a_secret_is_not_what_the_public_seed_predicts():
    """What an app could compute from the round id alone (the public seed) no longer says who wins:
    over 24 coin-flip rounds the secret's winners differ from the public prediction in some rounds,
    and two secrets differ from each other."""
    public = _winners()
    assert set(public) == {"a", "b"}  # the coin really is a coin
    one, two = _winners(secret=new_secret()), _winners(secret=new_secret())
    assert one != public and two != public and one != two


class Recording(Agent):
    """A real agent that keeps the rho requests it was sent (to compare the commitment it saw
    before bidding with the seed revealed afterwards)."""

    def __init__(self, app, name):
        super().__init__(app, name=name)
        self.requests = []

    def report(self, request):
        self.requests.append(request)
        return super().report(request)


def test_a_service_commits_to_each_rounds_seed_before_the_bids_reveals_it_after_and_keeps_it_over_a_restart(tmp_path):
    async def scenario():
        async with arbiter(tmp_path) as server:
            agent = Recording(halving_app(), "a")
            client = AgentClient(agent, "a", target(server), await credential(server, "a"), backoff_s=(0.05, 0.5))
            task = asyncio.create_task(client.run())
            await wait_for(lambda: agent.requests)
            asked = agent.requests[0]
            stub, meta, ch = admin_stub(server)
            revealed: dict[int, pb.RoundSummary] = {}
            while asked.round_id not in revealed:  # the round's summary is journaled once it has closed
                history = await stub.RoundHistory(pb.RoundHistoryRequest(limit=50), metadata=meta)
                revealed = {r.round_id: r for r in history.rounds}
                await asyncio.sleep(0.02)
            await ch.close()
            seen = revealed[asked.round_id]
            engine_seed = server.service.engine.seeds.of(asked.round_id)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return asked, seen, engine_seed

    asked, seen, engine_seed = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert asked.commitment and asked.commitment == seen.commitment
    assert hashlib.sha256(seen.seed.encode()).hexdigest() == asked.commitment  # what an auditor checks
    assert seen.seed == engine_seed and seen.seed != f"0:{asked.round_id}"

    async def again(path):
        async with arbiter(path) as server:
            return server.service.engine.seeds.of(asked.round_id)

    assert asyncio.run(again(tmp_path)) == seen.seed  # the secret is journaled: a restart draws the same
    other = tmp_path / "other"
    other.mkdir()
    assert asyncio.run(again(other)) != seen.seed  # a new journal, a new secret



# D38: one shared draw per auction, spread evenly over the PF winners.

def _searches_on_four_gpus(seed: int, fairness_knob: float = 0.0, min_bidders: int = 1):
    """Two equal searches of four 1-GPU jobs, both starving, on one 4-GPU machine; by default f = 0
    so that both contend (with D6's default f = 0.8 only the worst-ranked of two bids)."""
    cluster = load_cluster("testbed-64").subcluster(["r0-m4"])
    policy = make_policy("themis", fairness_knob=fairness_knob, min_bidders=min_bidders)
    engine = RoundEngine(cluster, policy, seed=seed, reclaim=False)
    agents = {}
    for name in ("a", "b"):
        engine.add_app(name, 0)
        app = SuccessiveHalvingApp([10.0 + k for k in range(4)], [1000.0, 2000.0], job_demand_max=1,
                                   slowdown=(1.0, 1.1, 1.5, 2.0))
        agents[name] = Agent(app, name=name)
    return engine.run_round(1, agents)


def test_two_searches_on_four_gpus_are_no_longer_both_lost_in_one_round():
    """The swing: each search's PF row is 2 GPUs at c ~ 0.54. With a draw of its own per app both
    rows were lost in about a fifth of the rounds, and D26 then gave all 4 GPUs to the one ranked
    first (4/0). Under D38 the two draws sit half a circle apart, so with both c_i >= 1/2 one row is
    always kept, and the other's row goes back to the app that lost it (the only one left wanting
    GPUs): 2/2 in every seed."""
    lost_both_before = 0
    for seed in range(30):
        result = _searches_on_four_gpus(seed)
        outcome = result.decision.auction
        assert set(outcome.pf) == {"a", "b"} and all(len(g) == 2 for g in outcome.pf.values())
        c = outcome.hidden_payment
        assert all(0.5 <= c[a] < 1 for a in outcome.pf)
        assert outcome.granted, f"seed {seed}: the auction handed out nothing"
        held = {a: sum(len(g.gpus) for g in result.grants if g.app == a) for a in ("a", "b")}
        assert held == {"a": 2, "b": 2}
        before = independent_draws(seed, outcome.pf)
        lost_both_before += all(before[a] >= c[a] for a in outcome.pf)
    assert lost_both_before > 0  # what the independent draws did with the same c_i


def _random_payments(rng: random.Random) -> dict[str, float]:
    n = rng.randint(1, 9)
    pick = [0.0, 1.0, 0.5, 1 / 3, rng.random(), rng.random(), rng.random()]
    return {f"app{k}": rng.choice(pick) for k in range(n)}


def test_each_winner_keeps_its_row_with_probability_exactly_its_hidden_payment():
    """Exact, not sampled: over the pieces of the one shared draw u on which the outcome is constant
    (:func:`cells`, their lengths summing to 1), each winner's draw is below its c_i on pieces whose
    lengths sum to c_i -- the marginal of D15, whatever the other winners and their c_j."""
    rng = random.Random(38)
    for _ in range(500):
        c = _random_payments(rng)
        pieces = cells(c)
        assert math.isclose(sum(w for _, w in pieces), 1.0, abs_tol=1e-12)
        kept = dict.fromkeys(c, 0.0)
        for u, w in pieces:
            draws = rotated_draws(u, c)
            for app in c:
                kept[app] += w * (draws[app] < c[app])
        for app in c:
            assert math.isclose(kept[app], c[app], abs_tol=1e-12), (c, app, kept[app])


def test_each_draw_alone_is_a_rotation_of_the_shared_one():
    """Why the marginal is exact (the proof behind the test above): winner k of n draws
    (u + k/n) mod 1, a rotation of the circle, which keeps the uniform measure; so each draw is
    uniform whoever else won, and nothing an app reports moves its own draw's law."""
    for n in range(1, 8):
        apps = [f"x{k}" for k in range(n)]
        for u in (0.0, 0.123, 0.5, 0.999):
            draws = rotated_draws(u, apps)
            assert sorted(draws) == apps
            for k, app in enumerate(apps):
                assert math.isclose(draws[app], (u + k / n) % 1.0)
            gaps = sorted(draws.values())
            assert all(math.isclose(b - a, 1 / n) for a, b in zip(gaps, gaps[1:]))
    assert set(auction_draws(7, ["b", "a"])) == {"a", "b"}
    assert auction_draws(7, ["a", "b"]) == rotated_draws(shared_draw(7), ["a", "b"])


def test_when_every_hidden_payment_is_at_least_one_nth_some_winner_keeps_its_row():
    """The round in which the auction hands out nothing: with independent draws its chance is the
    product of the (1 - c_i); with the draws 1/n apart one of them is always below 1/n."""
    rng = random.Random(3)
    for _ in range(300):
        n = rng.randint(1, 8)
        c = {f"a{k}": rng.uniform(1 / n, 1.0) for k in range(n)}
        for u, _ in cells(c):
            draws = rotated_draws(u, c)
            assert any(draws[a] < c[a] for a in c)


def test_at_the_default_knob_two_searches_swing_without_any_lottery():
    """The 4/0 the issue saw at D6's default f = 0.8: with two apps ceil(0.2 x 2) = 1 bids, wins its
    best row (all 4 GPUs) at c = 1 -- nobody else bid -- and the other, the reserve (D14), finds
    nothing left. No draw decides it, so D38 does not change it."""
    result = _searches_on_four_gpus(0, fairness_knob=0.8)
    outcome = result.decision.auction
    assert len(outcome.contenders) == 1 and outcome.hidden_payment[outcome.contenders[0]] == 1.0
    held = sorted(sum(len(g.gpus) for g in result.grants if g.app == a) for a in ("a", "b"))
    assert held == [0, 4]


def test_with_two_bidders_at_least_the_two_searches_share_at_the_default_knob():
    """D41's option: at f = 0.8 the auction still takes two of the two apps, so the 4/0 of D6's
    single bidder becomes the PF's 2/2 (c ~ 0.54 each, and under D38 one row is always kept while
    the other goes back to the app that lost it), in every seed."""
    for seed in range(10):
        result = _searches_on_four_gpus(seed, fairness_knob=0.8, min_bidders=2)
        outcome = result.decision.auction
        assert set(outcome.contenders) == {"a", "b"}
        assert all(0.5 <= outcome.hidden_payment[a] < 1 for a in outcome.pf)
        held = {a: sum(len(g.gpus) for g in result.grants if g.app == a) for a in ("a", "b")}
        assert held == {"a": 2, "b": 2}, f"seed {seed}: {held}"


def test_min_bidders_never_takes_more_apps_than_are_ranked_and_refuses_nonsense():
    from arbiter.policies.themis import filtered

    assert [filtered(n, 0.8, 2) for n in range(7)] == [0, 1, 2, 2, 2, 2, 2]
    assert [filtered(n, 0.8) for n in range(7)] == [0, 1, 1, 1, 1, 1, 2]
    assert filtered(20, 0.8, 2) == 4
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="min_bidders"):
            make_policy("themis", min_bidders=bad)
