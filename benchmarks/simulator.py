"""How long a full simulation takes, and how much memory it needs, for Themis and every baseline.

One run is the whole of a workload (default ``workload2``, the paper's successive-halving variant
of the Philly trace: 300 apps, 5080 phase-1 jobs) on ``sim-256`` through ``simulator.engine``:
the real round engine, the real agents (rho, bids) and the real policy, auctions included. Each
policy runs in a fresh Python subprocess, so its peak memory (``ru_maxrss``) is its own and no
cache or import is shared; the script reports the simulation's wall time (building the workload
is timed apart), the peak resident memory, the number of rounds and auctions and the simulated
makespan. ``--profile`` adds one more Themis run under cProfile and prints the 15 functions with
the most cumulative time, to show where the time goes (profiling slows the run, so that run is
not the timed one).

Goal: a Themis run of workload 2 on sim-256 in under 60 s on this 2-core machine. For context,
other open schedulers' simulators: Blox (Agarwal et al., EuroSys 2024) reports 6.6-22.5 minutes
for one simulation of the Philly trace with FIFO or LAS; Gavel (Narayanan et al., OSDI 2020)
52 s for about 470 simulated hours on a 36-GPU cluster. (Different traces, clusters and policies:
an order of magnitude, not a head-to-head comparison.)

Run ``python benchmarks/simulator.py [--quick] [--workload NAME] [--profile] [--out FILE]``;
``--quick`` runs only themis and fifo. Results go to ``benchmarks/results/simulator.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import os
import pstats
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from machine import machine_info
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder comes first on sys.path and this module (benchmarks/simulator.py)
# would shadow the ``simulator`` package it measures.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "simulator.json"
POLICIES = ("themis", "gandiva", "tiresias", "optimus", "slaq", "fifo", "drf")
QUICK_POLICIES = ("themis", "fifo")
FALLBACK_WORKLOAD = "small"
GOAL_S = 60.0  # themis, workload2 on sim-256
CONTEXT = {
    "blox": "Blox's simulator: 6.6-22.5 min for one Philly-trace run with FIFO or LAS",
    "gavel": "Gavel's simulator: 52 s for ~470 simulated hours on 36 GPUs",
}
TOP_FUNCTIONS = 15


# -- the child: one policy, one fresh process --------------------------------------------------------


def _rss_mb() -> float:
    """Current resident memory of this process (Linux /proc; 0 where unavailable)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def _load_workload(name: str, seed: int):
    """The workload, or the bundled ``small`` one (with the reason) when ``name`` cannot load."""
    from simulator.workloads import load_workload

    try:
        return load_workload(name, seed=seed), None
    except Exception as exc:  # another helper may still be finishing the workload builders
        if name == FALLBACK_WORKLOAD:
            raise
        return load_workload(FALLBACK_WORKLOAD, seed=seed), f"{name!r} did not load ({exc}); ran {FALLBACK_WORKLOAD!r}"


def profile_top(profiler: cProfile.Profile, n: int) -> tuple[str, list[dict[str, Any]]]:
    """The n functions with the most cumulative time: pstats' text and one dict per function."""
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("cumulative")
    stats.print_stats(n)
    rows = []
    for (path, line, func), (cc, nc, tt, ct, _callers) in sorted(
        stats.stats.items(), key=lambda kv: kv[1][3], reverse=True
    )[:n]:
        try:
            where = str(Path(path).resolve().relative_to(ROOT))
        except ValueError:
            where = path
        rows.append({"function": f"{where}:{line}({func})", "ncalls": nc, "primitive_calls": cc,
                     "tottime_s": tt, "cumtime_s": ct})
    return text.getvalue(), rows


CODE_DIRS = ("agent", "arbiter", "simulator", "protos")


def code_version() -> str:
    """The commit plus a digest of the simulated code (every file under agent/, arbiter/,
    simulator/, protos/): runs with different digests ran different code and are not comparable."""
    digest = hashlib.sha256()
    for folder in CODE_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".toml", ".csv") and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    try:
        proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True, cwd=ROOT,
                              timeout=10)
        commit = proc.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return f"{commit}+{digest.hexdigest()[:10]}"


