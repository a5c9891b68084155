"""A PyTorch hyperparameter search run as a Themis app: a lease lost mid-training, resumed with its AdamW state.

    python examples/torch_search.py                    # Hyperband over a CNN on digits, 17 trials, ~6 minutes on 2 busy cores
    python examples/torch_search.py --budget test      # 2 trials, 40-80 s on a busy 2-core box: what tests/test_torch_example.py runs
    python examples/torch_search.py --arbiter HOST:PORT --cluster NAME --token "$(themis-arbiter issue-token torch-cnn)"

The search is Hyperband (successive halving in the test budget) over a small CNN's width, AdamW's
learning rate and weight decay, and the batch size; each trial is ``examples/train_torch.py``, a real
PyTorch training process on scikit-learn's digits (no download) that the launcher starts on the GPU
its lease names: CUDA with bf16 autocast where there is one, the CPU otherwise. What a PyTorch user
writes is in docs/agents.md ("PyTorch"): ``job.resume()`` before training, ``job.step()`` after
each iteration, ``job.save()`` of the model, the optimizer and the step before leaving.

Without ``--arbiter`` the script starts an arbiter of its own on a free loopback port, with a
cluster of four one-GPU machines (every GPU is CUDA device 0 of its machine, so on a one-GPU box
all the jobs share that GPU; on a CPU box they are CPU processes) and short leases. There it also
plays the operator once (``--no-drain`` to leave it out): when a trial has clearly more training
left than a lease, it drains that trial's machine (``themis-arbiter drain``: no new grants there),
so the trial's lease runs out and is not renewed, the launcher sends SIGTERM, the trial saves its
model, optimizer and step and exits, and it resumes on another machine from that checkpoint; once it
has reported from there, the machine is given back (``drain --resume``).

It prints a line per grant, revocation and trial result (``AppRunner``), then what the lease loss
did: the step the trial went on from and the fingerprint of the AdamW state it loaded, the device,
and the iteration times the profiler measured. ``--json PATH`` writes the same as data.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.profiler import Profiler
from agent.runner import AppRunner
from agent.search_run import RunFinished
from hyperparam_adapters.hyperband import HyperbandAdapter, SuccessiveHalvingAdapter

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train_torch.py"
APP = "torch-cnn"
ADMIN = "torch-admin"
CLUSTER = "torch-4"
CLUSTER_TOML = f"""
name = "{CLUSTER}"
description = "one rack, four machines of one GPU each (CUDA device 0 of each; CPU processes without CUDA)"
[[racks]]
name = "r0"
machines = [{{ gpus = 1, slots = 1, count = 4 }}]
"""
THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass(frozen=True)
class Budget:
    lease_s: float
    steps: int  # optimizer steps per iteration (the tuner's unit); an epoch is 22 steps at batch 64
    hyperband: dict[str, Any] | None  # HyperbandAdapter kwargs, or None for successive halving
    halving: dict[str, Any] | None
    timeout_s: float


BUDGETS = {
    "default": Budget(5.0, 66, {"max_resource": 9, "eta": 3}, None, 900.0),
    # two trials to 2 iterations, the better one on to 20: it trains well past a lease
    "test": Budget(4.0, 66, None, {"n": 2, "eta": 2, "phase_iterations": [2, 18]}, 240.0),
}


def log_uniform(lo: float, hi: float):
    return lambda rng: round(math.exp(rng.uniform(math.log(lo), math.log(hi))), 6)


def space(steps: int) -> dict[str, Any]:
    """The search space: ``train_torch.py``'s hyperparameters (constants are passed as they are)."""
    return {"arch": "cnn", "width": [8, 16, 32], "lr": log_uniform(1e-3, 1e-2),
            "weight_decay": log_uniform(1e-4, 1e-1), "batch": [32, 64], "steps": steps}


def make_adapter(budget: Budget, seed: int) -> HyperbandAdapter | SuccessiveHalvingAdapter:
    # declared seconds per iteration until a trial measures its own (rho's budget B uses these)
    common = {"seed": seed, "iter_time": 0.01 * budget.steps, "start_time": time.time()}
    if budget.hyperband is not None:
        return HyperbandAdapter(space(budget.steps), **budget.hyperband, **common)
    return SuccessiveHalvingAdapter(space(budget.steps), **budget.halving, **common)  # type: ignore[arg-type]


