"""The executors' shared behaviour (issue 6), run against every backend: ``local`` (subprocesses,
with GPU locks) and ``slurm`` (a real Slurm on this host: slurmctld, three slurmd's with four fake
GPUs each, started by ``tests/slurm_kit.py``).

The test job takes an exclusive ``flock`` on ``<ledger>/<node>-g<index>`` for every GPU it sees
(``CUDA_VISIBLE_DEVICES``; the node from ``SLURMD_NODENAME`` where the engine says it), so two jobs
on one GPU at the same moment cannot go unnoticed: the second one records ``double-booked`` and
exits 99. Every start is recorded in ``<ledger>/starts.jsonl`` with the node and indices the job
really got. The arbiter is the real one on loopback (``tests/service_kit.py``), with machines named
like the Slurm nodes.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agent.agent import Agent
from agent.client import AgentClient
from agent.executors import LocalExecutor, SlurmExecutor, make_executor
from agent.executors.slurm import exit_code, gres_request
from agent.launcher import Launcher
from agent.runner import AppRunner
from agent.trial import TrialSpec
from arbiter.cluster import cluster_from_mapping, load_cluster
from arbiter.slurm_nodes import cluster_toml, parse_nodes
from hyperparam_adapters.hyperband import BracketTuner, Rung, SuccessiveHalvingAdapter
from protos import themis_pb2 as pb
from tests.service_kit import admin_stub, arbiter, credential, target, wait_for
from tests.slurm_kit import local_slurm

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
NODES = ("n1", "n2", "n3")

JOB = textwrap.dedent("""
    import fcntl, json, os, sys, time
    from agent.job import Job
    job = Job.from_env()
    ledger = os.environ["LEDGER"]
    node = os.environ.get("SLURMD_NODENAME") or os.environ.get("THEMIS_NODE") or job.placement[0][1]
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    locks = []
    for i in cvd.split(","):
        f = open(os.path.join(ledger, f"{node}-g{i}"), "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            with open(os.path.join(ledger, "double-booked"), "a") as out:
                out.write(f"{job.job_id} {node} {i}\\n")
            sys.exit(99)
        locks.append(f)
    state = job.resume() or {"it": 0}
    with open(os.path.join(ledger, "starts.jsonl"), "a") as out:
        out.write(json.dumps({"job": job.job_id, "node": node, "cvd": cvd, "from": state["it"],
                              "slurm_job": os.environ.get("SLURM_JOB_ID")}) + "\\n")
    it = state["it"]
    crash_at = int(job.params.get("crash_at", 0))
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 10**9
    while it < limit:
        time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 0.05)
        it += 1
        if it == crash_at:
            sys.exit(3)
        if job.step(it, 1.0 / it):
            break
    job.save({"it": it})
