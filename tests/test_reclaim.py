"""D27 on a real arbiter: leases beyond a fair share end when an app that holds nothing connects."""

from __future__ import annotations

import asyncio

from agent.agent import Agent
from agent.client import AgentClient
from tests.service_kit import arbiter, credential, halving_app, target, wait_for


def test_an_app_that_connects_to_a_full_cluster_is_served_from_leases_beyond_a_share_at_once(tmp_path):
    """D27 on a real arbiter: "big" holds all 8 GPUs under 10-minute leases; "small" connects
    holding nothing. Its arrival is an event; the round ends the leases big holds beyond its share
    (8 / 2 = 4), revokes the GPUs that moved with the reason "reclaimed", and small runs at once
    instead of after the expiry."""
    async def scenario():
        async with arbiter(tmp_path, lease_s=600.0) as server:
            big = AgentClient(Agent(halving_app(jobs=8)), "big", target(server), await credential(server, "big"),
                              backoff_s=(0.05, 0.5))
            revoked = []
            big.on_revoke = lambda gpus, reason: revoked.append((sorted(gpus), reason))
            t1 = asyncio.create_task(big.run())
            await wait_for(lambda: len(big.held) == 8)
            small = AgentClient(Agent(halving_app(jobs=2)), "small", target(server),
                                await credential(server, "small"), backoff_s=(0.05, 0.5))
            t2 = asyncio.create_task(small.run())
            await wait_for(lambda: len(small.held) >= 1, 15)
            held = dict(small.held)
            engine = server.service.engine
            for client in (big, small):
                client.stop()
            await asyncio.gather(t1, t2)
            return held, revoked, engine.lease_s

    held, revoked, lease_s = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert revoked and all(reason.startswith("reclaimed") for _, reason in revoked)
    assert set(held) <= {g for gpus, _ in revoked for g in gpus}  # what small got is what big lost
    assert lease_s == 600.0  # nothing expired: a lease runs 600 s
