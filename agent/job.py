"""The job's side of the launcher: what a training script calls to report metrics and to honour stops.

Two lines in a training loop::

    job = Job.from_env()                      # reads what the launcher put in the environment
    state = job.resume() or {"iteration": 0}  # the checkpoint, if any
    iteration = state["iteration"]
    while not job.should_stop(iteration):     # the target reached, or the launcher asked the job to stop
        loss = train_one_iteration()
        iteration += 1
        job.step(iteration, loss)             # reports (iteration, loss, measured time per iteration)
    job.save({"iteration": iteration, ...})   # checkpoint (atomic); exit 0

``job.resume()`` returns what the last ``job.save`` stored (None on a first start), so a job that lost
its GPUs goes on from its checkpoint on the next grant. The loop asks :meth:`Job.should_stop` *before*
training: a job resumed from a checkpoint already at its target trains nothing (issue 36, item 3: a
resumed trial trained iteration 28 of a 27-iteration rung). Such a job has nothing to do, and
``resume()`` reports the checkpoint's last result again (the checkpoint keeps it), so the tuner hears
that the trial reached its target even when the report got lost as the run ended.

A checkpoint records who wrote it (the run of the search, ``THEMIS_RUN``, the job and its
hyperparameters), and a job the launcher started refuses one another trial wrote
(:class:`CheckpointMismatch`, issue 11): it never trains on from someone else's model.
``job.params`` are the trial's hyperparameters (``THEMIS_PARAMS``).

What :meth:`Job.step` answers. True when the job should checkpoint and exit: the launcher sent SIGTERM
(a lease was lost, the tuner stopped or paused the trial, the agent is shutting down), or
``iteration`` reached ``THEMIS_TARGET_ITERATION`` (the tuner's rung or cap: exiting there, instead of
waiting to be stopped, wastes no GPU time). A SIGTERM arriving during an iteration is honoured at the
next ``step``; the launcher waits a grace period (``Launcher.grace_s``) for the checkpoint, then kills.

Reports (``agent.profiler.metrics_payload``, plus ``"extra"`` with any keyword arguments of ``step``)
go one of two ways, chosen by the launcher:

* ``THEMIS_METRICS_FD``: one JSON line per report written to a pipe the launcher inherited to the job.
  Lines under 4 KiB are written atomically (PIPE_BUF); the pipe needs no disk, no polling and no
  broker, and it reports the launcher's death to the job (a broken pipe stops the job gracefully).
* ``THEMIS_METRICS_FILE``: one JSON line per report appended (O_APPEND, one write each) to a file on
  storage the agent shares with the job's machine, for jobs a cluster engine runs (``agent.executors``).
* ``THEMIS_MQTT``: published straight to the broker on ``THEMIS_METRICS_TOPIC`` (QoS 1, paho), for
  jobs that run where the agent cannot hand them a pipe.

On a cluster engine (Slurm) the engine, not the launcher, sets ``CUDA_VISIBLE_DEVICES``; the
launcher adds ``THEMIS_CUDA_DEVICES`` (what the lease says) and :meth:`Job.from_env` refuses to
train when the two differ, so a misconfigured GRES mapping fails loudly instead of double-booking.

Started by hand (none of the variables set) a job trains normally: ``step`` only watches for SIGTERM
and the target, and nothing is reported.

The environment the launcher sets (``agent.launcher``): ``CUDA_VISIBLE_DEVICES``, ``THEMIS_APP``,
``THEMIS_JOB``, ``THEMIS_GPUS`` (GPU ids, comma-separated), ``THEMIS_PLACEMENT`` (JSON list of
``[rack, machine, slot]``), ``THEMIS_DEMAND``, ``THEMIS_CHECKPOINT``, ``THEMIS_METRICS_TOPIC``,
``THEMIS_PARAMS`` (JSON), ``THEMIS_START_ITERATION``, ``THEMIS_TARGET_ITERATION`` (empty: none),
``THEMIS_LAUNCHER_PID`` (local executor), ``THEMIS_CUDA_DEVICES``, ``THEMIS_HEARTBEAT`` and
``THEMIS_HEARTBEAT_TIMEOUT`` (other executors: the job leaves when the agent's heartbeat file is
older than the timeout, since it cannot see the agent die otherwise) and one of
``THEMIS_METRICS_FD`` / ``THEMIS_METRICS_FILE`` / ``THEMIS_MQTT``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import numbers
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agent.placement import Position
from agent.profiler import metrics_payload

__all__ = ["CheckpointMismatch", "GpuMismatch", "Job", "drop_temporary_checkpoints", "temporary_checkpoint"]


class GpuMismatch(RuntimeError):
    """The engine gave the job other GPUs than its lease names."""


class CheckpointMismatch(RuntimeError):
    """The checkpoint at the job's path was written by another trial (another run of the search,
    another job, other hyperparameters): resuming from it would corrupt the search (issue 11)."""

log = logging.getLogger("themis.job")

_PR_SET_PDEATHSIG = 1
def _plain(value: Any) -> Any:
    """An extra as JSON can carry it: numpy/JAX scalars as Python numbers, NaN and inf as null."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    return float(value) if math.isfinite(value) else None