def child(args: argparse.Namespace) -> dict[str, Any]:
    """Run one simulation in this (fresh) process and return its measurements."""
    from arbiter.cluster import load_cluster
    from arbiter.policies import make_policy
    from simulator.engine import Simulation
    from simulator.metrics import summarize

    rss_start = _rss_mb()
    load_at_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # other work on the machine
    version = code_version()
    t0 = time.perf_counter()
    workload, fallback = _load_workload(args.workload, args.seed)
    cluster = load_cluster(args.cluster)
    load_s = time.perf_counter() - t0
    rss_before = _rss_mb()
    sim = Simulation(cluster, workload, make_policy(args.child), lease_s=args.lease, restart_s=args.restart,
                     seed=args.seed)
    profiler = cProfile.Profile() if args.profile else None
    t0, cpu0 = time.perf_counter(), time.process_time()
    if profiler is not None:
        profiler.enable()
    result = sim.run()
    if profiler is not None:
        profiler.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    summary = summarize(result)
    out = {
        "policy": args.child,
        "code": version,
        "workload": workload.name,
        "workload_fallback": fallback,
        "cluster": cluster.name,
        "apps": len(workload.apps),
        "jobs": sum(len(a.jobs) for a in workload.apps),
        "profiled": bool(profiler),
        "wall_s": wall,
        "cpu_s": cpu,
        "load_average_1min_at_start": load_at_start,
        "workload_load_s": load_s,
        "rss_start_mb": rss_start,
        "rss_before_run_mb": rss_before,
        "peak_rss_mb": _peak_rss_mb(),
        "rounds": result.rounds,
        "auctions": result.auctions,
        "makespan_h": result.makespan / 3600,
        "simulated_h_per_wall_s": result.makespan / 3600 / wall if wall else None,
        "restarts": summary["restarts"],
        "utilization": summary["utilization"],
        "max_rho": summary["max_rho"],
        "mean_rho": summary["mean_rho"],
        "avg_jct_h": summary["avg_jct"] / 3600,
    }
    if profiler is not None:
        out["profile_text"], out["profile_top"] = profile_top(profiler, TOP_FUNCTIONS)
    return out


# -- the parent: one subprocess per policy -------------------------------------------------------------


def run_child(policy: str, args: argparse.Namespace, *, profile: bool = False) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", policy, "--workload", args.workload,
           "--cluster", args.cluster, "--seed", str(args.seed), "--lease", str(args.lease),
           "--restart", str(args.restart)]
    if profile:
        cmd.append("--profile")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"policy": policy, "profiled": profile, "error": f"timed out after {args.timeout:g} s"}
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        return {"policy": policy, "profiled": profile, "error": f"exit {proc.returncode}: {tail}"}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_s"] = time.perf_counter() - t0
    return out


