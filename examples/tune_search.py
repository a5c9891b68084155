"""A Ray Tune search (ASHA) run as a Themis app: Tune picks the trials and stops the bad ones, the arbiter
decides where and when they run.

    python examples/tune_search.py                       # a private arbiter, 4 "GPUs", 16 trials
    python examples/tune_search.py --budget test         # what tests/test_ray_tune_adapter.py runs
    python examples/tune_search.py --searcher optuna     # Tune's OptunaSearch instead of random search
    python examples/tune_search.py --arbiter HOST:PORT --cluster NAME --token "$(themis-arbiter issue-token tune-asha)"
    python examples/tune_search.py --workdir runs --resume   # go on with an interrupted search

The search is the one you would give ``tune.Tuner``: the same ``param_space`` (Tune's sample
domains) and the same ``tune.TuneConfig`` (metric, mode, ``ASHAScheduler``, ``num_samples``,
``max_concurrent_trials``, a searcher). What changes (docs/agents.md, "Ray Tune"):

* the trainable is now a training script (``examples/train_digits.py``, a scikit-learn MLP on the
  digits data) that the launcher starts once per trial on its leased GPUs: ``tune.report(...)``
  becomes ``job.step(iteration, loss)``, Tune's checkpoint ``job.save``/``job.resume``, and the
  config arrives as ``job.params``;
* ``tune.Tuner(train, param_space=..., tune_config=...).fit()`` becomes ``TuneAdapter(param_space,
  tune_config)`` and an ``AppRunner``: Tune's searcher and scheduler decide, the runner starts,
  stops and resumes the trial processes, and the agent bids for GPUs with the search's
  finish-time fairness (rho).

Without ``--arbiter`` the script starts an arbiter of its own on a free loopback port (a 4-"GPU"
cluster, short leases so that leases expire and trials move), so it runs anywhere; no Ray cluster is
started (Tune's searcher and scheduler run inside this process). ``--resume`` goes on with the run
recorded in ``--workdir``: the adapter replays the run's journal through Tune with the same seed.
It prints a line per grant, revocation and trial result, then the best trial. ``--json PATH`` writes
the runner's summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ray import tune
from ray.tune.schedulers import ASHAScheduler

from agent.runner import AppRunner
from agent.search_run import RunFinished
from hyperparam_adapters.ray_tune import TuneAdapter

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train_digits.py"
APP = "tune-asha"
ADMIN = "tune-admin"
CLUSTER_TOML = """
name = "tune-4"
description = "one rack, two machines of two GPUs (CPU processes here)"
[[racks]]
name = "r0"
machines = [{ gpus = 2, slots = 2, count = 2 }]
"""
THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass(frozen=True)
class Budget:
    num_samples: int
    max_t: int  # iterations of a trial ASHA never stops
    epochs: int  # epochs per iteration
    parallel: int
    lease_s: float
    timeout_s: float


BUDGETS = {"default": Budget(16, 27, 10, 4, 20.0, 600.0), "test": Budget(8, 9, 4, 4, 6.0, 240.0)}


def param_space(epochs: int) -> dict:
    """Tune's search space, as ``tune.Tuner(param_space=...)`` takes it."""
    return {"solver": "adam", "hidden": tune.choice([16, 32, 64, 128]), "lr": tune.loguniform(3e-4, 3e-2),
            "alpha": tune.loguniform(1e-5, 1e-2), "batch": tune.choice([32, 64, 128]), "epochs": epochs}


def tune_config(budget: Budget, searcher: str, seed: int) -> tune.TuneConfig:
    """Tune's configuration, as ``tune.Tuner(tune_config=...)`` takes it: ASHA stops the trials whose
    loss is in the worst two thirds at a rung (1, 3, 9, ... iterations)."""
    search_alg = None  # Tune's default: random search (the adapter seeds it)
    if searcher == "optuna":
        import optuna
        from ray.tune.search.optuna import OptunaSearch

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        search_alg = OptunaSearch(seed=seed)  # seeded, so that --resume replays the same suggestions
    return tune.TuneConfig(metric="loss", mode="min", num_samples=budget.num_samples,
                           max_concurrent_trials=budget.parallel, search_alg=search_alg,
                           scheduler=ASHAScheduler(max_t=budget.max_t, grace_period=1, reduction_factor=3))


