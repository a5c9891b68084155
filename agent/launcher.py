"""The launcher: an app's jobs as real processes on the GPUs the app holds (issue 5).

:class:`Launcher` starts one process per job run, with

* ``CUDA_VISIBLE_DEVICES``: the machine-local GPU indices (``r0-m3-g5`` is index 5; see
  :func:`gpu_index`), so a training framework sees exactly the job's GPUs;
* ``THEMIS_APP``, ``THEMIS_JOB``, ``THEMIS_GPUS`` (the full GPU ids, comma-separated),
  ``THEMIS_PLACEMENT`` (JSON ``[[rack, machine, slot], ...]``, what metrics carry),
  ``THEMIS_DEMAND``, ``THEMIS_CHECKPOINT`` (``<workdir>/<run>/<job>/checkpoint.pkl``: the same path
  on every start of the job in this run of the search, which is how a restarted job resumes; see
  ``agent.search_run``), ``THEMIS_RUN`` (the run id, which ``agent.job`` writes into checkpoints),
  ``THEMIS_METRICS_TOPIC``
  (``themis/<cluster>/apps/<app>/jobs/<job>/metrics``), ``THEMIS_PARAMS`` (the trial's
  hyperparameters, JSON), ``THEMIS_START_ITERATION`` / ``THEMIS_TARGET_ITERATION`` (where the tuner
  thinks the job resumes and where it should stop), ``THEMIS_LAUNCHER_PID``;
* how to report (``agent.job`` reads it): ``THEMIS_METRICS_FD``, the write end of a pipe the job
  inherits (``report="pipe"``, the default), or ``THEMIS_MQTT``, the broker URL
  (``report="mqtt"``: the job publishes itself and the runner follows the topic).

Why a pipe for the embedded channel. It needs no broker, no disk and no polling of files; reports
up to 4 KiB are atomic (PIPE_BUF), arrive in order, and everything a job wrote before it exited is
still in the pipe when the launcher sees the exit -- so :meth:`Launcher.poll` hands out a run's last
report *before* its exit, and a runner never mistakes a job that reached its rung for one that
vanished. A job whose launcher died gets EPIPE and stops (``agent.job``). With a bus the launcher
also republishes every report on the job's metrics topic (so dashboards and remote profilers see
them), but the scheduling path never depends on the broker. A job's stdout and stderr go to
``<job folder>/output.log`` (appended across restarts; the job folder is ``<workdir>/<run>/<job>``,
see :attr:`Launcher.run_dir`): a chatty job cannot block on a full pipe.

Where jobs run is the executor's business (:mod:`agent.executors`; issue 6): ``local``
subprocesses, as described below, by default; Slurm jobs or Ray supervisors otherwise, with the
differences each backend's module describes (no pipe: reports by metrics file or MQTT; a heartbeat
file instead of the parent-death signal).

Stopping. :meth:`Launcher.stop` has the executor send SIGTERM to the job's process group and arm a
deadline (``grace``); the executor sends SIGKILL once it passes (checked on :meth:`Launcher.poll`).
``agent.job`` turns the SIGTERM into ``step() -> True``, the script checkpoints and exits 0. Every
local job is the leader of its own session and process group (``start_new_session``), so a stop or
a kill reaches whatever it forked; when a job's main process ends, the executor kills what is left
of its group before reaping it (the group id cannot be reused while the leader is a zombie), and
the launcher removes the temporary file of a checkpoint a killed run was still writing.
:meth:`Launcher.shutdown` stops all jobs gracefully, then kills; an ``atexit`` hook kills the
groups of every launcher still holding some, and ``agent.job`` asks the kernel for SIGTERM when the
launcher's process dies (``PR_SET_PDEATHSIG``), so no job outlives its agent.

Everything here is synchronous (``poll`` is meant to be called every ~0.1 s from the runner's
loop) and non-blocking for local jobs; an engine's executor runs its commands (``sbatch``,
``squeue``: ~10-50 ms each, at most every ``poll_interval_s`` for ``squeue``) in the caller's thread.
:meth:`Launcher.wait` and :meth:`Launcher.shutdown` are the async conveniences.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import re
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.executors.base import Executor, Handle, JobCommand, Status, make_executor
from agent.job import drop_temporary_checkpoints
from agent.placement import Position

if TYPE_CHECKING:
    from agent.trial import TrialSpec
    from arbiter.events import EventBus

__all__ = ["JobExit", "Launcher", "Polled", "Run", "gpu_index"]

log = logging.getLogger("themis.launcher")

_JOB_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_GPU_INDEX = re.compile(r"(?:^|-)g(\d+)$")
_LAUNCHERS: weakref.WeakSet[Launcher] = weakref.WeakSet()
REPORT_CHANNELS = ("pipe", "file", "mqtt")


def gpu_index(gpu: str) -> str:
    """The machine-local index of a GPU id: ``r0-m3-g5`` -> ``"5"`` (the cluster files' naming,
    ``<machine>-g<k>``). ValueError for an id without a ``g<k>`` suffix; pass your own
    ``cuda_index`` to the launcher for other naming schemes (a UUID is fine for CUDA too)."""
    match = _GPU_INDEX.search(gpu)
    if not match:
        raise ValueError(f"cannot tell the local index of GPU {gpu!r}: expected an id ending in -g<k>")
    return str(int(match.group(1)))


def _by_machine(gpus: Sequence[str], placement: Sequence[Position], cuda_index: Callable[[str], str],
                job: str) -> list[tuple[str, tuple[int, ...]]]:
    """The job's GPUs as (machine, ascending local indices) pairs, the machine holding most of them
    first (where a single-process job runs); ties keep the lease's order."""
    groups: dict[str, list[int]] = {}
    for gpu, position in zip(gpus, placement):
        try:
            index = int(cuda_index(gpu))
        except ValueError as exc:
            raise ValueError(f"job {job}: {exc}") from None
        groups.setdefault(str(position[1]), []).append(index)
    for machine, indices in groups.items():
        if len(set(indices)) != len(indices):
            raise ValueError(f"job {job}: GPU index repeated on machine {machine}: {indices}")
    order = sorted(groups, key=lambda m: -len(groups[m]))  # stable: ties keep the lease's order
    return [(m, tuple(sorted(groups[m]))) for m in order]  # ascending, as engines list them


