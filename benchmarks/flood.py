"""Unauthenticated megabytes against a real arbiter: its memory, and how long everyone else waits.

The attack an audit ran on the service: 100 streams with no known credential, each sending one big
first message (7.9 MB then took the arbiter to 1.55 GB and stalled it for 3.8 s). The arbiter now
takes messages of at most 4 MB and reads at most a few first messages of unknown streams at once
(docs/service.md, "Limits"). This script starts ``python -m arbiter.cli serve`` in its own process,
a probe in another process (a health check and a small authenticated admin call, RoundHistory, back
to back every ``--every`` seconds: what any other agent or operator waits), lets the probe run
``--quiet`` seconds alone, then sends the flood from this process and keeps probing until it is
over. For each message size of ``--sizes`` (MB) it reports the arbiter's peak RSS before and after
(VmHWM), the probe's latencies before and during the flood, the statuses the streams ended with,
and the machine's load. The goal (issue: production-grade service) is under 200 MB of memory and no
call of another client delayed by more than 100 ms.

Run ``python benchmarks/flood.py [--streams 100] [--sizes 3.9,7.9] [--out FILE]``; results go to
``benchmarks/results/flood.json`` by default. ``--probe TARGET OUT UNTIL`` is the probe process's
entry point (internal).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from machine import machine_info
from rich.console import Console
from rich.table import Table
from service import ADMIN, REPO, free_port, memory_mb, stats, wait_serving

from protos import themis_pb2 as pb
from protos import themis_pb2_grpc as pb_grpc
from protos.rpc import channel

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "flood.json"
GOAL_MB = 200.0
GOAL_DELAY_S = 0.1


async def probe(target: str, out: Path, until: float, every_s: float) -> None:
    """(sent at, health s, admin s) until ``until`` (wall clock), written to ``out`` as JSON."""
    rows = []
    meta = [("authorization", f"Bearer {ADMIN}")]
    async with channel(target) as ch:
        health, stub = health_pb2_grpc.HealthStub(ch), pb_grpc.ArbiterStub(ch)
        while time.time() < until:
            sent = time.time()
            started = time.perf_counter()
            await health.Check(health_pb2.HealthCheckRequest(), timeout=30)
            checked = time.perf_counter()
            await stub.RoundHistory(pb.RoundHistoryRequest(limit=1), metadata=meta, timeout=30)
            rows.append((sent, checked - started, time.perf_counter() - checked))
            await asyncio.sleep(every_s)
    out.write_text(json.dumps(rows))


async def one_stream(ch, size_mb: float, hold_s: float) -> str:
    big = pb.AgentMessage(hello=pb.Hello(app="x" * int(size_mb * 1_000_000)))

    async def send():
        yield big
        await asyncio.sleep(hold_s)

    call = pb_grpc.ArbiterStub(ch).Connect(send(), metadata=[("authorization", "Bearer app_nobody")])
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    return "OK"


async def flood(target: str, streams: int, size_mb: float) -> tuple[dict[str, int], float, float]:
    channels = [channel(target) for _ in range(10)]
    started = time.time()
    codes = await asyncio.gather(*(one_stream(channels[k % 10], size_mb, 3.0) for k in range(streams)))
    ended = time.time()
    for ch in channels:
        await ch.close()
    counts: dict[str, int] = {}
    for code in codes:
        counts[code] = counts.get(code, 0) + 1
    return counts, started, ended


async def run_size(size_mb: float, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    port = free_port()
    target = f"127.0.0.1:{port}"
    log = workdir / f"arbiter-{size_mb}.log"
    cmd = [sys.executable, "-m", "arbiter.cli", "serve", "--cluster", "sim-256", "--port", str(port),
           "--db", str(workdir / f"arbiter-{size_mb}.db"), "--admin-token", ADMIN, "--log-level", "WARNING"]
    with log.open("wb") as log_file:
        arbiter = subprocess.Popen(cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        await wait_serving(target, arbiter, log)
        before = memory_mb(arbiter.pid)["VmHWM"]
        probe_out = workdir / f"probe-{size_mb}.json"
        until = time.time() + args.quiet + args.window
        prober = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--probe", target, str(probe_out),
                                   str(until), str(args.every)], cwd=REPO)
        await asyncio.sleep(args.quiet)
        loads = [os.getloadavg()[0]]
        counts, started, ended = await flood(target, args.streams, size_mb)
        loads.append(os.getloadavg()[0])
        after = memory_mb(arbiter.pid)["VmHWM"]
        await asyncio.to_thread(prober.wait, args.quiet + args.window + 60)
        rows = json.loads(probe_out.read_text())
        alive = arbiter.poll() is None
    finally:
        arbiter.kill()
        arbiter.wait()
    quiet = [r for r in rows if r[0] < started]
    during = [r for r in rows if started <= r[0] <= ended]
    worst_quiet = max((max(h, a) for _, h, a in quiet), default=0.0)
    worst_during = max((max(h, a) for _, h, a in during), default=None)
    return {
        "size_mb": size_mb, "streams": args.streams, "statuses": counts, "flood_s": ended - started,
        "peak_rss_mb_before": before, "peak_rss_mb_after": after, "peak_rss_growth_mb": after - before,
        "health_s_quiet": stats([h for _, h, _ in quiet]), "admin_s_quiet": stats([a for _, _, a in quiet]),
        "health_s_during": stats([h for _, h, _ in during]), "admin_s_during": stats([a for _, _, a in during]),
        "worst_call_quiet_s": worst_quiet, "worst_call_during_s": worst_during,
        "delay_over_quiet_s": None if worst_during is None else worst_during - worst_quiet,
        "arbiter_alive": alive, "load_1min": loads,
    }


def table(cells: list[dict[str, Any]]) -> Table:
    t = Table(title="Unauthenticated first messages: the arbiter's memory and other clients' calls")
    for name in ("MB x streams", "statuses", "flood", "peak RSS before -> after", "health p95 / max quiet",
                 "health p95 / max during", "admin p95 / max during", "worst call during", "load"):
        t.add_column(name, justify="right")
    for c in cells:
        def pm(s):
            return "-" if s["p95"] is None else f"{s['p95'] * 1000:.0f} / {s['max'] * 1000:.0f} ms"
        t.add_row(f"{c['size_mb']} x {c['streams']}", ", ".join(f"{k} {v}" for k, v in sorted(c["statuses"].items())),
                  f"{c['flood_s']:.1f} s", f"{c['peak_rss_mb_before']:.0f} -> {c['peak_rss_mb_after']:.0f} MB",
                  pm(c["health_s_quiet"]), pm(c["health_s_during"]), pm(c["admin_s_during"]),
                  "-" if c["worst_call_during_s"] is None else f"{c['worst_call_during_s'] * 1000:.0f} ms",
                  " / ".join(f"{x:.1f}" for x in c["load_1min"]))
    return t


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--sizes", default="3.9,7.9", help="comma-separated first-message sizes (MB)")
    parser.add_argument("--quiet", type=float, default=3.0, help="seconds probed before the flood")
    parser.add_argument("--window", type=float, default=12.0, help="seconds probed from the flood's start")
    parser.add_argument("--every", type=float, default=0.02, help="seconds between probes")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--probe", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        target, out, until, every = args.probe
        asyncio.run(probe(target, Path(out), float(until), float(every)))
        return 0
    console = Console(width=170)
    cells = []
    with tempfile.TemporaryDirectory(prefix="themis-flood-") as tmp:
        for size in (float(x) for x in args.sizes.split(",")):
            console.print(f"{args.streams} streams x {size} MB ...")
            cells.append(asyncio.run(run_size(size, args, Path(tmp))))
    growth = max(c["peak_rss_growth_mb"] for c in cells)
    delays = [c["delay_over_quiet_s"] for c in cells if c["delay_over_quiet_s"] is not None]
    goal = {"memory_goal_mb": GOAL_MB, "memory_met": growth < GOAL_MB, "delay_goal_s": GOAL_DELAY_S,
            "worst_delay_over_quiet_s": max(delays) if delays else None,
            "delay_met": bool(delays) and max(delays) < GOAL_DELAY_S}
    console.print(table(cells))
    console.print(f"goal: peak RSS growth {growth:.0f} MB (< {GOAL_MB:.0f}: {'met' if goal['memory_met'] else 'NOT MET'}); "
                  f"worst call during the flood, less the worst before it: "
                  f"{(goal['worst_delay_over_quiet_s'] or 0) * 1000:.0f} ms (< {GOAL_DELAY_S * 1000:.0f} ms: "
                  f"{'met' if goal['delay_met'] else 'NOT MET'})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine_info(), "settings": {k: v for k, v in vars(args).items()
                                                                           if k not in ("out", "probe")},
                                    "goal": goal, "cells": cells}, indent=1) + "\n")
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