""")

CLUSTER_TOML = """
name = "exec-6"
[[racks]]
name = "r0"
machines = [{ gpus = 2, slots = 2, names = ["n1", "n2", "n3"] }]
"""


# ------------------------------------------------------------------------------------------- backends


@pytest.fixture(scope="module")
def slurm():
    with local_slurm(nodes=3, gpus_per_node=4) as cluster:
        yield cluster


class Backend:
    """One executor under test, with what its tests need to know about it."""

    def __init__(self, name: str, tmp_path: Path, slurm=None):
        self.name, self.tmp_path, self.slurm = name, tmp_path, slurm
        self.ledger = tmp_path / "ledger"
        self.ledger.mkdir()
        self.script = tmp_path / "job.py"
        self.script.write_text(JOB)

    def executor(self):
        if self.name == "local":
            return LocalExecutor(lock_dir=self.tmp_path / "gpu-locks")
        return SlurmExecutor(slurm_env=self.slurm.env, poll_interval_s=0.2)

    @property
    def report(self) -> str:
        return "pipe" if self.name == "local" else "file"

    def env(self) -> dict[str, str]:
        return {"PYTHONPATH": str(ROOT), "LEDGER": str(self.ledger), "OMP_NUM_THREADS": "1"}

    def launcher(self, app: str, *args: str, grace_s: float = 5.0) -> Launcher:
        return Launcher(app, [PY, str(self.script), *args], self.tmp_path / app, cluster="exec-6", grace_s=grace_s,
                        report=self.report, env=self.env(), executor=self.executor())

    def starts(self) -> list[dict]:
        path = self.ledger / "starts.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def double_booked(self) -> str:
        path = self.ledger / "double-booked"
        return path.read_text() if path.exists() else ""


@pytest.fixture(params=["local", "slurm"])
def backend(request, tmp_path):
    return Backend(request.param, tmp_path, request.getfixturevalue("slurm") if request.param == "slurm" else None)


def place(*gpus: str):
    return [("r0", g.rsplit("-g", 1)[0], g) for g in gpus]


def trial(job: str, **params) -> TrialSpec:
    return TrialSpec(job, params)


async def settle(launcher: Launcher, job: str, timeout: float = 30.0):
    return await launcher.wait(job, timeout=timeout)


# ------------------------------------------------------------------------------------ launcher level


def test_a_grant_lands_on_its_machine_and_exactly_its_gpu_indices(backend):
    async def scenario():
        launcher = backend.launcher("a", "3", "0.02")
        run = launcher.start(trial("t1"), ["n2-g1", "n2-g3"], place("n2-g1", "n2-g3"))
        assert run.handle.machine == "n2" and run.handle.gpu_indices == (1, 3)
        polled = await settle(launcher, "t1")
        (ended,) = polled.exited
        assert ended.clean and ended.reports == 3, launcher.log_path("t1").read_text()
        (start,) = backend.starts()
        assert start["cvd"] == "1,3"
        assert start["node"] == "n2"
        if backend.name == "slurm":
            assert start["slurm_job"] == run.handle.ref and ended.detail == "COMPLETED"

    asyncio.run(scenario())


def test_a_lease_listing_its_gpus_out_of_order_runs_on_them(backend):
    """Engines list indices in ascending order whatever the lease's order; the job's check of its
    GPUs against the lease (THEMIS_CUDA_DEVICES) must not mistake that for other GPUs."""
    async def scenario():
        launcher = backend.launcher("a", "2", "0.02")
        gpus = ["n2-g1", "n2-g0"] if backend.name == "local" else ["n2-g3", "n2-g1"]
        launcher.start(trial("t1"), gpus, place(*gpus))
        (ended,) = (await settle(launcher, "t1")).exited
        assert ended.clean and ended.reports == 2, launcher.log_path("t1").read_text()
        (start,) = backend.starts()
        assert start["cvd"] == ("0,1" if backend.name == "local" else "1,3")

    asyncio.run(scenario())


def test_a_second_job_on_a_busy_gpu_waits_until_the_first_is_gone(backend):
    """Two apps' launchers, one GPU: the engine (or the local GPU lock) holds the second job back
    while the first one is still checkpointing after its stop, so they never share the GPU."""
    async def scenario():
        first, second = backend.launcher("a", "1000", "0.05"), backend.launcher("b", "3", "0.02")
        first.start(trial("slow"), ["n1-g0"], place("n1-g0"))
        await wait_for(lambda: first.poll().metrics, 30)  # running and reporting
        first.stop("slow", grace=10)
        second.start(trial("next"), ["n1-g0"], place("n1-g0"))
        await asyncio.gather(settle(first, "slow"), settle(second, "next"))
        assert not backend.double_booked()
        (slow,), (nxt,) = first.history, second.history
        assert slow.clean and nxt.clean and nxt.reports == 3
        assert [s["job"] for s in backend.starts()] == ["slow", "next"]

    asyncio.run(scenario())


def test_a_job_stopped_while_it_waits_for_its_gpus_never_starts(backend):
    async def scenario():
        first, second = backend.launcher("a", "1000", "0.05"), backend.launcher("b", "3", "0.02")
        first.start(trial("holder"), ["n3-g3" if backend.name == "slurm" else "n3-g1"],
                    place("n3-g3" if backend.name == "slurm" else "n3-g1"))
        await wait_for(lambda: first.poll().metrics, 30)
        run = second.start(trial("queued"), list(first.gpus_in_use()), place(*first.gpus_in_use()))
        await asyncio.sleep(1.0)
        second.poll()
        assert run.state == "pending"
        began = time.monotonic()
        second.stop("queued", grace=10)
        (ended,) = (await settle(second, "queued", timeout=15)).exited
        assert ended.requested and ended.reports == 0 and time.monotonic() - began < 10
        await first.shutdown(5)
        assert [s["job"] for s in backend.starts()] == ["holder"]

    asyncio.run(scenario())


def test_a_crashing_job_is_reported_and_its_gpus_return(backend):
    async def scenario():
        launcher = backend.launcher("a", "50", "0.02")
        launcher.start(trial("bad", crash_at=2), ["n3-g0", "n3-g1"], place("n3-g0", "n3-g1"))
        (ended,) = (await settle(launcher, "bad")).exited
        assert ended.returncode == 3 and not ended.clean and not ended.requested
        if backend.name == "slurm":
            assert ended.detail == "FAILED"
        assert not launcher.gpus_in_use()
        launcher.start(trial("good"), ["n3-g0", "n3-g1"], place("n3-g0", "n3-g1"))  # the same GPUs, free again
        (again,) = (await settle(launcher, "good")).exited
        assert again.clean and again.reports == 50
        assert [s["cvd"] for s in backend.starts()] == ["0,1", "0,1"]

    asyncio.run(scenario())


def test_a_stopped_job_checkpoints_and_resumes_on_another_machine(backend):
    async def scenario():
        launcher = backend.launcher("a", "1000", "0.05")
        launcher.start(trial("t1"), ["n1-g1"], place("n1-g1"))
        await wait_for(lambda: launcher.poll().metrics, 30)
        launcher.stop("t1", grace=10, reason="GPUs lost")
        (lost,) = (await settle(launcher, "t1")).exited
        assert lost.clean and lost.requested and not lost.killed and lost.last_iteration >= 1
        launcher.start(trial("t1"), ["n2-g0"], place("n2-g0"))
        await wait_for(lambda: launcher.poll().metrics, 30)
        launcher.stop("t1", grace=10)
        (resumed,) = (await settle(launcher, "t1")).exited
        assert resumed.resumed and resumed.first_iteration == lost.last_iteration + 1
        assert [(s["node"], s["from"]) for s in backend.starts()] == [("n1", 0), ("n2", lost.last_iteration)]

    asyncio.run(scenario())


def test_a_job_that_ignores_its_stop_is_killed_after_the_grace_period(backend):
    backend.script.write_text("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(120)\n")

    async def scenario():
        launcher = backend.launcher("a")
        launcher.start(trial("stubborn"), ["n2-g2" if backend.name == "slurm" else "n2-g1"],
                       place("n2-g2" if backend.name == "slurm" else "n2-g1"))
        await wait_for(lambda: launcher.poll() is not None and launcher.run_of("stubborn").state == "running", 30)
        await asyncio.sleep(0.5)
        began = time.monotonic()
        launcher.stop("stubborn", grace=1.0)
        (ended,) = (await settle(launcher, "stubborn")).exited
        assert ended.killed and ended.requested and ended.returncode == -9  # SIGKILL, really
        assert time.monotonic() - began >= 1.0

    asyncio.run(scenario())


# ------------------------------------------------------------------------ with a real arbiter and agents


def runner_for(backend: Backend, server, name: str, adapter, *args: str, grace_s: float = 5.0):
    async def make():
        client = AgentClient(Agent(adapter), name, target(server), await credential(server, name), backoff_s=(0.05, 0.5))
        return AppRunner(adapter, client, backend.launcher(name, *args, grace_s=grace_s))

    return make()


def cluster_path(tmp_path: Path) -> str:
    path = tmp_path / "exec-6.toml"
    path.write_text(CLUSTER_TOML)
    return str(path)


def test_a_lease_loss_stops_the_job_and_the_next_grant_resumes_it_elsewhere(backend, tmp_path):
    async def scenario():
        async with arbiter(tmp_path, cluster=cluster_path(tmp_path), lease_s=2.0) as server:
            adapter = BracketTuner({"lr": [0.1]}, [[Rung(1, 60)]], iter_time=0.05)
            runner = await runner_for(backend, server, "solo", adapter, "1000", "0.05")
            task = asyncio.create_task(runner.run(timeout=60))
            await wait_for(lambda: runner.reports, 30)
            machine = runner.launcher.run_of("t0").placement[0][1]
            stub, meta, ch = admin_stub(server)
            await stub.DrainMachine(pb.DrainMachineRequest(machine=machine), metadata=meta)
            await task
            await ch.close()
            lost, resumed = runner.launcher.history
            assert lost.reason == "GPUs lost" and lost.clean and not lost.killed
            assert resumed.resumed and resumed.first_iteration == lost.last_iteration + 1 and resumed.clean
            first, second = backend.starts()
            assert first["node"] == machine and second["node"] != machine  # the engine's word, not ours
            assert second["from"] == lost.last_iteration

    asyncio.run(asyncio.wait_for(scenario(), 90))


def test_a_drained_machine_gets_no_new_jobs_and_no_gpu_is_ever_shared(backend, tmp_path):
    """Two searches on 4 GPUs of n2 and n3 (n1 drained first) with 2 s leases: leases rotate, jobs
    stop, move and resume, and the engine's record shows nothing on n1 and no GPU held twice."""
    async def scenario():
        async with arbiter(tmp_path, cluster=cluster_path(tmp_path), lease_s=2.0) as server:
            stub, meta, ch = admin_stub(server)
            await stub.DrainMachine(pb.DrainMachineRequest(machine="n1"), metadata=meta)
            await ch.close()
            runners = []
            for name, seed in (("hb", 1), ("sh", 2)):
                adapter = SuccessiveHalvingAdapter({"lr": [0.1, 0.2, 0.3, 0.4]}, n=4, eta=2, min_resource=4,
                                                   iter_time=0.05, seed=seed)
                runners.append(await runner_for(backend, server, name, adapter, "1000", "0.05"))
            # bounds, not measures: a busy CI machine once took the Ray backend past 120 s
            await asyncio.gather(*(r.run(timeout=240) for r in runners))
            assert all(r.finished and not r.failed for r in runners)
            starts = backend.starts()
            assert starts and {s["node"] for s in starts} <= {"n2", "n3"}
            assert not backend.double_booked()
            assert all(e.returncode != 99 for r in runners for e in r.launcher.history)
            assert sum(e.resumed for r in runners for e in r.launcher.history) >= 2  # halving survivors resumed

    asyncio.run(asyncio.wait_for(scenario(), 300))


