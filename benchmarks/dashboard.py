"""The dashboard's first paint: 1,024 GPUs and 300 apps in headless Chromium (goal: under 1 s).

A ``MemorySource`` holds a cluster of 16 racks x 8 machines x 8 GPUs, 300 apps holding every GPU
between them, and ``--rounds`` rounds of history (each with all 300 apps in rank order and 16
contenders), built from a seeded generator rather than a simulation: a 300-app Themis run on 1,024
GPUs takes hours, and the page's cost depends on how many GPUs, apps and rounds it shows, not on
how they came about. The dashboard is served on loopback by ``arbiter.dashboard.start`` in this
process's event loop; Playwright drives Debian's Chromium (``/usr/bin/chromium``).

Each load opens a fresh browser context (no cache) at ``/#/cluster`` and reads, from the page's own
clock (milliseconds since navigation began): the first contentful paint, DOMContentLoaded, and
``themis-painted``, the mark the page sets in the frame after it has drawn the map of every GPU
with its holder and lease bar, and the legend from the apps (both API replies fetched and drawn).
The API's reply times and sizes are measured with a plain HTTP client.

    python benchmarks/dashboard.py [--loads 7] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from machine import machine_info, write_results
from rich.console import Console
from rich.table import Table

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import aiohttp  # noqa: E402
from playwright.async_api import async_playwright  # noqa: E402

from arbiter.dashboard import MemorySource, start  # noqa: E402
from arbiter.dashboard.model import (  # noqa: E402
    AppView,
    ClusterLayout,
    Contender,
    EventView,
    GpuPlace,
    LeaseView,
    Placed,
    Ranked,
    RoundView,
)

CHROMIUM = "/usr/bin/chromium"
RACKS, MACHINES, GPUS = 16, 8, 8
APPS = 300
GOAL_MS = 1000.0
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "dashboard.json"


def populated(rounds: int, seed: int = 0) -> MemorySource:
    """The source the page reads: every GPU leased, 300 apps, ``rounds`` rounds of history."""
    rng = random.Random(seed)
    source = MemorySource(title=f"{RACKS * MACHINES * GPUS} GPUs x {APPS} apps (benchmark)")
    gpus = tuple(GpuPlace(f"r{r}-m{r * MACHINES + m}-g{g}", f"r{r}", f"r{r}-m{r * MACHINES + m}",
                          f"r{r}-m{r * MACHINES + m}-s{g // 4}")
                 for r in range(RACKS) for m in range(MACHINES) for g in range(GPUS))
    source.set_layout(ClusterLayout("bench-1024", gpus))
    source.set_settings({"policy": "themis", "lease_s": 600.0, "fairness_knob": 0.8, "max_contenders": 16})
    apps = [f"app-{k:03d}" for k in range(APPS)]
    t0 = time.time() - rounds * 30.0
    holder: dict[str, str] = {}
    for r in range(1, rounds + 1):
        now = t0 + r * 30.0
        order = apps[:]
        rng.shuffle(order)
        moved = gpus if r == 1 else rng.sample(gpus, 40)  # a round moves a few dozen GPUs
        leases: dict[str, LeaseView | None] = {}
        for g in moved:
            holder[g.id] = rng.choice(apps)
            leases[g.id] = LeaseView(holder[g.id], now + rng.uniform(60, 600), now, r)
        source.apply(now, leases, {})
        held: dict[str, int] = {}
        for app in holder.values():
            held[app] = held.get(app, 0) + 1
        views = {a: AppView(a, "resnet50", None, held.get(a, 0) + rng.randint(0, 4), held.get(a, 0),
                            rng.uniform(0.5, 8.0), None, True, "active", t0) for a in apps}
        source.apply(now, {}, views)
        ranked = tuple(Ranked(a, views[a].rho or 1.0, None, 2, k < 32, k < 32) for k, a in enumerate(order))
        draws = [(rng.random(), rng.random()) for _ in range(16)]  # (c_i, draw)
        contenders = tuple(Contender(a, True, False, (gpus[k].id,), 1.0, c, d, d < c)
                           for k, (a, (c, d)) in enumerate(zip(order, draws)))
        placed = tuple(Placed(c.app, "auction", c.pf_row, now + 600.0) for c in contenders if c.won)
        source.push_round(RoundView(r, now, "40 leases ran out", "themis", tuple(g.id for g in gpus[:40]), ranked,
                                    contenders, placed))
        for p in placed:
            source.push_event(EventView(0, now, "grant", p.app, r, p.gpus, "won its lottery"))
    return source


async def api_times(base: str, repeat: int = 5) -> dict[str, dict[str, float]]:
    out = {}
    async with aiohttp.ClientSession() as http:
        for path in ("/api/v1/cluster", "/api/v1/apps", "/api/v1/rounds", "/api/v1/fairness", "/api/v1/timeline"):
            times, size = [], 0
            for _ in range(repeat):
                started = time.perf_counter()
                async with http.get(base + path.lstrip("/")) as reply:
                    body = await reply.read()
                times.append(time.perf_counter() - started)
                size = len(body)
            out[path] = {"median_ms": statistics.median(times) * 1000, "bytes": size}
    return out


async def first_paints(url: str, loads: int) -> list[dict[str, float]]:
    out = []
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            for _ in range(loads):
                context = await browser.new_context(viewport={"width": 1600, "height": 1000})
                page = await context.new_page()
                await page.goto(url + "#/cluster")
                await page.wait_for_selector("html[data-painted]", state="attached", timeout=60_000)
                marks = await page.evaluate("""() => ({
                    painted: performance.getEntriesByName('themis-painted')[0].startTime,
                    fcp: (performance.getEntriesByName('first-contentful-paint')[0] || {}).startTime ?? null,
                    dcl: performance.getEntriesByType('navigation')[0].domContentLoadedEventEnd,
                    gpus: document.querySelectorAll('.gpu[data-app]').length,
                })""")
                out.append(marks)
                await context.close()
        finally:
            await browser.close()
    return out


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    built = time.perf_counter()
    source = populated(args.rounds)
    build_s = time.perf_counter() - built
    dashboard = await start("127.0.0.1", 0, source)
    try:
        load_before = os.getloadavg()[0]
        api = await api_times(dashboard.url)
        paints = await first_paints(dashboard.url, args.loads)
        load_after = os.getloadavg()[0]
    finally:
        await dashboard.stop()
    painted = [p["painted"] for p in paints]
    return {
        "machine": machine_info(), "load_average_1min": [round(load_before, 2), round(load_after, 2)],
        "chromium": CHROMIUM, "gpus": RACKS * MACHINES * GPUS, "apps": APPS, "rounds": args.rounds,
        "loads": args.loads, "goal_ms": GOAL_MS, "source_build_s": build_s,
        "first_paint_ms": {"median": statistics.median(painted), "max": max(painted), "min": min(painted)},
        "fcp_ms_median": statistics.median(p["fcp"] for p in paints if p["fcp"] is not None),
        "dom_content_loaded_ms_median": statistics.median(p["dcl"] for p in paints),
        "gpus_drawn": paints[-1]["gpus"], "paints": paints, "api": api,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", type=int, default=7, help="page loads, each in a fresh browser context")
    parser.add_argument("--rounds", type=int, default=500, help="rounds of history the source holds")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args))
    fp = result["first_paint_ms"]
    table = Table(title=f"Dashboard first paint: {result['gpus']} GPUs x {result['apps']} apps, "
                        f"{result['rounds']} rounds kept, {args.loads} cold loads in headless Chromium "
                        f"(goal < {GOAL_MS:.0f} ms); {result['machine']['cpu_count']} CPUs, "
                        f"load {result['load_average_1min'][0]}")
    for col in ("measure", "median ms", "max ms"):
        table.add_column(col, justify="right")
    table.add_row("map and legend drawn (themis-painted)", f"{fp['median']:.0f}", f"{fp['max']:.0f}")
    table.add_row("first contentful paint", f"{result['fcp_ms_median']:.0f}", "")
    table.add_row("DOMContentLoaded", f"{result['dom_content_loaded_ms_median']:.0f}", "")
    for path, a in result["api"].items():
        table.add_row(f"GET {path} ({a['bytes'] / 1024:.0f} KiB)", f"{a['median_ms']:.1f}", "")
    Console(width=140).print(table)
    write_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
