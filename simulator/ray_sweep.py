"""A sweep's runs as Ray tasks (``--ray ADDRESS`` of ``compare``, ``experiment`` and ``strategic``).

Every (policy, setting, seed) run is one task. The driver keeps each summary in the run store as it
arrives (``simulator.run_store``), exactly as a local sweep does, so a sweep interrupted on Ray goes
on locally, or on Ray, simulating only what is missing. A task that raises is tried once more; if it
fails again the sweep stops and says which run it was. The project's code travels with the tasks
(Ray's ``working_dir``), so a cluster needs only the project's dependencies installed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RayCluster", "RunFailed", "run_on_ray"]

ROOT = Path(__file__).resolve().parents[1]
#: what the tasks need of the repository: its code and data, not its virtual environment or results
EXCLUDES = [".venv", ".git", "results", "docs", "**/__pycache__", "*.png", "benchmarks/results"]


@dataclass(frozen=True)
class RayCluster:
    """Where a sweep runs instead of local processes: ``local`` starts Ray on this machine for the
    sweep, ``auto`` joins the cluster started here with ``ray start --head``, HOST:PORT any other."""

    address: str

    def __post_init__(self) -> None:
        if not self.address or self.address != self.address.strip():
            raise ValueError(f"--ray takes local, auto or HOST:PORT, got {self.address!r}")


class RunFailed(RuntimeError):
    """A run failed on Ray twice (once and its retry); the message names it and says why."""


def _user_env() -> dict[str, str]:
    """What this command learned from its flags that a worker must know too (--plugin, --profiles)."""
    return {k: v for k, v in os.environ.items() if k in ("THEMIS_PLUGINS", "THEMIS_PROFILES")}


def _join(cluster: RayCluster) -> None:
    import ray

    if ray.is_initialized():
        return
    ray.init(address=None if cluster.address == "local" else cluster.address, log_to_driver=False,
             include_dashboard=False if cluster.address == "local" else None,
             runtime_env={"working_dir": str(ROOT), "excludes": EXCLUDES})


def run_on_ray(cluster: RayCluster, fn: Callable[..., Any], jobs: Sequence[Mapping[str, Any]], *,
               names: Sequence[str], keep: Callable[[int, Any], Any] | None = None,
               progress: Callable[[int, int], None] | None = None) -> list[Any]:
    """``fn(**job)`` for every job as a Ray task (one retry each); results in the order of ``jobs``.
    ``keep(i, result)`` is called as each one arrives (the run store) and its return is the result;
    ``progress(done, running)`` after each."""
    import ray

    if not jobs:
        return []
    _join(cluster)
    task = ray.remote(max_retries=1, retry_exceptions=True)(fn)
    env = _user_env()
    if env:
        task = task.options(runtime_env={"env_vars": env})
    refs = {task.remote(**job): i for i, job in enumerate(jobs)}
    pending = list(refs)
    out: list[Any] = [None] * len(jobs)
    done = 0
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            i = refs[ready[0]]
            try:
                result = ray.get(ready[0])
            except Exception as exc:  # a Ray error wraps the task's own; its last line says what it was
                cause = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                raise RunFailed(f"run {names[i]} failed twice on Ray ({cluster.address}): {cause}") from None
            out[i] = keep(i, result) if keep is not None else result
            done += 1
            if progress is not None:
                progress(done, len(pending))
    except BaseException:
        for ref in pending:  # a failed run (or Ctrl-C) ends the sweep: what has not run does not
            ray.cancel(ref, force=True)
        raise
    return out


def run_name(job: Mapping[str, Any]) -> str:
    """How a run is named when it fails: its policy, workload, seed and whatever else sets it apart."""
    parts = [f"{k}={job[k]}" for k in ("policy", "workload", "cluster", "seed") if k in job]
    parts += [f"{k}={v}" for k, v in sorted(job.items())
              if k not in ("policy", "workload", "cluster", "seed") and v not in (None, {}, ())]
    return "(" + ", ".join(parts) + ")"


def elapsed(started: float) -> str:
    minutes, seconds = divmod(int(time.monotonic() - started), 60)
    return f"{minutes}:{seconds:02d}"