# ------------------------------------------------------------------------------------- slurm specifics


def test_gres_requests_pin_each_index_and_exit_codes_read_like_processes():
    assert gres_request([1, 3]) == "gpu:g1:1,gpu:g3:1"
    assert gres_request([0], "gpu{index}") == "gpu:gpu0:1"
    assert exit_code("0:0", "COMPLETED") == 0
    assert exit_code("3:0", "FAILED") == 3
    assert exit_code("0:9", "FAILED") == -9
    assert exit_code("0:0", "CANCELLED") == -15
    assert exit_code("0:15", "CANCELLED") == -15
    assert exit_code("0:0", "NODE_FAIL") == -1
    for state in ("TIMEOUT", "PREEMPTED", "DEADLINE", "BOOT_FAIL", "SPECIAL_EXIT"):
        assert exit_code("0:0", state) == -1, state  # the engine ended it: never a clean exit
    assert exit_code("0:125", "OUT_OF_MEMORY") == -1  # 125 is not a signal
    assert exit_code("", "vanished") == -1


def test_the_cluster_file_comes_from_scontrol_and_names_machines_like_the_nodes(slurm, tmp_path):
    text = slurm.run("scontrol", "--oneliner", "show", "nodes").stdout
    nodes = parse_nodes(text)
    assert [n.name for n in nodes] == list(NODES) and all(n.gpu_indices == (0, 1, 2, 3) for n in nodes)
    path = tmp_path / "c.toml"
    path.write_text(cluster_toml(nodes, "local-slurm"))
    cluster = load_cluster(path)
    assert sorted(cluster.machines) == list(NODES) and cluster.size == 12
    assert cluster.machines["n2"] == ("n2-g0", "n2-g1", "n2-g2", "n2-g3")


