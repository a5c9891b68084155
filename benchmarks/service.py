"""The arbiter service under load: N connected apps, round latency, CPU and memory.

A real arbiter (``python -m arbiter.cli serve`` in its own process, so its CPU time and memory are
its own) schedules the shipped ``sim-256`` cluster with short leases, so rounds come every few
seconds; N apps -- real ``AgentClient`` objects with the real fairness and bidding code -- run in a
few client processes of their own (``--client-procs``), each app a successive-halving search that
wants 2 to 32 GPUs (11 on average), so the cluster is oversubscribed several times over. Jobs end now
and then (``--churn``: each app holding GPUs gives one back every 60 s on average and keeps its
demand, as a search starting its next trial would), so besides lease expiries there are releases
and rounds come every few seconds. For each N of ``--apps``
the script registers the apps (N IssueToken + N Register calls, concurrently), connects them all,
lets ``--warmup`` seconds pass, then measures for ``--seconds``:

* round latency as the server records it (RoundHistory ``latency_s``: from opening the round to
  the allocation, i.e. reports + offers + bids + auction; journaling and sending grants come after)
  -- median and p95 over the rounds opened in the window;
* round latency as agents see it: from the round's ``now`` (the arbiter's clock when it opened the
  round, carried in the RhoRequest) to the receipt of the round's last Grant, per round; and per
  grant;
* rounds, apps asked for rho and bidders (apps offered GPUs) per round, GPUs offered and granted,
  rounds in which some app missed the report or bid deadline;
* the same latency apart for rounds with and without a mass expiry (>= 100 leases ran out as the
  round opened) -- issue 12, item 8;
* how long a health check and a small admin call (RoundHistory) took, probed every 0.25 s during
  the window: the auction runs in a worker thread, so they must not wait behind it (issue 12, item 5);
* the arbiter's CPU (% of one core, from /proc/<pid>/stat) and peak RSS (VmHWM, /proc/<pid>/status);
  and, to tell a slow arbiter from a busy machine, the client processes' CPU and the whole machine's
  (from /proc/stat: other users' processes included) and its 1-minute load average, sampled during
  the window (os.getloadavg).

The goal (issue: the arbiter service) is 500 connected apps with a round p95 under 2 s; the output
says whether it was met, on the server's and on the agents' clock.

Run ``python benchmarks/service.py [--apps 100,500] [--seconds 60] [--lease 10] [--out FILE]``;
results go to ``benchmarks/results/service.json`` by default. ``--worker SPEC`` is the client
process's entry point (internal).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from machine import machine_info
from rich.console import Console
from rich.table import Table

from agent.agent import Agent
from agent.appsched import SuccessiveHalvingApp
from agent.client import AgentClient
from protos import themis_pb2 as pb
from protos import themis_pb2_grpc as pb_grpc
from protos.rpc import channel

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "service.json"
ADMIN = "benchmark-admin-token"
GOAL_APPS = 500
GOAL_P95_S = 2.0
MASS_EXPIRY = 100  # a round in which at least this many leases ran out together (issue 12: 3.6-4.2 s at 500 apps)
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


# -- the client processes --------------------------------------------------------------------------


class TimedClient(AgentClient):
    """An AgentClient that notes when each rho request, offer and grant arrives (and how long the
    real report and bid code took), for the latencies agents see."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.round_now: dict[int, float] = {}
        self.grants: list[tuple[int, float, int, str]] = []  # (round_id, received at, GPUs, source)
        self.compute: list[tuple[str, float]] = []
        self.offers = 0

    def _handle(self, msg: pb.ArbiterMessage) -> None:
        received = time.time()
        kind = msg.WhichOneof("kind")
        if kind == "rho_request":
            self.round_now[msg.rho_request.round_id] = msg.rho_request.now
        elif kind == "offer":
            self.round_now.setdefault(msg.offer.round_id, msg.offer.now)
            self.offers += 1
        elif kind == "grant":
            self.grants.append((msg.grant.round_id, received, len(msg.grant.gpus), msg.grant.source))
        started = time.perf_counter()
        super()._handle(msg)
        if kind in ("rho_request", "offer"):
            self.compute.append((kind, time.perf_counter() - started))


def make_app(spec: dict[str, Any]) -> SuccessiveHalvingApp:
    app = SuccessiveHalvingApp(spec["iter_times"], spec["iterations"], job_demand_max=spec["job_demand"],
                               slowdown=tuple(spec["slowdown"]))
    app.start_time = spec["start_time"]
    return app