_OWNER = "themis_checkpoint_owner"
_ITERATION = "themis_checkpoint_iteration"
_REPORT = "themis_checkpoint_report"  # the last report (iteration, loss, iter_time_s, extra): said again at the target


def temporary_checkpoint(checkpoint: Path, pid: int) -> Path:
    """Where :meth:`Job.save` of process ``pid`` writes before the rename (one name per writer)."""
    return checkpoint.with_name(f".{checkpoint.name}.{pid}.tmp")


def drop_temporary_checkpoints(checkpoint: Path) -> None:
    """Remove what saves cut short left beside ``checkpoint`` (a SIGKILL between the write and the
    rename: the grace period ran out, the OOM killer), each a whole checkpoint's size, one more per
    killed run. Only for a job none of whose processes runs (the launcher, once it reaped the run)."""
    for tmp in checkpoint.parent.glob(f".{checkpoint.name}.*.tmp"):
        tmp.unlink(missing_ok=True)


def _die_with_parent() -> None:
    """Linux: get SIGTERM (a graceful stop) when the process that started us dies, so a job never
    outlives an agent killed with SIGKILL. Best effort elsewhere (a no-op)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        pass


def _indices(text: str) -> list[int] | str:
    """``"3,1"`` -> [1, 3]; anything else (a UUID list) compared as given."""
    try:
        return sorted(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        return text


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _MqttSink:
    """Publishes reports to the broker with paho (a thread of its own), flushed at exit."""

    def __init__(self, url: str, client_id: str) -> None:
        import paho.mqtt.client as mqtt

        from arbiter.events import parse_url

        address = parse_url(url)
        self._client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id)
        if address.username:
            self._client.username_pw_set(address.username, address.password)
        if address.tls:
            self._client.tls_set()
        self._connected = threading.Event()
        self._client.on_connect = lambda *args: self._connected.set()
        self._client.connect_async(address.host, address.port, keepalive=30)
        self._client.loop_start()
        self._connected.wait(2.0)  # publishes before the CONNACK are queued anyway; this just orders them
        self._pending: list[Any] = []

    def send(self, topic: str, data: bytes) -> None:
        info = self._client.publish(topic, data, qos=1)
        self._pending = [p for p in self._pending if not p.is_published()] + [info]

    def close(self, timeout: float = 3.0) -> None:
        """Wait (bounded) for the broker to acknowledge what was published, then disconnect."""
        deadline = time.monotonic() + timeout
        while any(not p.is_published() for p in self._pending) and time.monotonic() < deadline:
            time.sleep(0.01)
        self._client.disconnect()
        self._client.loop_stop()


class Job:
    """One run of a trial, as the launcher started it (see the module docstring)."""

    def __init__(
        self,
        *,
        app: str = "",
        job_id: str = "",
        gpus: tuple[str, ...] = (),
        placement: tuple[Position, ...] = (),
        demand: int = 1,
        checkpoint: Path | None = None,
        metrics_topic: str | None = None,
        params: Mapping[str, Any] | None = None,
        start_iteration: int = 0,
        target_iteration: int | None = None,
        metrics_fd: int | None = None,
        metrics_file: str | os.PathLike[str] | None = None,
        mqtt: str | None = None,
        launcher_pid: int | None = None,
        heartbeat: str | os.PathLike[str] | None = None,
        heartbeat_timeout_s: float = 60.0,
        handle_sigterm: bool = True,
        run: str = "",
    ) -> None:
        self.app, self.job_id, self.run = app, job_id, run
        self.gpus, self.placement, self.demand = gpus, placement, demand
        self.checkpoint = checkpoint
        self.metrics_topic = metrics_topic
        self.params: dict[str, Any] = dict(params or {})
        self.start_iteration, self.target_iteration = start_iteration, target_iteration
        self.reports = 0
        self._fd = metrics_fd
        self._file = Path(metrics_file) if metrics_file else None
        self._sink: _MqttSink | None = None
        self._stop = threading.Event()
        self._last: tuple[float, float] | None = None  # (iteration, monotonic time) of the last step
        self._resumed_at: float | None = None  # the iteration of the last step before the checkpoint
        self._report: dict[str, Any] | None = None  # the last report, kept in the checkpoint
        self._warned_past_target = False
        self._started = time.monotonic()
        self._heartbeat = Path(heartbeat) if heartbeat else None
        self._heartbeat_timeout = heartbeat_timeout_s
        self._heartbeat_checked = 0.0
        if mqtt and metrics_fd is None and self._file is None and metrics_topic and placement:
            self._sink = _MqttSink(mqtt, f"themis-job-{app}-{job_id}-{os.getpid()}")
        self._handles_sigterm = False
        if handle_sigterm:
            try:
                signal.signal(signal.SIGTERM, self._on_sigterm)
                self._handles_sigterm = True
            except ValueError:  # not the main thread: the caller handles stops itself
                log.debug("not in the main thread: SIGTERM is not handled by agent.job")
        if launcher_pid is not None:
            _die_with_parent()
            if not _alive(launcher_pid):  # it died before prctl took effect
                self._stop.set()
        atexit.register(self.close)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, handle_sigterm: bool = True) -> Job:
        """The job the launcher started (``os.environ``), or a standalone one when run by hand."""
        env = os.environ if environ is None else environ
        expected = env.get("THEMIS_CUDA_DEVICES")
        if expected is not None:
            # Slurm's own record of the indices first: with ConstrainDevices=yes the job's CUDA
            # numbering starts at 0 whatever the node's indices are
            given = env.get("SLURM_JOB_GPUS") or env.get("CUDA_VISIBLE_DEVICES") or ""
            if _indices(given) != _indices(expected):
                raise GpuMismatch(f"job {env.get('THEMIS_JOB', '?')}: the lease gives GPU indices {expected!r} but "
                                  f"the engine gave {given!r}; check the GRES mapping (docs/executors.md)")
        placement = tuple(tuple(p) for p in json.loads(env.get("THEMIS_PLACEMENT") or "[]"))
        target = env.get("THEMIS_TARGET_ITERATION", "")
        fd = env.get("THEMIS_METRICS_FD", "")
        pid = env.get("THEMIS_LAUNCHER_PID", "")
        checkpoint = env.get("THEMIS_CHECKPOINT", "")
        return cls(
            app=env.get("THEMIS_APP", ""),
            job_id=env.get("THEMIS_JOB", ""),
            gpus=tuple(g for g in env.get("THEMIS_GPUS", "").split(",") if g),
            placement=placement,  # type: ignore[arg-type]
            demand=int(env.get("THEMIS_DEMAND") or max(1, len(placement))),
            checkpoint=Path(checkpoint) if checkpoint else None,
            metrics_topic=env.get("THEMIS_METRICS_TOPIC") or None,
            params=json.loads(env.get("THEMIS_PARAMS") or "{}"),
            start_iteration=int(env.get("THEMIS_START_ITERATION") or 0),
            target_iteration=int(target) if target else None,
            metrics_fd=int(fd) if fd else None,
            metrics_file=env.get("THEMIS_METRICS_FILE") or None,
            mqtt=env.get("THEMIS_MQTT") or None,
            launcher_pid=int(pid) if pid else None,
            heartbeat=env.get("THEMIS_HEARTBEAT") or None,
            heartbeat_timeout_s=float(env.get("THEMIS_HEARTBEAT_TIMEOUT") or 60.0),
            handle_sigterm=handle_sigterm,
            run=env.get("THEMIS_RUN", ""),
        )

    # -- stopping ---------------------------------------------------------------------------------

    def _on_sigterm(self, signum, frame) -> None:
        self._stop.set()

    def request_stop(self) -> None:
        """What SIGTERM does: the next :meth:`step` answers True."""
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def should_stop(self, iteration: float | None = None) -> bool:
        """True when asked to stop, when ``iteration`` reached the target iteration, or when the
        agent's heartbeat is older than its timeout (a job on a cluster engine whose agent died)."""
        if self._stop.is_set() or self._agent_gone():
            return True
        return iteration is not None and self.target_iteration is not None and iteration >= self.target_iteration

    def _agent_gone(self) -> bool:
        """Looks at the heartbeat file at most once a second."""
        if self._heartbeat is None:
            return False
        now = time.monotonic()
        if now - self._heartbeat_checked < 1.0:
            return False
        self._heartbeat_checked = now
        try:
            age = time.time() - self._heartbeat.stat().st_mtime
        except FileNotFoundError:
            age = math.inf
        except OSError as exc:  # shared storage hiccup (ESTALE, EIO): no news is not bad news
            log.debug("cannot read the heartbeat: %s", exc)
            return False
        if age > self._heartbeat_timeout:
            log.warning("the agent's heartbeat is %.0f s old: checkpointing and leaving", age)
            self._stop.set()
            return True
        return False

    # -- reporting --------------------------------------------------------------------------------

    @property
    def reporting(self) -> bool:
        return bool(self.placement) and (self._fd is not None or self._file is not None or self._sink is not None)

    def step(self, iteration: int | float, loss: float | None = None, **extra: Any) -> bool:
        """Report ``loss`` after ``iteration`` completed iterations, with the wall-clock time per
        iteration since the last call (since the start for the first), and answer whether to stop.
        Keyword arguments (numbers, strings) travel in the report's ``"extra"`` object."""
        now = time.monotonic()
        if self._last is None:
            # after a checkpoint, count from the iteration it was saved at: a tuner that started
            # over (resume=True) says start_iteration 0 while the job goes on from its checkpoint
            since = self._resumed_at if self._resumed_at is not None else self.start_iteration
            done = iteration - since if iteration > since else 1
            elapsed = now - self._started
        else:
            done, elapsed = iteration - self._last[0], now - self._last[1]
        self._last = (float(iteration), now)
        if (self.target_iteration is not None and iteration > self.target_iteration and not self._warned_past_target
                and self._resumed_at is not None and self._resumed_at >= self.target_iteration):
            self._warned_past_target = True
            log.warning("job %s trained iteration %g, past its target %d: its checkpoint was at the target "
                        "already. Ask job.should_stop(iteration) before training an iteration, not only after "
                        "(docs/agents.md, 'A complete example')", self.job_id, iteration, self.target_iteration)
        if done > 0:
            iter_time = max(elapsed / done, 1e-9)
            self.report(iteration, loss, iter_time, **extra)
            self._report = {"iteration": float(iteration), "loss": _plain(loss), "iter_time_s": iter_time,
                            "extra": {k: _plain(v) for k, v in extra.items()}}
        return self.should_stop(iteration)

    def report(self, iteration: float, loss: float | None, iter_time_s: float, **extra: Any) -> None:
        """Send one report now (``step`` measures ``iter_time_s`` for you)."""
        if not self.reporting:
            return
        payload = metrics_payload(iteration=iteration, iter_time_s=iter_time_s, gpus=self.placement,
                                  demand=self.demand, loss=loss)
        if extra:
            payload["extra"] = {k: _plain(v) for k, v in extra.items()}
        data = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
        self.reports += 1
        if self._fd is not None:
            try:
                os.write(self._fd, data + b"\n")
            except BrokenPipeError:  # the launcher is gone: checkpoint and leave
                self._fd = None
                self._stop.set()
        elif self._file is not None:
            fd = os.open(self._file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data + b"\n")  # one write: a reader never sees half a line followed by another
            finally:
                os.close(fd)
        elif self._sink is not None:
            self._sink.send(self.metrics_topic, data)  # type: ignore[arg-type]

    # -- checkpoints ------------------------------------------------------------------------------

    @property
    def owner(self) -> dict[str, str]:
        """Who this run of the job is, as its checkpoints record it: run, job, hyperparameters."""
        return {"run": self.run, "job": self.job_id,
                "params": json.dumps(self.params, sort_keys=True, separators=(",", ":"), default=str)}

    def save(self, state: Any) -> None:
        """Pickle ``state`` to the checkpoint path atomically (a job killed mid-save keeps the old
        checkpoint), with :attr:`owner` beside it. Without a checkpoint path (run by hand), nothing
        is written."""
        if self.checkpoint is None:
            return
        # the iteration the state is at: the last step, else (no step in this run) the checkpoint's
        at = self._last[0] if self._last else self._resumed_at
        state = {_OWNER: self.owner, "state": state, _ITERATION: at, _REPORT: self._report}
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary_checkpoint(self.checkpoint, os.getpid())
        try:
            with open(tmp, "wb") as f:
                pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.checkpoint)
        except BaseException:  # unpicklable state, a full disk: no half-written file left behind
            tmp.unlink(missing_ok=True)
            raise

    def resume(self) -> Any | None:
        """What the last :meth:`save` stored, or None (first start, or no checkpoint path). The
        first iteration's time is counted from here: set-up before it is not training.

        A checkpoint at (or past) the target iteration means this run has nothing to train: its last
        report is sent again (the tuner may not have heard it: the run ended as it was made), and
        :meth:`should_stop` answers True for the checkpoint's iteration, so a loop that asks it before
        training leaves at once."""
        self._started = time.monotonic()
        if self.checkpoint is None or not self.checkpoint.exists():
            return None
        with open(self.checkpoint, "rb") as f:
            data = pickle.load(f)
        owner = data.get(_OWNER) if isinstance(data, dict) else None
        if self.job_id and owner != self.owner:  # started by a launcher: only its own checkpoint
            found = "no owner (not written by agent.job)" if owner is None else (
                f"run {owner.get('run') or '-'}, job {owner.get('job')}, params {owner.get('params')}")
            raise CheckpointMismatch(
                f"refusing the checkpoint {self.checkpoint}: it was written by {found}, and this is run "
                f"{self.run or '-'}, job {self.job_id}, params {self.owner['params']}. Resuming it would train "
                "another trial's model. Start the search in a new workdir or delete the checkpoint; to go on "
                "with an interrupted search on purpose, resume it (AppRunner.create(resume=True)).")
        if owner is None:
            return data
        at = data.get(_ITERATION)
        if isinstance(at, (int, float)) and math.isfinite(at):
            self._resumed_at = float(at)
        report = data.get(_REPORT)
        self._report = report if isinstance(report, dict) else None
        if (self._report is not None and self._resumed_at is not None and self.target_iteration is not None
                and self._resumed_at >= self.target_iteration and self._report.get("iteration") == self._resumed_at):
            log.info("job %s: its checkpoint is at iteration %g, its target is %d: nothing to train",
                     self.job_id, self._resumed_at, self.target_iteration)
            try:
                self.report(self._resumed_at, self._report.get("loss"), float(self._report["iter_time_s"]),
                            **(self._report.get("extra") or {}))
            except (KeyError, TypeError, ValueError) as exc:  # an odd checkpoint: the tuner asks again later
                log.warning("job %s: could not report its checkpoint's result again: %s", self.job_id, exc)
        return data["state"]

    def close(self) -> None:
        """Flush MQTT reports (also run at exit). From here on SIGTERM is ignored: the job is on its
        way out already, and Python restores the default (deadly) handler while it finalises, which
        would turn a clean exit into death by signal."""
        if self._handles_sigterm:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self._sink is not None:
            sink, self._sink = self._sink, None
            sink.close()