def test_nodes_without_per_index_gpu_types_are_left_out_with_the_reason():
    text = ("NodeName=a1 Arch=x86_64 Gres=gpu:g0:1(S:0),gpu:g1:1(S:0) State=IDLE\n"
            "NodeName=b1 Gres=gpu:a100:4(S:0-1) State=IDLE\n"
            "NodeName=c1 Gres=(null) State=DRAIN\n")
    nodes = parse_nodes(text)
    assert [(n.name, n.gpu_indices, bool(n.problem)) for n in nodes] == [
        ("a1", (0, 1), False), ("b1", (), True), ("c1", (), True)]
    toml = cluster_toml(nodes, "x")
    assert "left out: b1" in toml and "left out: c1" in toml
    import tomllib

    assert list(cluster_from_mapping(tomllib.loads(toml)).machines) == ["a1"]
    with pytest.raises(ValueError, match="one GRES type per index"):
        cluster_toml(nodes[1:], "x")


def test_nodes_slurm_will_not_run_jobs_on_are_the_ones_to_drain():
    from arbiter.slurm_nodes import unavailable

    states = {"a": "IDLE", "b": "MIXED", "c": "IDLE+DRAIN", "d": "DOWN*", "e": "ALLOCATED+DRAIN", "f": "IDLE*",
              "g": "ALLOCATED", "h": "FAIL"}
    text = "".join(f"NodeName={n} Gres=gpu:g0:1 State={st}\n" for n, st in states.items())
    assert unavailable(parse_nodes(text)) == ["c", "d", "e", "f", "h"]


