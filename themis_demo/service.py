"""``themis-arbiter demo`` (also ``python -m themis_demo.service``): the service end to end in one
process, on loopback.

An arbiter on a free port (journal in a temporary folder, in-memory events unless ``--mqtt``),
a 16-GPU cluster and two successive-halving apps whose agents register with admin-issued tokens,
connect over gRPC, report rho, bid, and run their jobs emulated on what they are granted (50x real
time). Leases are 15 s, so rounds, grants and lease expiries go by on screen; at the end each app's
completion time and the number of rounds are printed.

With ``--contention deepshare`` (D35) the arbiter models network contention: the cluster is four
4-GPU machines and the apps' jobs take up to 6 GPUs, so some span machines and share their network;
emulated jobs slow down by the table next to the other app's jobs, their agents' profilers measure
it, and a line is printed whenever a job's ratio (the table's and the measured one, as the arbiter
publishes them on ``.../jobs/<job>/contention``) changes.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from agent.agent import Agent
from agent.appsched import SuccessiveHalvingApp
from agent.client import AgentClient
from agent.emulated import EmulatedJobs
from agent.placement import load_profiles
from arbiter.server import ArbiterServer, ServerConfig
from protos.rpc import issue_token, register

DEMO_CLUSTER = """
name = "demo-16"
description = "two 8-GPU machines with 4 slots each, in one rack"
[[racks]]
name = "r0"
machines = [{ gpus = 8, slots = 4, count = 2 }]
"""


#: D35's demo: four 4-GPU machines, so a job of more than four GPUs spans machines
CONTENTION_CLUSTER = """
name = "demo-16"
description = "four 4-GPU machines with 2 slots each, in one rack"
[[racks]]
name = "r0"
machines = [{ gpus = 4, slots = 2, count = 4 }]
"""
CONTENTION_JOB_GPUS = 6


#: each demo app's model: its slowdowns, and what the admin binds its token to, so the arbiter ranks
#: it by its work at the model's slowdowns (D21)
DEMO_MODELS = {"vgg-search": "vgg16", "lm-search": "lm"}


def demo_apps(job_gpus: int = 2) -> dict[str, SuccessiveHalvingApp]:
    profiles = load_profiles()
    return {
        "vgg-search": SuccessiveHalvingApp([80, 100, 100, 120, 90, 110, 95, 105], [8, 16, 24, 36],
                                           job_demand_max=job_gpus,
                                           slowdown=profiles[DEMO_MODELS["vgg-search"]].slowdown, grow_demand=True),
        "lm-search": SuccessiveHalvingApp([60, 70, 65, 75], [10, 20, 40], job_demand_max=job_gpus,
                                          slowdown=profiles[DEMO_MODELS["lm-search"]].slowdown, grow_demand=True),
    }


async def show_contention(events, started: float, out) -> None:
    """A line per change of a job's contention ratio, the table's or the measured one (D35)."""
    shown: dict[str, tuple[float, float | None]] = {}
    async for event in events:
        j = event.payload
        if not j:
            continue
        app, job = event.topic.split("/")[-4], event.topic.split("/")[-2]
        now = (round(j["expected"], 2), None if j["measured"] is None else round(j["measured"], 2))
        if shown.get(event.topic) == now or now[1] is None:
            continue
        shown[event.topic] = now
        print(f"t={j['now'] - started:6.1f}s contention: {app}/{job} on {len(j['gpus'])} GPUs over "
              f"{j['machines']} machine{'s' if j['machines'] > 1 else ''} ({j['cls']}): table {now[0]:.2f}, "
              f"measured {now[1]:.2f}", file=out)


async def _demo(seconds: float, mqtt: str | None, out=sys.stdout, *, speedup: float = 50.0, lease_s: float = 15.0,
                contention: str | None = None) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Path(tmp) / "demo-16.toml"
        cluster.write_text(CONTENTION_CLUSTER if contention else DEMO_CLUSTER)
        server = ArbiterServer(ServerConfig(cluster=str(cluster), port=0, db=Path(tmp) / "arbiter.db", mqtt=mqtt,
                                            admin_token="demo-admin", lease_s=lease_s, report_timeout_s=1.0,
                                            bid_timeout_s=1.0, contention=contention))
        port = await server.start()
        target = f"127.0.0.1:{port}"
        print(f"arbiter on {target}, cluster demo-16 (16 GPUs), lease {lease_s:g} s, f = 0.8", file=out)
        events = server.service.bus.subscribe("themis/demo-16/rounds")
        started = time.time()

        async def show_rounds():
            async for event in events:
                r = event.payload
                grants = ", ".join(f"{a} +{n}" for a, n in sorted(r["granted"].items())) or "-"
                rho = ", ".join(f"{a} {'inf' if v is None else f'{v:.2f}'}" for a, v in sorted(r["rho"].items()))
                print(f"t={r['now'] - started:6.1f}s round {r['round_id']:3d}: {r['offered']:2d} free, "
                      f"{r['expired']:2d} expired, bidders {r['bidders'] or '-'}, granted {grants}, "
                      f"{r['idle']} idle; rho {rho or '-'}", file=out)

        printers = [asyncio.create_task(show_rounds())]
        if contention:
            print(f"network contention on (D35, table {contention}): jobs take up to {CONTENTION_JOB_GPUS} GPUs",
                  file=out)
            ratios = server.service.bus.subscribe("themis/demo-16/apps/+/jobs/+/contention")
            printers.append(asyncio.create_task(show_contention(ratios, started, out)))
        runs = []
        for name, app in demo_apps(CONTENTION_JOB_GPUS if contention else 2).items():
            app.start_time = time.time()
            token = await issue_token(target, name, "demo-admin", model=DEMO_MODELS[name])
            credential = await register(target, name, token)
            client = AgentClient(Agent(app), name, target, credential)
            jobs = EmulatedJobs(client, app, speedup=speedup)
            runs.append((name, app, client, jobs, asyncio.create_task(client.run()), asyncio.create_task(jobs.run())))
            await asyncio.sleep(100.0 / speedup)
        await asyncio.wait([r[5] for r in runs], timeout=seconds)
        summary = []
        for name, app, client, jobs, runner, job_task in runs:
            summary.append({"app": name, "finished": jobs.finished_at is not None,
                            "completion_s": round(jobs.finished_at - app.start_time, 1) if jobs.finished_at else None,
                            "connects": client.connects, "rejections": len(client.rejections),
                            "model": server.service.models.get(name),
                            "claims_refused": sum("work" in r.reason for r in client.rejections)}
                           | ({"lowest_ratio": round(jobs.lowest_ratio, 3)} if contention else {}))
            client.stop()
            job_task.cancel()
        await asyncio.gather(*(r[4] for r in runs), *(r[5] for r in runs), return_exceptions=True)
        rounds = server.service.rounds_run
        for printer in printers:
            printer.cancel()
        await server.stop()
        print(json.dumps({"rounds": rounds, "apps": summary}, indent=1), file=out)
        return 0 if all(s["finished"] for s in summary) else 1


def run_demo(seconds: float = 60.0, mqtt: str | None = None, *, speedup: float = 50.0, lease_s: float = 15.0,
             contention: str | None = None) -> int:
    return asyncio.run(_demo(seconds, mqtt, speedup=speedup, lease_s=lease_s, contention=contention))


def main(argv: list[str] | None = None) -> int:
    """``python -m themis_demo.service [--seconds 60] [--mqtt URL]`` (what ``themis-arbiter demo`` runs)."""
    import argparse

    parser = argparse.ArgumentParser(prog="themis-arbiter demo", description="an arbiter and two agents on "
                                     "loopback, in one process")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--mqtt", help="also publish events to this broker")
    parser.add_argument("--contention", metavar="deepshare|FILE",
                        help="model network contention (D35) with this table; bigger jobs on four machines")
    args = parser.parse_args(argv)
    try:
        return run_demo(seconds=args.seconds, mqtt=args.mqtt, contention=args.contention)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
