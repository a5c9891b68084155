"""AppRunner and lease loss, with real job processes (agent.launcher) and a scripted stand-in for
the arbiter side of the AgentClient (what the runner reads of it: held GPUs, grants, revocations):
the runner must never keep or start a job on a GPU the app may no longer hold."""

from __future__ import annotations

import asyncio
import statistics
import sys
import textwrap
import time

from agent.agent import Agent
from agent.client import HeldGpu
from agent.launcher import Launcher
from agent.runner import AppRunner
from hyperparam_adapters.hyperband import BracketTuner, Rung

JOB = textwrap.dedent("""
    import os, sys, time
    from agent.job import Job
    job = Job.from_env()
    while len(sys.argv) > 2 and not os.path.exists(sys.argv[2]):  # start-up (imports, data) until the test says
        time.sleep(0.01)
    state = job.resume() or {"it": 0}
    it = state["it"]
    while True:
        time.sleep(0.05)
        it += 1
        if job.step(it, 1.0 / it):
            break
    time.sleep(float(sys.argv[1]))  # slow to leave (evaluation, a big checkpoint)
    job.save({"it": it})
""")


class ScriptedClient:
    """The AgentClient surface AppRunner uses, driven by the test instead of an arbiter."""

    def __init__(self, adapter):
        self.agent, self.app = Agent(adapter), "a"
        self.on_grant = self.on_revoke = None
        self.held: dict[str, HeldGpu] = {}
        self.finished = False
        self.welcomed = asyncio.Event()
        self.heartbeat_s = 10.0
        self.heard_at = time.monotonic()  # what the test says it last heard

    def hears_arbiter(self, within_s):
        return self.welcomed.is_set() and time.monotonic() - self.heard_at <= within_s

    def grant(self, gpus, expires_at):
        got = {g: HeldGpu(g, ("r0", "r0-m0", g), expires_at) for g in gpus}
        self.held.update(got)
        if self.on_grant:
            self.on_grant(got)

    def revoke(self, gpus):
        for g in gpus:
            self.held.pop(g, None)
        if self.on_revoke:
            self.on_revoke(list(gpus), "lease expired")

    def release(self, gpus):
        for g in gpus:
            self.held.pop(g, None)

    def set_demand(self, demand):
        pass

    def done(self):
        self.finished = True

    def stop(self):
        pass


