"""The executor interface: how a granted job becomes a process on exactly the granted GPUs (issue 6).

The launcher (:mod:`agent.launcher`) decides *what* runs where: which job, on which GPUs of which
machine, with which environment, and when it must stop. An executor does the running on one kind of
infrastructure, in three calls:

* :meth:`Executor.launch` ``(job, machine, gpu_indices, checkpoint, env)`` starts the job's command on
  ``machine`` so that it sees exactly ``gpu_indices`` (machine-local CUDA indices) and returns a
  :class:`Handle`;
* :meth:`Executor.stop` ``(handle, grace)`` asks the job to checkpoint and exit (SIGTERM now), and
  kills it once ``grace`` seconds have passed;
* :meth:`Executor.poll` tells each handle's :class:`Status`: pending (the engine has not started it),
  running, or exited with its code.

Backends are one file each and register under a name (:func:`make_executor`): ``local``
(subprocesses on this host, the embedded default), ``slurm`` (``sbatch`` pinned to the node and to
per-index GRES types) and any a site writes. A job that spans machines (D1 lets an app hold GPUs on
several) is launched with ``more``: further ``(machine, indices)`` pairs; an executor that cannot
hold GPUs on several machines for one job says so with :class:`LaunchError`.

Why the executor, not the launcher, enforces the grace period: on a cluster engine the kill has to
be the engine's (``scancel``), and the engine's own clock decides; the launcher only learns the
outcome from :meth:`poll`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

__all__ = ["EXECUTORS", "BadCommand", "Executor", "Handle", "JobCommand", "LaunchError", "Status", "make_executor",
           "register"]


class LaunchError(RuntimeError):
    """The executor could not start a job (the message says what the engine answered). The runner
    takes it for the engine's trouble and tries again later without counting a failure."""


class BadCommand(ValueError):
    """The job's own command cannot run: no such program, not executable, no such working folder.
    Trying again cannot help, so the runner counts it as the job's failure (its fail-fast limits)
    instead of holding the app's GPUs while it retries forever."""


@dataclass(frozen=True)
class JobCommand:
    """What to run for one start of a job: its command, where, and where its output goes.

    ``fds`` are file descriptors the job inherits, each named by the environment variable that
    tells the job its number (the local executor's metrics pipe: ``THEMIS_METRICS_FD``). The caller
    may close them once :meth:`Executor.launch` returns. An executor whose jobs are not children of
    this process refuses them."""

    app: str
    job_id: str
    argv: tuple[str, ...]
    log_path: Path
    cwd: str | None = None
    fds: tuple[tuple[str, int], ...] = ()
    attempt: int = 1  # how many times the job has been started, this one included


@dataclass(frozen=True)
class Handle:
    """One launched run. ``ref`` is the engine's id for it: a pid, a Slurm job id."""

    executor: str
    ref: str
    job_id: str
    machine: str
    gpu_indices: tuple[int, ...]
    more: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @property
    def machines(self) -> tuple[str, ...]:
        return (self.machine, *(m for m, _ in self.more))


@dataclass(frozen=True)
class Status:
    """What :meth:`Executor.poll` found for a handle.

    ``state``: ``pending`` (queued by the engine, no process yet), ``running`` or ``exited``.
    ``returncode`` (exited only): 0 clean, > 0 the job's exit code, < 0 the signal that ended it.
    ``killed``: the executor killed it after its grace period ran out. ``detail``: the engine's own
    words (``COMPLETED``, ``FAILED``, ``NODE_FAIL``, ``vanished``), for logs and errors."""

    handle: Handle
    state: str
    returncode: int | None = None
    killed: bool = False
    detail: str = ""

    @property
    def exited(self) -> bool:
        return self.state == "exited"


@dataclass
class _Tracked:
    handle: Handle
    kill_at: float | None = None  # monotonic deadline armed by stop()
    signalled: bool = False
    killed: bool = False


