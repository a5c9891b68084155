"""Themis at scale: CPU time of whole simulations as GPUs and apps grow, against Tiresias.

Issue 13 item 7 (hidden payments at scale): crowded synthetic runs spend most of Themis's time in the
auction's MILPs, above all the re-solves for the hidden payments c_i, so Themis's CPU time grows much
faster with apps than a baseline's. Each cell of the grid is one ``themis-sim run`` of the
``synthetic`` workload (load 0.8 on the cell's GPUs, default knobs otherwise, seed 0) in a fresh
process; the script reads the process's own CPU time (``os.wait4``), the run's rounds and auctions
and non-canonical auctions (D16) from its ``summary.json``, and stops a run at ``--timeout``
seconds of wall time (reported as not finished). Clusters bigger than 256 GPUs are ``sim-256``
repeated (its 11 racks copied with new names), written to a temporary folder: nothing is written into
the repo but the results file.

Goals (issue 13): Themis's CPU time at 1,024 GPUs x 150 apps at most 2x Tiresias's; 1,000 apps on
1,024 GPUs under 5 minutes.

Run ``python benchmarks/scale.py [--cells 256x50,1024x150,1024x1000] [--policies themis,tiresias]
[--timeout 600] [--out FILE]``; results go to ``benchmarks/results/scale.json`` by default. A policy
``themis@N`` is Themis with the service's cap of N contenders per auction (D20, ``--max-contenders``);
the goals are judged for exact Themis and for each capped variant separately. A policy ending in
``/bounds`` (``themis/bounds``, ``themis@16/bounds``) runs with ``--payments bounds`` (D42: bounds on c_i
decide the lotteries they can, the same run with c_i reported as bounds).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

from machine import machine_info
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "arbiter" / "clusters" / "sim-256.toml"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "scale.json"
DEFAULT_CELLS = "256x50,256x150,1024x150,1024x1000"
GOAL_RATIO = 2.0  # Themis CPU <= 2x Tiresias at 1,024 x 150
GOAL_BIG_S = 300.0  # 1,000 apps x 1,024 GPUs under 5 minutes


def cluster_file(gpus: int, folder: Path) -> str:
    """``sim-256`` itself, or ``gpus / 256`` copies of its racks in one cluster file."""
    if gpus == 256:
        return "sim-256"
    if gpus % 256:
        raise SystemExit(f"cluster sizes are multiples of 256 GPUs (copies of sim-256), got {gpus}")
    racks = tomllib.loads(BASE.read_text())["racks"]
    lines = [f'name = "sim-{gpus}"', f'description = "{gpus // 256} copies of sim-256\'s racks"', ""]
    for copy in range(gpus // 256):
        for k, rack in enumerate(racks):
            lines += ["[[racks]]", f'name = "r{copy * len(racks) + k}"', "machines = ["]
            for m in rack["machines"]:
                fields = ", ".join(f"{key} = {value}" for key, value in m.items())
                lines.append(f"  {{ {fields} }},")
            lines += ["]", ""]
    path = folder / f"sim-{gpus}.toml"
    path.write_text("\n".join(lines))
    return str(path)


def run_cell(gpus: int, apps: int, policy: str, timeout: float, folder: Path) -> dict[str, Any]:
    """One simulation in its own process: its CPU time (user + system), wall time and summary."""
    tag = policy.replace("/", "+")  # themis/bounds names no folder
    out = folder / f"{tag}-{gpus}x{apps}"
    spec, _, payments = policy.partition("/")
    name, _, cap = spec.partition("@")
    cmd = [sys.executable, "-m", "simulator", "run", "--cluster", cluster_file(gpus, folder), "--workload",
           "synthetic", "--workload-knob", f"apps={apps}", "--workload-knob", f"cluster_gpus={gpus}",
           "--workload-knob", "load=0.8", "--policy", name, "--seed", "0", "--out", str(out)]
    if cap:
        cmd += ["--max-contenders", cap]
    if payments:
        cmd += ["--payments", payments]
    errors = folder / f"{tag}-{gpus}x{apps}.stderr"  # a file, not a pipe: nobody reads it while it runs
    started = time.monotonic()
    with errors.open("wb") as err_file:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err_file, start_new_session=True)
    finished = True
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() - started > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            _, status, usage = os.wait4(proc.pid, 0)
            finished = False
            break
        time.sleep(0.2)
    wall = time.monotonic() - started
    code = os.waitstatus_to_exitcode(status)
    cell: dict[str, Any] = {"gpus": gpus, "apps": apps, "policy": policy, "finished": finished,
                            "cpu_s": usage.ru_utime + usage.ru_stime, "wall_s": wall,
                            "peak_rss_mb": usage.ru_maxrss / 1024}
    if finished and code != 0:
        raise SystemExit(f"{policy} {gpus}x{apps} failed ({code}):\n{errors.read_text(errors='replace')[-2000:]}")
    if finished:
        summary = json.loads((out / "summary.json").read_text())
        cell |= {k: summary[k] for k in ("rounds", "auctions", "noncanonical_auctions", "max_rho", "jain_rho",
                                         "gpu_time", "makespan")}
    return cell


def goals(cells: list[dict[str, Any]], themis_name: str = "themis") -> dict[str, Any]:
    by = {(c["gpus"], c["apps"], c["policy"]): c for c in cells}
    themis, tiresias = by.get((1024, 150, themis_name)), by.get((1024, 150, "tiresias"))
    ratio = None
    if themis and tiresias and themis["finished"] and tiresias["finished"]:
        ratio = themis["cpu_s"] / tiresias["cpu_s"]
    big = by.get((1024, 1000, themis_name))
    return {
        "cpu_ratio_1024x150": ratio, "cpu_ratio_goal": GOAL_RATIO,
        "cpu_ratio_met": None if ratio is None else ratio <= GOAL_RATIO,
        "themis_1024x1000_wall_s": big["wall_s"] if big else None,
        "themis_1024x1000_finished": big["finished"] if big else None, "big_goal_s": GOAL_BIG_S,
        "big_met": None if big is None else big["finished"] and big["wall_s"] < GOAL_BIG_S,
    }


def table(cells: list[dict[str, Any]]) -> Table:
    t = Table(title="Whole synthetic runs (load 0.8, seed 0): CPU time by GPUs x apps")
    for name in ("GPUs x apps", "policy", "CPU", "wall", "peak RSS", "rounds", "auctions", "non-canonical",
                 "max rho", "Jain"):
        t.add_column(name, justify="right")
    for c in cells:
        done = c["finished"]
        t.add_row(f"{c['gpus']} x {c['apps']}", c["policy"],
                  f"{c['cpu_s']:.0f} s" + ("" if done else " (stopped)"), f"{c['wall_s']:.0f} s",
                  f"{c['peak_rss_mb']:.0f} MB", str(c.get("rounds", "-")), str(c.get("auctions", "-")),
                  str(c.get("noncanonical_auctions", "-")),
                  f"{c['max_rho']:.2f}" if done else "-", f"{c['jain_rho']:.3f}" if done else "-")
    return t


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", default=DEFAULT_CELLS, help="comma-separated GPUSxAPPS (GPUs a multiple of 256)")
    parser.add_argument("--policies", default="themis,tiresias")
    parser.add_argument("--timeout", type=float, default=600.0, help="wall seconds before a run is stopped")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    try:
        grid = [tuple(int(x) for x in cell.lower().split("x")) for cell in args.cells.split(",")]
    except ValueError:
        parser.error(f"--cells: expected GPUSxAPPS,..., got {args.cells!r}")
    policies = args.policies.split(",")
    console = Console(width=None if sys.stdout.isatty() else 150)  # a log file gets the whole table
    cells = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="themis-scale-") as tmp, Progress(console=console) as progress:
        task = progress.add_task("scale grid", total=len(grid) * len(policies))
        for gpus, apps in grid:
            for policy in policies:
                progress.update(task, description=f"{policy} {gpus} x {apps}")
                cells.append(run_cell(gpus, apps, policy, args.timeout, Path(tmp)))
                progress.advance(task)
    console.print(table(cells))
    variants = [p for p in policies if p.partition("/")[0].partition("@")[0] == "themis"]
    result = {"machine": machine_info(), "settings": vars(args) | {"out": str(args.out)},
              "goals": goals(cells), "goals_by_variant": {v: goals(cells, v) for v in variants},
              "cells": cells, "total_s": time.monotonic() - started}
    for variant, g in result["goals_by_variant"].items():
        if g["cpu_ratio_1024x150"] is not None:
            console.print(f"{variant} / Tiresias CPU at 1,024 x 150: {g['cpu_ratio_1024x150']:.1f}x "
                          f"(goal <= {GOAL_RATIO:.0f}x): {'MET' if g['cpu_ratio_met'] else 'NOT MET'}")
        if g["themis_1024x1000_finished"] is not None:
            console.print(f"{variant}, 1,000 apps x 1,024 GPUs: {g['themis_1024x1000_wall_s']:.0f} s"
                          f"{'' if g['themis_1024x1000_finished'] else ' (stopped, not finished)'} "
                          f"(goal < {GOAL_BIG_S:.0f} s): {'MET' if g['big_met'] else 'NOT MET'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