def make(tmp_path, adapter, linger_s=0.0, grace_s=5.0, go=None, quiet=False):
    """A runner of JOB: each run lingers ``linger_s`` s after its last step and, with ``go`` (a file
    path), starts up (launch to first report) until that file exists."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    client = ScriptedClient(adapter)
    argv = [sys.executable, str(script), str(linger_s)] + ([str(go)] if go is not None else [])
    launcher = Launcher("a", argv, tmp_path / "w", grace_s=grace_s,
                        env={"PYTHONPATH": str(__import__("pathlib").Path(__file__).resolve().parents[1])})
    return AppRunner(adapter, client, launcher, quiet=quiet), client, launcher


def _step_until(runner, done, limit_s=10.0):
    deadline = time.monotonic() + limit_s
    while not done():
        assert time.monotonic() < deadline
        runner.step()
        time.sleep(0.02)


def test_no_job_runs_on_a_lease_that_ran_out_while_the_stream_was_down(tmp_path):
    adapter = BracketTuner({"lr": [0.1]}, [[Rung(1, 1000)]], iter_time=0.05)
    runner, client, launcher = make(tmp_path, adapter)
    client.grant(["r0-m0-g0"], expires_at=time.time() - 60)  # disconnected: no revocation can come
    try:
        for _ in range(10):
            runner.step()
            time.sleep(0.05)
        assert not launcher.live()
        client.welcomed.set()  # connected again: the Welcome would have listed it, so it is ours
        client.held["r0-m0-g0"] = HeldGpu("r0-m0-g0", ("r0", "r0-m0", "r0-m0-g0"), time.time() + 600)
        for _ in range(10):
            runner.step()
            time.sleep(0.05)
        assert [run.gpus for run in launcher.live().values()] == [("r0-m0-g0",)]
    finally:
        asyncio.run(launcher.shutdown(1))


def test_an_expired_lease_is_not_run_on_while_a_stream_that_looks_connected_has_gone_silent(tmp_path):
    """A stream is found broken only after three silent heartbeat intervals; a lease past its end
    used to count for all that time, on GPUs the round may have given to another app meanwhile."""
    adapter = BracketTuner({"lr": [0.1]}, [[Rung(1, 1000)]], iter_time=0.05)
    runner, client, launcher = make(tmp_path, adapter, grace_s=1.0)
    client.welcomed.set()
    client.grant(["r0-m0-g0"], expires_at=time.time() - 5)  # ran out; the round has not decided yet
    try:
        _step_until(runner, lambda: launcher.live())  # heard from just now: it runs on (D13)
        client.heard_at = time.monotonic() - (client.heartbeat_s + 2.0)  # silent since, still "welcomed"
        _step_until(runner, lambda: not launcher.live())
        assert launcher.history[-1].requested  # stopped by the runner, not crashed
    finally:
        asyncio.run(launcher.shutdown(1))


def test_a_job_leaving_at_its_target_is_hurried_when_its_gpus_are_revoked(tmp_path):
    adapter = BracketTuner({"lr": [0.1, 0.2]}, [[Rung(2, 3), Rung(1, 6)]], iter_time=0.05)
    runner, client, launcher = make(tmp_path, adapter, linger_s=30.0, grace_s=5.0)
    client.welcomed.set()
    client.grant(["r0-m0-g0", "r0-m0-g1"], expires_at=time.time() + 600)
    try:
        deadline = time.monotonic() + 10
        stopping = []
        while not stopping and time.monotonic() < deadline:
            runner.step()
            time.sleep(0.05)
            stopping = [(j, r) for j, r in launcher.live().items() if r.state == "stopping"]
        job, run = stopping[0]
        assert not run.signalled  # at its target: left to exit by itself
        client.revoke(list(run.gpus))
        runner.step()
        assert launcher.run_of(job).signalled  # its GPUs are gone: SIGTERM now, not after a grace
    finally:
        asyncio.run(launcher.shutdown(1))


def test_start_up_longer_than_a_tenth_of_the_lease_is_warned_once(tmp_path, caplog):
    """Issue 11, item 5: with 6 s leases 45% of launches were stopped during Python start-up, silently.

    The jobs' start-up ends when the test says so: only once both have been starting for more than
    0.6 s on the launcher's clock, twice a tenth of the 3 s lease, however slow the machine is. The
    lease the warning names is the one the runner took from the grant (3 s less the moments the
    grant took to hand over)."""
    adapter = BracketTuner({"lr": [0.1, 0.2]}, [[Rung(2, 1000)]], iter_time=0.05)
    go = tmp_path / "go"
    runner, client, launcher = make(tmp_path, adapter, go=go, quiet=True)
    client.welcomed.set()
    before = expires = time.time()
    expires += 3.0
    client.grant(["r0-m0-g0", "r0-m0-g1"], expires_at=expires)  # a 3 s lease: start-up > 0.3 s warns
    after = time.time()
    try:
        with caplog.at_level("WARNING", logger="themis.runner"):
            _step_until(runner, lambda: len(launcher.live()) == 2, 30.0)
            _step_until(runner, lambda: min(launcher.clock() - r.started_at for r in launcher.live().values()) > 0.6,
                        30.0)
            go.touch()
            _step_until(runner, lambda: len({r.job_id for r in runner.reports}) == 2, 30.0)
    finally:
        asyncio.run(launcher.shutdown(1))
    assert expires - after <= runner.lease_s <= expires - before  # what was left of it at the grant
    assert len(runner.start_ups) == 2 and all(s > 0.6 for _, s in runner.start_ups)
    # D30: rho counts the measured start-up (T_id, phases still to start, bid rows that move jobs)
    assert adapter.start_up_s == statistics.median(s for _, s in runner.start_ups) > 0.6
    assert client.agent.restart_s == adapter.start_up_s
    warnings = [r.getMessage() for r in caplog.records if "from launch to its first report" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once per app
    assert f"more than a tenth of the {runner.lease_s:.0f} s lease" in warnings[0]
    assert "Use leases of at least" in warnings[0]


def test_start_up_well_within_the_lease_is_not_warned(tmp_path, caplog):
    """The job starts up as fast as Python does (its go file is there from the start): far below
    a tenth of a 600 s lease."""
    adapter = BracketTuner({"lr": [0.1]}, [[Rung(1, 1000)]], iter_time=0.05)
    go = tmp_path / "go"
    go.touch()
    runner, client, launcher = make(tmp_path, adapter, go=go, quiet=True)
    client.welcomed.set()
    client.grant(["r0-m0-g0"], expires_at=time.time() + 600)
    try:
        with caplog.at_level("WARNING", logger="themis.runner"):
            _step_until(runner, lambda: bool(runner.reports), 30.0)
    finally:
        asyncio.run(launcher.shutdown(1))
    assert runner.start_ups and not [r for r in caplog.records if "first report" in r.getMessage()]


def _quiet_exit_runner(tmp_path):
    """A runner whose jobs report on MQTT (issue 11 item 3 vs. a late broker): the job exits cleanly
    at once without publishing; the test stands in for the broker by handing reports to the runner's
    inbox, as its MQTT follower does."""
    from arbiter.events import make_bus

    script = tmp_path / "job.py"
    script.write_text("raise SystemExit(0)\n")
    adapter = BracketTuner({"lr": [0.1]}, [[Rung(1, 1000)]], iter_time=0.05)
    client = ScriptedClient(adapter)
    launcher = Launcher("a", [sys.executable, str(script)], tmp_path / "w", mqtt="mqtt://127.0.0.1:1",
                        report="mqtt")
    runner = AppRunner(adapter, client, launcher, bus=make_bus(None, client_id="t"), report_wait_s=0.5, quiet=True)
    client.welcomed.set()
    client.grant(["r0-m0-g0"], expires_at=time.time() + 600)
    deadline = time.monotonic() + 30
    while not launcher.history:
        assert time.monotonic() < deadline, "the job never ran"
        runner.step()
        time.sleep(0.02)
    return runner, launcher.history[0].job_id


def test_a_clean_exit_whose_mqtt_reports_land_after_it_is_not_a_failure(tmp_path):
    runner, job = _quiet_exit_runner(tmp_path)
    assert runner.failures[job] == 0  # not judged at the exit: its reports may still be on the broker
    runner._inbox.append((job, {"iteration": 1, "loss": 0.5, "iter_time_s": 0.05,
                                "gpus": [["r0", "r0-m0", "r0-m0-g0"]], "demand": 1}))
    started = time.monotonic()
    _step_until(runner, lambda: time.monotonic() - started > 1.0)  # past report_wait_s
    assert runner.failures[job] == 0 and job not in runner.failed
    assert [r.iteration for r in runner.reports] == [1]
    asyncio.run(runner.launcher.shutdown(1))


def test_a_clean_exit_that_never_reports_is_a_failure_once_the_wait_is_over(tmp_path):
    runner, job = _quiet_exit_runner(tmp_path)
    _step_until(runner, lambda: runner.failures[job] > 0)
    assert runner._failed_streak[0][1] == "exited without reporting progress"
    asyncio.run(runner.launcher.shutdown(1))
