"""D24: a round's randomness is public in a simulation and secret, committed and revealed in a service.

The audit predicted the service's auction seed in 20 of 20 rounds: it followed from seed 0, the
round id and the number of ranked apps, all of which an app sees. These tests hold the engine and
a real arbiter to the decision: a secret from the CSPRNG, journaled (a restart draws as before),
SHA-256 of each round's seed sent with the rho requests, the seed revealed once the round closed.
"""

from __future__ import annotations

import asyncio
import hashlib
import math

from agent.agent import Agent
from agent.client import AgentClient
from arbiter.cluster import load_cluster
from arbiter.lottery import RoundSeeds, commitment, new_secret, verify
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