async def worker(spec_path: Path) -> None:
    logging.getLogger("themis.agent").setLevel(logging.ERROR)  # rejections are counted, not printed
    spec = json.loads(spec_path.read_text())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    clients = [TimedClient(Agent(make_app(a)), a["name"], spec["target"], a["credential"], backoff_s=(0.2, 2.0))
               for a in spec["apps"]]
    tasks = []
    for c in clients:  # a short stagger: the arbiter sees a stream of arrivals, not one burst
        tasks.append(asyncio.create_task(c.run()))
        await asyncio.sleep(0.002)
    releases = 0

    async def churn() -> None:
        """A job of an app holding GPUs ends now and then (Poisson, mean ``churn_s`` per app): the
        app gives that GPU back and keeps its demand, as a search starting its next trial would."""
        nonlocal releases
        rng = random.Random(spec["seed"])
        tick = 0.1
        while True:
            await asyncio.sleep(tick)
            now = time.time()
            for c in clients:
                if c.held and rng.random() < tick / spec["churn_s"]:
                    live = sorted(g for g, h in c.held.items() if h.expires_at > now + 0.5)  # not expiring now
                    if live:
                        c.release([rng.choice(live)])
                        releases += 1

    churner = asyncio.create_task(churn()) if spec["churn_s"] > 0 else None
    await stop.wait()
    if churner is not None:
        churner.cancel()
    for c in clients:
        c.stop()
    await asyncio.wait(tasks, timeout=10)
    out = {
        "apps": len(clients),
        "connects": sum(c.connects for c in clients),
        "rejections": sum(len(c.rejections) for c in clients),
        "offers": sum(c.offers for c in clients),
        "releases": releases,
        "grants": [(c.app, rid, c.round_now.get(rid), t, n, source)
                   for c in clients for rid, t, n, source in c.grants],
        "compute": [(kind, s) for c in clients for kind, s in c.compute],
    }
    Path(spec["out"]).write_text(json.dumps(out))


# -- the arbiter process ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies over all CPUs since boot, from /proc/stat."""
    values = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def memory_mb(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(value.split()[0]) / 1024
    return out


async def wait_serving(target: str, proc: subprocess.Popen, log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with channel(target) as ch:
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the arbiter did not start:\n{log.read_text()[-2000:]}")
        await asyncio.sleep(0.1)


def app_specs(n: int, rng: random.Random) -> list[dict[str, Any]]:
    """Successive-halving searches of 2-16 jobs of 1-2 GPUs (2-32 GPUs wanted, ~11 on average)."""
    now = time.time()
    specs = []
    for k in range(n):
        jobs = rng.choice((2, 4, 4, 8, 8, 16))
        specs.append({
            "name": f"app{k:04d}",
            "iter_times": [round(rng.uniform(5.0, 60.0), 3) for _ in range(jobs)],
            "iterations": [float(rng.choice((500, 1000, 2000))), float(rng.choice((2000, 4000)))],
            "job_demand": rng.choice((1, 1, 1, 2)),
            "slowdown": rng.choice(((1.0, 1.05, 1.2, 1.5), (1.0, 1.1, 1.5, 2.0), (1.0, 1.0, 1.0, 1.1))),
            "start_time": now - rng.uniform(0, 600),
        })
    return specs


async def register_all(target: str, specs: list[dict[str, Any]], concurrency: int = 64) -> float:
    meta = [("authorization", f"Bearer {ADMIN}")]
    gate = asyncio.Semaphore(concurrency)
    started = time.perf_counter()
    async with channel(target) as ch:
        stub = pb_grpc.ArbiterStub(ch)

        async def one(spec):
            async with gate:
                token = (await stub.IssueToken(pb.IssueTokenRequest(app=spec["name"]), metadata=meta, timeout=30)).token
                reply = await stub.Register(pb.RegisterRequest(app=spec["name"]),
                                            metadata=[("authorization", f"Bearer {token}")], timeout=30)
                spec["credential"] = reply.credential

        await asyncio.gather(*(one(s) for s in specs))
    return time.perf_counter() - started


async def probe(target: str, until: float, every_s: float = 0.25) -> dict[str, list[float]]:
    """Every ``every_s`` during the window: a health check and a small admin call (how long
    each took, issue 12 item 5: they must not wait behind an auction), and the machine's 1-minute
    load average (issue 12 item 8: how busy the machine was while it was measured)."""
    out: dict[str, list[float]] = {"health_s": [], "admin_s": [], "load_1min": []}
    meta = [("authorization", f"Bearer {ADMIN}")]
    async with channel(target) as ch:
        health, stub = health_pb2_grpc.HealthStub(ch), pb_grpc.ArbiterStub(ch)
        while time.time() < until:
            started = time.perf_counter()
            await health.Check(health_pb2.HealthCheckRequest(), timeout=30)
            out["health_s"].append(time.perf_counter() - started)
            started = time.perf_counter()
            await stub.RoundHistory(pb.RoundHistoryRequest(limit=1), metadata=meta, timeout=30)
            out["admin_s"].append(time.perf_counter() - started)
            out["load_1min"].append(os.getloadavg()[0])
            await asyncio.sleep(every_s)
    return out


async def admin_call(target: str, method: str, request):
    async with channel(target) as ch:
        return await getattr(pb_grpc.ArbiterStub(ch), method)(
            request, metadata=[("authorization", f"Bearer {ADMIN}")], timeout=30)


def quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def stats(values: Sequence[float]) -> dict[str, float | None]:
    return {"n": len(values), "median": statistics.median(values) if values else None,
            "p95": quantile(values, 0.95), "max": max(values) if values else None,
            "mean": statistics.fmean(values) if values else None}


_DASHBOARD_MESSAGES: dict[int, int] = {}


async def follow_dashboard(api: str) -> None:
    """One open dashboard page, as the arbiter sees it: the page's first reads, then its live stream
    (server-sent events) read to the end; the messages it got are counted."""
    import aiohttp

    key = len(_DASHBOARD_MESSAGES)
    _DASHBOARD_MESSAGES[key] = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=None)) as session:
        for path in ("/cluster", "/apps", "/rounds", "/fairness", "/events", "/settings"):
            async with session.get(api + path) as reply:
                await reply.read()
        async with session.get(api + "/stream") as reply:
            async for line in reply.content:
                if line.startswith(b"event:"):
                    _DASHBOARD_MESSAGES[key] += 1