class Executor(ABC):
    """Runs jobs on some infrastructure; see the module docstring. Not thread-safe: the launcher
    calls it from one loop."""

    name: ClassVar[str] = ""
    #: Jobs are children of this process (so they can inherit a pipe and see the agent die).
    local: ClassVar[bool] = False

    @abstractmethod
    def launch(self, job: JobCommand, machine: str, gpu_indices: Sequence[int], checkpoint: Path,
               env: Mapping[str, str], *, more: Sequence[tuple[str, Sequence[int]]] = ()) -> Handle:
        """Start ``job`` on ``machine`` seeing exactly ``gpu_indices`` (plus ``more`` machines' GPUs
        for a job that spans machines). ``env`` is the job's whole environment except
        ``CUDA_VISIBLE_DEVICES``, which the executor sets (or has the engine set) from the indices;
        ``checkpoint`` is where the job saves and resumes. LaunchError if the engine refuses."""

    @abstractmethod
    def stop(self, handle: Handle, grace: float) -> None:
        """Ask the job to checkpoint and exit (SIGTERM now); kill it when ``grace`` s have passed.
        Calling it again keeps the sooner deadline and does not signal twice."""

    @abstractmethod
    def kill(self, handle: Handle) -> None:
        """Kill the job now, without a checkpoint."""

    @abstractmethod
    def poll(self) -> list[Status]:
        """The status of every handle launched and not yet :meth:`release` d. Enforces the grace
        deadlines armed by :meth:`stop`. An exited handle keeps being reported until released.
        Never blocks for long (a cluster engine is asked at most every few tenths of a second)."""

    @abstractmethod
    def release(self, handle: Handle) -> None:
        """Forget an exited handle (after the launcher has read its last reports)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Kill whatever is still running (used at interpreter exit and by tests)."""

    def cancel_leftovers(self, app: str) -> list[str]:
        """End jobs of ``app`` that an earlier agent left running and this executor does not know
        (an engine's jobs outlive the agent); their ids. Local jobs die with their agent: none."""
        return []

    @staticmethod
    def cuda_visible_devices(gpu_indices: Sequence[int]) -> str:
        return ",".join(str(int(i)) for i in gpu_indices)


def check_indices(gpu_indices: Sequence[int], where: str) -> tuple[int, ...]:
    """Machine-local GPU indices: non-empty, distinct, non-negative integers."""
    out = tuple(gpu_indices)
    if not out:
        raise LaunchError(f"{where}: no GPU indices")
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in out) or len(set(out)) != len(out):
        raise LaunchError(f"{where}: GPU indices must be distinct non-negative integers, got {list(out)}")
    return out


EXECUTORS: dict[str, Callable[..., Executor]] = {}


def register(name: str) -> Callable[[type[Executor]], type[Executor]]:
    """Class decorator: make an executor selectable by ``name`` (``--executor NAME``)."""

    def wrap(cls: type[Executor]) -> type[Executor]:
        cls.name = name
        EXECUTORS[name] = cls
        return cls

    return wrap


def make_executor(name: str, **options) -> Executor:
    """An executor by name (``local``, ``slurm``); ValueError naming the known ones otherwise."""
    from agent import executors  # noqa: F401 - registers the shipped backends

    if name not in EXECUTORS:
        raise ValueError(f"unknown executor {name!r}; known: {', '.join(sorted(EXECUTORS))}")
    return EXECUTORS[name](**options)


def strip_engine_env(env: Mapping[str, str]) -> dict[str, str]:
    """The job's environment without what the engine sets itself (CUDA_VISIBLE_DEVICES, and any
    SLURM_* inherited from an agent that runs inside an allocation, which would confuse sbatch;
    SLURM_CONF, which says which cluster to talk to, stays)."""
    return {k: v for k, v in env.items()
            if k not in ("CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")
            and (not k.startswith("SLURM_") or k == "SLURM_CONF")}
