"""The ``local`` executor: jobs as subprocesses of the agent, on this host (the embedded default).

``CUDA_VISIBLE_DEVICES`` is the lease's machine-local indices. Every job leads its own session and
process group (``start_new_session``), so a stop or a kill reaches whatever it forked; when a job's
main process ends, what is left of its group is killed before the leader is reaped (a group id
cannot be reused while its leader is a zombie, so the kill cannot hit a stranger). The machines a
lease names are not checked: on one host every machine of the cluster file is this one, so a job
spanning machines sees the union of its indices.

GPU locks (``lock_dir``). Leases keep apps off each other's GPUs, but a job that lost its lease may
still be writing its checkpoint when the GPU's next holder starts. A cluster engine holds the new job
back until the old one is gone (Slurm does); with ``lock_dir`` this executor does the same on one
host: it takes an exclusive ``flock`` on ``<lock_dir>/<machine>-g<index>.lock`` for every GPU of a
job before starting it, keeps the job ``pending`` while another process (any agent on the host) holds
one, and drops the locks only once the job's whole process group is gone. The job inherits the
locks too, so if the agent dies they last until the job (and whatever it forked) has gone as well,
and never longer: nothing stays locked by dead processes. Locks are per (machine, index) as the
cluster file names them; on one real multi-GPU host, describe it as one machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from agent.executors.base import (
    BadCommand,
    Executor,
    Handle,
    JobCommand,
    LaunchError,
    Status,
    _Tracked,
    check_indices,
    register,
)

__all__ = ["LocalExecutor"]


@register("local")
class LocalExecutor(Executor):
    local = True

    def __init__(self, lock_dir: str | os.PathLike[str] | None = None) -> None:
        self.lock_dir = Path(lock_dir) if lock_dir is not None else None
        self._runs: dict[str, tuple[_Tracked, subprocess.Popen]] = {}
        self._done: dict[str, Status] = {}
        self._waiting: dict[str, tuple[_Tracked, JobCommand, dict[str, str], dict[str, int]]] = {}  # for GPU locks
        self._locks: dict[str, list[int]] = {}  # ref -> lock file descriptors held for it
        self._seq = 0

    def launch(self, job: JobCommand, machine: str, gpu_indices: Sequence[int], checkpoint: Path,
               env: Mapping[str, str], *, more: Sequence[tuple[str, Sequence[int]]] = ()) -> Handle:
        indices = check_indices(gpu_indices, f"job {job.job_id}")
        extra = tuple((m, check_indices(i, f"job {job.job_id} on {m}")) for m, i in more)
        visible = tuple(dict.fromkeys(indices + tuple(i for _, more_indices in extra for i in more_indices)))
        env = {**env, "CUDA_VISIBLE_DEVICES": self.cuda_visible_devices(visible), "THEMIS_CHECKPOINT": str(checkpoint)}
        job.log_path.parent.mkdir(parents=True, exist_ok=True)
        fds = {name: os.dup(fd) for name, fd in job.fds}  # ours: the caller closes its own
        if self.lock_dir is None:
            popen = self._spawn(job, env, fds)
            handle = Handle(self.name, str(popen.pid), job.job_id, machine, indices, extra)
            self._runs[handle.ref] = (_Tracked(handle), popen)
            return handle
        try:
            self.lock_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            for fd in fds.values():
                os.close(fd)
            raise LaunchError(f"job {job.job_id}: cannot use the GPU lock folder {self.lock_dir}: {exc}") from exc
        self._seq += 1
        handle = Handle(self.name, f"w{self._seq}", job.job_id, machine, indices, extra)
        self._waiting[handle.ref] = (_Tracked(handle), job, env, fds)
        self._start_waiting()
        return handle

    def _spawn(self, job: JobCommand, env: Mapping[str, str], fds: Mapping[str, int],
               locks: Sequence[int] = ()) -> subprocess.Popen:
        """Start the process; the inherited ``fds`` are closed here whatever happens. The job also
        inherits the GPU ``locks``: a lock lives as long as any process holding it, so if the agent
        dies the GPUs stay locked until the job (and whatever it forked) is gone too."""
        try:
            try:
                out = open(job.log_path, "ab")
            except OSError as exc:
                raise LaunchError(f"job {job.job_id}: cannot open its log {job.log_path}: {exc}") from exc
            with out:
                return subprocess.Popen(
                    list(job.argv), env={**env, **{k: str(fd) for k, fd in fds.items()}}, cwd=job.cwd,
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    pass_fds=(*fds.values(), *locks), start_new_session=True, close_fds=True)
        except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
            # the program or the working folder named by the job's command: its own fault
            raise BadCommand(f"job {job.job_id}: cannot start {job.argv[0]!r} in {job.cwd or '.'}: {exc}") from exc
        except OSError as exc:
            raise LaunchError(f"job {job.job_id}: cannot start {job.argv[0]!r}: {exc}") from exc
        finally:
            for fd in fds.values():
                os.close(fd)

    def _lock(self, handle: Handle) -> list[int] | None:
        """Exclusive locks on all of the handle's GPUs, or None (and nothing held) if one is taken;
        LaunchError if the lock files cannot be opened."""
        assert self.lock_dir is not None
        held: list[int] = []
        try:
            for machine, indices in ((handle.machine, handle.gpu_indices), *handle.more):
                for i in indices:
                    fd = os.open(self.lock_dir / f"{machine}-g{i}.lock", os.O_RDWR | os.O_CREAT, 0o666)
                    held.append(fd)
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            for fd in held:
                os.close(fd)
            if isinstance(exc, BlockingIOError):
                return None
            raise LaunchError(f"job {handle.job_id}: cannot lock its GPUs in {self.lock_dir}: {exc}") from exc
        return held

    def _start_waiting(self) -> None:
        for ref, (tracked, job, env, fds) in list(self._waiting.items()):
            try:
                locks = self._lock(tracked.handle)
            except LaunchError as exc:
                del self._waiting[ref]
                for fd in fds.values():
                    os.close(fd)
                self._done[ref] = Status(tracked.handle, "exited", 127, False, str(exc))
                continue
            if locks is None:
                continue
            del self._waiting[ref]
            try:
                popen = self._spawn(job, env, fds, locks)
            except (LaunchError, BadCommand) as exc:
                for fd in locks:
                    os.close(fd)
                self._done[ref] = Status(tracked.handle, "exited", 127, False, str(exc))
                continue
            self._locks[ref] = locks
            self._runs[ref] = (tracked, popen)

    def stop(self, handle: Handle, grace: float) -> None:
        if self._cancel_waiting(handle, False):
            return
        entry = self._runs.get(handle.ref)
        if entry is None:
            return
        tracked, _ = entry
        deadline = time.monotonic() + max(0.0, grace)
        if not tracked.signalled:
            tracked.signalled = True
            self._signal(handle, signal.SIGTERM)
        if tracked.kill_at is None or deadline < tracked.kill_at:
            tracked.kill_at = deadline

    def _cancel_waiting(self, handle: Handle, killed: bool) -> bool:
        """A job still waiting for its GPU locks never started: it ends at once."""
        waiting = self._waiting.pop(handle.ref, None)
        if waiting is not None:
            for fd in waiting[3].values():
                os.close(fd)
            self._done[handle.ref] = Status(handle, "exited", -int(signal.SIGTERM), killed, "cancelled before start")
        return waiting is not None

    def kill(self, handle: Handle) -> None:
        if self._cancel_waiting(handle, True):
            return
        entry = self._runs.get(handle.ref)
        if entry is not None:
            entry[0].killed = entry[0].signalled = True
            self._signal(handle, signal.SIGKILL)

    def poll(self) -> list[Status]:
        now = time.monotonic()
        if self._waiting:
            self._start_waiting()
        out = list(self._done.values()) + [Status(t.handle, "pending", detail="waiting for GPU locks")
                                           for t, *_ in self._waiting.values()]
        for ref, (tracked, popen) in list(self._runs.items()):
            if tracked.kill_at is not None and now >= tracked.kill_at and not tracked.killed:
                tracked.killed = True
                self._signal(tracked.handle, signal.SIGKILL)
            if self._ended(popen):
                self._signal(tracked.handle, signal.SIGKILL)  # whatever the job left behind in its group
                status = Status(tracked.handle, "exited", popen.wait(), tracked.killed, "exited")
                del self._runs[ref]
                for fd in self._locks.pop(ref, ()):
                    os.close(fd)
                self._done[ref] = status
                out.append(status)
            else:
                out.append(Status(tracked.handle, "running"))
        return out

    def release(self, handle: Handle) -> None:
        self._done.pop(handle.ref, None)

    def close(self) -> None:
        for tracked, *_ in list(self._waiting.values()):
            self._cancel_waiting(tracked.handle, True)
        for tracked, popen in list(self._runs.values()):
            tracked.killed = True
            self._signal(tracked.handle, signal.SIGKILL)
        for ref, (tracked, popen) in list(self._runs.items()):
            with contextlib.suppress(Exception):
                code = popen.wait(timeout=5)
                self._done[ref] = Status(tracked.handle, "exited", code, True, "killed at exit")
                del self._runs[ref]
                for fd in self._locks.pop(ref, ()):
                    os.close(fd)

    @staticmethod
    def _ended(popen: subprocess.Popen) -> bool:
        if not hasattr(os, "waitid"):  # macOS: reap at once (the group is killed just after)
            return popen.poll() is not None
        try:  # look without reaping, so the group id stays reserved until the group is killed
            info = os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # already reaped (by Popen itself)
            return True
        return info is not None and info.si_pid == popen.pid

    def _signal(self, handle: Handle, sig: int) -> None:
        entry = self._runs.get(handle.ref)
        if entry is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(entry[1].pid, sig)
