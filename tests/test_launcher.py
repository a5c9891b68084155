"""The launcher, the job library and the app runner, with real processes (issue 5).

Jobs here are small Python scripts that use ``agent.job`` exactly as a training script does (no
scikit-learn, so they start in ~0.1 s); the runner tests use a real arbiter on loopback
(``tests/service_kit.py``) and real agents.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agent.agent import Agent
from agent.client import AgentClient
from agent.job import Job
from agent.launcher import Launcher, gpu_index
from agent.profiler import Profiler, parse_metrics
from agent.trial import TrialSpec
from arbiter.events import MemoryBus, job_metrics_pattern
from hyperparam_adapters.hyperband import BracketTuner, Rung, SuccessiveHalvingAdapter
from protos import themis_pb2 as pb
from tests.service_kit import admin_stub, arbiter, credential, target, wait_for

PY = sys.executable
POS = [("r0", "r0-m3", "r0-m3-s2"), ("r0", "r0-m3", "r0-m3-s3")]

# a training loop as the docs show it: resume, step (report + stop?), save
COUNTER = textwrap.dedent("""
    import sys, time
    from agent.job import Job
    job = Job.from_env()
    state = job.resume() or {"iteration": 0}
    it = state["iteration"]
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 10**9
    delay = float(sys.argv[2]) if len(sys.argv) > 2 else 0.05
    while it < limit:
        time.sleep(delay)
        it += 1
        if job.step(it, 1.0 / it, note="ok"):
            break
    job.save({"iteration": it})