async def make_runner(adapter, steps: int, *, arbiter: str, token: str | None, cluster: str, workdir: Path,
                      credential_file: str | None = None, quiet: bool = False, env: dict[str, str] | None = None,
                      **kwargs: Any) -> AppRunner:
    """The app: the adapter, the training script as the job command, the profiler (``steps``: per
    iteration, for its first guess of an iteration's time)."""
    return await AppRunner.create(adapter, [sys.executable, str(TRAIN)], app=APP, arbiter=arbiter, token=token,
                                  credential_file=credential_file, cluster=cluster, workdir=str(workdir),
                                  grace_s=30.0, env={**THREADS, **(env or {})}, quiet=quiet,
                                  profiler=Profiler(iter_time_serial=0.01 * steps), **kwargs)


# ---------------------------------------------------------------------------------------------- the operator


async def drain(arbiter: str, admin: str, machine: str, *, resume: bool = False) -> None:
    """``themis-arbiter drain MACHINE`` (or ``--resume``), as an operator would type it."""
    from protos import themis_pb2 as pb
    from protos import themis_pb2_grpc as pb_grpc
    from protos.rpc import channel

    async with channel(arbiter, None) as ch:
        await pb_grpc.ArbiterStub(ch).DrainMachine(pb.DrainMachineRequest(machine=machine, resume=resume),
                                                   metadata=[("authorization", f"Bearer {admin}")])


async def move_one_trial(runner: AppRunner, arbiter: str, admin: str, lease_s: float, out=sys.stdout) -> dict:
    """Drain the machine of the first trial with clearly more than a lease of training left (its lease
    runs out within a lease of the drain, while it still trains); give the machine back once that
    trial has reported from another one. What happened, as data."""
    done: dict[str, Any] = {}
    while not runner.finished:
        for job, run in runner.launcher.live().items():
            target = run.spec.target_iteration
            times = [r.iter_time_s for r in runner.reports if r.job_id == job]
            if (run.active and run.last_iteration is not None and target is not None and times
                    and (target - run.last_iteration) * statistics.median(times) > 1.5 * lease_s):
                done = {"job": job, "machine": run.placement[0][1], "from_gpus": list(run.gpus),
                        "at_iteration": run.last_iteration}
                break
        if done:
            break
        await asyncio.sleep(0.05)
    if not done:
        return {}
    print(f"operator: draining {done['machine']} (maintenance): {done['job']}'s lease runs out there and is not "
          "renewed", file=out, flush=True)
    await drain(arbiter, admin, done["machine"])
    started = len(runner.launcher.history)
    while not runner.finished:
        run = runner.launcher.run_of(done["job"])
        if (run is not None and run.reports and run.placement[0][1] != done["machine"]
                and len(runner.launcher.history) > started):
            done["to_gpus"] = list(run.gpus)
            break
        await asyncio.sleep(0.05)
    await drain(arbiter, admin, done["machine"], resume=True)
    moved = f"reports from {','.join(done['to_gpus'])}" if "to_gpus" in done else "did not move (the search ended)"
    print(f"operator: {done['job']} {moved}; {done['machine']} is back", file=out, flush=True)
    return done


# ---------------------------------------------------------------------------------------------- the run


def what_happened(runner: AppRunner, moved: dict) -> dict[str, Any]:
    """The summary, plus what the resumed runs said about the state they loaded, the devices and
    the iteration times measured."""
    summary = runner.summary()
    summary["resumed_state"] = [
        {"job": r.job_id, "iteration": r.iteration, "resumed_step": r.extra["resumed_step"], "step": r.extra["step"],
         "exp_avg_fingerprint": r.extra["exp_avg_fingerprint"]}
        for r in runner.reports if "resumed_step" in r.extra]
    summary["devices"] = sorted({str(r.extra.get("device")) for r in runner.reports})
    times = [r.iter_time_s for r in runner.reports]
    summary["iter_time_s"] = {"median": round(statistics.median(times), 4), "min": round(min(times), 4),
                              "max": round(max(times), 4)} if times else None
    serial = runner.profiler.iter_time_serial if runner.profiler is not None else None
    summary["profiler_iter_time_serial_s"] = None if serial is None else round(serial, 4)
    summary["moved"] = moved
    return summary


