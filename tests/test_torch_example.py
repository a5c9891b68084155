"""The PyTorch example against a real arbiter: a real PyTorch job loses its lease, checkpoints on
SIGTERM and resumes elsewhere with its optimizer state.

The arbiter is ``arbiter.server.ArbiterServer`` on loopback (``tests/service_kit.py``), the app is
the example's own ``AppRunner`` (``examples/torch_search.make_runner``) whose jobs are
``examples/train_torch.py`` processes training a CNN with AdamW on the CPU. The lease is lost the way
an operator makes it happen: the job's machine is drained, so its lease runs out and is not renewed.
The checkpoint the stopped run left is read by the test itself (pickle, as ``agent.job`` wrote it),
and the resumed run's first report must say the same step and the same AdamW moments.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import pickle
import subprocess
import sys
from pathlib import Path

import torch

from hyperparam_adapters.hyperband import BracketTuner, Rung
from tests.service_kit import ADMIN, arbiter, cluster_file, target, wait_for

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "torch_search.py"
STEPS = 66  # optimizer steps per iteration: three epochs at batch 64
ITERATIONS = 30  # long enough to be training still when the drained machine's lease runs out


def example():
    spec = importlib.util.spec_from_file_location("torch_search", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def exp_avg_sum_of_squares(optimizer_state: dict) -> float:
    return sum(float(s["exp_avg"].to(torch.float64).pow(2).sum()) for _, s in sorted(optimizer_state["state"].items()))


def adamw_steps(optimizer_state: dict) -> set[int]:
    return {int(s["step"]) for s in optimizer_state["state"].values()}


def test_a_pytorch_job_that_loses_its_lease_resumes_elsewhere_with_its_adamw_state(tmp_path):
    torch_search = example()
    adapter = BracketTuner({"arch": "cnn", "width": 8, "lr": 0.003, "weight_decay": 0.01, "batch": 64,
                            "steps": STEPS}, [[Rung(1, ITERATIONS)]], iter_time=0.2)
    cluster = cluster_file(tmp_path, torch_search.CLUSTER_TOML)
    seen: dict = {}

    async def operator(runner) -> None:
        """Drain the job's machine once it has trained; keep the checkpoint its stopped run leaves."""
        await wait_for(lambda: (run := runner.launcher.run_of("t0")) is not None and (run.last_iteration or 0) >= 1,
                       timeout=120)
        run = runner.launcher.run_of("t0")
        seen["machine"], seen["gpus"] = run.placement[0][1], run.gpus
        await torch_search.drain(target(server), ADMIN, seen["machine"])
        await wait_for(lambda: any(e.job_id == "t0" for e in runner.launcher.history), timeout=60)
        seen["exit"] = runner.launcher.history[0]
        # the next run of t0 writes its checkpoint only when it leaves, long after this
        seen["checkpoint"] = pickle.loads(runner.launcher.checkpoint_path("t0").read_bytes())
        await wait_for(lambda: any("resumed_step" in r.extra for r in runner.reports), timeout=120)
        await torch_search.drain(target(server), ADMIN, seen["machine"], resume=True)

    async def scenario():
        nonlocal server
        async with arbiter(tmp_path, cluster=str(cluster), lease_s=3.0) as server:
            token = await torch_search.AppRunner.token(target(server), torch_search.APP, ADMIN)
            runner = await torch_search.make_runner(adapter, STEPS, arbiter=target(server), token=token,
                                                    cluster="torch-4", workdir=tmp_path / "work", quiet=True,
                                                    env={"PYTHONPATH": str(ROOT)})
            watching = asyncio.create_task(operator(runner))
            await runner.run(timeout=240)
            await watching
            return runner

    server = None
    runner = asyncio.run(asyncio.wait_for(scenario(), 300))
    assert runner.finished and not runner.failed

    # the first run was stopped because its lease ran out on the drained machine, and left cleanly
    stopped = seen["exit"]
    assert stopped.requested and stopped.reason == "GPUs lost" and stopped.clean and not stopped.killed
    revoked = [e for e in runner.events if e["what"] == "revoke"]
    assert revoked and revoked[0]["gpus"] == list(seen["gpus"]) and revoked[0]["reason"] == "lease expired"

    # its checkpoint: model, AdamW state and step, as agent.job pickled it
    saved = seen["checkpoint"]["state"]
    step = saved["step"]
    assert step > STEPS and set(saved["model"]) and saved["optimizer"]["param_groups"][0]["lr"] == 0.003
    assert adamw_steps(saved["optimizer"]) == {step}  # AdamW counted every step since the first
    fingerprint = exp_avg_sum_of_squares(saved["optimizer"])
    assert fingerprint > 0

    # the resumed run: on another machine, from that step, with those moments
    starts = [e for e in runner.events if e["what"] == "start" and e["job"] == "t0"]
    assert len(starts) >= 2 and starts[1]["resumed"] and starts[1]["after"] == "GPUs lost"
    assert starts[1]["gpus"] != list(seen["gpus"])
    first = next(r for r in runner.reports if "resumed_step" in r.extra)
    assert first.extra["resumed_step"] == step
    assert abs(first.extra["exp_avg_fingerprint"] - fingerprint) <= 1e-9 * fingerprint
    assert first.extra["step"] == (step // STEPS + 1) * STEPS  # it finished the iteration it was stopped in
    assert first.iteration == step // STEPS + 1

    # the end: every step counted once, in the model's and in AdamW's count alike
    final = pickle.loads(runner.launcher.checkpoint_path("t0").read_bytes())["state"]
    assert final["step"] == ITERATIONS * STEPS and adamw_steps(final["optimizer"]) == {ITERATIONS * STEPS}
    iterations = [r.iteration for r in runner.reports]
    assert iterations == sorted(iterations) and iterations[-1] == ITERATIONS
    assert runner.reports[-1].extra["accuracy"] > 0.8 and runner.reports[-1].extra["device"] == "cpu"


def test_the_torch_example_runs_from_its_command_and_a_moved_trial_resumes(tmp_path):
    """``examples/torch_search.py --budget test``, as the README says to run it: its own arbiter, a
    successive-halving search of real PyTorch trials, one trial moved by a drained machine."""
    out = tmp_path / "summary.json"
    done = subprocess.run([sys.executable, str(EXAMPLE), "--budget", "test", "--workdir", str(tmp_path / "work"),
                           "--json", str(out), "--quiet"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["finished"] and not summary["failed_jobs"] and summary["killed_after_grace"] == 0
    assert summary["devices"] == ["cpu"]
    assert summary["best"]["accuracy"] > 0.8 and summary["best"]["params"]["arch"] == "cnn"
    moved = summary["moved"]
    if not moved.get("to_gpus"):
        # The operator drains a machine only while a trial has clearly more than a lease of training
        # left; on a busy machine the search can get past that point first (the move itself is
        # tested step by step above, on a drain the test makes).
        assert "lease lost: " not in done.stdout
        return
    assert moved["to_gpus"] != moved["from_gpus"]
    assert summary["resumed_after_preemption"] >= 1
    resumed = [r for r in summary["resumed_state"] if r["job"] == moved["job"]]
    assert resumed and all(r["exp_avg_fingerprint"] > 0 and r["step"] > r["resumed_step"] for r in resumed)
    assert "lease lost: " in done.stdout and "resumed from its checkpoint at optimizer step" in done.stdout
