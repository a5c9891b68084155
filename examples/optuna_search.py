"""An Optuna study (HyperbandPruner) run as a Themis app: trials only on the GPUs the arbiter leases.

    python examples/optuna_search.py                       # a private arbiter, 4 "GPUs", 24 trials
    python examples/optuna_search.py --budget test         # what tests/test_example_e2e.py runs
    python examples/optuna_search.py --arbiter HOST:PORT --token "$(themis-arbiter issue-token optuna-sgd)"
    python examples/optuna_search.py --workdir runs --resume   # go on with an interrupted search

The study is the one you would write for ``study.optimize``: a sampler, a ``HyperbandPruner`` over
``max_resource`` epochs, its storage. What changes (docs/agents.md, "Optuna"):

* the objective is now a training script (``examples/train_breast_cancer.py``) that the launcher
  starts once per trial on its leased GPUs;
* its ``trial.suggest_*`` calls move to ``suggest(trial)`` below, which the adapter calls for each
  new trial (``study.ask``); the script reads the values from ``job.params``;
* ``study.optimize(objective, n_trials=N, n_jobs=P)`` becomes ``OptunaAdapter(study, n_trials=N,
  parallel=P, suggest=suggest)`` and an ``AppRunner``: the adapter asks and tells, the runner
  starts, stops and resumes the trial processes, and the agent bids for GPUs with the search's
  finish-time fairness (rho).

The study lives in ``<workdir>/study.db`` (SQLite): ``--resume`` goes on with the run recorded in
the workdir, taking up its trials from their checkpoints (a run that finished: one line saying so,
and nothing is run); without it, a new run starts in the same workdir and new trials never touch an
older run's checkpoints (issue 11).

Without ``--arbiter`` the script starts an arbiter of its own on a free loopback port (a 4-"GPU"
cluster, 30 s leases: docs/agents.md, "Choosing the lease"), so it runs anywhere. It prints a line
per grant, revocation and trial result (``AppRunner``), then the best trial. ``--json PATH`` writes the runner's summary.
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
from dataclasses import dataclass
from pathlib import Path

import optuna

from agent.runner import AppRunner
from agent.search_run import RunFinished
from hyperparam_adapters.optuna_adapter import OptunaAdapter

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train_breast_cancer.py"
APP = "optuna-sgd"
ADMIN = "optuna-admin"
CLUSTER_TOML = """
name = "optuna-4"
description = "one rack, two machines of two GPUs (CPU processes here)"
[[racks]]
name = "r0"
machines = [{ gpus = 2, slots = 2, count = 2 }]
"""
THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass(frozen=True)
class Budget:
    n_trials: int
    max_resource: int  # iterations (of 50 epochs) of a trial that is never pruned
    parallel: int
    lease_s: float
    timeout_s: float


BUDGETS = {"default": Budget(24, 27, 4, 30.0, 600.0), "test": Budget(8, 9, 4, 6.0, 240.0)}


def suggest(trial: optuna.Trial) -> None:
    """The objective's ``trial.suggest_*`` calls, unchanged."""
    trial.suggest_float("alpha", 1e-6, 1e-1, log=True)
    trial.suggest_float("eta0", 1e-4, 1e-1, log=True)
    trial.suggest_categorical("learning_rate", ["constant", "invscaling", "adaptive"])


def make_study(storage: str, seed: int, max_resource: int) -> optuna.Study:
    return optuna.create_study(
        study_name=APP, storage=storage, load_if_exists=True, direction="minimize",
        sampler=optuna.samplers.TPESampler(seed=seed),
        pruner=optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max_resource, reduction_factor=3))


@contextlib.asynccontextmanager
async def private_arbiter(lease_s: float):
    """An arbiter on a free loopback port, for a run without ``--arbiter``."""
    from arbiter.server import ArbiterServer, ServerConfig

    with tempfile.TemporaryDirectory(prefix="themis-optuna-") as tmp:
        cluster = Path(tmp) / "optuna-4.toml"
        cluster.write_text(CLUSTER_TOML)
        server = ArbiterServer(ServerConfig(cluster=str(cluster), port=0, db=Path(tmp) / "arbiter.db",
                                            admin_token=ADMIN, lease_s=lease_s, report_timeout_s=1.0,
                                            bid_timeout_s=1.0, coalesce_s=0.2))
        port = await server.start()
        try:
            yield f"127.0.0.1:{port}", await AppRunner.token(f"127.0.0.1:{port}", APP, ADMIN), "optuna-4"
        finally:
            await server.stop(grace=0.5)


async def search(args: argparse.Namespace, arbiter: str, token: str | None, cluster: str) -> dict:
    budget = BUDGETS[args.budget]
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    study = make_study(f"sqlite:///{workdir / 'study.db'}", args.seed, budget.max_resource)
    adapter = OptunaAdapter(study, n_trials=budget.n_trials, parallel=budget.parallel, suggest=suggest,
                            iter_time_serial=0.05, start_time=time.time())
    runner = await AppRunner.create(adapter, [sys.executable, str(TRAIN)], app=APP, arbiter=arbiter, token=token,
                                    credential_file=args.credential_file, cluster=cluster, workdir=str(workdir),
                                    grace_s=5.0, env=THREADS, resume=args.resume, quiet=args.quiet)
    await runner.run(timeout=budget.timeout_s)
    summary = runner.summary()
    states = [t.state.name for t in study.get_trials(deepcopy=False)]
    summary["trials"] = {s: states.count(s) for s in sorted(set(states))}
    best = summary["best"]
    if best is not None:
        accuracy = f", accuracy {best['accuracy']:.3f}" if "accuracy" in best else ""  # an earlier run's: not here
        print(f"best: {best['job']} {json.dumps(best['params'])}: validation loss {best['loss']:.4f}{accuracy} "
              f"after {best['iteration']:g} iterations; "
              f"trials {summary['trials']}; {summary['completion_s']} s; records in {runner.launcher.run_dir}")
    return summary


async def main_async(args: argparse.Namespace) -> dict:
    if args.arbiter:
        cluster = args.cluster
        return await search(args, args.arbiter, args.token, cluster)
    async with private_arbiter(BUDGETS[args.budget].lease_s) as (arbiter, token, cluster):
        return await search(args, arbiter, token, cluster)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="An Optuna study as a Themis app.")
    parser.add_argument("--budget", choices=sorted(BUDGETS), default="default")
    parser.add_argument("--arbiter", default=None, help="HOST:PORT of a running arbiter (default: start one here)")
    parser.add_argument("--cluster", default="local", help="the arbiter's cluster name (with --arbiter)")
    parser.add_argument("--token", default=None, help="registration token (themis-arbiter issue-token optuna-sgd)")
    parser.add_argument("--credential-file", default=None, help="keep the app credential here for later runs")
    parser.add_argument("--workdir", default="themis-runs/optuna", help="study database, checkpoints, logs, records (default: ./themis-runs/optuna, ignored by git)")
    parser.add_argument("--resume", action="store_true", help="go on with the interrupted run in --workdir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the runner's summary as JSON here")
    parser.add_argument("--quiet", action="store_true", help="no line per grant, revocation or trial, no progress bar")
    args = parser.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
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
