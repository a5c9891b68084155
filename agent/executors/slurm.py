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

Watching: one ``squeue`` call for all of the executor's jobs per ``poll_interval_s`` gives each
job's state, pending reason and exit status; a job Slurm has forgotten (``MinJobAge`` passed,
controller restarted) is asked of ``sacct``, if accounting is on, and otherwise reported exited with
code -1 and detail ``vanished``. When ``squeue`` itself fails (controller down), nothing is
reported: a running job is never declared dead on a hiccup, and stops ``scancel`` could not deliver
are tried again on the next poll. A job pending for a reason that will not pass within a lease
(``NEVER_STARTS``: its node drained, its partition down) is cancelled and reported ended.

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
#: Pending reasons after which a job will not start on its leased node within a lease.
NEVER_STARTS = {"ReqNodeNotAvail", "PartitionDown", "PartitionInactive", "PartitionNodeLimit", "NodeDown",
                "BadConstraints", "InvalidQOS", "InvalidAccount", "JobHeldAdmin", "JobHeldUser",
                "DependencyNeverSatisfied", "PartitionConfig", "QOSJobLimit"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def job_name(app: str, job_id: str) -> str:
    """The Slurm job name of a job: ``themis:<app>:<job>`` (both free of ':', so unambiguous)."""
    return f"themis:{app}:{job_id}"


def gres_request(gpu_indices: Sequence[int], gres_type: str = "g{index}") -> str:
    """``--gres`` value pinning these machine-local indices: ``gpu:g1:1,gpu:g3:1``."""
    return ",".join(f"gpu:{gres_type.format(index=i)}:1" for i in gpu_indices)


def exit_code(slurm_exit: str, state: str) -> int:
    """A Slurm ``ExitCode=X:S`` and final state as a return code: -S when a real signal ended it,
    else X when non-zero; 0 only for COMPLETED; -15 for a job cancelled without either; -1 for
    every other end by the engine's doing (node failure, time limit, preemption, out of memory)."""
    try:
        code, sig = (int(x) for x in slurm_exit.split(":", 1))
    except ValueError:
        code, sig = 0, 0
    if 0 < sig < 65:
        return -sig
    if code:
        return code
    return 0 if state == "COMPLETED" else -15 if state == "CANCELLED" else -1


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
        if not _NAME.match(job.app) or not _NAME.match(job.job_id):
            raise LaunchError(f"app {job.app!r} / job {job.job_id!r}: Slurm job names here use A-Z a-z 0-9 . _ - only")
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
        name = job_name(job.app, job.job_id)
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
        try:
            out = self.run("sbatch", *args, env=job_env)
        except LaunchError:
            self._cancel_named(name)  # a timed-out sbatch may have been accepted all the same
            raise
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
        if tracked.kill_at is None or deadline < tracked.kill_at:
            tracked.kill_at = deadline
        self._terminate(tracked)

    def _terminate(self, tracked: _Tracked) -> None:
        """SIGTERM a started job, cancel one that has not started; marked done only once Slurm took
        it, so :meth:`poll` tries again after a controller hiccup."""
        if tracked.signalled:
            return
        ref = tracked.handle.ref
        if self._states[ref].state == "pending":
            # `scancel --signal` on a job that has not started blocks, retrying, so look again (the
            # cached state may be a poll old); a job still not started is cancelled outright (a
            # plain scancel still sends SIGTERM, and SIGKILL only after Slurm's KillWait, should
            # it have started meanwhile).
            self._refresh()
        status = self._states[ref]
        if status.exited:
            tracked.signalled = True
        elif status.state == "pending":
            tracked.signalled = self._scancel(ref)
        else:
            tracked.signalled = self._scancel("--signal=TERM", "--full", ref)

    def kill(self, handle: Handle) -> None:
        tracked = self._jobs.get(handle.ref)
        if tracked is not None:
            self._kill_now([tracked])

    def _kill_now(self, tracked: Sequence[_Tracked]) -> None:
        """SIGKILL to the started ones (never ``--signal`` to a pending job: scancel would block),
        then cancel them all; each is marked killed once Slurm took it."""
        live = [t for t in tracked if not self._states[t.handle.ref].exited]
        started = [t.handle.ref for t in live if self._states[t.handle.ref].state == "running"]
        if started:
            self._scancel("--signal=KILL", "--full", *started)
        if live and self._scancel(*(t.handle.ref for t in live)):
            for t in live:
                t.killed = t.signalled = True

    def _scancel(self, *args: str) -> bool:
        try:
            self.run("scancel", *args)
        except LaunchError as exc:  # the controller is unreachable, or the job ended meanwhile
            log.info("%s", exc)
            return False
        return True

    def poll(self) -> list[Status]:
        now = time.monotonic()
        if now - self._last_poll >= self.poll_interval_s:
            self._last_poll = now
            self._refresh()
            stopping = [t for t in self._jobs.values() if t.kill_at is not None and not self._states[t.handle.ref].exited]
            for tracked in stopping:
                if not tracked.signalled:
                    self._terminate(tracked)  # a stop that Slurm did not take yet
            overdue = [t for t in stopping if now >= t.kill_at and not t.killed]
            if overdue:
                log.warning("Slurm jobs %s outlived their grace period: killing them",
                            ", ".join(t.handle.ref for t in overdue))
                self._kill_now(overdue)
        return [self._states[ref] for ref in self._jobs]

    def _refresh(self) -> None:
        live = [ref for ref in self._jobs if not self._states[ref].exited]
        if not live:
            return
        try:
            done = self.call("squeue", "--noheader", "--states=all", f"--jobs={','.join(live)}",
                             "--Format=JobID:|,State:|,Reason:|,exit_code:|")
        except LaunchError as exc:
            log.warning("squeue failed, keeping the last known states: %s", exc)
            return
        if done.returncode != 0 and "invalid job id" not in done.stderr.lower():
            # the controller is unreachable or busy: say nothing rather than declare jobs dead
            log.warning("squeue failed (%d), keeping the last known states: %s", done.returncode, done.stderr.strip())
            return
        seen: dict[str, tuple[str, str, int]] = {}
        for line in done.stdout.splitlines():
            fields = line.strip().split("|")
            if len(fields) < 4:
                continue
            ref = fields[0].split("+")[0]  # a heterogeneous job's components: 123+0, 123+1
            state = fields[1].split()[0].rstrip("+") if fields[1] else ""
            status = int(fields[3]) if fields[3].strip().isdigit() else 0
            if ref in self._jobs and (ref not in seen or state not in FINAL):
                seen[ref] = (state, fields[2], status)
        stuck = []
        for ref in live:
            tracked = self._jobs[ref]
            if ref not in seen:
                state, exit_field = self._forgotten(ref)
                self._states[ref] = Status(tracked.handle, "exited", exit_code(exit_field, state), tracked.killed, state)
                continue
            state, reason, status = seen[ref]
            if state in FINAL:
                code = status >> 8 & 0xFF, status & 0x7F
                self._states[ref] = Status(tracked.handle, "exited", exit_code(f"{code[0]}:{code[1]}", state),
                                           tracked.killed, state)
            elif state in NOT_STARTED and reason.split(",")[0].strip() in NEVER_STARTS:
                stuck.append(tracked)
                self._states[ref] = Status(tracked.handle, "exited", -1, tracked.killed, f"{state} ({reason})")
            else:
                self._states[ref] = Status(tracked.handle, "pending" if state in NOT_STARTED else "running",
                                           detail=f"{state} ({reason})" if reason and reason != "None" else state)
        if stuck:  # it would wait for a node or a partition the lease cannot wait for: give the GPUs back
            log.warning("Slurm jobs %s cannot start where their lease is: %s", ", ".join(t.handle.ref for t in stuck),
                        "; ".join(self._states[t.handle.ref].detail for t in stuck))
            self._scancel(*(t.handle.ref for t in stuck))

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

    def _queue(self) -> list[tuple[str, str, str]] | None:
        """(job id, name, state) of our user's jobs; None if squeue fails."""
        try:
            out = self.run("squeue", "--me", "--noheader", "--format=%i|%j|%T")
        except LaunchError as exc:
            log.warning("cannot read the queue: %s", exc)
            return None
        rows = []
        for line in out.splitlines():
            ref, _, rest = line.strip().partition("|")
            name, _, state = rest.rpartition("|")
            rows.append((ref.split("+")[0].split("_")[0], name, state))
        return rows

    def _cancel_named(self, name: str) -> None:
        rows = self._queue() or []
        refs = sorted({ref for ref, n, state in rows if n == name and state not in FINAL and ref not in self._jobs})
        if refs:
            self._scancel(*refs)

    def cancel_leftovers(self, app: str, wait_s: float = 60.0) -> list[str]:
        """Jobs ``themis:<app>:<job>`` in our user's queue that this executor did not submit: a
        plain ``scancel`` (SIGTERM, then SIGKILL after Slurm's KillWait, so they can checkpoint),
        then wait (up to ``wait_s``) until they are gone, so a new start of the same job does not
        race the old one for its checkpoint."""
        prefix = job_name(app, "")
        rows = self._queue() or []
        found = sorted({ref for ref, name, state in rows
                        if name.startswith(prefix) and _NAME.match(name[len(prefix):]) and ref not in self._jobs
                        and state not in FINAL}, key=int)
        if not found:
            return []
        self._scancel(*found)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            rows = self._queue()
            if rows is not None and not any(ref in found and state not in FINAL for ref, _, state in rows):
                break
            time.sleep(0.5)
        return found

    def release(self, handle: Handle) -> None:
        self._jobs.pop(handle.ref, None)
        self._states.pop(handle.ref, None)

    def close(self) -> None:
        """scancel every job of this executor that has not ended."""
        self._kill_now(list(self._jobs.values()))
        self._last_poll = -1e9
