"""The ``ray`` executor: each start of a job runs under a thin supervisor actor pinned to the leased GPUs.

Pinning. The arbiter leases *particular* GPUs, so a job must get exactly those. Ray's ``num_gpus``
lets Ray pick the indices (and setting ``CUDA_VISIBLE_DEVICES`` by hand while asking ``num_gpus``
double-books silently), so the operator starts every Ray node with one custom resource per GPU
index instead, named ``{machine}_gpu{index}`` (``resource_name`` changes the pattern), plus a node
label naming the machine (``machine_label``, default ``themis/machine``)::

    ray start --address=HEAD:6379 --num-gpus=0 \\
        --resources='{"n2_gpu0": 1, "n2_gpu1": 1, "n2_gpu2": 1, "n2_gpu3": 1}' --labels='themis/machine=n2'

To run a job on GPUs 1 and 3 of ``n2`` the executor creates a supervisor actor that asks for
``{"n2_gpu1": 1, "n2_gpu3": 1}`` and ``num_cpus`` (default 0), never ``num_gpus``. Only ``n2``
has those resources, so Ray places the supervisor there; and as each resource is 1, a second job
asking for a GPU whose supervisor is still alive waits (``pending``) until that supervisor is gone:
the same semantics as Slurm's per-index GRES types.

The supervisor (needs nothing but Ray and the standard library on the node) checks that Ray really
gave it the resources of those indices, then starts the job's command as a subprocess leading its
own session and process group, with the job's environment (``env``, without what the engine sets)
plus ``CUDA_VISIBLE_DEVICES`` = the indices (lease order), ``THEMIS_CHECKPOINT`` and
``THEMIS_NODE``: the machine of the Ray node it really runs on (its ``machine_label``, else read off
the node's per-GPU resource names), so a job and its tests can see where the engine put it.
Output is appended to ``job.log_path`` and the process runs in ``job.cwd``: both must be on storage
the nodes share with the agent, as must the checkpoint. A supervisor that finds itself on a node
labelled as another machine refuses to start the job (exit -1, detail ``misplaced``).

The process is only started by an explicit call from the executor once the supervisor is alive, so
a job stopped while its supervisor still waits for its GPUs is cancelled (``ray.kill``) without
ever starting. Stopping a started job: the supervisor sends SIGTERM to the process group and, on
its own clock, SIGKILL when ``grace`` runs out (the executor sends a SIGKILL of its own too if the
job still lives a second later). When the job's main process ends, the rest of its group is
killed, the exit code is reported, and the executor kills the supervisor, which frees the GPUs.

Watching: :meth:`poll` never blocks. Every pending request to a supervisor is an ``ObjectRef``
looked at with ``ray.wait(timeout=0)``; a running job's supervisor is asked for its state at most
every ``poll_interval_s``. A supervisor that dies (its node fails, someone ``ray.kill`` s it, the
agent that owns it exits) is reported as exited with code -1 and detail ``supervisor died...``;
its job goes with it: Ray kills a dead worker's child processes, and the job's main process is
started through a two-line shim that sets ``PR_SET_PDEATHSIG`` (SIGKILL when the supervisor dies)
before it execs the command. Processes the job forked into other sessions are not covered.

Jobs spanning machines (``more``) are refused with :class:`LaunchError`: one supervisor holds the
GPUs of one node, and this executor does not gang several into a placement group.

Launch checks: the per-GPU resources must be declared by some node of the cluster
(``ray.cluster_resources()``), else LaunchError (so a typo or an unknown machine does not wait
forever as an infeasible actor); a job cannot inherit file descriptors (report by ``file`` or
``mqtt``).

``import ray`` happens in the constructor, so the project imports without Ray installed. The
executor joins the Ray cluster at ``address`` (``ray.init``) unless this process is already
connected; :meth:`close` kills its jobs but does not disconnect.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

__all__ = ["RayExecutor", "resource_pattern"]

log = logging.getLogger("themis.executor.ray")

NODE_ENV = "THEMIS_NODE"  # set by the supervisor: the machine of the Ray node the job runs on


def resource_pattern(resource_name: str) -> str:
    """A regular expression matching the per-GPU resource names, with groups ``machine`` and ``index``."""
    if "{machine}" not in resource_name or "{index}" not in resource_name:
        raise ValueError(f"resource_name must contain '{{machine}}' and '{{index}}', got {resource_name!r}")
    escaped = re.escape(resource_name)
    return "^" + escaped.replace(re.escape("{machine}"), "(?P<machine>.+?)", 1).replace(
        re.escape("{index}"), r"(?P<index>\d+)", 1) + "$"


# Run by the supervisor's Python between fork and the job's exec: SIGKILL when the supervisor dies,
# unless it is gone already; then become the job (exit 127 as a shell would when that fails).
_SHIM = """import ctypes, os, sys
ctypes.CDLL(None, use_errno=True).prctl(1, 9)
if os.getppid() != int(sys.argv[1]):
    os._exit(137)