def string_command(argv: str | bytes) -> str:
    """Issue 11: a string was taken one character per argument ("cannot start 'p'"), retried forever."""
    text = argv.decode() if isinstance(argv, bytes) else argv
    return (f"the training command must be a list of arguments, not the string {text!r}: "
            f"pass e.g. {text.split() or ['python', 'train.py']!r} (or [sys.executable, 'train.py'])")


def training_command(given: Any) -> list[str]:
    """The training command as the arguments to run; TypeError or ValueError saying what to pass
    instead, before any agent registers or job starts (issue 11: a string was taken one character
    per argument; a path failed the first start with "'PosixPath' object is not iterable")."""
    if isinstance(given, (str, bytes)):
        raise TypeError(string_command(given))
    if isinstance(given, os.PathLike):
        raise TypeError(f"the training command must be a list of arguments, not the path {os.fspath(given)!r}: "
                        f"pass e.g. [sys.executable, {os.fspath(given)!r}]")
    if not isinstance(given, Iterable):
        raise TypeError(f"the training command must be a list of arguments, not {type(given).__name__} {given!r}")
    argv = [str(a) for a in given]  # a command function may return any iterable (a generator, a map)
    if not argv:
        raise ValueError("the training command is empty: pass e.g. [sys.executable, 'train.py']")
    return argv


def _position_of(gpu: str) -> Position:
    """A best guess at (rack, machine, slot) from an id ``<rack>-m<i>-g<k>`` when no placement is given."""
    parts = gpu.split("-")
    if len(parts) >= 3:
        return (parts[0], "-".join(parts[:-1]), gpu)
    return ("r", "m", gpu)