def render(summary: dict[str, Any], out) -> None:
    best = summary["best"]
    if best is not None:
        params = {k: v for k, v in best["params"].items() if k not in ("arch", "steps")}
        print(f"best: {best['job']} {json.dumps(params, sort_keys=True)}: validation loss {best['loss']:.4f}, "
              f"accuracy {best.get('accuracy', float('nan')):.3f} after {best['iteration']:g} iterations", file=out)
    times = summary["iter_time_s"]
    if times:
        print(f"devices: {', '.join(summary['devices'])}; iteration times measured: median {times['median']:.3f} s "
              f"({times['min']:.3f}-{times['max']:.3f}); the profiler's serial estimate "
              f"{summary['profiler_iter_time_serial_s']} s", file=out)
    moved = summary["moved"]
    if moved.get("to_gpus"):
        print(f"lease lost: {moved['job']} on {','.join(moved['from_gpus'])} at iteration {moved['at_iteration']:g}, "
              f"resumed on {','.join(moved['to_gpus'])}", file=out)
    for r in summary["resumed_state"]:
        print(f"  {r['job']} resumed from its checkpoint at optimizer step {r['resumed_step']} (AdamW exp_avg "
              f"fingerprint {r['exp_avg_fingerprint']:.6g}) and reported step {r['step']} at iteration "
              f"{r['iteration']:g}", file=out)
    print(f"{summary['runs']} runs of {summary['jobs']} trials, {summary['resumed_runs']} resumed from a checkpoint "
          f"({summary['resumed_after_preemption']} after losing their GPUs), {summary['lease_losses']} revocations; "
          f"{summary['completion_s']} s; records in {summary['run_dir']}", file=out)


@contextlib.asynccontextmanager
async def private_arbiter(lease_s: float):
    """An arbiter on a free loopback port, for a run without ``--arbiter``."""
    from arbiter.server import ArbiterServer, ServerConfig

    with tempfile.TemporaryDirectory(prefix="themis-torch-") as tmp:
        cluster = Path(tmp) / f"{CLUSTER}.toml"
        cluster.write_text(CLUSTER_TOML)
        server = ArbiterServer(ServerConfig(cluster=str(cluster), port=0, db=Path(tmp) / "arbiter.db",
                                            admin_token=ADMIN, lease_s=lease_s, report_timeout_s=1.0,
                                            bid_timeout_s=1.0, coalesce_s=0.2))
        port = await server.start()
        try:
            yield f"127.0.0.1:{port}"
        finally:
            await server.stop(grace=0.5)


async def search(args: argparse.Namespace, arbiter: str, token: str | None, cluster: str, admin: str | None,
                 out=sys.stdout) -> dict[str, Any]:
    budget = BUDGETS[args.budget]
    lease = args.lease or budget.lease_s
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    runner = await make_runner(make_adapter(budget, args.seed), budget.steps, arbiter=arbiter, token=token, cluster=cluster,
                               workdir=workdir, credential_file=args.credential_file, quiet=args.quiet,
                               resume=args.resume)
    operator = (asyncio.create_task(move_one_trial(runner, arbiter, admin, lease, out))
                if admin is not None and args.drain else None)
    try:
        await runner.run(timeout=budget.timeout_s)
    finally:
        moved = {}
        if operator is not None:
            if not operator.done():
                operator.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                moved = await operator
    summary = what_happened(runner, moved)
    render(summary, out)
    return summary


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    if args.arbiter:
        return await search(args, args.arbiter, args.token, args.cluster, None)
    lease = args.lease or BUDGETS[args.budget].lease_s
    async with private_arbiter(lease) as arbiter:
        token = await AppRunner.token(arbiter, APP, ADMIN)
        print(f"arbiter on {arbiter}: cluster {CLUSTER} (4 one-GPU machines), lease {lease:g} s", flush=True)
        return await search(args, arbiter, token, CLUSTER, ADMIN)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A PyTorch search as a Themis app.")
    parser.add_argument("--budget", choices=sorted(BUDGETS), default="default")
    parser.add_argument("--arbiter", default=None, help="HOST:PORT of a running arbiter (default: start one here)")
    parser.add_argument("--cluster", default="local", help="the arbiter's cluster name (with --arbiter)")
    parser.add_argument("--token", default=None, help=f"registration token (themis-arbiter issue-token {APP})")
    parser.add_argument("--credential-file", default=None, help="keep the app credential here for later runs")
    parser.add_argument("--lease", type=float, default=None, help="lease length in seconds (private arbiter; "
                                                                   "the budget's default)")
    parser.add_argument("--no-drain", dest="drain", action="store_false",
                        help="do not drain a trial's machine to show a lease lost and resumed (private arbiter)")
    parser.add_argument("--workdir", default="themis-runs/torch",
                        help="checkpoints, logs, records (default: ./themis-runs/torch, ignored by git)")
    parser.add_argument("--resume", action="store_true", help="go on with the interrupted run in --workdir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the summary as JSON here")
    parser.add_argument("--quiet", action="store_true", help="no line per grant, revocation or trial, no progress bar")
    args = parser.parse_args(argv)
    logging.getLogger("themis.arbiter").setLevel(logging.ERROR)
    try:
        summary = asyncio.run(main_async(args))
    except RunFinished as exc:  # --resume of a run that finished: say so, run nothing
        print(exc)
        return 0
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1, default=str))
    return 0 if summary["finished"] else 1


if __name__ == "__main__":
    sys.exit(main())