def test_a_job_slurm_will_not_start_on_its_leased_node_is_given_up_at_once(slurm, tmp_path):
    """Pending for a drained node (ReqNodeNotAvail) would hold a lease's GPUs for nothing."""
    backend = Backend("slurm", tmp_path, slurm)

    async def scenario():
        launcher = backend.launcher("a", "3", "0.02")
        slurm.run("scontrol", "update", "nodename=n1", "state=drain", "reason=themis-test")
        try:
            launcher.start(trial("t1"), ["n1-g3"], place("n1-g3"))
            (ended,) = (await settle(launcher, "t1", timeout=20)).exited
        finally:
            slurm.run("scontrol", "update", "nodename=n1", "state=resume")
        assert ended.returncode == -1 and "ReqNodeNotAvail" in ended.detail and not backend.starts()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_stop_slurm_could_not_take_is_tried_again(slurm, tmp_path):
    backend = Backend("slurm", tmp_path, slurm)
    broken = tmp_path / "broken-bin"
    broken.mkdir()
    (broken / "scancel").write_text("#!/bin/sh\necho 'Unable to contact slurm controller' >&2\nexit 1\n")
    (broken / "scancel").chmod(0o755)
    for name in ("squeue", "sbatch", "sacct"):
        (broken / name).symlink_to(f"/usr/bin/{name}")

    async def scenario():
        launcher = backend.launcher("a", "100000", "0.05")
        run = launcher.start(trial("t1"), ["n2-g2"], place("n2-g2"))
        await wait_for(lambda: launcher.poll().metrics and run.state == "running", 30)
        launcher.executor.bin_dir = str(broken)  # scancel fails: the controller "is away"
        launcher.stop("t1", grace=30)
        for _ in range(4):
            await asyncio.sleep(0.3)
            assert not launcher.poll().exited  # the job trains on: nothing took the SIGTERM
        launcher.executor.bin_dir = None
        (ended,) = (await settle(launcher, "t1")).exited
        assert ended.clean and ended.requested and not ended.killed  # SIGTERM taken on a later poll

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_bad_launch_is_refused_with_what_slurm_said(slurm, tmp_path):
    launcher = Launcher("a", [PY, "-c", "pass"], tmp_path / "a", report="file", env={"PYTHONPATH": str(ROOT)},
                        executor=SlurmExecutor(slurm_env=slurm.env))
    with pytest.raises(RuntimeError, match="sbatch.*(node|Node)"):
        launcher.start(trial("t1"), ["n9-g0"], place("n9-g0"))  # no such node
    assert not launcher.live()
    with pytest.raises(ValueError, match="cannot inherit a pipe"):
        Launcher("a", [PY], tmp_path, report="pipe", executor="slurm")
    with pytest.raises(ValueError, match="unknown executor 'nope'"):
        make_executor("nope")


