"""The executors' shared behaviour (``tests/test_executors.py``), run against the ``ray`` backend.

Not collected by a plain ``pytest`` run (the name does not match ``test_*.py``): Ray binds to the
machine's network address whatever it is told, so these tests run only inside a network namespace
whose one interface is ``lo``. ``tests/test_ray_in_netns.py`` makes such a namespace and runs this
file there (``THEMIS_IN_NETNS=1``); this module refuses to run anywhere else.

The Ray cluster is real: ``ray.cluster_utils.Cluster`` with three nodes n1..n3, each declaring four
per-GPU resources (``n2_gpu0`` ... ``n2_gpu3``) and the label ``themis/machine=n2``, like an operator's
``ray start``. The job script reads its node from ``THEMIS_NODE``, which the supervisor actor sets
from the Ray node it really runs on, so ``start["node"]`` is the engine's word, not the placement's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest

if os.environ.get("THEMIS_IN_NETNS") != "1":
    raise RuntimeError("tests/ray_shared_tests.py runs only in a loopback-only network namespace: "
                       "run tests/test_ray_in_netns.py (as root), which makes one and runs this file in it")

from agent.executors.base import JobCommand, LaunchError  # noqa: E402
from agent.executors.ray import NODE_ENV, RayExecutor  # noqa: E402
from agent.launcher import Launcher  # noqa: E402
from tests import test_executors as shared  # noqa: E402
from tests.test_executors import (  # noqa: E402, F401 - collected here, with this module's `backend`
    NODES,
    PY,
    ROOT,
    test_a_crashing_job_is_reported_and_its_gpus_return,
    test_a_drained_machine_gets_no_new_jobs_and_no_gpu_is_ever_shared,
    test_a_grant_lands_on_its_machine_and_exactly_its_gpu_indices,
    test_a_job_stopped_while_it_waits_for_its_gpus_never_starts,
    test_a_job_that_ignores_its_stop_is_killed_after_the_grace_period,
    test_a_lease_loss_stops_the_job_and_the_next_grant_resumes_it_elsewhere,
    test_a_second_job_on_a_busy_gpu_waits_until_the_first_is_gone,
    test_a_stopped_job_checkpoints_and_resumes_on_another_machine,
)

GPUS_PER_NODE = 4
TIMINGS = os.environ.get("THEMIS_RAY_TIMINGS")


def record(key: str, value) -> None:
    """Add a measurement to the JSON file the outer test reads (``THEMIS_RAY_TIMINGS``)."""
    if not TIMINGS:
        return
    path = Path(TIMINGS)
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = value
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


def only_loopback() -> list[str]:
    return sorted(name for _, name in socket.if_nameindex())


@pytest.fixture(scope="module")
def ray_cluster():
    assert only_loopback() == ["lo"], f"not in a loopback-only network namespace: {only_loopback()}"
    import ray
    from ray.cluster_utils import Cluster

    temp = tempfile.mkdtemp(prefix="thr", dir="/tmp")  # short: Ray puts Unix sockets under it
    (Path(temp) / "ray").mkdir()
    before = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp  # all of Ray's files (sessions, ray_current_cluster) in here, not /tmp/ray
    began = time.monotonic()
    cluster = Cluster()
    try:
        for node in NODES:
            cluster.add_node(num_cpus=1, resources={f"{node}_gpu{i}": 1 for i in range(GPUS_PER_NODE)},
                             labels={"themis/machine": node}, object_store_memory=80 * 1024 * 1024,
                             include_dashboard=False)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        record("cluster_start_s", round(time.monotonic() - began, 2))
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if before is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = before
        shutil.rmtree(temp, ignore_errors=True)


class RayBackend(shared.Backend):
    """The shared tests' backend, on the Ray cluster; the job script takes its node from the
    supervisor (``THEMIS_NODE``), strictly: a job that is not told where it runs fails."""

    def __init__(self, tmp_path: Path, cluster):
        super().__init__("ray", tmp_path)
        self.cluster = cluster
        strict = f'node = os.environ.get("SLURMD_NODENAME") or os.environ["{NODE_ENV}"]'
        script, count = re.subn(r"(?m)^node = .*$", strict, shared.JOB)
        assert count == 1, "the shared job script no longer has one `node = ...` line"
        self.script.write_text(script)

    def executor(self):
        return RayExecutor(self.cluster.address, poll_interval_s=0.1)

    @property
    def report(self) -> str:
        return "file"


@pytest.fixture
def backend(tmp_path, ray_cluster):
    return RayBackend(tmp_path, ray_cluster)


# ------------------------------------------------------------------------------------- ray specifics


def job_command(tmp_path: Path, name: str, *argv: str) -> JobCommand:
    return JobCommand("a", name, tuple(argv), tmp_path / name / "log.txt")


def wait_state(executor: RayExecutor, handle, state: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        polled = {s.handle.ref: s for s in executor.poll()}
        status = polled.get(handle.ref)
        if status is not None and status.state == state:
            return status
        time.sleep(0.01)
    raise TimeoutError(f"{handle.ref} not {state} after {timeout} s: {executor.poll()}")


def test_the_supervisor_pins_indices_names_its_node_and_measures_latencies(ray_cluster, tmp_path):
    executor = RayExecutor(ray_cluster.address, poll_interval_s=0.05)
    out = tmp_path / "env.json"
    code = ("import json, os, signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
            f"json.dump({{k: os.environ.get(k) for k in ('CUDA_VISIBLE_DEVICES', '{NODE_ENV}', 'THEMIS_CHECKPOINT', "
            f"'X')}}, open({str(out)!r}, 'w'))\n"
            "time.sleep(60)\n")
    launches, stops = [], []
    try:
        for k, (machine, indices) in enumerate((("n3", (2, 0)), ("n1", (1,)), ("n2", (3,)))):
            began = time.monotonic()
            handle = executor.launch(job_command(tmp_path, f"j{k}", PY, "-c", code), machine, indices,
                                     tmp_path / "ckpt", {"X": "y", "CUDA_VISIBLE_DEVICES": "7", "SLURM_JOB_ID": "1"})
            wait_state(executor, handle, "running")
            launches.append(time.monotonic() - began)
            deadline = time.monotonic() + 30
            while not out.exists() or not out.read_text():
                assert time.monotonic() < deadline
                time.sleep(0.02)
            time.sleep(0.1)
            seen = json.loads(out.read_text())
            out.unlink()
            assert seen == {"CUDA_VISIBLE_DEVICES": ",".join(map(str, indices)), NODE_ENV: machine,
                            "THEMIS_CHECKPOINT": str(tmp_path / "ckpt"), "X": "y"}
            began = time.monotonic()
            executor.stop(handle, grace=10)
            ended = wait_state(executor, handle, "exited")
            stops.append(time.monotonic() - began)
            assert ended.returncode == 0 and not ended.killed
            executor.release(handle)
            assert not executor.poll()
        record("launch_to_running_s", [round(x, 3) for x in launches])
        record("stop_to_exited_s", [round(x, 3) for x in stops])
    finally:
        executor.close()


def test_a_second_job_waits_for_the_first_supervisor_and_the_engine_refuses_what_it_cannot_do(ray_cluster,
                                                                                             tmp_path):
    executor = RayExecutor(ray_cluster.address, poll_interval_s=0.05)
    try:
        first = executor.launch(job_command(tmp_path, "first", PY, "-c", "import time; time.sleep(1.5)"), "n2", [0, 1],
                                tmp_path / "c1", {})
        wait_state(executor, first, "running")
        second = executor.launch(job_command(tmp_path, "second", PY, "-c", "pass"), "n2", [1], tmp_path / "c2", {})
        time.sleep(0.5)
        assert {s.handle.ref: s.state for s in executor.poll()}[second.ref] == "pending"
        assert wait_state(executor, first, "exited").returncode == 0
        assert wait_state(executor, second, "exited").returncode == 0  # started once the first was gone
        missing = executor.launch(job_command(tmp_path, "missing", "/no/such/program"), "n1", [0], tmp_path / "c3", {})
        ended = wait_state(executor, missing, "exited")
        assert ended.returncode == 127 and "cannot start" in ended.detail
        assert "cannot start" in (tmp_path / "missing" / "log.txt").read_text()
        with pytest.raises(LaunchError, match="no Ray node declares"):
            executor.launch(job_command(tmp_path, "nine", PY), "n9", [0], tmp_path / "c4", {})
        with pytest.raises(LaunchError, match="one machine only"):
            executor.launch(job_command(tmp_path, "span", PY), "n1", [0], tmp_path / "c5", {}, more=[("n2", (0,))])
        with pytest.raises(LaunchError, match="file descriptors"):
            executor.launch(JobCommand("a", "fd", (PY,), tmp_path / "fd.log", fds=(("THEMIS_METRICS_FD", 0),)), "n1",
                            [0], tmp_path / "c6", {})
        with pytest.raises(ValueError, match="inherit a pipe"):
            Launcher("a", [PY], tmp_path, report="pipe", executor=executor)
    finally:
        executor.close()


def test_close_kills_running_and_waiting_jobs_and_frees_their_gpus(ray_cluster, tmp_path):
    executor = RayExecutor(ray_cluster.address, poll_interval_s=0.05)
    running = executor.launch(job_command(tmp_path, "r", PY, "-c", "import time; time.sleep(60)"), "n1", [3],
                              tmp_path / "c", {})
    wait_state(executor, running, "running")
    waiting = executor.launch(job_command(tmp_path, "w", PY, "-c", "pass"), "n1", [3], tmp_path / "c", {})
    executor.close()
    states = {s.handle.ref: s for s in executor.poll()}
    assert states[running.ref].exited and states[running.ref].killed and states[running.ref].returncode == -9
    assert states[waiting.ref].exited and states[waiting.ref].detail == "killed at exit"
    again = RayExecutor(ray_cluster.address, poll_interval_s=0.05)
    try:
        handle = again.launch(job_command(tmp_path, "again", PY, "-c", "pass"), "n1", [3], tmp_path / "c", {})
        assert wait_state(again, handle, "exited").returncode == 0
    finally:
        again.close()


def test_a_supervisor_that_dies_takes_its_job_with_it_and_is_reported(ray_cluster, tmp_path):
    import ray

    def pid_alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    executor = RayExecutor(ray_cluster.address, poll_interval_s=0.05, machine_label="")  # node from resource names
    pidfile = tmp_path / "pid"
    code = (f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()) + ' ' + os.environ['{NODE_ENV}'])\n"
            "time.sleep(60)\n")
    try:
        handle = executor.launch(job_command(tmp_path, "doomed", PY, "-c", code), "n3", [3], tmp_path / "c", {})
        running = wait_state(executor, handle, "running")
        assert running.detail.startswith("running on n3") and "dies with its supervisor" in running.detail
        deadline = time.monotonic() + 30
        while not pidfile.exists() or " " not in pidfile.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        pid, node = pidfile.read_text().split()
        assert node == "n3" and pid_alive(int(pid))
        ray.kill(executor._runs[handle.ref].actor, no_restart=True)  # as if its node or worker failed
        ended = wait_state(executor, handle, "exited")
        assert ended.returncode == -1 and ended.detail.startswith("supervisor died")
        deadline = time.monotonic() + 10
        while pid_alive(int(pid)):  # Ray kills a dead worker's children; PR_SET_PDEATHSIG besides
            assert time.monotonic() < deadline, "the job outlived its supervisor"
            time.sleep(0.05)
    finally:
        executor.close()


# -- simulation sweeps as Ray tasks (issue 33: `themis-sim ... --ray ADDRESS`) ----------------------


def test_a_sweep_runs_as_ray_tasks_keeps_its_runs_like_a_local_one_and_resumes_either_way(ray_cluster, tmp_path):
    """Every (policy, seed) run a Ray task; the runs land in OUT/runs and equal the local runs field
    for field (wall time aside); a local sweep into the same folder takes them all, and a Ray sweep
    with more seeds simulates only the new ones."""
    from simulator.cli import main

    ray_out, local_out = tmp_path / "ray", tmp_path / "local"
    args = ["compare", "--workload", "small", "--policies", "themis,fifo", "--seeds", "2"]
    assert main([*args, "--ray", ray_cluster.address, "--out", str(ray_out)]) == 0
    assert main([*args, "--workers", "1", "--out", str(local_out)]) == 0

    def kept(folder):
        out = {}
        for path in (folder / "runs").glob("*.json"):
            s = json.loads(path.read_text())["summary"]
            s.pop("wall_seconds")
            for app in s["apps"]:
                app.pop("wall_seconds", None)
            out[(s["policy"], s["seed"])] = s
        return out

    on_ray, here = kept(ray_out), kept(local_out)
    assert sorted(on_ray) == sorted(here) == [("fifo", 0), ("fifo", 1), ("themis", 0), ("themis", 1)]
    assert on_ray == here
    before = {p.name: p.stat().st_mtime_ns for p in (ray_out / "runs").glob("*.json")}
    assert main([*args, "--seeds", "3", "--ray", ray_cluster.address, "--out", str(ray_out)]) == 0
    after = {p.name: p.stat().st_mtime_ns for p in (ray_out / "runs").glob("*.json")}
    assert len(after) == 6 and all(after[name] == at for name, at in before.items())  # only seed 2 ran


def test_a_run_that_fails_on_ray_is_tried_once_more_then_named(ray_cluster, tmp_path, capsys):
    from simulator.cli import main

    attempts = tmp_path / "attempts"
    plugin = tmp_path / "explodes.py"
    plugin.write_text(
        "from arbiter.policies import register_policy\n"
        "from arbiter.policies.fifo import FifoPolicy\n"
        "@register_policy\n"
        "class Explodes(FifoPolicy):\n"
        "    name = 'explodes'\n"
        "    def allocate(self, ctx, bids):\n"
        f"        open({str(attempts)!r}, 'a').write('x')\n"
        "        raise RuntimeError('the policy exploded')\n")
    code = main(["compare", "--plugin", str(plugin), "--workload", "small", "--policies", "explodes", "--seeds", "1",
                 "--ray", ray_cluster.address, "--out", str(tmp_path / "out")])
    said = capsys.readouterr()
    err = said.out + said.err
    assert code == 1 and "failed twice on Ray" in err and "policy=explodes" in err and "seed=0" in err
    assert "the policy exploded" in err
    assert attempts.read_text() == "xx"  # once, and its retry


def test_a_sweep_goes_on_when_a_ray_worker_is_killed_under_it(ray_cluster, tmp_path):
    """A worker process running a run is SIGKILLed mid-sweep (as a node or a worker dies): Ray runs
    the task again elsewhere and the sweep ends with every run, equal to the local sweep's."""
    import signal
    import threading

    from simulator.cli import main

    args = ["compare", "--workload", "contended", "--cluster", "testbed-64", "--policies", "themis", "--seeds", "2"]
    result = {}
    sweep = threading.Thread(target=lambda: result.setdefault("code", main(
        [*args, "--ray", ray_cluster.address, "--out", str(tmp_path / "ray")])))
    sweep.start()
    killed = None
    deadline = time.monotonic() + 120
    while killed is None and sweep.is_alive():
        assert time.monotonic() < deadline, "no Ray worker ran a simulation"
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if title.startswith("ray::simulate_quietly"):
                os.kill(int(pid), signal.SIGKILL)
                killed = int(pid)
                break
        time.sleep(0.2)
    sweep.join(600)
    assert killed is not None and result.get("code") == 0
    assert main([*args, "--workers", "1", "--out", str(tmp_path / "local")]) == 0
    runs = [sorted(json.loads(p.read_text())["summary"]["max_rho"] for p in (tmp_path / d / "runs").glob("*.json"))
            for d in ("ray", "local")]
    assert runs[0] == runs[1] and len(runs[0]) == 2
