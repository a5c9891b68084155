"""D30 on a real arbiter with real agents and real job processes: a search of short trials that pay
a start-up every rung reports a rho like a search of long trials when both hold their fair share.

Issue 36: a Hyperband app whose jobs took about 6 s to start and milliseconds per iteration reported
rho 35-40 on its fair share, and won GPUs from an app at 7.7, because T_id had no start-up in it.
Here two one-trial searches share a 2-GPU arbiter (N_avg 2, so one GPU each is the fair share, and
each wants one GPU): both jobs sleep ``START_S`` before their first iteration; the short search's
rungs are a few 20 ms iterations, the long one's add up to seconds. Each rung restarts its trial.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
from pathlib import Path

from agent.runner import AppRunner
from hyperparam_adapters.hyperband import BracketTuner, Rung
from tests.service_kit import ADMIN, arbiter, cluster_file, target, wait_for

ROOT = Path(__file__).resolve().parents[1]
START_S = 1.0
CLUSTER_2 = """
name = "test-2"
[[racks]]
name = "r0"
machines = [{ gpus = 2, slots = 1, count = 1 }]
"""
JOB = textwrap.dedent("""
    import sys, time
    from agent.job import Job
    time.sleep(float(sys.argv[1]))  # start-up: imports, data, model
    job = Job.from_env()
    state = job.resume() or {"it": 0}
    it = state["it"]
    while True:
        time.sleep(float(sys.argv[2]))
        it += 1
        if job.step(it, 1.0 / it):
            break
    job.save({"it": it})
""")


async def _search(server, script: Path, tmp_path: Path, name: str, iteration_s: float) -> AppRunner:
    adapter = BracketTuner({"lr": [0.1]}, [[Rung(1, 2), Rung(1, 4), Rung(1, 8)]], iter_time=iteration_s)
    token = await AppRunner.token(target(server), name, ADMIN)
    return await AppRunner.create(adapter, [sys.executable, str(script), str(START_S), str(iteration_s)], app=name,
                                  arbiter=target(server), token=token, workdir=str(tmp_path / name),
                                  cluster="test-2", grace_s=5.0, env={"PYTHONPATH": str(ROOT)}, quiet=True,
                                  rho_every_s=0.1)


def test_a_short_trial_search_reports_a_rho_like_a_long_trial_one_on_its_fair_share(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)

    async def scenario():
        async with arbiter(tmp_path, cluster=str(cluster_file(tmp_path, CLUSTER_2)), lease_s=600.0) as server:
            short = await _search(server, script, tmp_path, "short", 0.02)
            long_ = await _search(server, script, tmp_path, "long", 0.5)
            tasks = [asyncio.create_task(r.run(timeout=120)) for r in (short, long_)]
            # each at its last rung, its trial starting again (two start-ups measured, the third being
            # paid): its rho as the runner samples it on what it holds, a sample taken from then on
            at_last_rung = {}

            def sampled(r: AppRunner) -> bool:
                if r.app not in at_last_rung and r.adapter.current_phase() == 3 and len(r.start_ups) >= 2:
                    at_last_rung[r.app] = len(r.rho_now)
                return r.app in at_last_rung and len(r.rho_now) > at_last_rung[r.app]

            await wait_for(lambda: all([sampled(short), sampled(long_)]), 90)
            at_last_rung = {r.app: (r.rho_now[-1][1], len(r.client.held)) for r in (short, long_)}
            await asyncio.gather(*tasks)
            return short, long_, at_last_rung

    short, long_, at_last_rung = asyncio.run(asyncio.wait_for(scenario(), 150))
    assert all(r.adapter.start_up_s >= START_S for r in (short, long_))  # measured, launch to first report
    (rho_short, held_short), (rho_long, held_long) = at_last_rung["short"], at_last_rung["long"]
    assert held_short == held_long == 1  # each on its fair share
    # before D30 the short search's rho was over 10 times the long one's here (its T_id was ~0.1 s)
    assert 1 / 2 < rho_short / rho_long < 2, at_last_rung