@dataclass
class Run:
    """One start of a job, as the executor runs it."""

    job_id: str
    spec: Any  # the TrialSpec it was started for
    gpus: tuple[str, ...]
    placement: tuple[Position, ...]
    handle: Handle
    started_at: float
    resumed: bool  # a checkpoint existed when it started
    fd: int | None = None
    metrics_file: Path | None = None
    offset: int = 0  # how far metrics_file has been read
    engine_state: str = "pending"  # what the executor last said: pending or running
    buffer: bytearray = field(default_factory=bytearray)
    stop_deadline: float | None = None
    stop_reason: str = ""
    signalled: bool = False  # SIGTERM sent
    killed: bool = False
    returncode: int | None = None
    ended_at: float | None = None
    reports: int = 0
    first_iteration: float | None = None
    last_iteration: float | None = None

    @property
    def pid(self) -> int:
        """The process id (local executor); ValueError for an engine's job id that is not one."""
        return int(self.handle.ref)

    @property
    def active(self) -> bool:
        """Running, or queued by a cluster engine to run: on its GPUs and not asked to stop."""
        return self.state in ("running", "pending")

    @property
    def state(self) -> str:
        """exited, stopping, pending (queued by a cluster engine) or running."""
        if self.returncode is not None:
            return "exited"
        return "stopping" if self.stop_deadline is not None else self.engine_state


@dataclass(frozen=True)
class JobExit:
    """How a run ended. ``requested``: the launcher had asked it to stop (``reason`` says why);
    ``killed``: it outlived the grace period and got SIGKILL. A negative ``returncode`` is the
    signal that ended it."""

    job_id: str
    returncode: int
    requested: bool
    killed: bool
    reason: str
    gpus: tuple[str, ...]
    resumed: bool
    reports: int
    first_iteration: float | None
    last_iteration: float | None
    started_at: float
    ended_at: float
    detail: str = ""  # the executor's words for the end (``COMPLETED``, ``FAILED``, ``NODE_FAIL``)

    @property
    def clean(self) -> bool:
        return self.returncode == 0


@dataclass
class Polled:
    """What :meth:`Launcher.poll` found: reports (in arrival order) and runs that ended."""

    metrics: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    exited: list[JobExit] = field(default_factory=list)


