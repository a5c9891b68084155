"""Launch, stop and restart latencies of the executors (issue 6), on this machine.

For each executor (``local``: subprocesses with GPU locks; ``slurm``: a real local Slurm from
``tests/slurm_kit.py``, three slurmd's with four fake GPUs each) and ``--reps`` repetitions, a tiny
training job (``agent.job``: resume, step every 20 ms, save) goes through what a lease rotation does
to it, and the benchmark times, from the launcher's side:

* **launch -> running**: ``Launcher.start`` until the executor says running (Slurm: scheduled and
  started by slurmd);
* **launch -> first report**: until the job's first report arrives (adds the Python start-up and
  the report channel: pipe for local, a metrics file for slurm);
* **stop -> exited**: ``Launcher.stop`` (SIGTERM; the job checkpoints and exits 0) until the
  launcher has reaped it;
* **restart**: the whole gap in training when a lease moves a job to another machine: stop on
  machine A, exit seen, start on machine B, until the first report of the resumed run.

Run ``python benchmarks/executors.py [--reps 10] [--executors local,slurm] [--out FILE]``; a table on
stdout and JSON in ``benchmarks/results/executors.json``. Slurm needs its packages
(``scripts/install_slurm.sh``, as root).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from machine import machine_info
from rich.console import Console
from rich.progress import track
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.executors import LocalExecutor, SlurmExecutor  # noqa: E402
from agent.launcher import Launcher  # noqa: E402
from agent.trial import TrialSpec  # noqa: E402

JOB = textwrap.dedent("""
    import time
    from agent.job import Job
    job = Job.from_env()
    it = (job.resume() or {"it": 0})["it"]
    while True:
        time.sleep(0.02)
        it += 1
        if job.step(it, 1.0 / it):
            break
    job.save({"it": it})
""")
PHASES = ("launch_to_running_s", "launch_to_first_report_s", "stop_to_exited_s", "restart_gap_s")


async def until(predicate, timeout: float = 60.0, step: float = 0.005) -> float:
    began = time.monotonic()
    while not predicate():
        if time.monotonic() - began > timeout:
            raise TimeoutError("benchmark step did not complete")
        await asyncio.sleep(step)
    return time.monotonic() - began


async def one_rep(launcher: Launcher, job: str, machines: tuple[str, str]) -> dict[str, float]:
    reports: list[Any] = []

    def poll() -> None:
        reports.extend(launcher.poll().metrics)

    a, b = (f"{m}-g0" for m in machines)
    began = time.monotonic()
    run = launcher.start(TrialSpec(job, {}), [a], [("r0", machines[0], a)])
    running = await until(lambda: (poll(), run.state == "running")[1])
    first = running + await until(lambda: (poll(), bool(reports))[1])
    began = time.monotonic()
    launcher.stop(job, grace=30)
    await until(lambda: (poll(), not launcher.is_live(job))[1])
    stopped = time.monotonic() - began
    reports.clear()
    launcher.start(TrialSpec(job, {}), [b], [("r0", machines[1], b)])
    await until(lambda: (poll(), bool(reports))[1])
    restart = time.monotonic() - began
    launcher.stop(job, grace=30)
    await until(lambda: (poll(), not launcher.is_live(job))[1])
    assert launcher.history[-1].resumed and launcher.history[-1].clean
    return dict(zip(PHASES, (running, first, stopped, restart)))


async def measure(name: str, executor, reps: int, workdir: Path, machines: tuple[str, str]) -> list[dict[str, float]]:
    script = workdir / "job.py"
    script.write_text(JOB)
    launcher = Launcher("bench", [sys.executable, str(script)], workdir / name, cluster="bench", grace_s=30,
                        report="pipe" if name == "local" else "file", env={"PYTHONPATH": str(ROOT)},
                        executor=executor)
    await one_rep(launcher, "warmup", machines)  # the first Slurm job after start-up waits for a scheduler pass
    return [await one_rep(launcher, f"j{k}", machines) for k in track(range(reps), description=f"{name:>6}")]


def summarize(samples: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    out = {}
    for phase in PHASES:
        values = sorted(s[phase] for s in samples)
        p95 = values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]
        out[phase] = {"median": round(statistics.median(values), 4), "p95": round(p95, 4),
                      "min": round(values[0], 4), "max": round(values[-1], 4)}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--executors", default="local,slurm")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "executors.json")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"machine": machine_info(), "reps": args.reps, "executors": {}}
    with tempfile.TemporaryDirectory(prefix="themis-exec-bench-") as tmp:
        for name in args.executors.split(","):
            workdir = Path(tmp) / name
            workdir.mkdir()
            if name == "local":
                samples = asyncio.run(measure(name, LocalExecutor(lock_dir=workdir / "locks"), args.reps, workdir,
                                              ("m0", "m1")))
                results["executors"][name] = {"setup": "subprocesses, GPU locks, pipe reports",
                                              **summarize(samples)}
            elif name == "slurm":
                from tests.slurm_kit import local_slurm

                with local_slurm(nodes=3, gpus_per_node=4) as slurm:
                    executor = SlurmExecutor(slurm_env=slurm.env, poll_interval_s=0.05)
                    samples = asyncio.run(measure(name, executor, args.reps, workdir, ("n1", "n2")))
                    results["executors"][name] = {
                        "setup": "Slurm 22.05 local: slurmctld + 3 slurmd, batch_sched_delay=0, metrics files, "
                                 "squeue every 0.05 s", "slurm_commands": executor.commands, **summarize(samples)}
            else:
                parser.error(f"unknown executor {name!r} (this benchmark knows local, slurm)")
    table = Table(title=f"Executor latencies, {args.reps} reps (median / p95, seconds)")
    table.add_column("executor")
    for phase in PHASES:
        table.add_column(phase.removesuffix("_s").replace("_", " "), justify="right")
    for name, cells in results["executors"].items():
        table.add_row(name, *(f"{cells[p]['median']:.3f} / {cells[p]['p95']:.3f}" for p in PHASES))
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