async def run_one(n: int, args: argparse.Namespace, console: Console, workdir: Path) -> dict[str, Any]:
    port = free_port()
    target = f"127.0.0.1:{port}"
    log = workdir / f"arbiter-{n}.log"
    cmd = [sys.executable, "-m", "arbiter.cli", "serve", "--cluster", args.cluster, "--port", str(port),
           "--db", str(workdir / f"arbiter-{n}.db"), "--admin-token", ADMIN, "--lease", str(args.lease),
           "--fairness-knob", str(args.fairness_knob), "--report-timeout", str(args.report_timeout),
           "--bid-timeout", str(args.bid_timeout), "--max-contenders", str(args.max_contenders),
           "--log-level", args.log_level]
    http_port = free_port() if args.dashboards else None
    if http_port is not None:
        cmd += ["--http", f"127.0.0.1:{http_port}"]
    with log.open("wb") as log_file:
        arbiter = subprocess.Popen(cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT)
    workers: list[subprocess.Popen] = []
    try:
        await wait_serving(target, arbiter, log)
        specs = app_specs(n, random.Random(args.seed * 1000 + n))
        register_s = await register_all(target, specs)
        console.print(f"[bold]{n} apps[/]: registered in {register_s:.1f} s; connecting them from "
                      f"{args.client_procs} client processes")
        outs = []
        for k in range(args.client_procs):
            part = specs[k::args.client_procs]
            spec_path, out = workdir / f"worker-{n}-{k}.json", workdir / f"worker-{n}-{k}.out.json"
            spec_path.write_text(json.dumps({"target": target, "apps": part, "out": str(out), "churn_s": args.churn,
                                             "seed": args.seed * 1000 + n * 10 + k}))
            workers.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path)],
                                            cwd=REPO))
            outs.append(out)
        connect_started = time.perf_counter()
        while True:
            apps = (await admin_call(target, "ListApps", pb.ListAppsRequest())).apps
            connected = sum(a.connected for a in apps)
            if connected == n:
                break
            if time.perf_counter() - connect_started > 120:
                raise SystemExit(f"only {connected} of {n} apps connected in 120 s")
            await asyncio.sleep(0.5)
        connect_s = time.perf_counter() - connect_started
        console.print(f"  all connected in {connect_s:.1f} s; warming up {args.warmup:.0f} s, then measuring "
                      f"{args.seconds:.0f} s")
        viewers = [asyncio.create_task(follow_dashboard(f"http://127.0.0.1:{http_port}/api/v1"))
                   for _ in range(args.dashboards)]
        await asyncio.sleep(args.warmup)
        t0, cpu0, busy0 = time.time(), cpu_seconds(arbiter.pid), machine_busy()
        clients0 = sum(cpu_seconds(w.pid) for w in workers)
        probes = asyncio.create_task(probe(target, t0 + args.seconds))
        await asyncio.sleep(args.seconds)
        t1, cpu1, busy1 = time.time(), cpu_seconds(arbiter.pid), machine_busy()
        clients1 = sum(cpu_seconds(w.pid) for w in workers)
        load = os.getloadavg()
        probed = await probes
        failed = [v.exception() for v in viewers if v.done() and not v.cancelled() and v.exception()]
        if failed:
            raise SystemExit(f"a dashboard page stopped following the arbiter: {failed[0]!r}")
        for viewer in viewers:
            viewer.cancel()
        await asyncio.gather(*viewers, return_exceptions=True)
        dashboard_messages = sum(_DASHBOARD_MESSAGES.values())
        memory = memory_mb(arbiter.pid)
        history = (await admin_call(target, "RoundHistory", pb.RoundHistoryRequest(limit=10_000))).rounds
        apps_end = (await admin_call(target, "ListApps", pb.ListAppsRequest())).apps
        leases_end = len((await admin_call(target, "ListLeases", pb.ListLeasesRequest())).leases)
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            w.wait(60)
        results = [json.loads(out.read_text()) for out in outs]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
        arbiter.send_signal(signal.SIGTERM)
        try:
            arbiter.wait(15)
        except subprocess.TimeoutExpired:
            arbiter.kill()

    rounds = [r for r in history if t0 <= r.now < t1]
    in_window = {r.round_id: r for r in rounds}
    server_latency = [r.latency_s for r in rounds]
    last_grant: dict[int, float] = {}
    per_grant = []
    by_source: dict[int, dict[str, int]] = {}
    for w in results:
        for _app, rid, now, received, gpus, source in w["grants"]:
            if rid in in_window:
                by_source.setdefault(rid, {}).setdefault(source, 0)
                by_source[rid][source] += gpus
            if rid in in_window and now is not None:
                per_grant.append(received - now)
                last_grant[rid] = max(last_grant.get(rid, 0.0), received - now)
    big = [r for r in rounds if r.expired >= MASS_EXPIRY]  # many leases ran out together
    agent_latency = list(last_grant.values())
    missed = [r for r in rounds if any("before the deadline" in why for why in r.rejected.values())]
    compute = {kind: [s * 1e3 for w in results for k, s in w["compute"] if k == kind]
               for kind in ("rho_request", "offer")}
    window = t1 - t0
    return {
        "apps": n,
        "dashboards": args.dashboards,
        "dashboard_messages": dashboard_messages if args.dashboards else 0,
        "window_s": window,
        "register_s": register_s,
        "connect_s": connect_s,
        "rounds": len(rounds),
        "rounds_per_min": len(rounds) / window * 60,
        "server_latency_s": stats(server_latency),
        "agent_latency_s": stats(agent_latency),
        "agent_grant_latency_s": stats(per_grant),
        "asked_per_round": stats([len(r.rho) for r in rounds]),
        "bidders_per_round": stats([len(r.bidders) for r in rounds]),
        "offered_per_round": stats([r.offered for r in rounds]),
        "granted_per_round": stats([sum(r.granted.values()) for r in rounds]),
        "idle_per_round": stats([r.idle for r in rounds]),
        "gpus_by_source": {src: sum(s.get(src, 0) for s in by_source.values())
                           for src in ("auction", "queue", "leftover", "policy")},
        "big_rounds": {"n": len(big), "expired_min": MASS_EXPIRY, "server_latency_s": stats([r.latency_s for r in big]),
                       "bidders": stats([len(r.bidders) for r in big]),
                       "reports_s": stats([r.reports_s for r in big]), "bids_s": stats([r.bids_s for r in big]),
                       "allocation_s": stats([r.allocation_s for r in big]),
                       "auction_gpus": sum(by_source.get(r.round_id, {}).get("auction", 0) for r in big),
                       "queue_gpus": sum(by_source.get(r.round_id, {}).get("queue", 0) for r in big),
                       "leftover_gpus": sum(by_source.get(r.round_id, {}).get("leftover", 0) for r in big)},
        "small_rounds_server_latency_s": stats([r.latency_s for r in rounds if r.expired < MASS_EXPIRY]),
        "health_check_s": stats(probed["health_s"]),
        "admin_call_s": stats(probed["admin_s"]),
        "load_1min_during": stats(probed["load_1min"]),
        "rounds_missing_deadlines": len(missed),
        "deadline_misses": sum(sum("before the deadline" in why for why in r.rejected.values()) for r in rounds),
        "arbiter_cpu_percent": (cpu1 - cpu0) / window * 100,
        "clients_cpu_percent": (clients1 - clients0) / window * 100,
        # everything on the machine (other users' processes included), in % of one core: contention
        "machine_cpu_percent": (busy1[0] - busy0[0]) / (busy1[1] - busy0[1]) * 100 * (os.cpu_count() or 1),
        "loadavg_1_5_min": list(load[:2]),
        "arbiter_peak_rss_mb": memory.get("VmHWM"),
        "arbiter_rss_mb": memory.get("VmRSS"),
        "connected_at_end": sum(a.connected for a in apps_end),
        "leases_at_end": leases_end,
        "agent_connects": sum(w["connects"] for w in results),
        "agent_rejections": sum(w["rejections"] for w in results),
        "agent_releases": sum(w["releases"] for w in results),
        "agent_report_ms": stats(compute["rho_request"]),
        "agent_bid_ms": stats(compute["offer"]),
        "phases_s": {name: stats([getattr(r, name) for r in rounds]) for name in ("reports_s", "bids_s", "allocation_s")},
        "rounds_detail": [{"round_id": r.round_id, "now": r.now, "latency_s": r.latency_s, "asked": len(r.rho),
                           "reports_s": r.reports_s, "bids_s": r.bids_s, "allocation_s": r.allocation_s,
                           "expired": r.expired,
                           "bidders": len(r.bidders), "offered": r.offered, "granted": sum(r.granted.values()),
                           "agent_latency_s": last_grant.get(r.round_id), "by_source": by_source.get(r.round_id, {})}
                          for r in rounds],
    }