@contextlib.asynccontextmanager
async def private_arbiter(lease_s: float):
    """An arbiter on a free loopback port, for a run without ``--arbiter``."""
    from arbiter.server import ArbiterServer, ServerConfig

    with tempfile.TemporaryDirectory(prefix="themis-tune-") as tmp:
        cluster = Path(tmp) / "tune-4.toml"
        cluster.write_text(CLUSTER_TOML)
        server = ArbiterServer(ServerConfig(cluster=str(cluster), port=0, db=Path(tmp) / "arbiter.db",
                                            admin_token=ADMIN, lease_s=lease_s, report_timeout_s=1.0,
                                            bid_timeout_s=1.0, coalesce_s=0.2))
        port = await server.start()
        try:
            yield f"127.0.0.1:{port}", await AppRunner.token(f"127.0.0.1:{port}", APP, ADMIN), "tune-4"
        finally:
            await server.stop(grace=0.5)


async def search(args: argparse.Namespace, arbiter: str, token: str | None, cluster: str) -> dict:
    budget = BUDGETS[args.budget]
    adapter = TuneAdapter(param_space(budget.epochs), tune_config(budget, args.searcher, args.seed), seed=args.seed,
                          iter_time_serial=0.02 * budget.epochs, start_time=time.time())
    runner = await AppRunner.create(adapter, [sys.executable, str(TRAIN)], app=APP, arbiter=arbiter, token=token,
                                    credential_file=args.credential_file, cluster=cluster, workdir=args.workdir,
                                    grace_s=5.0, env=THREADS, resume=args.resume, quiet=args.quiet)
    await runner.run(timeout=budget.timeout_s)
    summary = runner.summary()
    summary["trials"] = dict(sorted(Counter(str(adapter.outcome(j)) for j in adapter.trials()).items()))
    summary["iterations"] = {j: adapter.last_result(j)[0] if adapter.last_result(j) else 0 for j in adapter.trials()}
    best = summary["best"]
    if best is not None:
        accuracy = f", accuracy {best['accuracy']:.3f}" if "accuracy" in best else ""  # an earlier session's: not here
        print(f"best: {best['job']} {json.dumps(best['params'])}: validation loss {best['loss']:.4f}{accuracy} "
              f"after {best['iteration']:g} iterations; trials {summary['trials']}; {summary['completion_s']} s; "
              f"records in {runner.launcher.run_dir}")
    return summary


async def main_async(args: argparse.Namespace) -> dict:
    if args.arbiter:
        return await search(args, args.arbiter, args.token, args.cluster)
    async with private_arbiter(BUDGETS[args.budget].lease_s) as (arbiter, token, cluster):
        return await search(args, arbiter, token, cluster)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A Ray Tune search (ASHA) as a Themis app.")
    parser.add_argument("--budget", choices=sorted(BUDGETS), default="default")
    parser.add_argument("--searcher", choices=("random", "optuna"), default="random",
                        help="Tune's default random search, or Tune's OptunaSearch (needs optuna)")
    parser.add_argument("--arbiter", default=None, help="HOST:PORT of a running arbiter (default: start one here)")
    parser.add_argument("--cluster", default="local", help="the arbiter's cluster name (with --arbiter)")
    parser.add_argument("--token", default=None, help=f"registration token (themis-arbiter issue-token {APP})")
    parser.add_argument("--credential-file", default=None, help="keep the app credential here for later runs")
    parser.add_argument("--workdir", default="themis-runs/tune",
                        help="checkpoints, logs, records (default: ./themis-runs/tune, ignored by git)")
    parser.add_argument("--resume", action="store_true", help="go on with the interrupted run in --workdir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the runner's summary as JSON here")
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