""")


def script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def spec(job: str = "t1", **kw) -> TrialSpec:
    return TrialSpec(job, kw.pop("params", {"lr": 0.1}), kw.pop("demand_max", 1), kw.pop("start_iteration", 0),
                     kw.pop("target_iteration", None))


def poll_until(launcher: Launcher, predicate, timeout: float = 15.0):
    """Poll the launcher until ``predicate(metrics, exited)`` holds; returns what was polled."""
    metrics, exited = [], []
    deadline = time.monotonic() + timeout
    while True:
        got = launcher.poll()
        metrics += got.metrics
        exited += got.exited
        if predicate(metrics, exited):
            return metrics, exited
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; metrics {metrics[-3:]}, exits {exited}")
        time.sleep(0.02)


def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie waiting for whoever inherited it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ---------------------------------------------------------------------------------------------- environment


def test_the_job_gets_its_gpus_ids_checkpoint_topic_and_channel(tmp_path, monkeypatch):
    monkeypatch.setenv("THEMIS_LEFTOVER", "from the agent's own environment")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    out = tmp_path / "env.json"
    dump = script(tmp_path, "dump.py", "import json, os, sys\njson.dump(dict(os.environ), open(sys.argv[1], 'w'))\n")
    launcher = Launcher("app1", [PY, str(dump), str(out)], tmp_path / "work", cluster="test", env={"EXTRA": "1"})
    launcher.start(spec(params={"lr": 0.5, "width": 64}, demand_max=2, start_iteration=3, target_iteration=7),
                   ["r0-m3-g5", "r0-m3-g6"], POS)
    _, exited = poll_until(launcher, lambda m, e: e)
    assert exited[0].clean and not exited[0].requested
    env = json.loads(out.read_text())
    assert env["CUDA_VISIBLE_DEVICES"] == "5,6"
    assert env["THEMIS_GPUS"] == "r0-m3-g5,r0-m3-g6"
    assert json.loads(env["THEMIS_PLACEMENT"]) == [list(p) for p in POS]
    assert (env["THEMIS_APP"], env["THEMIS_JOB"], env["THEMIS_DEMAND"]) == ("app1", "t1", "2")
    assert env["THEMIS_CHECKPOINT"] == str(tmp_path / "work" / "t1" / "checkpoint.pkl")
    assert env["THEMIS_METRICS_TOPIC"] == "themis/test/apps/app1/jobs/t1/metrics"
    assert json.loads(env["THEMIS_PARAMS"]) == {"lr": 0.5, "width": 64}
    assert (env["THEMIS_START_ITERATION"], env["THEMIS_TARGET_ITERATION"]) == ("3", "7")
    assert env["THEMIS_LAUNCHER_PID"] == str(os.getpid())
    assert int(env["THEMIS_METRICS_FD"]) > 2 and "THEMIS_MQTT" not in env  # the embedded channel
    assert "THEMIS_LEFTOVER" not in env and env["EXTRA"] == "1"
    assert (tmp_path / "work" / "t1" / "output.log").read_text().startswith("--- start 1 of t1 on r0-m3-g5,r0-m3-g6")

    mqtt = Launcher("app1", [PY], tmp_path / "w2", cluster="test", mqtt="mqtt://127.0.0.1:1884", report="mqtt")
    env = mqtt.environment(spec(), ["r0-m0-g0"], POS[:1])
    assert env["THEMIS_MQTT"] == "mqtt://127.0.0.1:1884" and "THEMIS_METRICS_FD" not in env
    assert env["THEMIS_TARGET_ITERATION"] == ""


def test_gpu_indices_and_refusals(tmp_path):
    assert gpu_index("r0-m3-g5") == "5" and gpu_index("r12-m0-g07") == "7" and gpu_index("g3") == "3"
    with pytest.raises(ValueError, match="-g<k>"):
        gpu_index("GPU-5f1c")
    with pytest.raises(ValueError):
        Launcher("app/1", [PY], tmp_path)
    with pytest.raises(ValueError, match="broker"):
        Launcher("app", [PY], tmp_path, report="mqtt")
    launcher = Launcher("app", [PY, "-c", "import time; time.sleep(30)"], tmp_path)
    with pytest.raises(ValueError, match="job id"):
        launcher.start(spec("../escape"), ["r0-m0-g0"])
    with pytest.raises(ValueError, match="no GPUs"):
        launcher.start(spec(), [])
    launcher.start(spec("a"), ["r0-m0-g0"])
    try:
        with pytest.raises(RuntimeError, match="already running"):
            launcher.start(spec("a"), ["r0-m0-g1"])
        with pytest.raises(RuntimeError, match="still used"):
            launcher.start(spec("b"), ["r0-m0-g0"])
    finally:
        launcher.kill_all()
    assert not launcher.live() and launcher.history[-1].killed


# ---------------------------------------------------------------------------------------------- stop and resume


def test_a_stopped_job_checkpoints_exits_and_resumes_from_its_checkpoint(tmp_path):
    job = script(tmp_path, "counter.py", COUNTER)
    launcher = Launcher("app", [PY, str(job)], tmp_path / "work", grace_s=5.0)
    launcher.start(spec("t1"), ["r0-m0-g1"])
    metrics, _ = poll_until(launcher, lambda m, e: len(m) >= 5)
    assert launcher.stop("t1", reason="lease expired")
    assert launcher.run_of("t1").state == "stopping"
    metrics, exited = poll_until(launcher, lambda m, e: e)
    first = exited[0]
    assert first.clean and first.requested and not first.killed and first.reason == "lease expired"
    assert not first.resumed and first.first_iteration == 1
    saved = Job(checkpoint=launcher.checkpoint_path("t1"), handle_sigterm=False).resume()
    assert saved == {"iteration": first.last_iteration}  # what it reported last is what it saved

    launcher.start(spec("t1", start_iteration=int(first.last_iteration), target_iteration=int(first.last_iteration) + 3),
                   ["r0-m1-g0"])
    metrics, exited = poll_until(launcher, lambda m, e: e)
    second = exited[0]
    assert second.resumed and second.clean and not second.requested  # it reached its target and left
    assert [p["iteration"] for _, p in metrics] == [first.last_iteration + k for k in (1, 2, 3)]
    assert launcher.starts["t1"] == 2 and len(launcher.history) == 2
    payload = metrics[0][1]
    assert parse_metrics(payload).gpus == (("r0", "r0-m1", "r0-m1-g0"),)  # placement guessed from the id
    assert payload["extra"] == {"note": "ok"} and payload["iter_time_s"] > 0.04


def test_a_job_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    ready = tmp_path / "ready"
    stubborn = script(tmp_path, "stubborn.py", textwrap.dedent("""
        import signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(sys.argv[1], "w").write("ready")
        time.sleep(60)
    """))
    launcher = Launcher("app", [PY, str(stubborn), str(ready)], tmp_path / "work", grace_s=0.5)
    launcher.start(spec("s"), ["r0-m0-g0"])
    poll_until(launcher, lambda m, e: ready.exists())
    asked = time.monotonic()
    launcher.stop("s")
    _, exited = poll_until(launcher, lambda m, e: e)
    took = time.monotonic() - asked
    assert exited[0].killed and exited[0].requested and exited[0].returncode == -signal.SIGKILL
    assert 0.5 <= took < 4.0


def test_a_save_cut_short_by_the_grace_period_leaves_no_temporary_checkpoint(tmp_path):
    """``job.save`` writes a temporary file and renames it, so a job killed mid-save keeps its old
    checkpoint. The temporary file stayed behind, named by the dead process, one more (a whole
    checkpoint's size) every time a big save outlived the grace period."""
    saving = tmp_path / "saving"
    slow_save = script(tmp_path, "slow_save.py", textwrap.dedent("""
        import sys, time
        from agent.job import Job

        class Model:  # a big model: pickling it outlasts the grace period
            def __reduce__(self):
                open(sys.argv[1], "w").write("saving")
                time.sleep(60)
                return (Model, ())

        job = Job.from_env()
        job.step(1, 1.0)
        job.save({"model": Model()})
    """))
    launcher = Launcher("app", [PY, str(slow_save), str(saving)], tmp_path / "work", grace_s=0.3)
    launcher.start(spec("s"), ["r0-m0-g0"])
    poll_until(launcher, lambda m, e: saving.exists())
    assert [p.name for p in launcher.job_dir("s").glob(".checkpoint.pkl.*.tmp")]  # what the save was writing
    launcher.stop("s")
    _, exited = poll_until(launcher, lambda m, e: e)
    assert exited[0].killed and exited[0].requested
    assert sorted(p.name for p in launcher.job_dir("s").iterdir()) == ["output.log"]


def test_a_job_at_its_target_is_given_time_to_leave_before_any_signal(tmp_path):
    # stop(signal_now=False): no SIGTERM while it saves; SIGTERM after grace, SIGKILL after another
    ready = tmp_path / "ready"
    slow = script(tmp_path, "slow.py", textwrap.dedent("""
        import signal, sys, time
        got = []
        signal.signal(signal.SIGTERM, lambda *a: got.append(1))
        open(sys.argv[1], "w").write("ready")
        time.sleep(0.6)
        sys.exit(5 if got else 0)
    """))
    launcher = Launcher("app", [PY, str(slow), str(ready)], tmp_path / "work", grace_s=3.0)
    launcher.start(spec("s"), ["r0-m0-g0"])
    poll_until(launcher, lambda m, e: ready.exists())
    launcher.stop("s", signal_now=False)
    _, exited = poll_until(launcher, lambda m, e: e)
    assert exited[0].returncode == 0 and not exited[0].killed


def test_no_process_outlives_shutdown_even_its_children(tmp_path):
    pids = tmp_path / "pids"
    forker = script(tmp_path, "forker.py", textwrap.dedent("""
        import os, signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open(sys.argv[1], "w").write(f"{os.getpid()} {child.pid}")
        time.sleep(60)
    """))
    counter = script(tmp_path, "counter.py", COUNTER)
    launcher = Launcher("app", lambda s: [PY, str(forker), str(pids)] if s.job_id == "f" else [PY, str(counter)],
                        tmp_path / "work", grace_s=0.3)
    launcher.start(spec("f"), ["r0-m0-g0"])
    launcher.start(spec("c"), ["r0-m0-g1"])
    poll_until(launcher, lambda m, e: pids.exists() and pids.read_text() and m)
    leader, child = map(int, pids.read_text().split())
    polled = asyncio.run(launcher.shutdown())
    assert {e.job_id for e in polled.exited} == {"f", "c"} and not launcher.live()
    by_job = {e.job_id: e for e in polled.exited}
    assert by_job["c"].clean and by_job["f"].killed
    assert wait_gone(leader) and wait_gone(child)


def test_jobs_die_when_the_agent_exits_or_is_killed(tmp_path):
    counter = script(tmp_path, "counter.py", COUNTER)
    agent_code = textwrap.dedent(f"""
        import sys, time
        from agent.launcher import Launcher
        from agent.trial import TrialSpec
        launcher = Launcher("app", [{PY!r}, {str(counter)!r}], {str(tmp_path / "work")!r})
        launcher.start(TrialSpec("t1", {{}}), ["r0-m0-g0"])
        while not launcher.poll().metrics:  # the job runs and reports: its death signal is armed
            time.sleep(0.02)
        print(launcher.run_of("t1").pid, flush=True)
        if sys.argv[1] == "hang":
            time.sleep(60)
    """)
    # 1. the agent exits without shutting its launcher down: the atexit hook kills the job
    done = subprocess.run([PY, "-c", agent_code, "exit"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert wait_gone(int(done.stdout.split()[0]), 5.0)
    # 2. the agent is SIGKILLed: the kernel sends the job SIGTERM (PR_SET_PDEATHSIG), it checkpoints
    agent = subprocess.Popen([PY, "-c", agent_code, "hang"], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(agent.stdout.readline())
        agent.kill()
        agent.wait(10)
        assert wait_gone(pid, 10.0)
        assert Job(checkpoint=tmp_path / "work" / "t1" / "checkpoint.pkl", handle_sigterm=False).resume()["iteration"] >= 1
    finally:
        agent.kill()


# ---------------------------------------------------------------------------------------------- the job library


def test_the_job_library_on_its_own(tmp_path):
    job = Job.from_env({}, handle_sigterm=False)
    assert not job.reporting and job.checkpoint is None and job.resume() is None
    assert job.step(1, 0.5) is False
    job.save({"lost": True})  # no path: nothing written, no error
    job.request_stop()
    assert job.step(2, 0.4) is True and job.stop_requested

    env = {"THEMIS_TARGET_ITERATION": "3", "THEMIS_CHECKPOINT": str(tmp_path / "j" / "ck.pkl"),
           "THEMIS_PARAMS": '{"lr": 0.01}', "THEMIS_JOB": "t9"}
    job = Job.from_env(env, handle_sigterm=False)
    assert job.params == {"lr": 0.01} and job.job_id == "t9"
    assert [job.step(k, 1.0 / k) for k in (1, 2, 3)] == [False, False, True]
    job.save({"iteration": 3, "weights": [1, 2]})
    assert job.resume() == {"iteration": 3, "weights": [1, 2]}
    assert os.listdir(tmp_path / "j") == ["ck.pkl"]  # the temporary file was renamed into place


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _reports(read_fd):
    return [json.loads(line) for line in os.read(read_fd, 1 << 16).decode().splitlines()]


def _saved_at_five(tmp_path, monkeypatch):
    """A job that ran 5 iterations of 2 s on a fake clock and saved a checkpoint at iteration 5:
    (the clock, the read end of its metrics pipe, the keyword arguments that make the job again)."""
    clock = _Clock()
    monkeypatch.setattr("agent.job.time.monotonic", clock)
    read_fd, write_fd = os.pipe()
    kw = dict(app="a", job_id="t0", gpus=("r0-m0-g0",), placement=(("r0", "r0-m0", "r0-m0-g0"),),
              checkpoint=tmp_path / "ck.pkl", run="run-1", params={"lr": 0.1}, handle_sigterm=False,
              metrics_fd=write_fd)
    first = Job(**kw)
    first.resume()
    for it in range(1, 6):
        clock.now += 2.0
        first.step(it, 1.0 / it)
    first.save({"it": 5})
    return clock, read_fd, kw


def test_a_resumed_job_times_its_first_iteration_from_its_checkpoint_not_from_a_stale_start(tmp_path, monkeypatch):
    """After AppRunner.create(resume=True) a tuner that starts over says start iteration 0 while the
    job goes on from its checkpoint at 5: the first iteration time was divided by 6."""
    clock, read_fd, kw = _saved_at_five(tmp_path, monkeypatch)
    again = Job(**kw, start_iteration=0)
    assert again.resume() == {"it": 5}
    clock.now += 2.0
    again.step(6, 0.1)
    times = [r["iter_time_s"] for r in _reports(read_fd)]
    assert times == [2.0] * 6, times


def test_a_save_before_any_step_keeps_the_iteration_its_checkpoint_was_at(tmp_path, monkeypatch):
    """A run that saves before its first step (stopped as it resumed, or its own iteration cap
    already reached) wrote a checkpoint without the iteration it holds, so the next run timed its
    first iteration from the tuner's start iteration: 0 after a resume, 6 iterations in 2 s."""
    clock, read_fd, kw = _saved_at_five(tmp_path, monkeypatch)
    stopped_at_once = Job(**kw)
    assert stopped_at_once.resume() == {"it": 5}
    stopped_at_once.save({"it": 5})  # no step in this run
    again = Job(**kw, start_iteration=0)
    assert again.resume() == {"it": 5}
    clock.now += 2.0
    again.step(6, 0.1)
    times = [r["iter_time_s"] for r in _reports(read_fd)]
    assert times == [2.0] * 6, times


def test_numpy_scalars_are_numbers_to_a_job(tmp_path):
    """np.float32 is not a float nor np.int64 an int: step() refused them (ValueError) and an extra
    of that type broke json.dumps, so the training job crashed."""
    import numpy as np

    read_fd, write_fd = os.pipe()
    job = Job(app="a", job_id="t0", gpus=("r0-m0-g0",), placement=(("r0", "r0-m0", "r0-m0-g0"),),
              handle_sigterm=False, metrics_fd=write_fd)
    job.resume()
    job.step(np.int64(1), np.float32(0.5), acc=np.float32(0.25), seen=np.int64(32), bad=np.float64("nan"))
    (report,) = _reports(read_fd)
    assert report["iteration"] == 1 and report["loss"] == 0.5
    assert report["extra"] == {"acc": 0.25, "seen": 32, "bad": None}


def test_a_failed_save_keeps_the_old_checkpoint_and_leaves_no_temporary_file(tmp_path):
    job = Job(checkpoint=tmp_path / "ck.pkl", handle_sigterm=False)
    job.save({"it": 1})
    with pytest.raises(Exception):
        job.save({"it": 2, "lock": __import__("threading").Lock()})  # cannot be pickled
    assert os.listdir(tmp_path) == ["ck.pkl"] and job.resume() == {"it": 1}


def test_reports_travel_through_the_pipe_and_are_republished_on_the_bus(tmp_path):
    async def scenario():
        bus = MemoryBus()
        await bus.start()
        sub = bus.subscribe(job_metrics_pattern("c1", "app"))
        counter = script(tmp_path, "counter.py", COUNTER)
        seen = []
        launcher = Launcher("app", [PY, str(counter), "4", "0.01"], tmp_path / "work", cluster="c1", bus=bus,
                            on_metrics=lambda job, payload: seen.append((job, payload["iteration"])))
        launcher.start(spec("t2", demand_max=2), ["r0-m0-g0", "r0-m0-g1"], POS)
        polled = await launcher.wait("t2", timeout=15)
        events = [await sub.get(1.0) for _ in range(4)]
        assert seen == [("t2", k) for k in (1, 2, 3, 4)] == [(j, p["iteration"]) for j, p in polled.metrics]
        assert [e.topic for e in events] == ["themis/c1/apps/app/jobs/t2/metrics"] * 4
        m = parse_metrics(events[-1].payload)
        assert (m.iteration, m.loss, m.demand, m.gpus) == (4, 0.25, 2, tuple(POS))
        await bus.stop()

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------------------- the runner


def counter_runner(server, tmp_path, adapter, name, argv, **kw):
    async def make():
        client = AgentClient(Agent(adapter), name, target(server), await credential(server, name), backoff_s=(0.05, 0.5))
        launcher = Launcher(name, argv, tmp_path / name, cluster="test-8", grace_s=kw.pop("grace_s", 5.0))
        from agent.runner import AppRunner

        return AppRunner(adapter, client, launcher, **kw)

    return make()


def test_the_runner_feeds_reports_to_the_tuner_and_finishes_the_search(tmp_path):
    async def scenario():
        async with arbiter(tmp_path) as server:
            counter = script(tmp_path, "counter.py", COUNTER)
            adapter = SuccessiveHalvingAdapter({"lr": [0.1, 0.2, 0.3]}, n=4, eta=2, min_resource=2, iter_time=0.02)
            runner = await counter_runner(server, tmp_path, adapter, "sh", [PY, str(counter), "100", "0.02"],
                                          profiler=Profiler())
            await runner.run(timeout=40)
            summary = runner.summary()
            assert runner.finished and summary["finished"] and not runner.failed
            assert adapter.finished() and adapter.best() is not None
            # rungs 4 x 2, 2 x 4, 1 x 8 iterations: every job stopped exactly at its rung
            assert sorted(r.iteration for r in runner.reports if r.job_id == adapter.best().job_id)[-1] == 8
            assert all(r.serial_s == r.iter_time_s and r.gpus == 1 for r in runner.reports)  # 1 GPU, S = 1
            assert all(e.clean for e in runner.launcher.history)
            # the survivors of each rung resumed from their checkpoints, one iteration after it
            resumed = [e for e in runner.launcher.history if e.resumed]
            assert len(resumed) == 3 and {e.first_iteration for e in resumed} == {3.0, 5.0}
            assert summary["resumed_runs"] == 3 and summary["reports"] == len(runner.reports) == 16
            assert runner.profiler.serial_observations() == 16
            assert runner.demand_history[0][1] == 4 and runner.demand_history[-1][1] == 0
            assert any(e["what"] == "release" for e in runner.events)  # GPUs of finished rungs given back

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_job_that_loses_its_lease_is_stopped_and_resumes_from_its_checkpoint_elsewhere(tmp_path):
    async def scenario():
        async with arbiter(tmp_path, lease_s=2.0) as server:
            counter = script(tmp_path, "counter.py", COUNTER)
            adapter = BracketTuner({"lr": [0.1]}, [[Rung(1, 100)]], iter_time=0.05)  # one job, 100 iterations
            runner = await counter_runner(server, tmp_path, adapter, "solo", [PY, str(counter), "1000", "0.05"])
            task = asyncio.create_task(runner.run(timeout=40))
            await wait_for(lambda: runner.reports, 10)
            machine = runner.launcher.run_of("t0").placement[0][1]
            stub, meta, ch = admin_stub(server)
            await stub.DrainMachine(pb.DrainMachineRequest(machine=machine), metadata=meta)  # no renewal there
            await task
            await ch.close()
            history = runner.launcher.history
            assert runner.finished and len(history) == 2
            lost, resumed = history
            assert lost.reason == "GPUs lost" and lost.clean and not lost.killed
            assert resumed.resumed and resumed.first_iteration == lost.last_iteration + 1
            assert resumed.last_iteration == 100 and resumed.clean and not resumed.killed  # ran to its target
            assert not any(g.startswith(machine + "-") for g in resumed.gpus)
            revoked = [e for e in runner.events if e["what"] == "revoke"]
            assert revoked and revoked[0]["reason"] == "lease expired"
            summary = runner.summary()
            assert summary["resumed_after_preemption"] == 1 and summary["stopped_for_lost_gpus"] == 1

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_failing_job_is_retried_then_given_up_without_stalling_the_search(tmp_path):
    async def scenario():
        async with arbiter(tmp_path) as server:
            crash = script(tmp_path, "crash.py", "import sys\nsys.exit(3)\n")
            adapter = BracketTuner({"lr": [0.1]}, [[Rung(1, 3)]], iter_time=0.05)
            runner = await counter_runner(server, tmp_path, adapter, "crashy", [PY, str(crash)], max_failures=2)
            await runner.run(timeout=30)
            assert runner.finished and runner.failed == {"t0"} and runner.failures["t0"] == 2
            assert [e.returncode for e in runner.launcher.history] == [3, 3]
            assert adapter.status("t0") == "finished" and adapter.best() is None

    asyncio.run(asyncio.wait_for(scenario(), 60))