def print_table(console: Console, runs: Sequence[dict[str, Any]], title: str) -> None:
    table = Table(title=title)
    for col in ("policy", "wall (s)", "CPU (s)", "peak RSS (MB)", "run RSS growth (MB)", "rounds", "auctions",
                "makespan (h)", "sim h / wall s", "restarts", "max rho", "mean rho"):
        table.add_column(col, justify="right")
    for r in runs:
        if "error" in r:
            table.add_row(r["policy"], "[red]failed[/red]", *[""] * 10)
            continue
        style = "red" if r["policy"] == "themis" and r["wall_s"] > GOAL_S else None
        table.add_row(
            r["policy"], f"{r['wall_s']:.1f}", f"{r['cpu_s']:.1f}", f"{r['peak_rss_mb']:.0f}",
            f"{r['peak_rss_mb'] - r['rss_before_run_mb']:.0f}", str(r["rounds"]), str(r["auctions"]),
            f"{r['makespan_h']:.1f}", f"{r['simulated_h_per_wall_s']:.1f}", str(r["restarts"]),
            f"{r['max_rho']:.2f}", f"{r['mean_rho']:.2f}", style=style,
        )
    console.print(table)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only {' and '.join(QUICK_POLICIES)}")
    parser.add_argument("--policies", help=f"comma-separated subset of {','.join(POLICIES)}")
    parser.add_argument("--workload", default="workload2", help="workload name or CSV trace (default workload2)")
    parser.add_argument("--cluster", default="sim-256")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lease", type=float, default=600.0, help="lease length in seconds (D10)")
    parser.add_argument("--restart", type=float, default=35.0, help="restart delay in seconds (D11)")
    parser.add_argument("--profile", action="store_true",
                        help=f"also run themis under cProfile and print the top {TOP_FUNCTIONS} functions")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per policy run")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: run one policy in this process
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    console = Console()
    if not console.is_terminal:  # a log file: wide enough for the table
        console = Console(width=170)
    if args.policies:
        policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
        unknown = [p for p in policies if p not in POLICIES]
        if unknown:
            raise SystemExit(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    else:
        policies = QUICK_POLICIES if args.quick else POLICIES
    runs = []
    for policy in policies:
        with console.status(f"{policy}: {args.workload} on {args.cluster} (fresh process)"):
            r = run_child(policy, args)
        runs.append(r)
        if "error" in r:
            console.print(f"[red]{policy}: {r['error']}[/red]")
        else:
            console.print(f"{policy}: {r['wall_s']:.1f} s, peak {r['peak_rss_mb']:.0f} MB, {r['rounds']} rounds")
    done = [r for r in runs if "error" not in r]
    versions = sorted({r["code"] for r in done})
    if len(versions) > 1:
        console.print(f"[yellow]warning: the simulated code changed during the benchmark "
                      f"({', '.join(versions)}); the runs are not comparable[/yellow]")
    fallback = next((r["workload_fallback"] for r in done if r.get("workload_fallback")), None)
    workload = done[0]["workload"] if done else args.workload
    if fallback:
        console.print(f"[yellow]note: {fallback}[/yellow]")
    if done:
        console.print(f"{done[0]['apps']} apps, {done[0]['jobs']} jobs; workload built in "
                      f"{done[0]['workload_load_s']:.1f} s (not in wall time)")
    print_table(console, runs, f"Simulation of {workload} on {args.cluster}, one fresh process per policy "
                               f"(goal: themis < {GOAL_S:g} s)")
    themis = next((r for r in done if r["policy"] == "themis"), None)
    if themis is not None:
        verdict = "[green]meets[/green]" if themis["wall_s"] <= GOAL_S else "[red]misses[/red]"
        console.print(f"themis: {themis['wall_s']:.1f} s -- {verdict} the {GOAL_S:g} s goal; for context, "
                      f"{CONTEXT['blox']}; {CONTEXT['gavel']}")
    profile = None
    if args.profile:
        with console.status(f"themis under cProfile: {args.workload} on {args.cluster}"):
            profile = run_child("themis", args, profile=True)
        if "error" in profile:
            console.print(f"[red]profiled run: {profile['error']}[/red]")
        else:
            console.print(f"themis under cProfile: {profile['wall_s']:.1f} s; top {TOP_FUNCTIONS} by cumulative time")
            console.print(profile["profile_text"], markup=False, highlight=False)
    results = {
        "machine": machine_info(),
        "code": versions[0] if len(versions) == 1 else versions,
        "settings": {"workload": args.workload, "workload_run": workload, "workload_fallback": fallback,
                     "cluster": args.cluster, "seed": args.seed, "lease_s": args.lease,
                     "restart_s": args.restart, "quick": args.quick, "policies": list(policies)},
        "goal_s": GOAL_S,
        "context": CONTEXT,
        "runs": runs,
    }
    if profile is not None:
        results["profile"] = {k: v for k, v in profile.items() if k != "profile_text"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"results written to {args.out}")
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
