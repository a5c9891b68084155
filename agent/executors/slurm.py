"""The ``slurm`` executor: each start of a job is a Slurm batch job pinned to the leased GPUs.

Pinning. The arbiter leases *particular* GPUs, so a job must get exactly those, not any N on the
node. Slurm's count-only request (``--gres=gpu:2``) lets Slurm pick the indices; instead the operator
declares one GRES *type* per GPU index (``Gres=gpu:g0:1,gpu:g1:1,...`` in ``slurm.conf`` and
``Name=gpu Type=g1 File=/dev/nvidia1`` in ``gres.conf``), and the executor submits::

    sbatch --parsable -w n3 --gres=gpu:g1:1,gpu:g3:1 --nodes=1 --ntasks=1 ... job.sh

so Slurm itself allocates GPUs 1 and 3 of node ``n3`` and sets ``CUDA_VISIBLE_DEVICES=1,3``. Slurm
then also refuses to double-book them: a job left over from an earlier lease keeps the GPUs in
Slurm's books, and a new job asking for them waits (``pending``) instead of sharing. The job's
``agent.job`` compares ``CUDA_VISIBLE_DEVICES`` with the lease (``THEMIS_CUDA_DEVICES``) and refuses
to train on a mismatch. ``gres_type`` changes the type naming (default ``g{index}``).

A job that spans machines becomes a heterogeneous job, one component per machine
(``sbatch -w n1 --gres=... : -w n2 --gres=... job.sh``); the script runs on the first component
(the machine with most of the job's GPUs) and can ``srun --het-group=1`` onto the others.

Stopping: ``scancel --signal=TERM --full`` (the batch shell and every step, so the training process
sees SIGTERM, checkpoints and exits 0), then, after the grace period, ``scancel --signal=KILL
--full`` and a plain ``scancel``. A job still pending is cancelled outright.

Watching: one ``squeue`` call for all of the executor's jobs per ``poll_interval_s``; a job in a
final state is asked once more with ``scontrol show job`` for its exit code, and a job Slurm has
forgotten (``MinJobAge`` passed, controller restarted) with ``sacct``, if accounting is on;
otherwise it is reported exited with code -1 and detail ``vanished``. When ``squeue`` itself fails
(controller down), nothing is reported: a running job is never declared dead on a hiccup.

The job script and its output live in the job's folder, which must be on storage the nodes share
with the agent (so must the checkpoint: the next start may be on another node).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from agent.executors.base import (
    Executor,
    Handle,
    JobCommand,
    LaunchError,
    Status,
    _Tracked,
    check_indices,
    register,
    strip_engine_env,
)

__all__ = ["SlurmExecutor", "exit_code", "gres_request"]

log = logging.getLogger("themis.executor.slurm")

FINAL = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
         "TIMEOUT", "SPECIAL_EXIT", "REVOKED"}
NOT_STARTED = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"}
_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.:-]")


def gres_request(gpu_indices: Sequence[int], gres_type: str = "g{index}") -> str:
    """``--gres`` value pinning these machine-local indices: ``gpu:g1:1,gpu:g3:1``."""
    return ",".join(f"gpu:{gres_type.format(index=i)}:1" for i in gpu_indices)


def exit_code(slurm_exit: str, state: str) -> int:
    """A Slurm ``ExitCode=X:S`` as a return code: -S when a signal ended it, else X; -1 for a job
    that never ran or ended by the engine's doing (node failure) without either."""
    try:
        code, sig = (int(x) for x in slurm_exit.split(":", 1))
    except ValueError:
        return -1
    if sig:
        return -sig
    if code == 0 and state not in ("COMPLETED",):
        return -1 if state in ("NODE_FAIL", "BOOT_FAIL", "REVOKED") else -15 if state == "CANCELLED" else 0
    return code