# -- the report ----------------------------------------------------------------------------------


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(cells: list[dict[str, Any]]) -> Table:
    t = Table(title="Arbiter service under load (sim-256)")
    for name in ("apps", "rounds", "server p50 / p95 (s)", "no mass expiry p50 / p95", "mass expiry p50 / p95 (n)",
                 "agents p50 / p95 (s)", "reports / bids per round", "GPUs offered / granted", "deadline misses",
                 "health / admin p95", "arbiter CPU", "peak RSS", "register / connect",
                 "clients / whole machine CPU", "load (1 min) mean / max"):
        t.add_column(name, justify="right")
    for c in cells:
        t.add_row(
            str(c["apps"]), f"{c['rounds']} ({c['rounds_per_min']:.1f}/min)",
            f"{fmt(c['server_latency_s']['median'], '.3f')} / {fmt(c['server_latency_s']['p95'], '.3f')}",
            f"{fmt(c['small_rounds_server_latency_s']['median'], '.3f')} / "
            f"{fmt(c['small_rounds_server_latency_s']['p95'], '.3f')}",
            f"{fmt(c['big_rounds']['server_latency_s']['median'], '.3f')} / "
            f"{fmt(c['big_rounds']['server_latency_s']['p95'], '.3f')} ({c['big_rounds']['n']})",
            f"{fmt(c['agent_latency_s']['median'], '.3f')} / {fmt(c['agent_latency_s']['p95'], '.3f')}",
            f"{fmt(c['asked_per_round']['mean'], '.0f')} / {fmt(c['bidders_per_round']['mean'], '.1f')}",
            f"{fmt(c['offered_per_round']['mean'], '.1f')} / {fmt(c['granted_per_round']['mean'], '.1f')}",
            f"{c['deadline_misses']} in {c['rounds_missing_deadlines']} rounds",
            f"{fmt(c['health_check_s']['p95'], '.3f')} / {fmt(c['admin_call_s']['p95'], '.3f')} s",
            f"{c['arbiter_cpu_percent']:.0f}%", f"{fmt(c['arbiter_peak_rss_mb'], '.0f')} MB",
            f"{c['register_s']:.1f} / {c['connect_s']:.1f} s",
            f"{c['clients_cpu_percent']:.0f}% / {c['machine_cpu_percent']:.0f}% of {os.cpu_count()} cores",
            f"{fmt(c['load_1min_during']['mean'])} / {fmt(c['load_1min_during']['max'])}",
        )
    return t