def test_a_job_refuses_to_train_on_gpus_its_lease_does_not_name(tmp_path):
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT), "THEMIS_CUDA_DEVICES": "1,3", "CUDA_VISIBLE_DEVICES": "0,1"}
    done = subprocess.run([PY, "-c", "from agent.job import Job; Job.from_env()"], env=env, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode != 0 and "the lease gives GPU indices '1,3'" in done.stderr


def test_the_operator_writes_the_cluster_file_from_slurm_and_drains_a_node_from_the_command_line(slurm, tmp_path):
    import subprocess

    from tests.service_kit import ADMIN

    saved = tmp_path / "nodes.txt"
    saved.write_text(slurm.run("scontrol", "--oneliner", "show", "nodes").stdout)
    cli = [PY, "-m", "arbiter.cli"]
    made = subprocess.run([*cli, "cluster-from-slurm", "--name", "prod", "--from", str(saved)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    path = tmp_path / "prod.toml"
    path.write_text(made.stdout)
    assert load_cluster(path).machines["n3"] == ("n3-g0", "n3-g1", "n3-g2", "n3-g3")

    async def scenario():
        async with arbiter(tmp_path, cluster=str(path)) as server:
            for machine, code in (("n2", 0), ("n9", 1)):
                proc = await asyncio.create_subprocess_exec(
                    *cli, "drain", machine, "--arbiter", target(server), "--admin-token", ADMIN, cwd=ROOT,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
                out, err = await proc.communicate()
                assert proc.returncode == code, err.decode()
            assert server.service.engine.drained == {"n2"}
            assert "n9" in err.decode()  # the refusal names the unknown machine

            # Slurm drains n3: slurm-sync drains it in the arbiter too
            slurm.run("scontrol", "update", "nodename=n3", "state=drain", "reason=themis-test")
            try:
                proc = await asyncio.create_subprocess_exec(
                    *cli, "slurm-sync", "--arbiter", target(server), "--admin-token", ADMIN, cwd=ROOT,
                    env={**os.environ, **slurm.env}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
                out, err = await proc.communicate()
            finally:
                slurm.run("scontrol", "update", "nodename=n3", "state=resume")
            assert proc.returncode == 0, err.decode()
            assert json.loads(out.decode()) == {"drained_now": ["n3"], "failed": []}
            assert server.service.engine.drained == {"n2", "n3"}
            # cron hears of a sync that did nothing: scontrol output with no node, an unreachable arbiter
            garbage = tmp_path / "garbage.txt"
            garbage.write_text("slurm_load_node error: Unable to contact slurm controller\n")
            down = tmp_path / "down.txt"
            down.write_text("NodeName=n3 Arch=x86_64 State=DRAIN Gres=gpu:g0:1\n")
            for source, arbiter_at in ((garbage, target(server)), (down, "127.0.0.1:9")):
                proc = await asyncio.create_subprocess_exec(
                    *cli, "slurm-sync", "--from", str(source), "--arbiter", arbiter_at, "--admin-token", ADMIN,
                    cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
                out, err = await proc.communicate()
                assert proc.returncode == 1, (source, out.decode(), err.decode())

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_slurm_job_whose_agent_is_gone_checkpoints_and_frees_its_gpus(slurm, tmp_path):
    """An engine's jobs are not the agent's children: they watch its heartbeat file instead, and a
    new agent of the app ends whatever an earlier one left in the queue."""
    backend = Backend("slurm", tmp_path, slurm)

    async def scenario():
        launcher = Launcher("orphan", [PY, str(backend.script), "100000", "0.05"], tmp_path / "orphan",
                            report="file", env=backend.env(), executor=backend.executor(), heartbeat_timeout_s=3)
        launcher.start(trial("t1"), ["n1-g2"], place("n1-g2"))
        await wait_for(lambda: launcher.poll().metrics, 30)
        # the agent "dies": nobody polls, the heartbeat goes stale from its last touch (not from
        # now: a poll a moment ago may have touched it, and the job counts from that)
        last_beat = launcher.heartbeat_path.stat().st_mtime
        ref = launcher.run_of("t1").handle.ref
        await wait_for(lambda: slurm.job_state(int(ref)) in ("COMPLETED", "FAILED", "CANCELLED"), 30, 0.2)
        assert slurm.job_state(int(ref)) == "COMPLETED" and time.time() - last_beat >= 3
        assert (tmp_path / "orphan" / "t1" / "checkpoint.pkl").exists()  # it saved before leaving

        # a leftover that is still running when a new agent of the app starts is cancelled by it
        first = Launcher("orphan", [PY, str(backend.script), "100000", "0.05"], tmp_path / "orphan",
                         report="file", env=backend.env(), executor=backend.executor())
        first.start(trial("t2"), ["n1-g2"], place("n1-g2"))
        await wait_for(lambda: first.poll().metrics, 30)
        left = first.run_of("t2").handle.ref
        second = backend.launcher("orphan")
        assert second.cancel_leftovers() == [left]
        assert backend.launcher("someone-else").cancel_leftovers() == []
        await wait_for(lambda: slurm.job_state(int(left)) in ("COMPLETED", "FAILED", "CANCELLED"), 30, 0.2)
        first.executor.release(first.run_of("t2").handle)

    asyncio.run(asyncio.wait_for(scenario(), 90))


def test_a_controller_hiccup_never_declares_a_running_slurm_job_dead(slurm, tmp_path):
    """squeue failing (controller unreachable) keeps the last known states; a job Slurm no longer
    knows at all is reported ended (-1, vanished) rather than kept forever."""
    backend = Backend("slurm", tmp_path, slurm)
    broken = tmp_path / "broken-bin"
    broken.mkdir()
    for name in ("squeue", "sacct", "scontrol"):
        (broken / name).write_text("#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm controller' >&2\n"
                                   "exit 1\n")
        (broken / name).chmod(0o755)

    async def scenario():
        launcher = backend.launcher("a", "100000", "0.05")
        run = launcher.start(trial("t1"), ["n3-g2"], place("n3-g2"))
        await wait_for(lambda: launcher.poll().metrics and run.state == "running", 30)
        executor = launcher.executor
        executor.bin_dir = str(broken)  # the controller "goes away"
        for _ in range(5):
            await asyncio.sleep(0.25)
            assert not launcher.poll().exited and run.state == "running"
        executor.bin_dir = None
        launcher.stop("t1", grace=10)
        (ended,) = (await settle(launcher, "t1")).exited
        assert ended.clean and ended.detail == "COMPLETED"

        # a job id Slurm never heard of: squeue says "Invalid job id", sacct has no accounting
        ghost = executor.launch(launcher_command(tmp_path), "n3", [0], tmp_path / "ck", backend.env())
        slurm.run("scancel", ghost.ref)
        executor._jobs["999999"] = executor._jobs.pop(ghost.ref)  # tracked under an id Slurm does not know
        executor._states["999999"] = executor._states.pop(ghost.ref)
        executor._last_poll = -1e9
        (status,) = [s for s in executor.poll() if s.handle is ghost]
        assert status.exited and status.returncode == -1 and status.detail == "vanished"

    asyncio.run(asyncio.wait_for(scenario(), 60))


def launcher_command(tmp_path: Path):
    from agent.executors import JobCommand

    return JobCommand("a", "ghost", ("/bin/sleep", "60"), tmp_path / "ghost.log")


def test_local_gpu_locks_outlive_a_dead_agent_until_its_job_is_gone(tmp_path):
    """The job inherits its GPU locks: an agent killed with SIGKILL leaves them held by the job,
    which is still checkpointing (PR_SET_PDEATHSIG gave it SIGTERM), so no other agent starts there."""
    import fcntl
    import signal
    import subprocess

    locks = tmp_path / "locks"
    job = tmp_path / "slow_exit.py"
    job.write_text("import signal, sys, time\nfrom agent.job import Job\njob = Job.from_env()\n"
                   "open(sys.argv[1], 'w').write('up')\n"
                   "while not job.should_stop():\n    time.sleep(0.05)\ntime.sleep(3)  # a long checkpoint\n")
    agent = tmp_path / "the_agent.py"
    agent.write_text(textwrap.dedent(f"""
        import time
        from agent.executors import LocalExecutor
        from agent.launcher import Launcher
        from agent.trial import TrialSpec
        launcher = Launcher("a", [{PY!r}, {str(job)!r}, {str(tmp_path / "up")!r}], {str(tmp_path / "w")!r},
                            executor=LocalExecutor(lock_dir={str(locks)!r}), env={{"PYTHONPATH": {str(ROOT)!r}}})
        launcher.start(TrialSpec("t1", {{}}), ["m0-g0"], [("r0", "m0", "m0-g0")])
        while True:
            launcher.poll()
            time.sleep(0.05)
    """))
    proc = subprocess.Popen([PY, str(agent)], env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "up").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the job did not start"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        lock = open(locks / "m0-g0.lock", "a")
        with pytest.raises(BlockingIOError):  # the job, checkpointing, still holds it
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        deadline = time.monotonic() + 20
        while True:  # and lets go when it is gone
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, "the lock outlived the job"
                time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_an_unusable_lock_folder_is_a_clear_launch_error(tmp_path):
    from agent.executors import LaunchError

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    launcher = Launcher("a", [PY, "-c", "pass"], tmp_path / "w", executor=LocalExecutor(lock_dir=blocker / "locks"))
    with pytest.raises(LaunchError, match="GPU lock folder"):
        launcher.start(trial("t1"), ["m0-g0"], place("m0-g0"))
    assert not launcher.live() and not launcher.poll().exited


def test_an_engine_outage_delays_launches_without_failing_the_trial(slurm, tmp_path):
    backend = Backend("slurm", tmp_path, slurm)
    broken = tmp_path / "broken-bin"
    broken.mkdir()
    (broken / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Unable to contact "
                                   "slurm controller' >&2\nexit 1\n")
    (broken / "sbatch").chmod(0o755)
    for name in ("squeue", "scancel", "sacct"):
        (broken / name).symlink_to(f"/usr/bin/{name}")

    async def scenario():
        async with arbiter(tmp_path, cluster=cluster_path(tmp_path), lease_s=30.0) as server:
            adapter = BracketTuner({"lr": [0.1]}, [[Rung(1, 5)]], iter_time=0.05)
            runner = await runner_for(backend, server, "solo", adapter, "1000", "0.05")
            runner.launcher.executor.bin_dir = str(broken)
            task = asyncio.create_task(runner.run(timeout=60))
            await wait_for(lambda: runner._launch_errors["t0"] >= 3, 30)  # 3 refused launches: > max_failures
            runner.launcher.executor.bin_dir = None
            await task
            assert runner.finished and not runner.failed and not runner.failures
            (ran,) = runner.launcher.history
            assert ran.clean and ran.last_iteration == 5

    asyncio.run(asyncio.wait_for(scenario(), 90))


def test_cluster_from_slurm_says_what_is_wrong_with_its_input(tmp_path, capsys):
    from arbiter.cli import main

    assert main(["cluster-from-slurm", "--from", str(tmp_path / "missing.txt")]) == 1
    assert "cannot read" in capsys.readouterr().err
    saved = tmp_path / "nodes.txt"
    saved.write_text("NodeName=a1 Gres=gpu:g0:1 State=IDLE\n")
    assert main(["cluster-from-slurm", "--from", str(saved), "--gres-type", "g0"]) == 1
    assert "must contain '{index}'" in capsys.readouterr().err
    assert main(["cluster-from-slurm", "--from", str(saved), "--name", "x"]) == 0
    assert 'names = ["a1"]' in capsys.readouterr().out