class Launcher:
    """Runs an app's jobs as processes; see the module docstring.

    ``argv(spec)`` gives the command of a trial (``spec`` is a ``TrialSpec``; a plain sequence is
    used for every trial). ``env`` is added to the inherited environment (THEMIS_* variables of the
    agent's own environment are not inherited). ``on_metrics(job_id, payload)`` is called for every
    report read from a pipe or a metrics file; ``bus`` republishes them on the job's metrics topic.
    ``executor`` runs the processes (:mod:`agent.executors`: ``"local"``, the default, or
    ``"slurm"``, or an instance); jobs that are not children of the agent report by ``"file"`` (on
    storage the job's machine shares with the agent) or ``"mqtt"``, not by ``"pipe"``; ``report``
    defaults to ``"pipe"`` for local jobs and ``"file"`` for the others.

    Such jobs cannot see the agent die (no pipe, no parent death signal), so the launcher touches a
    heartbeat file (``<workdir>/.heartbeat``) on every :meth:`poll`, at most once a second, and
    ``agent.job`` checkpoints and exits once it is ``heartbeat_timeout_s`` old: a job never keeps
    GPUs for an agent that is gone. :meth:`cancel_leftovers` ends jobs an earlier agent of the same
    app left in the engine.
    """

    def __init__(
        self,
        app: str,
        argv: Callable[[TrialSpec], Sequence[str]] | Sequence[str],
        workdir: str | os.PathLike[str],
        *,
        cluster: str = "local",
        mqtt: str | None = None,
        report: str | None = None,
        bus: EventBus | None = None,
        grace_s: float = 10.0,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        cuda_index: Callable[[str], str] = gpu_index,
        on_metrics: Callable[[str, dict[str, Any]], None] | None = None,
        clock: Callable[[], float] = time.time,
        executor: Executor | str | None = None,
        heartbeat_timeout_s: float = 60.0,
        run_id: str | None = None,
    ) -> None:
        from arbiter.events import check_segment

        check_segment("app", app)
        check_segment("cluster", cluster)
        self.executor: Executor = make_executor(executor or "local") if not isinstance(executor, Executor) else executor
        if not heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s!r}")
        self.heartbeat_timeout_s = float(heartbeat_timeout_s)
        self._beat_at = -1e9
        report = report or ("pipe" if self.executor.local else "file")
        if report not in REPORT_CHANNELS:
            raise ValueError(f"report must be one of {', '.join(REPORT_CHANNELS)}, got {report!r}")
        if report == "mqtt" and not mqtt:
            raise ValueError("report='mqtt' needs the broker URL (mqtt=...)")
        if report == "pipe" and not self.executor.local:
            raise ValueError(f"the {self.executor.name} executor's jobs are not children of the agent and cannot "
                             "inherit a pipe: report by 'file' (shared storage) or 'mqtt'")
        if not grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s!r}")
        self.app, self.cluster, self.mqtt, self.report = app, cluster, mqtt, report
        if not callable(argv):
            argv = training_command(argv)  # kept as a list: a one-shot iterable would run once
        self._argv = argv
        self.workdir = Path(workdir)
        if run_id is not None and (not _JOB_ID.match(run_id) or run_id in (".", "..")):
            raise ValueError(f"run id {run_id!r} must be 1-128 characters of A-Z a-z 0-9 . _ -")
        self.run_id = run_id
        self.bus, self.grace_s = bus, float(grace_s)
        self.env = dict(env or {})
        self.cwd = cwd
        self.cuda_index = cuda_index
        self.on_metrics = on_metrics
        self.clock = clock
        self.starts: Counter[str] = Counter()  # job -> processes started
        self.history: list[JobExit] = []  # every run that ended, in order
        self.rejected = 0  # pipe lines that were not JSON objects
        self.start_ups: list[tuple[str, float]] = []  # (job, launch to first report in s), for the runner to take
        self._runs: dict[str, Run] = {}  # live runs (running or stopping)
        _LAUNCHERS.add(self)

    # -- paths and environment --------------------------------------------------------------------

    @property
    def run_dir(self) -> Path:
        """Where this run's job folders and records go: ``<workdir>/<run id>`` (``agent.search_run``),
        or the workdir itself for a launcher made without a run id."""
        return self.workdir / self.run_id if self.run_id else self.workdir

    def job_dir(self, job_id: str) -> Path:
        return self.run_dir / job_id

    def checkpoint_path(self, job_id: str) -> Path:
        return self.job_dir(job_id) / "checkpoint.pkl"

    def log_path(self, job_id: str) -> Path:
        return self.job_dir(job_id) / "output.log"

    @property
    def heartbeat_path(self) -> Path:
        return self.workdir / ".heartbeat"

    def beat(self, force: bool = False) -> None:
        """Touch the heartbeat file (jobs run by an engine watch it; see the class docstring)."""
        now = time.monotonic()
        if self.executor.local or (not force and now - self._beat_at < 1.0):
            return
        self._beat_at = now
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.heartbeat_path.touch()  # sets the mtime of an existing file too

    def cancel_leftovers(self) -> list[str]:
        """End the jobs an earlier agent of this app left running in the engine (they checkpoint
        first where the engine allows; see the executor). Returns their engine ids."""
        found = self.executor.cancel_leftovers(self.app)
        if found:
            log.warning("%s: ended %d job(s) an earlier agent left in %s: %s", self.app, len(found),
                        self.executor.name, ", ".join(found))
        return found

    def metrics_path(self, job_id: str, attempt: int) -> Path:
        """Where start number ``attempt`` of a job appends its reports (``report="file"``)."""
        return self.job_dir(job_id) / f"metrics.{attempt}.jsonl"

    def metrics_topic(self, job_id: str) -> str:
        from arbiter.events import job_metrics_topic

        return job_metrics_topic(self.cluster, self.app, job_id)

    def environment(self, spec: TrialSpec, gpus: Sequence[str], placement: Sequence[Position]) -> dict[str, str]:
        """The variables a run of ``spec`` on ``gpus`` gets (without the reporting channel's fd)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("THEMIS_")}
        env.update(self.env)
        env.update({
            "CUDA_VISIBLE_DEVICES": ",".join(self.cuda_index(g) for g in gpus),
            "THEMIS_APP": self.app,
            "THEMIS_JOB": spec.job_id,
            "THEMIS_GPUS": ",".join(gpus),
            "THEMIS_PLACEMENT": json.dumps([list(p) for p in placement]),
            "THEMIS_DEMAND": str(int(spec.demand_max)),
            "THEMIS_CHECKPOINT": str(self.checkpoint_path(spec.job_id)),
            "THEMIS_RUN": self.run_id or "",
            "THEMIS_METRICS_TOPIC": self.metrics_topic(spec.job_id),
            "THEMIS_PARAMS": json.dumps(dict(spec.params), sort_keys=True, default=str),
            "THEMIS_START_ITERATION": str(int(spec.start_iteration)),
            "THEMIS_TARGET_ITERATION": "" if spec.target_iteration is None else str(int(spec.target_iteration)),
        })
        if self.executor.local:
            env["THEMIS_LAUNCHER_PID"] = str(os.getpid())
        else:
            env["THEMIS_HEARTBEAT"] = str(self.heartbeat_path)
            env["THEMIS_HEARTBEAT_TIMEOUT"] = f"{self.heartbeat_timeout_s:g}"
        if self.report == "mqtt":
            env["THEMIS_MQTT"] = str(self.mqtt)
        return env

    # -- starting and stopping --------------------------------------------------------------------

    def start(self, spec: TrialSpec, gpus: Sequence[str], placement: Sequence[Position] | None = None) -> Run:
        """Start a run of ``spec`` on ``gpus`` (``placement``: their positions, same order). The job
        resumes from its checkpoint if an earlier run left one. RuntimeError if it is running."""
        job = spec.job_id
        if not isinstance(job, str) or not _JOB_ID.match(job) or job in (".", ".."):
            raise ValueError(f"job id {job!r} must be 1-128 characters of A-Z a-z 0-9 . _ -")
        if job in self._runs:
            raise RuntimeError(f"job {job} is already running ({self.executor.name} {self._runs[job].handle.ref})")
        gpus = tuple(gpus)
        if not gpus:
            raise ValueError(f"job {job}: no GPUs to start on")
        placement = tuple(tuple(p) for p in placement) if placement is not None else tuple(map(_position_of, gpus))
        if len(placement) != len(gpus):
            raise ValueError(f"job {job}: {len(gpus)} GPUs but {len(placement)} positions")
        taken = self.gpus_in_use() & set(gpus)
        if taken:
            raise RuntimeError(f"job {job}: GPUs {sorted(taken)} are still used by another job")
        argv = training_command(self._argv(spec) if callable(self._argv) else self._argv)
        parts = _by_machine(gpus, placement, self.cuda_index, job)
        env = self.environment(spec, gpus, placement)  # type: ignore[arg-type]
        if not self.executor.local:  # the engine sets CUDA_VISIBLE_DEVICES; agent.job checks it against this
            env["THEMIS_CUDA_DEVICES"] = ",".join(str(i) for i in parts[0][1])
        folder = self.job_dir(job)
        folder.mkdir(parents=True, exist_ok=True)
        self.beat(force=True)
        resumed = self.checkpoint_path(job).exists()
        attempt = self.starts[job] + 1
        read_fd = write_fd = None
        metrics_file = None
        if self.report == "pipe":
            read_fd, write_fd = os.pipe()
            os.set_blocking(read_fd, False)
            with contextlib.suppress(OSError, AttributeError):  # Linux: room for ~5,000 reports
                import fcntl

                fcntl.fcntl(read_fd, 1031, 1 << 20)  # F_SETPIPE_SZ
        elif self.report == "file":
            metrics_file = self.metrics_path(job, attempt)
            metrics_file.unlink(missing_ok=True)
            env["THEMIS_METRICS_FILE"] = str(metrics_file)
        command = JobCommand(self.app, job, tuple(argv), self.log_path(job), str(self.cwd) if self.cwd else None,
                             (("THEMIS_METRICS_FD", write_fd),) if write_fd is not None else (), attempt)
        try:
            with open(self.log_path(job), "ab") as out:
                where = " + ".join(f"{m}:{','.join(map(str, i))}" for m, i in parts)
                out.write(f"--- start {attempt} of {job} on {','.join(gpus)} ({self.executor.name} {where}; "
                          f"resume: {resumed}) ---\n".encode())
            handle = self.executor.launch(command, parts[0][0], parts[0][1], self.checkpoint_path(job), env,
                                          more=parts[1:])
        except BaseException:
            for fd in (read_fd, write_fd):
                if fd is not None:
                    os.close(fd)
            raise
        if write_fd is not None:
            os.close(write_fd)
        run = Run(job, spec, gpus, placement, handle, self.clock(), resumed, read_fd, metrics_file,  # type: ignore[arg-type]
                  engine_state="running" if self.executor.local else "pending")
        self._runs[job] = run
        self.starts[job] += 1
        log.info("started %s/%s (%s %s) on %s%s", self.app, job, self.executor.name, handle.ref, ",".join(gpus),
                 " (resuming)" if resumed else "")
        return run

    def stop(self, job_id: str, grace: float | None = None, reason: str = "stopped", *, signal_now: bool = True) -> bool:
        """Ask a running job to checkpoint and exit: SIGTERM to its process group now, SIGKILL from
        :meth:`poll` once ``grace`` (default ``grace_s``) seconds have passed. With
        ``signal_now=False`` the job is expected to exit by itself (it reached its target iteration):
        it gets ``grace`` seconds to do so before the SIGTERM, and another ``grace`` before the SIGKILL.
        False if the job is not running; a job already stopping keeps its earlier deadline unless this
        one is sooner (and a SIGTERM asked for now is sent now)."""
        run = self._runs.get(job_id)
        if run is None or run.returncode is not None:
            return False
        grace = self.grace_s if grace is None else max(0.0, float(grace))
        deadline = time.monotonic() + grace
        if run.stop_deadline is None:
            run.stop_reason = reason
        if signal_now:
            run.signalled = True
            self.executor.stop(run.handle, grace)  # SIGTERM once; the executor kills after the sooner grace
        if run.stop_deadline is None or deadline < run.stop_deadline:
            run.stop_deadline = deadline
        return True

    def kill(self, job_id: str) -> bool:
        """SIGKILL the job now (no checkpoint)."""
        run = self._runs.get(job_id)
        if run is None:
            return False
        run.stop_reason = run.stop_reason or "killed"
        run.stop_deadline = run.stop_deadline or time.monotonic()
        run.killed = run.signalled = True
        self.executor.kill(run.handle)
        return True

    # -- watching ---------------------------------------------------------------------------------

    def poll(self) -> Polled:
        """Read every report waiting in the pipes or metrics files, ask the executor how the jobs
        are (it kills those whose grace ran out), and reap the runs that ended (after their last
        reports). Never blocks for long."""
        out = Polled()
        now = time.monotonic()
        if self._runs:
            self.beat()
        for run in list(self._runs.values()):
            self._drain(run, out)
            if run.stop_deadline is not None and not run.signalled and now >= run.stop_deadline:
                run.signalled = True  # it was expected to leave by itself and did not: SIGTERM now
                self.executor.stop(run.handle, self.grace_s)
        by_ref = {run.handle.ref: run for run in self._runs.values()}
        for status in self.executor.poll():
            run = by_ref.get(status.handle.ref)
            if run is None:
                continue
            if status.exited:
                out.exited.append(self._reap(run, status, out))
            else:
                run.engine_state = status.state
        return out

    def _reap(self, run: Run, status: Status, out: Polled) -> JobExit:
        run.returncode = status.returncode if status.returncode is not None else -1
        run.killed = run.killed or status.killed
        run.ended_at = self.clock()
        self._drain(run, out, final=True)
        self.executor.release(run.handle)
        del self._runs[run.job_id]
        with contextlib.suppress(OSError):  # a save the run did not finish (killed) is garbage now
            drop_temporary_checkpoints(self.checkpoint_path(run.job_id))
        ended = JobExit(run.job_id, run.returncode, run.stop_deadline is not None, run.killed, run.stop_reason,
                        run.gpus, run.resumed, run.reports, run.first_iteration, run.last_iteration, run.started_at,
                        run.ended_at, status.detail)
        self.history.append(ended)
        if run.killed and run.stop_deadline is not None:
            log.warning("%s/%s did not stop within its grace period and was killed", self.app, run.job_id)
        log.info("%s/%s (%s %s) exited with %d%s", self.app, run.job_id, self.executor.name, run.handle.ref,
                 run.returncode, f" ({run.stop_reason})" if run.stop_deadline is not None else "")
        return ended

    def _drain(self, run: Run, out: Polled, final: bool = False) -> None:
        if run.metrics_file is not None:
            self._drain_file(run, out, final)
            return
        if run.fd is None:
            return
        while True:
            try:
                chunk = os.read(run.fd, 1 << 16)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                final = True
                break
            run.buffer += chunk
        *lines, rest = run.buffer.split(b"\n")
        run.buffer = bytearray(rest)
        for line in lines:
            if line.strip():
                self._deliver(run, line, out)
        if final:
            os.close(run.fd)
            run.fd = None
            if run.buffer.strip():
                log.warning("%s/%s: dropping a partial report at exit", self.app, run.job_id)

    def _drain_file(self, run: Run, out: Polled, final: bool) -> None:
        """Complete lines the job appended to its metrics file since the last look."""
        path = run.metrics_file
        assert path is not None
        try:
            with open(path, "rb") as f:
                f.seek(run.offset)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        end = chunk.rfind(b"\n") + 1
        run.offset += end
        for line in chunk[:end].split(b"\n"):
            if line.strip():
                self._deliver(run, line, out)
        if final and chunk[end:].strip():
            log.warning("%s/%s: dropping a partial report at exit", self.app, run.job_id)

    def _deliver(self, run: Run, line: bytes, out: Polled) -> None:
        try:
            payload = json.loads(line)
            if not isinstance(payload, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            self.rejected += 1
            log.warning("%s/%s: ignoring a report that is not a JSON object (%s): %.80r", self.app, run.job_id,
                        exc, bytes(line))
            return
        if run.reports == 0:
            self.start_ups.append((run.job_id, self.clock() - run.started_at))
        run.reports += 1
        iteration = payload.get("iteration")
        if isinstance(iteration, (int, float)) and not isinstance(iteration, bool):
            if run.first_iteration is None:
                run.first_iteration = float(iteration)
            run.last_iteration = float(iteration)
        out.metrics.append((run.job_id, payload))
        if self.on_metrics is not None:
            self.on_metrics(run.job_id, payload)
        if self.bus is not None:
            self.bus.publish(self.metrics_topic(run.job_id), payload)

    # -- what runs --------------------------------------------------------------------------------

    def live(self) -> dict[str, Run]:
        """Runs that have not been reaped (running or stopping)."""
        return dict(self._runs)

    def run_of(self, job_id: str) -> Run | None:
        return self._runs.get(job_id)

    def is_live(self, job_id: str) -> bool:
        return job_id in self._runs

    def gpus_in_use(self) -> set[str]:
        """GPUs some unreaped process may still be using (a stopping job keeps its GPUs)."""
        return {g for run in self._runs.values() for g in run.gpus}

    async def wait(self, job_id: str | None = None, timeout: float | None = None, interval: float = 0.05) -> Polled:
        """Poll until ``job_id`` (or every job) has ended; TimeoutError after ``timeout`` s.
        Returns everything polled meanwhile."""
        total = Polled()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            got = self.poll()
            total.metrics += got.metrics
            total.exited += got.exited
            if (job_id is None and not self._runs) or (job_id is not None and job_id not in self._runs):
                return total
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{job_id or 'jobs'} still running after {timeout} s")
            await asyncio.sleep(interval)

    async def shutdown(self, grace: float | None = None) -> Polled:
        """Stop every job (SIGTERM, ``grace`` s, SIGKILL) and wait until all are reaped."""
        for job in list(self._runs):
            self.stop(job, grace, reason="shutdown")
        return await self.wait(timeout=(self.grace_s if grace is None else grace) + 10.0)

    def kill_all(self) -> None:
        """Kill every job and reap them (synchronous; used at interpreter exit)."""
        for run in list(self._runs.values()):
            run.killed = run.signalled = True
            run.stop_deadline = run.stop_deadline or time.monotonic()
            run.stop_reason = run.stop_reason or "killed at exit"
        with contextlib.suppress(Exception):
            self.executor.close()
        by_ref = {run.handle.ref: run for run in self._runs.values()}
        with contextlib.suppress(Exception):
            for status in self.executor.poll():
                if status.exited and status.handle.ref in by_ref:
                    self._reap(by_ref[status.handle.ref], status, Polled())


@atexit.register
def _kill_leftovers() -> None:
    for launcher in list(_LAUNCHERS):
        with contextlib.suppress(Exception):
            launcher.kill_all()