@register("slurm")
class SlurmExecutor(Executor):
    """Options: ``partition``, ``account``, ``qos``, ``time_limit`` (sbatch ``--time``),
    ``cpus_per_task``, ``extra_args`` (more sbatch options, for every component), ``gres_type``,
    ``poll_interval_s``, ``slurm_env`` (added to the Slurm commands' environment, e.g.
    ``SLURM_CONF``), ``bin_dir`` (where sbatch and friends are; default: PATH)."""

    def __init__(self, *, partition: str | None = None, account: str | None = None, qos: str | None = None,
                 time_limit: str | None = None, cpus_per_task: int = 1, extra_args: Sequence[str] = (),
                 gres_type: str = "g{index}", poll_interval_s: float = 0.5,
                 slurm_env: Mapping[str, str] | None = None, bin_dir: str | None = None,
                 command_timeout_s: float = 10.0) -> None:
        if "{index}" not in gres_type:
            raise ValueError(f"gres_type must contain '{{index}}', got {gres_type!r}")
        self.partition, self.account, self.qos, self.time_limit = partition, account, qos, time_limit
        self.cpus_per_task = int(cpus_per_task)
        self.extra_args = tuple(extra_args)
        self.gres_type = gres_type
        self.poll_interval_s = float(poll_interval_s)
        self.slurm_env = dict(slurm_env or {})
        self.bin_dir = bin_dir
        self.command_timeout_s = command_timeout_s
        self._jobs: dict[str, _Tracked] = {}
        self._states: dict[str, Status] = {}
        self._last_poll = -1e9
        self.commands = 0  # Slurm commands run (for the benchmark)

    # -- the Slurm commands -----------------------------------------------------------------------

    def _cmd(self, name: str) -> str:
        return str(Path(self.bin_dir) / name) if self.bin_dir else name

    def _env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env.update(self.slurm_env)
        return env

    def call(self, name: str, *args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run a Slurm command; LaunchError only if it cannot run at all (missing, timed out)."""
        self.commands += 1
        try:
            return subprocess.run([self._cmd(name), *args], env=self._env(env), capture_output=True, text=True,
                                  timeout=self.command_timeout_s, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise LaunchError(f"{name}: {exc}") from exc

    def run(self, name: str, *args: str, env: Mapping[str, str] | None = None, check: bool = True) -> str:
        """Run a Slurm command and return its stdout; LaunchError with its stderr when it fails."""
        done = self.call(name, *args, env=env)
        argv = [self._cmd(name), *args]
        if check and done.returncode != 0:
            raise LaunchError(f"{shlex.join(argv[:1] + list(args[:12]))} failed ({done.returncode}): "
                              f"{done.stderr.strip() or done.stdout.strip()}")
        return done.stdout

    # -- the interface ----------------------------------------------------------------------------

    def launch(self, job: JobCommand, machine: str, gpu_indices: Sequence[int], checkpoint: Path,
               env: Mapping[str, str], *, more: Sequence[tuple[str, Sequence[int]]] = ()) -> Handle:
        if job.fds:
            raise LaunchError("a Slurm job cannot inherit file descriptors: report by 'file' or 'mqtt'")
        parts = [(machine, check_indices(gpu_indices, f"job {job.job_id} on {machine}"))]
        parts += [(m, check_indices(i, f"job {job.job_id} on {m}")) for m, i in more]
        if len({m for m, _ in parts}) != len(parts):
            raise LaunchError(f"job {job.job_id}: a machine appears twice in {parts}")
        folder = job.log_path.parent
        folder.mkdir(parents=True, exist_ok=True)
        script = folder / f"slurm-{job.attempt}.sh"
        cd = f"cd {shlex.quote(job.cwd)}\n" if job.cwd else ""
        script.write_text(f"#!/bin/sh\n# {job.app}/{job.job_id}, start {job.attempt} (written by agent.executors.slurm)\n"
                          f"{cd}exec {shlex.join(job.argv)}\n")
        script.chmod(0o755)
        name = _SAFE_NAME.sub("_", f"themis:{job.app}:{job.job_id}")[:200]
        args = ["--parsable", f"--job-name={name}", f"--output={job.log_path}", "--open-mode=append",
                f"--chdir={job.cwd or folder}", "--export=ALL", "--kill-on-invalid-dep=yes"]
        for k, (node, indices) in enumerate(parts):
            if k:
                args.append(":")
            args += [f"--nodelist={node}", "--nodes=1", "--ntasks=1", f"--cpus-per-task={self.cpus_per_task}",
                     f"--gres={gres_request(indices, self.gres_type)}"]
            args += [f"--partition={self.partition}"] if self.partition else []
            args += [f"--account={self.account}"] if self.account else []
            args += [f"--qos={self.qos}"] if self.qos else []
            args += [f"--time={self.time_limit}"] if self.time_limit else []
            args += list(self.extra_args)
        args.append(str(script))
        job_env = strip_engine_env(env)
        job_env["THEMIS_CHECKPOINT"] = str(checkpoint)
        out = self.run("sbatch", *args, env=job_env)
        ref = out.strip().split(";")[0]
        if not ref.isdigit():
            raise LaunchError(f"sbatch answered {out.strip()!r}, not a job id")
        handle = Handle(self.name, ref, job.job_id, machine, parts[0][1], tuple(parts[1:]))
        self._jobs[ref] = _Tracked(handle)
        self._states[ref] = Status(handle, "pending", detail="PENDING")
        self._last_poll = -1e9  # look soon
        log.info("submitted %s/%s as Slurm job %s on %s", job.app, job.job_id, ref,
                 " + ".join(f"{m}[{gres_request(i, self.gres_type)}]" for m, i in parts))
        return handle

    def stop(self, handle: Handle, grace: float) -> None:
        tracked = self._jobs.get(handle.ref)
        if tracked is None:
            return
        deadline = time.monotonic() + max(0.0, grace)
        if not tracked.signalled:
            tracked.signalled = True
            # `scancel --signal` on a job that has not started blocks, retrying: ask where it is now
            # (the cached state may be a poll old); a job not started yet is cancelled outright (a
            # plain scancel still sends SIGTERM, and SIGKILL only after Slurm's KillWait, if it has
            # just started meanwhile).
            self._refresh()
            if self._states[handle.ref].state == "pending":
                self._cancel(handle.ref)
            elif not self._states[handle.ref].exited:
                self._scancel("--signal=TERM", "--full", handle.ref)
        if tracked.kill_at is None or deadline < tracked.kill_at:
            tracked.kill_at = deadline

    def kill(self, handle: Handle) -> None:
        tracked = self._jobs.get(handle.ref)
        if tracked is not None:
            tracked.killed = tracked.signalled = True
            self._kill_now([handle.ref])

    def _kill_now(self, refs: Sequence[str]) -> None:
        """SIGKILL to the started ones (never ``--signal`` to a pending job: scancel would block),
        then cancel them all."""
        started = [r for r in refs if r in self._states and self._states[r].state == "running"]
        if started:
            self._scancel("--signal=KILL", "--full", *started)
        if refs:
            self._cancel(*refs)

    def _scancel(self, *args: str) -> bool:
        try:
            self.run("scancel", *args)
        except LaunchError as exc:  # e.g. the job ended meanwhile, or is still pending; poll() tells
            log.info("%s", exc)
            return False
        return True

    def _cancel(self, *refs: str) -> None:
        self._scancel(*refs)

    def poll(self) -> list[Status]:
        now = time.monotonic()
        for ref, tracked in self._jobs.items():
            if tracked.kill_at is not None and now >= tracked.kill_at and not tracked.killed:
                if self._states.get(ref) is None or not self._states[ref].exited:
                    log.warning("Slurm job %s (%s) outlived its grace period: killing it", ref, tracked.handle.job_id)
                    tracked.killed = True
                    self._kill_now([ref])
        if now - self._last_poll >= self.poll_interval_s:
            self._last_poll = now
            self._refresh()
        return [self._states[ref] for ref in self._jobs if ref in self._states]

    def _refresh(self) -> None:
        live = [ref for ref in self._jobs if not self._states[ref].exited]
        if not live:
            return
        try:
            done = self.call("squeue", "--noheader", "--states=all", f"--jobs={','.join(live)}", "--format=%i|%T|%r")
        except LaunchError as exc:
            log.warning("squeue failed, keeping the last known states: %s", exc)
            return
        out = done.stdout
        if done.returncode != 0 and "invalid job id" not in done.stderr.lower():
            # the controller is unreachable or busy: say nothing rather than declare jobs dead
            log.warning("squeue failed (%d), keeping the last known states: %s", done.returncode, done.stderr.strip())
            return
        seen: dict[str, str] = {}
        for line in out.splitlines():
            fields = line.strip().split("|")
            if len(fields) < 2:
                continue
            ref = fields[0].split("+")[0]  # a heterogeneous job's components: 123+0, 123+1
            state = fields[1].split()[0].rstrip("+")
            if ref in self._jobs and (ref not in seen or state not in FINAL):
                seen[ref] = state
        for ref in live:
            tracked = self._jobs[ref]
            state = seen.get(ref)
            if state is None:
                self._states[ref] = self._final(tracked, *self._forgotten(ref))
            elif state in FINAL:
                self._states[ref] = self._final(tracked, state, self._exit_of(ref))
            else:
                self._states[ref] = Status(tracked.handle, "pending" if state in NOT_STARTED else "running",
                                           detail=state)

    def _final(self, tracked: _Tracked, state: str, slurm_exit: str) -> Status:
        return Status(tracked.handle, "exited", exit_code(slurm_exit, state), tracked.killed, state)

    def _exit_of(self, ref: str) -> str:
        try:
            out = self.run("scontrol", "--oneliner", "show", "job", ref)
        except LaunchError:
            return ""
        match = re.search(r"\bExitCode=(\d+:\d+)", out)
        return match.group(1) if match else ""

    def _forgotten(self, ref: str) -> tuple[str, str]:
        """(state, ExitCode) of a job squeue no longer lists, from accounting; ("vanished", "")."""
        try:
            out = self.run("sacct", "--noheader", "--parsable2", f"--jobs={ref}", "--format=JobID,State,ExitCode",
                           check=False)
        except LaunchError:
            out = ""
        for line in out.splitlines():
            fields = line.split("|")
            if len(fields) == 3 and fields[0] == ref:
                return fields[1].split()[0], fields[2]
        return "vanished", ""

    def cancel_leftovers(self, app: str) -> list[str]:
        """Jobs named ``themis:<app>:*`` in Slurm's queue that this executor did not submit: a
        plain ``scancel`` (SIGTERM, then SIGKILL after Slurm's KillWait, so they can checkpoint)."""
        prefix = _SAFE_NAME.sub("_", f"themis:{app}:")
        try:
            out = self.run("squeue", "--me", "--noheader", "--format=%i|%j|%T")
        except LaunchError as exc:
            log.warning("cannot look for leftover jobs: %s", exc)
            return []
        found = []
        for line in out.splitlines():
            ref, _, rest = line.strip().partition("|")
            name, _, state = rest.rpartition("|")
            ref = ref.split("+")[0].split("_")[0]
            if name.startswith(prefix) and ref not in self._jobs and state not in FINAL and ref not in found:
                found.append(ref)
        if found:
            self._cancel(*found)
        return found

    def release(self, handle: Handle) -> None:
        self._jobs.pop(handle.ref, None)
        self._states.pop(handle.ref, None)

    def close(self) -> None:
        """scancel every job of this executor that has not ended."""
        live = [ref for ref in self._jobs if not self._states.get(ref, Status(self._jobs[ref].handle, "")).exited]
        if live:
            for ref in live:
                self._jobs[ref].killed = True
            self._kill_now(live)
            self._last_poll = -1e9
