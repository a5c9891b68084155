"""What a restart costs a real PyTorch job, per model size, through the project's own launcher (D32).

A restart is what a lost lease does to a job (D11, D17): the launcher sends SIGTERM, the job
finishes its optimizer step, saves its model, its AdamW state and its step through ``agent.job`` and
exits; then a new process starts on other GPUs, loads the checkpoint and trains until its first
report. For each model size this benchmark runs ``examples/train_torch.py`` (one optimizer step per
iteration, so the first report comes after the first finished step) through ``agent.launcher`` with
the local executor, and times, from the launcher's side:

* **stop**: ``Launcher.stop`` (SIGTERM) until the launcher has reaped the exited process, the
  checkpoint written and fsync'ed (``agent.job.save``);
* **restart**: ``Launcher.start`` of the new process until its first report (``Launcher.start_ups``:
  Python and PyTorch start-up, data, building the model, loading the checkpoint, one step);
* **checkpoint**: the size of the file the stopped run left.

Each size is started once from scratch (its cold start is recorded too), then stopped and restarted
``--reps`` times, alternating between two "machines" (two GPU ids that are CUDA device 0 of their
machine, so on a GPU box the job uses the GPU, on a CPU box the CPU). Every restart must go on from
its checkpoint's step (the benchmark checks the report's iteration) and every stop must exit 0
within its grace period: the numbers are of real stops and resumes, never of killed processes.

Run ``python benchmarks/restart_cost.py [--quick] [--sizes a,b] [--reps N] [--out FILE]``; a table on
stdout and JSON in ``benchmarks/results/restart_cost.json`` (the machine and its load average named).
The default sizes (two restarts each) take about 2 minutes 40 seconds of CPU on this 2-core machine
(6 minutes of wall time at a load average of 9, other work running); ``--quick`` (two tiny models,
one restart each) is what ``tests/test_restart_cost.py`` runs. The shipped restart-cost table
(``agent/profiles/restart_costs.toml``) cites these results beside the H200 measurements.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from machine import machine_info, write_results
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.launcher import Launcher  # noqa: E402
from agent.trial import TrialSpec  # noqa: E402

TRAIN = ROOT / "examples" / "train_torch.py"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "restart_cost.json"
GPUS = ("bench-m0-g0", "bench-m1-g0")  # CUDA device 0 of two machines
COMMON = {"lr": 1e-3, "weight_decay": 1e-2, "steps": 1, "val": 64, "seed": 0}


@dataclass(frozen=True)
class Size:
    what: str
    params: dict[str, Any]


SIZES = {
    "cnn-16": Size("small CNN (2 conv layers, 16/32 channels)", {"arch": "cnn", "width": 16, "batch": 64}),
    "mlp-4x2048": Size("MLP, 4 hidden layers of 2048", {"arch": "mlp", "width": 2048, "depth": 4, "batch": 64}),
    "mlp-4x4096": Size("MLP, 4 hidden layers of 4096 (the H200 row's shape)",
                       {"arch": "mlp", "width": 4096, "depth": 4, "batch": 64}),
    "transformer-1024x8": Size("transformer encoder, 8 layers, width 1024",
                               {"arch": "transformer", "width": 1024, "depth": 8, "batch": 8}),
}
QUICK = {
    "cnn-8": Size("tiny CNN", {"arch": "cnn", "width": 8, "batch": 64}),
    "mlp-2x256": Size("tiny MLP", {"arch": "mlp", "width": 256, "depth": 2, "batch": 64}),
}
DEFAULT_REPS = 2


def until(poll, done, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        poll()
        if done():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"restart benchmark: {what} took over {timeout:.0f} s")
        time.sleep(0.01)


def measure(name: str, size: Size, reps: int, workdir: Path, threads: int, timeout: float) -> dict[str, Any]:
    """Cold start, then ``reps`` x (stop, restart on the other GPU), then a last stop."""
    launcher = Launcher("bench", [sys.executable, str(TRAIN)], workdir / name, cluster="bench", grace_s=timeout,
                        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads),
                             "MKL_NUM_THREADS": str(threads)})
    spec = TrialSpec(name, {**COMMON, **size.params})
    reports: list[dict[str, Any]] = []

    def poll() -> None:
        reports.extend(payload for _, payload in launcher.poll().metrics)

    def start(k: int) -> float:
        reports.clear()
        gpu = GPUS[k % 2]
        launcher.start(spec, [gpu], [("r0", gpu.rsplit("-", 1)[0], gpu)])
        until(poll, lambda: bool(reports), timeout, f"{name}: launch to first report")
        return launcher.start_ups[-1][1]

    def stop() -> float:
        began = time.monotonic()
        launcher.stop(name, timeout, reason="benchmark")
        until(poll, lambda: not launcher.is_live(name), timeout, f"{name}: stop")
        took = time.monotonic() - began
        ended = launcher.history[-1]
        if not ended.clean or ended.killed:
            raise RuntimeError(f"{name}: the stopped run exited with {ended.returncode} (killed: {ended.killed}); "
                               f"see {launcher.log_path(name)}")
        return took

    try:
        cold = start(0)
        first = reports[0]
        stops, restarts, sizes = [], [], []
        for k in range(1, reps + 1):
            stops.append(stop())
            saved = launcher.history[-1].last_iteration  # one step per iteration: the checkpoint's step
            sizes.append(launcher.checkpoint_path(name).stat().st_size)
            restarts.append(start(k))
            resumed = reports[0]
            if (not launcher.run_of(name).resumed or resumed["iteration"] != saved + 1
                    or resumed["extra"].get("resumed_step") != saved):
                raise RuntimeError(f"{name}: restart {k} did not go on from its checkpoint (saved at step {saved}, "
                                   f"first report {resumed})")
        stops.append(stop())
        sizes.append(launcher.checkpoint_path(name).stat().st_size)
    finally:
        launcher.executor.close()
    return {"what": size.what, "params": {**COMMON, **size.params}, "parameters": first["extra"]["parameters"],
            "device": first["extra"]["device"], "checkpoint_mb": round(statistics.median(sizes) / 1e6, 1),
            "cold_start_s": round(cold, 3), "stop_s": [round(s, 3) for s in stops],
            "restart_s": [round(s, 3) for s in restarts], "stop_median_s": round(statistics.median(stops), 3),
            "restart_median_s": round(statistics.median(restarts), 3),
            "stop_plus_restart_s": round(statistics.median(stops) + statistics.median(restarts), 3)}


def span(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if len(values) > 1 else f"{values[0]:.2f}"


def table(result: dict[str, Any]) -> Table:
    load = result["load_average_1min"]
    t = Table(title=f"Restart cost through the launcher on {result['machine']['cpu_count']} x "
                    f"{result['machine']['cpu_model']} (load {load[0]:.1f} -> {load[1]:.1f}), "
                    f"{result['settings']['reps']} restarts per size; seconds, min-max")
    for column in ("model", "parameters", "device", "checkpoint MB", "cold start", "stop", "restart",
                   "stop + restart (medians)"):
        t.add_column(column, justify="left" if column in ("model", "device") else "right")
    for name, cell in result["sizes"].items():
        t.add_row(name, f"{cell['parameters'] / 1e6:.2f} M", cell["device"], f"{cell['checkpoint_mb']:.1f}",
                  f"{cell['cold_start_s']:.2f}", span(cell["stop_s"]), span(cell["restart_s"]),
                  f"{cell['stop_plus_restart_s']:.2f}")
    return t


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two tiny models, one restart each (the test)")
    parser.add_argument("--sizes", default=None,
                        help=f"comma-separated, of {', '.join(SIZES)} (default: all; --quick: {', '.join(QUICK)})")
    parser.add_argument("--reps", type=int, default=None, help=f"restarts per size (default {DEFAULT_REPS}; quick 1)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="PyTorch threads per job")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a stop or a start may take")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    known = {**SIZES, **QUICK}
    names = args.sizes.split(",") if args.sizes else list(QUICK if args.quick else SIZES)
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown size(s) {', '.join(unknown)}; known: {', '.join(known)}")
    reps = args.reps or (1 if args.quick else DEFAULT_REPS)
    if reps < 1:
        parser.error("--reps must be >= 1")
    load_before = os.getloadavg()[0]
    began = time.monotonic()
    cells: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="themis-restart-bench-") as tmp:
        for name in names:
            print(f"{name}: {known[name].what} ...", file=sys.stderr, flush=True)
            cells[name] = measure(name, known[name], reps, Path(tmp), args.threads, args.timeout)
    result = {"machine": machine_info(), "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
              "settings": {"quick": args.quick, "reps": reps, "threads": args.threads, "executor": "local",
                           "report": "pipe", "checkpoint": "agent.job.save (pickle, fsync)", "disk": "local",
                           "script": "examples/train_torch.py", "sizes": names},
              "seconds": round(time.monotonic() - began, 1), "sizes": cells}
    Console(width=160).print(table(result))
    write_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
