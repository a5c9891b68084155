"""The ``local`` executor: jobs as subprocesses of the agent, on this host (the embedded default).

``CUDA_VISIBLE_DEVICES`` is the lease's machine-local indices. Every job leads its own session and
process group (``start_new_session``), so a stop or a kill reaches whatever it forked; when a job's
main process ends, what is left of its group is killed before the leader is reaped (a group id
cannot be reused while its leader is a zombie, so the kill cannot hit a stranger). The machines a
lease names are not checked: on one host every machine of the cluster file is this one, so a job
spanning machines sees the union of its indices.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from agent.executors.base import Executor, Handle, JobCommand, LaunchError, Status, _Tracked, check_indices, register

__all__ = ["LocalExecutor"]


@register("local")
class LocalExecutor(Executor):
    local = True

    def __init__(self) -> None:
        self._runs: dict[str, tuple[_Tracked, subprocess.Popen]] = {}
        self._done: dict[str, Status] = {}

    def launch(self, job: JobCommand, machine: str, gpu_indices: Sequence[int], checkpoint: Path,
               env: Mapping[str, str], *, more: Sequence[tuple[str, Sequence[int]]] = ()) -> Handle:
        indices = check_indices(gpu_indices, f"job {job.job_id}")
        extra = tuple((m, check_indices(i, f"job {job.job_id} on {m}")) for m, i in more)
        visible = tuple(dict.fromkeys(indices + tuple(i for _, more_indices in extra for i in more_indices)))
        env = {**env, "CUDA_VISIBLE_DEVICES": self.cuda_visible_devices(visible), "THEMIS_CHECKPOINT": str(checkpoint)}
        job.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(job.log_path, "ab") as out:
                popen = subprocess.Popen(
                    list(job.argv), env=env, cwd=job.cwd, stdin=subprocess.DEVNULL, stdout=out,
                    stderr=subprocess.STDOUT, pass_fds=job.pass_fds, start_new_session=True, close_fds=True)
        except OSError as exc:
            raise LaunchError(f"job {job.job_id}: cannot start {job.argv[0]!r}: {exc}") from exc
        handle = Handle(self.name, str(popen.pid), job.job_id, machine, indices, extra)
        self._runs[handle.ref] = (_Tracked(handle), popen)
        return handle

    def stop(self, handle: Handle, grace: float) -> None:
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

    def kill(self, handle: Handle) -> None:
        entry = self._runs.get(handle.ref)
        if entry is not None:
            entry[0].killed = entry[0].signalled = True
            self._signal(handle, signal.SIGKILL)

    def poll(self) -> list[Status]:
        now = time.monotonic()
        out = list(self._done.values())
        for ref, (tracked, popen) in list(self._runs.items()):
            if tracked.kill_at is not None and now >= tracked.kill_at and not tracked.killed:
                tracked.killed = True
                self._signal(tracked.handle, signal.SIGKILL)
            if self._ended(popen):
                self._signal(tracked.handle, signal.SIGKILL)  # whatever the job left behind in its group
                status = Status(tracked.handle, "exited", popen.wait(), tracked.killed, "exited")
                del self._runs[ref]
                self._done[ref] = status
                out.append(status)
            else:
                out.append(Status(tracked.handle, "running"))
        return out

    def release(self, handle: Handle) -> None:
        self._done.pop(handle.ref, None)

    def close(self) -> None:
        for tracked, popen in list(self._runs.values()):
            tracked.killed = True
            self._signal(tracked.handle, signal.SIGKILL)
        for ref, (tracked, popen) in list(self._runs.items()):
            with contextlib.suppress(Exception):
                code = popen.wait(timeout=5)
                self._done[ref] = Status(tracked.handle, "exited", code, True, "killed at exit")
                del self._runs[ref]

    @staticmethod
    def _ended(popen: subprocess.Popen) -> bool:
        if not hasattr(os, "waitid"):  # macOS: reap at once (the group is killed just after)
            return popen.poll() is not None
        try:  # look without reaping, so the group id stays reserved until the group is killed
            info = os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # already reaped (by Popen itself)
            return True
        return info is not None and info.si_pid == popen.pid

    @staticmethod
    def _signal(handle: Handle, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(handle.ref), sig)