try:
    os.execv(sys.argv[2], sys.argv[3:])
except OSError as exc:
    sys.stderr.write(f"cannot start {sys.argv[3]!r}: {exc}\\n")
    os._exit(127)
"""


def _supervisor_class():
    """The supervisor actor's class. Defined in a function so that Ray ships it by value: the nodes
    need Ray and the standard library, not this project."""

    class ThemisSupervisor:
        def __init__(self, machine: str, indices: list[int], resource_names: list[str], label_key: str,
                     pattern: str) -> None:
            import os
            import threading

            import ray

            self.machine, self.indices, self.resource_names = machine, list(indices), list(resource_names)
            self.popen = None
            self.code = None
            self.killed = False
            self.signalled = False
            self.kill_at = None
            self.lock = threading.Lock()
            self.timer = None
            ctx = ray.get_runtime_context()
            self.node_id = ctx.get_node_id()
            self.node = None
            labels = {}
            try:
                labels = dict(ctx.get_node_labels() or {})
            except Exception:  # noqa: BLE001 - an older Ray without labels
                pass
            self.node = labels.get(label_key) if label_key else None
            if not self.node:  # read the machine off the node's per-GPU resource names
                import re

                regex = re.compile(pattern)
                for entry in ray.nodes():
                    if entry.get("NodeID") == self.node_id:
                        for name in entry.get("Resources", {}):
                            match = regex.match(name)
                            if match:
                                self.node = match.group("machine")
                                break
            try:
                assigned = dict(ctx.get_assigned_resources())
            except Exception:  # noqa: BLE001
                assigned = {}
            self.assigned = {k: v for k, v in assigned.items() if k in self.resource_names}
            self.pid = os.getpid()

        def where(self) -> dict:
            import socket

            return {"node": self.node, "node_id": self.node_id, "pid": self.pid, "host": socket.gethostname(),
                    "assigned": self.assigned}

        def start(self, argv: list[str], env: dict, cwd: str | None, log_path: str) -> dict:
            import os
            import shutil
            import subprocess
            import sys
            import threading

            missing = [n for n in self.resource_names if self.assigned and n not in self.assigned]
            if missing:
                return {"error": f"Ray did not assign {missing} to the supervisor", "detail": "misplaced"}
            if self.node and self.node != self.machine:
                return {"error": f"the supervisor runs on machine {self.node!r}, not {self.machine!r}",
                        "detail": "misplaced"}
            env = dict(env)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in self.indices)
            if self.node:
                env["THEMIS_NODE"] = self.node
            program = argv[0]
            if "/" in program:
                resolved = os.path.join(cwd, program) if cwd and not os.path.isabs(program) else program
                resolved = resolved if os.access(resolved, os.X_OK) and os.path.isfile(resolved) else None
            else:
                resolved = shutil.which(program, path=env.get("PATH", os.defpath))
            if resolved is None:
                return {"error": f"cannot start {program!r}: no such executable", "detail": "cannot start"}
            # The job's main process dies with the supervisor (PR_SET_PDEATHSIG), so an agent or a
            # supervisor that dies cannot leave a job on GPUs Ray has handed out again. The signal
            # follows the *thread* that forks: only done from the worker's main thread, which lives
            # as long as the supervisor.
            pdeathsig = threading.current_thread() is threading.main_thread() and sys.platform.startswith("linux")
            command = list(argv)
            if pdeathsig:
                command = [sys.executable, "-I", "-S", "-c", _SHIM, str(os.getpid()), resolved, *argv]
            try:
                os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
                with open(log_path, "ab") as out:
                    self.popen = subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                                  stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
            except OSError as exc:
                return {"error": f"cannot start {program!r}: {exc}", "detail": "cannot start"}
            return {"pid": self.popen.pid, "node": self.node, "pdeathsig": pdeathsig}

        def _killpg(self, sig: int) -> None:
            import os

            if self.popen is not None and self.code is None:
                try:
                    os.killpg(self.popen.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

        def _deadline(self) -> None:
            import signal

            with self.lock:
                if self.code is None and self.popen is not None:
                    self.killed = True
                    self._killpg(signal.SIGKILL)

        def terminate(self, grace: float) -> None:
            import signal
            import threading
            import time

            with self.lock:
                deadline = time.monotonic() + max(0.0, float(grace))
                if not self.signalled:
                    self.signalled = True
                    self._killpg(signal.SIGTERM)
                if self.kill_at is None or deadline < self.kill_at:
                    self.kill_at = deadline
                    if self.timer is not None:
                        self.timer.cancel()
                    self.timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._deadline)
                    self.timer.daemon = True
                    self.timer.start()

        def kill(self) -> None:
            import signal

            with self.lock:
                if self.code is None and self.popen is not None:
                    self.killed = self.signalled = True
                    self._killpg(signal.SIGKILL)

        def status(self) -> tuple:
            import os
            import signal

            with self.lock:
                if self.popen is None:
                    return ("idle", None, False)
                if self.code is None:
                    try:  # look without reaping: the group id stays reserved until the group is killed
                        info = os.waitid(os.P_PID, self.popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                        ended = info is not None and info.si_pid == self.popen.pid
                    except ChildProcessError:
                        ended = True
                    if not ended:
                        return ("running", None, False)
                    self._killpg(signal.SIGKILL)  # whatever the job left behind in its group
                    self.code = self.popen.wait()
                    if self.timer is not None:
                        self.timer.cancel()
                return ("exited", self.code, self.killed)

    return ThemisSupervisor


_SUPERVISOR = None  # the supervisor's Ray actor class, made on first use


@dataclass
class _Run:
    tracked: _Tracked
    actor: Any
    job: JobCommand
    env: dict[str, str]
    phase: str = "placing"  # placing (waiting for its GPUs) -> starting -> running -> exited
    ready_ref: Any = None
    start_ref: Any = None
    status_ref: Any = None
    last_ask: float = -1e9
    where: dict | None = None
    status: Status | None = None
    freed: bool = False


@register("ray")
class RayExecutor(Executor):
    """Options: ``address`` (the Ray cluster, for ``ray.init``; None: ``RAY_ADDRESS`` or a local
    one, unless already connected), ``resource_name`` (per-GPU resource naming, default
    ``{machine}_gpu{index}``), ``machine_label`` (node label naming the machine, default
    ``themis/machine``; empty: read the machine off the resource names), ``num_cpus`` (the
    supervisor's CPU request, default 0), ``poll_interval_s``, ``init_options`` (more ``ray.init``
    keywords), ``check_resources`` (refuse GPUs no node declares, default True)."""

    def __init__(self, address: str | None = None, *, resource_name: str = "{machine}_gpu{index}",
                 machine_label: str = "themis/machine", num_cpus: float = 0, poll_interval_s: float = 0.2,
                 init_options: Mapping[str, Any] | None = None, check_resources: bool = True) -> None:
        import ray

        self._ray = ray
        self.pattern = resource_pattern(resource_name)
        self.resource_name = resource_name
        self.machine_label = machine_label
        self.num_cpus = num_cpus
        self.poll_interval_s = float(poll_interval_s)
        self.check_resources = check_resources
        if not ray.is_initialized():
            options = {"log_to_driver": False, **dict(init_options or {})}
            try:
                ray.init(address=address, **options)
            except Exception as exc:  # noqa: BLE001 - ConnectionError, RuntimeError, ...
                raise LaunchError(f"cannot join the Ray cluster at {address or 'default address'}: {exc}") from exc
        global _SUPERVISOR
        if _SUPERVISOR is None:  # one actor class per process: Ray exports it once
            _SUPERVISOR = ray.remote(_supervisor_class())
        self._supervisor = _SUPERVISOR
        self._runs: dict[str, _Run] = {}

    def gpu_resource(self, machine: str, index: int) -> str:
        return self.resource_name.format(machine=machine, index=index)

    # -- the interface ----------------------------------------------------------------------------

    def launch(self, job: JobCommand, machine: str, gpu_indices: Sequence[int], checkpoint: Path,
               env: Mapping[str, str], *, more: Sequence[tuple[str, Sequence[int]]] = ()) -> Handle:
        if job.fds:
            raise LaunchError("a Ray job cannot inherit file descriptors: report by 'file' or 'mqtt'")
        if more:
            raise LaunchError(f"job {job.job_id}: the ray executor runs a job on one machine only, not on "
                              f"{[machine, *(m for m, _ in more)]}")
        indices = check_indices(gpu_indices, f"job {job.job_id} on {machine}")
        names = [self.gpu_resource(machine, i) for i in indices]
        if self.check_resources:
            try:
                known = self._ray.cluster_resources()
            except Exception as exc:  # noqa: BLE001
                raise LaunchError(f"job {job.job_id}: cannot read the Ray cluster's resources: {exc}") from exc
            unknown = [n for n in names if n not in known]
            if unknown:
                raise LaunchError(f"job {job.job_id}: no Ray node declares the resources {unknown} (machine "
                                  f"{machine!r}, GPUs {list(indices)}); start the node with "
                                  f"--resources='{{\"{names[0]}\": 1, ...}}'")
        job.log_path.parent.mkdir(parents=True, exist_ok=True)
        job_env = strip_engine_env(env)
        job_env["THEMIS_CHECKPOINT"] = str(checkpoint)
        job_env.pop(NODE_ENV, None)
        ref = f"{job.job_id}.{job.attempt}.{uuid.uuid4().hex[:8]}"
        try:
            actor = self._supervisor.options(
                num_cpus=self.num_cpus, num_gpus=0, resources={n: 1 for n in names}, max_restarts=0,
                name=f"themis:{job.app}:{ref}", namespace="themis",
            ).remote(machine, list(indices), names, self.machine_label, self.pattern)
            ready = actor.where.remote()
        except Exception as exc:  # noqa: BLE001
            raise LaunchError(f"job {job.job_id}: Ray refused the supervisor: {exc}") from exc
        handle = Handle(self.name, ref, job.job_id, machine, indices)
        run = _Run(_Tracked(handle), actor, job, job_env, ready_ref=ready)
        run.status = Status(handle, "pending", detail="waiting for GPUs")
        self._runs[ref] = run
        log.info("launched %s/%s as Ray supervisor %s on %s %s", job.app, job.job_id, ref, machine, names)
        return handle

    def stop(self, handle: Handle, grace: float) -> None:
        run = self._runs.get(handle.ref)
        if run is None or run.phase == "exited":
            return
        if run.phase == "placing":
            self._end(run, -15, "cancelled before start")
            return
        deadline = time.monotonic() + max(0.0, grace)
        tracked = run.tracked
        if not tracked.signalled:
            tracked.signalled = True
            run.actor.terminate.remote(float(grace))  # queued after start(): ordered per actor
        if tracked.kill_at is None or deadline < tracked.kill_at:
            tracked.kill_at = deadline

    def kill(self, handle: Handle) -> None:
        run = self._runs.get(handle.ref)
        if run is None or run.phase == "exited":
            return
        run.tracked.killed = run.tracked.signalled = True
        if run.phase == "placing":
            self._end(run, -9, "cancelled before start")
        else:
            run.actor.kill.remote()

    def poll(self) -> list[Status]:
        now = time.monotonic()
        out = []
        for run in list(self._runs.values()):
            if run.phase != "exited":
                tracked = run.tracked
                if tracked.kill_at is not None and now >= tracked.kill_at + 1.0 and not tracked.killed:
                    # the supervisor kills on its own clock at kill_at; this is the backstop
                    log.warning("Ray job %s (%s) outlived its grace period: killing it", tracked.handle.ref,
                                tracked.handle.job_id)
                    tracked.killed = True
                    run.actor.kill.remote()
                self._advance(run, now)
            out.append(run.status)
        return out

    def release(self, handle: Handle) -> None:
        run = self._runs.get(handle.ref)
        if run is not None and run.phase == "exited":
            self._free(run)
            del self._runs[handle.ref]

    def close(self) -> None:
        """Kill every job of this executor that has not ended, and its supervisor."""
        ray = self._ray
        live = [run for run in self._runs.values() if run.phase != "exited"]
        waits = []
        for run in live:
            run.tracked.killed = run.tracked.signalled = True
            if run.phase == "placing":
                self._end(run, -9, "killed at exit")
            else:
                waits.append((run, run.actor.kill.remote()))
        for run, ref in waits:
            code, detail = -9, "killed at exit"
            try:
                ray.get(ref, timeout=5)
                if run.start_ref is not None:
                    ray.get(run.start_ref, timeout=5)
                for _ in range(50):
                    state, rc, _killed = ray.get(run.actor.status.remote(), timeout=5)
                    if state != "running":
                        code = rc if rc is not None else code
                        break
                    time.sleep(0.05)
            except Exception as exc:  # noqa: BLE001 - the supervisor is gone already
                detail = f"killed at exit ({type(exc).__name__})"
            self._end(run, code, detail)

    # -- internals --------------------------------------------------------------------------------

    def _ready(self, ref) -> bool:
        done, _ = self._ray.wait([ref], num_returns=1, timeout=0)
        return bool(done)

    def _get(self, run: _Run, ref) -> tuple[Any, str | None]:
        """(value, None), or (None, why) when the supervisor died."""
        try:
            return self._ray.get(ref, timeout=0), None
        except Exception as exc:  # noqa: BLE001 - RayActorError, ActorDiedError, ...
            return None, f"supervisor died: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

    def _advance(self, run: _Run, now: float) -> None:
        handle = run.tracked.handle
        if run.phase == "placing":
            if not self._ready(run.ready_ref):
                return
            where, err = self._get(run, run.ready_ref)
            if err:
                self._end(run, -1, err)
                return
            run.where = where
            job = run.job
            run.start_ref = run.actor.start.remote(list(job.argv), run.env, job.cwd, str(job.log_path))
            run.phase = "starting"
        if run.phase == "starting":
            if not self._ready(run.start_ref):
                return
            started, err = self._get(run, run.start_ref)
            if err:
                self._end(run, -1, err)
                return
            if "error" in started:
                with open(run.job.log_path, "a") as out:
                    out.write(f"ray executor: {started['error']}\n")
                self._end(run, -1 if started.get("detail") == "misplaced" else 127,
                          f"{started.get('detail', 'error')}: {started['error']}")
                return
            run.phase = "running"
            node = started.get("node") or handle.machine
            tied = ", dies with its supervisor" if started.get("pdeathsig") else ""
            run.status = Status(handle, "running", detail=f"running on {node} (pid {started['pid']}{tied})")
            if run.tracked.killed:  # killed while starting: kill() queued after start(); look soon
                run.last_ask = -1e9
        if run.phase == "running":
            if run.status_ref is not None:
                if not self._ready(run.status_ref):
                    return
                answer, err = self._get(run, run.status_ref)
                run.status_ref = None
                if err:
                    self._end(run, -1, err)
                    return
                state, code, killed = answer
                if state == "exited":
                    run.tracked.killed = run.tracked.killed or bool(killed)
                    self._end(run, int(code), "exited")
                    return
            if now - run.last_ask >= self.poll_interval_s:
                run.last_ask = now
                run.status_ref = run.actor.status.remote()

    def _end(self, run: _Run, code: int, detail: str) -> None:
        run.phase = "exited"
        run.status = Status(run.tracked.handle, "exited", code, run.tracked.killed, detail)
        self._free(run)

    def _free(self, run: _Run) -> None:
        """Kill the supervisor (its job has ended or never started), which gives its GPUs back to Ray."""
        if not run.freed:
            run.freed = True
            try:
                self._ray.kill(run.actor, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - already dead
                log.debug("ray.kill(%s): %s", run.tracked.handle.ref, exc)
