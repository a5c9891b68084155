"""Two real hyperparameter searches sharing one Themis arbiter, on this machine (issue 5).

    python examples/digits_search.py                      # about a minute on 2 cores
    python examples/digits_search.py --budget test        # ~20 s: what the end-to-end test runs
    python examples/digits_search.py --mqtt mqtt://127.0.0.1:1883   # events and job metrics on a broker
    python examples/digits_search.py --executor slurm     # the jobs as Slurm jobs (docs/executors.md)

What runs, all on loopback:

* an arbiter (``arbiter.server.ArbiterServer``: gRPC, SQLite journal, the Themis auction) on a free
  port, with a 4-"GPU" cluster (one rack, two machines of two GPUs) and short leases (10 s; 4 s in
  the test budget), so leases expire, are re-auctioned and sometimes move between the apps;
* two agents, each an ``agent.runner.AppRunner`` (its own gRPC stream, rho reports and bids, job
  launcher, profiler):

  - ``digits-hyperband``: Hyperband (R = 9 iterations, eta = 3; successive halving with 4
    configurations in the test budget) over an Adam-trained MLP's width, learning rate, L2 and batch;
  - ``digits-curves``: performance-curve early stopping over an SGD-with-momentum MLP's width, depth,
    learning rate, momentum and batch, two trials at a time;

* the jobs: ``examples/train_digits.py`` processes that really train scikit-learn MLPs on the
  digits data shipped with scikit-learn (no download), one job per "GPU" (CPU processes;
  ``CUDA_VISIBLE_DEVICES`` is set, nominally), reporting validation loss and accuracy each
  iteration, checkpointing when they lose their GPUs or reach their rung, resuming from the
  checkpoint on their next grant.

It ends with a summary: each app's rho and GPUs over time, its completion time, lease losses and
resumed runs, and the best hyperparameters found with their validation accuracy. ``--json PATH``
writes the same as data. ``--report mqtt`` (with ``--mqtt``) makes the jobs publish their metrics
to the broker themselves instead of through the launcher's pipe.

``--executor slurm`` (issue 6) runs every job as a Slurm batch job pinned to its leased node and GPU
indices, on whatever cluster ``SLURM_CONF`` (or the default configuration) names. The arbiter's
4-GPU cluster is then two GPUs (indices 0 and 1) of each of the first two Slurm nodes that declare
per-index GPU types (``arbiter.slurm_nodes``), so the contention is the same as on one machine; jobs
report through metrics files in ``--workdir`` (which the nodes must share) unless ``--report mqtt``.
``scripts/slurm-demo`` starts a local fake-GPU Slurm and runs this.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.profiler import Profiler
from agent.runner import AppRunner
from arbiter.events import rounds_topic
from arbiter.server import ArbiterServer, ServerConfig
from hyperparam_adapters.curve_stopping import CurveStoppingAdapter
from hyperparam_adapters.hyperband import HyperbandAdapter, SuccessiveHalvingAdapter

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train_digits.py"
ADMIN = "digits-admin"
CLUSTER = "digits-4"
CLUSTER_TOML = f"""
name = "{CLUSTER}"
description = "one rack, two machines of two GPUs (CPU processes here)"
[[racks]]
name = "r0"
machines = [{{ gpus = 2, slots = 2, count = 2 }}]
"""
THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass(frozen=True)
class Budget:
    lease_s: float
    epochs: int  # epochs per iteration
    hyperband: dict[str, Any] | None  # HyperbandAdapter kwargs, or None for successive halving
    halving: dict[str, Any] | None
    curves: dict[str, Any]
    timeout_s: float


BUDGETS = {
    "default": Budget(10.0, 25, {"max_resource": 9, "eta": 3}, None,
                      {"max_trials": 6, "parallel": 2, "max_iterations": 20, "tolerance": 0.01}, 400.0),
    "test": Budget(4.0, 6, None, {"n": 4, "eta": 2, "min_resource": 1},
                   {"max_trials": 3, "parallel": 2, "max_iterations": 8, "tolerance": 0.02}, 120.0),
}


def log_uniform(lo: float, hi: float):
    return lambda rng: round(math.exp(rng.uniform(math.log(lo), math.log(hi))), 6)


def adam_space(epochs: int) -> dict[str, Any]:
    return {"solver": "adam", "hidden": [16, 32, 64, 128], "lr": log_uniform(3e-4, 3e-2),
            "alpha": log_uniform(1e-5, 1e-2), "batch": [32, 64, 128], "epochs": epochs}


def sgd_space(epochs: int) -> dict[str, Any]:
    return {"solver": "sgd", "hidden": [32, 64], "layers": [1, 2], "lr": log_uniform(3e-3, 1e-1),
            "momentum": [0.0, 0.5, 0.9], "batch": [32, 64], "epochs": epochs}


def adapters(budget: Budget, seed: int) -> dict[str, Any]:
    now = time.time()
    # declared seconds per iteration until a trial measures its own (rho's budget B uses these):
    # ~12 ms per epoch for these MLPs on one core, twice that with four jobs sharing two cores
    common = {"seed": seed, "iter_time": 0.025 * budget.epochs, "start_time": now}
    if budget.hyperband is not None:
        search = HyperbandAdapter(adam_space(budget.epochs), **budget.hyperband, **common)
    else:
        search = SuccessiveHalvingAdapter(adam_space(budget.epochs), **budget.halving, **common)
    curves = CurveStoppingAdapter(sgd_space(budget.epochs), **budget.curves, **common)
    return {"digits-hyperband": search, "digits-curves": curves}


def argv(spec) -> list[str]:
    return [sys.executable, str(TRAIN)]


# ---------------------------------------------------------------------------------------------- the summary

BARS = "▁▂▃▄▅▆▇█"
MISSING = object()


def sparkline(values: list[Any]) -> str:
    """One character per value: a bar scaled between the finite values, ∞ for infinity (None),
    a space where there is no value."""
    finite = [v for v in values if v is not None and v is not MISSING]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 0.0)
    return "".join(" " if v is MISSING else "∞" if v is None
                   else BARS[0 if hi == lo else round((v - lo) / (hi - lo) * (len(BARS) - 1))] for v in values)


def bucketed(series: list[tuple[float, Any]], edges: list[float], carry: bool) -> list[Any]:
    """Per bucket ending at each edge: the last value in it, or (``carry``) the last one so far."""
    out, last, k = [], MISSING, 0
    for edge in edges:
        inside = MISSING
        while k < len(series) and series[k][0] <= edge:
            inside = last = series[k][1]
            k += 1
        out.append(last if carry else inside)
    return out


def cell(v: Any) -> str:
    return "·" if v is MISSING else "inf" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)


def render(summaries: list[dict[str, Any]], rounds: dict[str, Any], total_s: float, out) -> None:
    width = 12
    edges = [total_s * (i + 1) / width for i in range(width)]
    print(f"\n=== summary: {rounds['rounds']} rounds, {rounds['expired']} leases expired, "
          f"{sum(s['lease_losses'] for s in summaries)} revocations, {total_s:.0f} s ===", file=out)
    churn = 10 * rounds["moved"] / (len(summaries) * rounds["rounds"]) if summaries and rounds["rounds"] else 0.0
    print(f"GPUs moved between apps at expiry: {rounds['moved']} ({churn:.2f} per app per 10 rounds)", file=out)
    print("rho with the GPUs held (inf: none held), and GPUs held, at the end of each interval:", file=out)
    print("t (s)".ljust(25) + "".join(f"{e:>6.0f}" for e in edges), file=out)
    for s in summaries:
        rho = bucketed(s["rho"], edges, carry=False)
        held = bucketed(s["gpus_held"], edges, carry=True)
        print(f"{s['app']:<18} rho   " + "".join(f"{cell(v):>6}" for v in rho), file=out)
        print(f"{'':<18} GPUs  " + "".join(f"{cell(0 if v is MISSING else v):>6}" for v in held), file=out)
    for s in summaries:
        done = f"finished in {s['completion_s']:.1f} s" if s["finished"] else "DID NOT FINISH"
        print(f"\n{s['app']}: {done}; {s['runs']} runs of {s['jobs']} jobs, {s['resumed_runs']} resumed from a "
              f"checkpoint ({s['resumed_after_preemption']} after losing or changing GPUs), "
              f"{s['lease_losses']} revocations, {s['killed_after_grace']} killed after the grace period", file=out)
        rhos = [r for _, r in s["rho"]]
        finite = [r for r in rhos if r is not None]
        span = f", {min(finite):.2f} to {max(finite):.2f}" if finite else ""
        print(f"  rho  {sparkline(rhos)}  (one per second{span})", file=out)
        best = s["best"]
        if best:
            params = {k: v for k, v in best["params"].items() if k != "epochs"}
            acc = best.get("accuracy")
            print(f"  best: {best['job']} {json.dumps(params, sort_keys=True)}", file=out)
            print(f"        validation loss {best['loss']:.4f}, accuracy "
                  f"{'?' if acc is None else f'{acc:.3f}'} at iteration {best['iteration']:g}", file=out)


# ---------------------------------------------------------------------------------------------- the run


def executor(name: str, workdir: Path):
    """Local jobs take file locks on their "GPUs" (shared by both apps' launchers), so a job that
    lost its lease and is still checkpointing holds the next one back, as Slurm does."""
    from agent.executors import LocalExecutor

    return LocalExecutor(lock_dir=workdir / ".gpu-locks") if name == "local" else name


def slurm_cluster_toml() -> str:
    """Two GPUs of each of the first two usable Slurm nodes, shaped like ``CLUSTER_TOML``."""
    import subprocess

    from arbiter.slurm_nodes import parse_nodes

    text = subprocess.run(["scontrol", "--oneliner", "show", "nodes"], capture_output=True, text=True, check=True,
                          timeout=30).stdout
    nodes = [n.name for n in parse_nodes(text) if not n.problem and n.gpu_indices[:2] == (0, 1)]
    if len(nodes) < 2:
        raise SystemExit(f"--executor slurm needs two Slurm nodes with per-index GPU types g0, g1; found {nodes}")
    names = ", ".join(f'"{n}"' for n in nodes[:2])
    return (f'name = "{CLUSTER}"\ndescription = "GPUs 0-1 of Slurm nodes {nodes[0]} and {nodes[1]}"\n'
            f'[[racks]]\nname = "r0"\nmachines = [{{ gpus = 2, slots = 2, names = [{names}] }}]\n')


async def run(args: argparse.Namespace, out=sys.stdout) -> dict[str, Any]:
    budget = BUDGETS[args.budget]
    lease = args.lease or budget.lease_s
    with tempfile.TemporaryDirectory(prefix="themis-digits-") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        cluster_file = Path(tmp) / f"{CLUSTER}.toml"
        cluster_file.write_text(slurm_cluster_toml() if args.executor == "slurm" else CLUSTER_TOML)
        server = ArbiterServer(ServerConfig(
            cluster=str(cluster_file), port=0, db=Path(tmp) / "arbiter.db", mqtt=args.mqtt, admin_token=ADMIN,
            lease_s=lease, report_timeout_s=1.0, bid_timeout_s=1.0, coalesce_s=0.2))
        port = await server.start()
        target = f"127.0.0.1:{port}"
        print(f"arbiter on {target}: cluster {CLUSTER} (4 GPUs), lease {lease:g} s, "
              f"events {'on ' + args.mqtt if args.mqtt else 'in memory'}; jobs run by the {args.executor} executor "
              f"and report via {args.report}", file=out)
        started = time.time()
        rounds = {"rounds": 0, "expired": 0, "granted": 0, "moved": 0}
        subscription = server.service.bus.subscribe(rounds_topic(CLUSTER))

        async def watch_rounds():
            async for event in subscription:
                r = event.payload
                rounds["rounds"] += 1
                rounds["expired"] += r["expired"]
                rounds["granted"] += sum(r["granted"].values())
                rounds["moved"] += r["moved"]
                if not args.quiet:
                    grants = ", ".join(f"{a} +{n}" for a, n in sorted(r["granted"].items())) or "-"
                    rho = ", ".join(f"{a} {'inf' if v is None else f'{v:.2f}'}" for a, v in sorted(r["rho"].items()))
                    print(f"t={r['now'] - started:5.1f}s round {r['round_id']:3d}: {r['offered']} free, "
                          f"{r['expired']} expired, granted {grants}; rho {rho or '-'}", file=out, flush=True)

        watcher = asyncio.create_task(watch_rounds())
        runners: list[AppRunner] = []
        try:
            for name, adapter in adapters(budget, args.seed).items():
                token = await AppRunner.token(target, name, ADMIN)
                runner = await AppRunner.create(
                    adapter, argv, app=name, arbiter=target, token=token, workdir=str(workdir / name),
                    cluster=CLUSTER, mqtt=args.mqtt, report=args.report, grace_s=5.0, env=THREADS,
                    executor=executor(args.executor, workdir),
                    profiler=Profiler(iter_time_serial=0.025 * budget.epochs))
                runners.append(runner)
            results = await asyncio.gather(*(r.run(timeout=budget.timeout_s) for r in runners), return_exceptions=True)
            for runner, result in zip(runners, results):
                if isinstance(result, BaseException):
                    print(f"{runner.app}: {type(result).__name__}: {result}", file=out)
        finally:
            total = time.time() - started
            await asyncio.sleep(0.2)  # the last round summaries
            watcher.cancel()
            await server.stop(grace=0.5)
        summaries = [r.summary() for r in runners]
        render(summaries, rounds, total, out)
        return {"budget": args.budget, "lease_s": lease, "mqtt": args.mqtt, "report": args.report,
                "executor": args.executor,
                "cluster": CLUSTER, "seconds": round(total, 2), "rounds": rounds, "apps": summaries}


def main(argv_: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Two real hyperparameter searches sharing a Themis arbiter.")
    parser.add_argument("--budget", choices=sorted(BUDGETS), default="default")
    parser.add_argument("--mqtt", default=None, help="broker URL (mqtt://host:port) for events and job metrics")
    parser.add_argument("--executor", choices=("local", "slurm"), default="local",
                        help="run jobs as local processes (default) or as Slurm jobs (docs/executors.md)")
    parser.add_argument("--report", choices=("pipe", "file", "mqtt"), default=None,
                        help="how jobs report: the launcher's pipe (local default), a metrics file (slurm "
                             "default) or straight to the broker")
    parser.add_argument("--lease", type=float, default=None, help="lease length in seconds (budget's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="keep checkpoints and job logs here (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the summary as JSON here")
    parser.add_argument("--quiet", action="store_true", help="no line per round")
    args = parser.parse_args(argv_)
    args.report = args.report or ("pipe" if args.executor == "local" else "file")
    if args.report == "pipe" and args.executor != "local":
        parser.error("--report pipe works with the local executor only")
    if args.report == "mqtt" and not args.mqtt:
        parser.error("--report mqtt needs --mqtt URL")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("themis.arbiter").setLevel(logging.ERROR)  # its JSON log lines would drown the output
    random.seed(args.seed)
    result = asyncio.run(run(args))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0 if all(a["finished"] for a in result["apps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
