"""A crowded public trace: 120 jobs on 32 GPUs (the Shockwave artifact), judged by Shockwave's metric.

Eq. 1's rho reads about 0.1 for every job of this trace (N_avg is about 75 on 32 GPUs), which hides
that many jobs finish later than on their own share. Shockwave (NSDI'23) and Gavel publish finish-
time fairness as JCT / (time alone x max(1, jobs / GPUs)); this replays the trace in our simulator
for each policy at ``--seeds`` seeds and reports that metric: its max, mean and the share of jobs
above 1, with 95% intervals, beside Eq. 1's max rho and GPU time. ``data/shockwave/README.md``
says where the trace comes from and how it maps onto our models.

    python benchmarks/crowded.py [--seeds 5] [--policies themis,tiresias,...] [--out FILE]
    python benchmarks/crowded.py --convert   # rewrite data/shockwave/trace_120.csv from the original

Prints a table and writes JSON (``benchmarks/results/crowded.json`` by default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from machine import machine_info
from rich.console import Console
from rich.table import Table

# Run as a script, this folder comes first on sys.path, and its simulator.py would hide the package:
# the repository goes first and this folder last, not away, because the seeds run in spawned
# processes, which import this script (and machine) again with the parent's path.
HERE = Path(__file__).resolve().parent
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE)]

from simulator.runs import run_seeds  # noqa: E402
from simulator.seeds import fmt, interval  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data" / "shockwave"
ORIGINAL = DATA / "120_0.2_5_100_40_25_0,0.5,0.5_0.6,0.3,0.09,0.01_multigpu_dynamic.trace"
TRACE = DATA / "trace_120.csv"
CLUSTER = DATA / "cluster_32.toml"
GPUS = 32
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "crowded.json"
MODELS = {"LM": "lm", "ResNet-50": "resnet50", "Transformer": "transformer", "ResNet-18": "vgg19",
          "Recommendation": "resnet50"}
# Published on this trace (the issue that asked for this comparison; Shockwave's own simulator and
# the Themis authors' simulator, replayed side by side): max, mean, share of jobs above 1.
PUBLISHED = {"Shockwave (NSDI'23)": (1.20, 0.80, 0.117), "Themis authors' simulator": (2.12, 0.69, 0.167)}


def convert() -> list[dict[str, Any]]:
    """The original trace -> our CSV trace (one app per job), and the jobs' durations alone."""
    jobs = []
    for k, line in enumerate(ORIGINAL.read_text().splitlines()):
        f = line.split("\t")
        name, steps, gpus, duration, arrival = f[0], float(f[5]), int(f[6]), float(f[10]), float(f[11])
        jobs.append({"app": f"sw{k:03d}", "model": MODELS[name.split(" (")[0]], "gpus": gpus, "steps": steps,
                     "duration": duration, "arrival": arrival, "iter_time": duration * gpus / steps})
    return jobs


def write_csv(jobs: list[dict[str, Any]]) -> None:
    lines = ["# 120 jobs of the Shockwave artifact on 32 GPUs: see data/shockwave/README.md",
             "app,job,arrival_s,gpus,iterations,iter_time_s,model"]
    lines += [f"{j['app']},job0,{j['arrival']:g},{j['gpus']},{j['steps']:g},{j['iter_time']:.9g},{j['model']}"
              for j in jobs]
    TRACE.write_text("\n".join(lines) + "\n")


def shockwave_rho(summary: dict[str, Any], duration: dict[str, float]) -> list[float]:
    factor = max(1.0, len(duration) / GPUS)
    return [a["jct_s"] / (duration[a["app"]] * factor) for a in summary["apps"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--policies", default="themis,tiresias,optimus,gandiva,slaq,fifo,drf")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--convert", action="store_true", help="rewrite trace_120.csv and stop")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    jobs = convert()
    if args.convert:
        write_csv(jobs)
        print(f"wrote {TRACE}")
        return 0
    duration = {j["app"]: j["duration"] for j in jobs}
    policies = [p for p in args.policies.split(",") if p]
    started = time.perf_counter()
    per_policy = run_seeds([{"cluster": str(CLUSTER), "workload": str(TRACE), "policy": p} for p in policies],
                           list(range(args.seeds)), args.workers, f"crowded trace: {len(policies)} policies")
    rows = []
    for policy, summaries in zip(policies, per_policy):
        sw = [shockwave_rho(s, duration) for s in summaries]
        rows.append({
            "policy": policy,
            "sw_max": interval([max(r) for r in sw]),
            "sw_mean": interval([statistics.fmean(r) for r in sw]),
            "sw_share_gt_1": interval([sum(x > 1 for x in r) / len(r) for r in sw]),
            "eq1_max_rho": interval([s["max_rho"] for s in summaries]),
            "eq1_mean_rho": interval([s["mean_rho"] for s in summaries]),
            "avg_jct_h": interval([s["avg_jct"] / 3600 for s in summaries]),
            "gpu_time_h": interval([s["gpu_time"] / 3600 for s in summaries]),
            "restarts_per_job": interval([s["restarts_per_job"] for s in summaries]),
        })
    table = Table(title=f"120 jobs on 32 GPUs (Shockwave artifact), {args.seeds} seeds: Shockwave's metric "
                        "JCT / (alone x max(1, jobs/GPUs))")
    for col in ("scheduler", "max", "mean", "share > 1", "Eq. 1 max rho", "avg JCT (h)", "GPU h", "restarts/job"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["policy"], fmt(r["sw_max"]), fmt(r["sw_mean"]), fmt(r["sw_share_gt_1"], "{:.1%}"),
                      fmt(r["eq1_max_rho"], "{:.3f}"), fmt(r["avg_jct_h"]), fmt(r["gpu_time_h"], "{:.0f}"),
                      fmt(r["restarts_per_job"], "{:.1f}"))
    for name, (mx, mean, share) in PUBLISHED.items():
        table.add_row(f"[dim]{name}", f"{mx:.2f}", f"{mean:.2f}", f"{share:.1%}", "", "", "", "")
    Console(width=160).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine_info(), "seeds": args.seeds, "rows": rows,
                                    "published": PUBLISHED, "wall_seconds": time.perf_counter() - started},
                                   indent=1))
    Console(stderr=True).print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