def goal(cells: list[dict[str, Any]]) -> dict[str, Any]:
    big = [c for c in cells if c["apps"] >= GOAL_APPS]
    if not big:
        return {"apps": GOAL_APPS, "p95_s": GOAL_P95_S, "measured": False, "met": None}
    c = max(big, key=lambda c: c["apps"])
    server, agents = c["server_latency_s"]["p95"], c["agent_latency_s"]["p95"]
    met_server = server is not None and server < GOAL_P95_S
    met_agents = agents is not None and agents < GOAL_P95_S
    return {"apps": GOAL_APPS, "p95_s": GOAL_P95_S, "measured": True, "at_apps": c["apps"],
            "server_p95_s": server, "agent_p95_s": agents, "connected": c["connected_at_end"],
            "met_server": met_server, "met_agents": met_agents,
            "met": met_server and met_agents and c["connected_at_end"] >= GOAL_APPS}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--apps", default="100,500", help="comma-separated numbers of connected apps")
    parser.add_argument("--seconds", type=float, default=60.0, help="measurement window per N")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds after all apps connected")
    parser.add_argument("--lease", type=float, default=10.0, help="lease length (s)")
    parser.add_argument("--fairness-knob", type=float, default=0.8)
    parser.add_argument("--max-contenders", type=int, default=16, help="the arbiter's cap on contenders (D20; 0 = none)")
    parser.add_argument("--report-timeout", type=float, default=2.0)
    parser.add_argument("--bid-timeout", type=float, default=2.0)
    parser.add_argument("--churn", type=float, default=60.0,
                        help="mean seconds between job ends (one GPU given back) per app holding GPUs; 0: none")
    parser.add_argument("--cluster", default="sim-256")
    parser.add_argument("--dashboards", type=int, default=0,
                        help="serve the web dashboard (--http) with this many pages following its live stream")
    parser.add_argument("--client-procs", type=int, default=2, help="client processes the apps are spread over")
    parser.add_argument("--log-level", default="WARNING", help="the arbiter's log level")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        asyncio.run(worker(args.worker))
        return 0
    console = Console(width=None if sys.stdout.isatty() else 170)
    counts = [int(x) for x in args.apps.split(",") if x.strip()]
    cells = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="themis-service-bench-") as tmp:
        for n in counts:
            cells.append(asyncio.run(run_one(n, args, console, Path(tmp))))
    console.print(table(cells))
    for c in cells:
        b = c["big_rounds"]
        console.print(f"{c['apps']} apps: {b['n']} rounds with >= {MASS_EXPIRY} leases expiring together: "
                      f"server p50 / p95 {fmt(b['server_latency_s']['median'], '.3f')} / "
                      f"{fmt(b['server_latency_s']['p95'], '.3f')} s with {fmt(b['bidders']['mean'], '.0f')} bidders, "
                      f"GPUs won in the auction / placed by bidders' own rows after it (queue, D9) / at random "
                      f"(leftover): {b['auction_gpus']} / {b.get('queue_gpus', 0)} / {b['leftover_gpus']}; "
                      f"the other rounds: p95 {fmt(c['small_rounds_server_latency_s']['p95'], '.3f')} s")
    verdict = goal(cells)
    if not verdict["measured"]:
        console.print(f"goal ({GOAL_APPS} apps, round p95 < {GOAL_P95_S} s): not measured (give --apps {GOAL_APPS})")
    else:
        word = "[green]MET[/]" if verdict["met"] else "[red]NOT MET[/]"
        console.print(f"goal ({GOAL_APPS} connected apps, round p95 < {GOAL_P95_S:.0f} s): {word} -- "
                      f"{verdict['connected']} connected; p95 {fmt(verdict['server_p95_s'], '.3f')} s on the "
                      f"server's clock, {fmt(verdict['agent_p95_s'], '.3f')} s until the agents had their grants")
    results = {
        "machine": machine_info(),
        "settings": {"apps": counts, "seconds": args.seconds, "warmup": args.warmup, "lease_s": args.lease,
                     "fairness_knob": args.fairness_knob, "max_contenders": args.max_contenders,
                     "report_timeout_s": args.report_timeout,
                     "bid_timeout_s": args.bid_timeout, "churn_s": args.churn, "cluster": args.cluster,
                     "client_procs": args.client_procs, "arbiter_log_level": args.log_level, "seed": args.seed},
        "goal": verdict,
        "cells": cells,
        "total_s": time.perf_counter() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"wrote {args.out} ({results['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
