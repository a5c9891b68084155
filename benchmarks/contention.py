"""What network contention (D35) costs the simulator: the same run with the contention model off
and on, each in a fresh Python subprocess.

Default: Workload 2 on sim-256 (300 apps, 5080 phase-1 jobs, the paper's successive-halving
workload) with Themis and Tiresias, contention off and on (the shipped DeepShare table, every
model mapped to its class by ``agent/profiles/contention_classes.toml``). Each configuration runs
``--repeats`` times, off and on alternating so that a change in the machine's load falls on both;
the table gives the median CPU and wall time and on / off. Goal (issue 34): on at most 1.5 x off.
CPU time is the comparison (the simulation is single-threaded; wall time also counts what else the
machine runs). The runs' outcomes are recorded too: contention changes them (that is its point).

Run ``python benchmarks/contention.py [--policies themis,tiresias] [--workload workload2]
[--repeats 1] [--out FILE]``; results go to ``benchmarks/results/contention.json``.

``--aware`` compares instead Themis unaware (``themis``) and contention-aware (``themis-aware``,
D36) with contention on, alternating the same way, and checks issue 34's Workload 2 goals: aware
max rho at least 10% lower, mean contention ratio higher, GPU time no worse
(``benchmarks/results/contention_aware.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from machine import machine_info, write_results
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder comes first on sys.path: keep ``simulator`` the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "contention.json"
AWARE_OUT = ROOT / "benchmarks" / "results" / "contention_aware.json"
GOAL = 1.5  # contention on / off, CPU time


def child(policy: str, workload: str, cluster: str, contention: str | None, seed: int) -> dict[str, Any]:
    from arbiter.cluster import load_cluster
    from arbiter.policies import make_policy
    from simulator.contention import ContentionModel
    from simulator.engine import Simulation
    from simulator.metrics import summarize
    from simulator.workloads import load_workload

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    sim = Simulation(load_cluster(cluster), load_workload(workload, seed=seed), make_policy(policy), seed=seed,
                     contention=ContentionModel.load(contention) if contention else None)
    t0, cpu0 = time.perf_counter(), time.process_time()
    result = sim.run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    s = summarize(result)
    return {"policy": policy, "contention": contention, "wall_s": wall, "cpu_s": cpu, "load_average_1min_at_start": load,
            "rounds": result.rounds, "makespan_h": result.makespan / 3600, "max_rho": s["max_rho"],
            "mean_rho": s["mean_rho"], "avg_jct_h": s["avg_jct"] / 3600, "gpu_time_h": s["gpu_time"] / 3600,
            "mean_contention_ratio": s["mean_contention_ratio"]}


def run_child(policy: str, args: argparse.Namespace, contention: str | None) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", policy, "--workload", args.workload,
           "--cluster", args.cluster, "--seed", str(args.seed)] + (["--contention", contention] if contention else [])
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        return {"policy": policy, "contention": contention, "error": proc.stderr.strip().splitlines()[-3:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def aware(args: argparse.Namespace) -> int:
    """D36: the same run with contention on, Themis unaware and aware, alternating per repeat."""
    console = Console(stderr=True)
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for policy in (("themis", "themis-aware") if repeat % 2 == 0 else ("themis-aware", "themis")):
            console.print(f"{policy}, contention on, repeat {repeat + 1}...")
            runs.append({**run_child(policy, args, args.table), "repeat": repeat})
    by = {p: [r for r in runs if r["policy"] == p and "error" not in r] for p in ("themis", "themis-aware")}
    keys = ("cpu_s", "wall_s", "max_rho", "mean_rho", "avg_jct_h", "gpu_time_h", "mean_contention_ratio", "rounds")
    rows = {p: {k: statistics.median(r[k] for r in rs) for k in keys} for p, rs in by.items() if rs}
    goals = {}
    if len(rows) == 2:
        u, a = rows["themis"], rows["themis-aware"]
        goals = {"max_rho_10pct_lower": a["max_rho"] <= 0.9 * u["max_rho"],
                 "mean_ratio_higher": a["mean_contention_ratio"] > u["mean_contention_ratio"],
                 "gpu_time_no_worse": a["gpu_time_h"] <= u["gpu_time_h"],
                 "cpu_aware_over_unaware": a["cpu_s"] / u["cpu_s"]}
    table = Table(title=f"Themis unaware vs aware (D36), contention on: {args.workload} on {args.cluster}, "
                        f"seed {args.seed}, median of {args.repeats}")
    for col in ("policy", *keys):
        table.add_column(col, justify="right")
    for p, row in rows.items():
        table.add_row(p, *(f"{row[k]:.3f}" if isinstance(row[k], float) else str(row[k]) for k in keys))
    Console().print(table)
    if goals:
        Console().print(goals)
    write_results(args.out, {"benchmark": "contention_aware", "workload": args.workload, "cluster": args.cluster,
                             "seed": args.seed, "table": args.table, "repeats": args.repeats,
                             "machine": machine_info(), "rows": rows, "goals": goals, "runs": runs})
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", default="themis,tiresias")
    p.add_argument("--workload", default="workload2")
    p.add_argument("--cluster", default="sim-256")
    p.add_argument("--contention", default=None, help=argparse.SUPPRESS)
    p.add_argument("--table", default="deepshare", help="the contention table for the 'on' runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--aware", action="store_true", help="themis unaware vs themis-aware, contention on (D36)")
    args = p.parse_args()
    if args.out is None:
        args.out = AWARE_OUT if args.aware else DEFAULT_OUT
    if args.child:
        print(json.dumps(child(args.child, args.workload, args.cluster, args.contention, args.seed)))
        return 0
    if args.aware:
        return aware(args)
    console = Console(stderr=True)
    runs: list[dict[str, Any]] = []
    for policy in args.policies.split(","):
        for repeat in range(args.repeats):
            for table in ((None, args.table) if repeat % 2 == 0 else (args.table, None)):
                console.print(f"{policy}, contention {'on' if table else 'off'}, repeat {repeat + 1}...")
                runs.append({**run_child(policy, args, table), "repeat": repeat})
    rows = []
    table = Table(title=f"contention on vs off: {args.workload} on {args.cluster}, seed {args.seed}, "
                        f"median of {args.repeats}")
    for col in ("policy", "CPU s off", "CPU s on", "on/off CPU", "wall s off", "wall s on", "on/off wall",
                "mean ratio on"):
        table.add_column(col, justify="right")
    for policy in args.policies.split(","):
        off = [r for r in runs if r["policy"] == policy and not r.get("contention") and "error" not in r]
        on = [r for r in runs if r["policy"] == policy and r.get("contention") and "error" not in r]
        if not off or not on:
            continue
        row = {"policy": policy, **{f"{k}_{side}": statistics.median(r[k] for r in rs)
                                    for side, rs in (("off", off), ("on", on)) for k in ("cpu_s", "wall_s")},
               "mean_contention_ratio_on": on[0]["mean_contention_ratio"]}
        row["cpu_on_over_off"] = row["cpu_s_on"] / row["cpu_s_off"]
        row["wall_on_over_off"] = row["wall_s_on"] / row["wall_s_off"]
        row["goal_met"] = row["cpu_on_over_off"] <= GOAL
        rows.append(row)
        table.add_row(policy, f"{row['cpu_s_off']:.1f}", f"{row['cpu_s_on']:.1f}", f"{row['cpu_on_over_off']:.2f}",
                      f"{row['wall_s_off']:.1f}", f"{row['wall_s_on']:.1f}", f"{row['wall_on_over_off']:.2f}",
                      f"{row['mean_contention_ratio_on']:.3f}")
    Console().print(table)
    write_results(args.out, {"benchmark": "contention", "goal_on_over_off": GOAL, "workload": args.workload,
                             "cluster": args.cluster, "seed": args.seed, "table": args.table, "repeats": args.repeats,
                             "machine": machine_info(), "rows": rows, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
