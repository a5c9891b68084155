"""Issue 36, item 4 (errors a person reads) and the arbiter's log (item 5), on real processes.

``themis-agent`` and ``themis-arbiter`` say one line with the cause and the fix, and exit with the
code of ``protos.exits`` (docs/agents.md's table), for: no arbiter at the address, a refused
registration token, no token, a stale or revoked credential, an app an admin removed, a second
agent and a take-over, Ctrl-C. ``AppRunner`` raises the same as one-line exceptions. An agent under
which the arbiter restarts ends cleanly (no "Task was destroyed but it is pending!", no "cannot
reuse already awaited coroutine"). ``serve`` logs JSON off a terminal or lines for a person, and a
last line when it stops.

Every arbiter here is a ``themis-arbiter serve`` process (``python -m arbiter.cli``) and every
agent a ``themis-agent run`` process; the tests wait on what the processes say or the arbiter
reports, never on sleeps.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from protos import exits
from protos import themis_pb2 as pb
from protos import themis_pb2_grpc as pb_grpc
from protos.rpc import bearer, channel, issue_token
from tests.service_kit import ADMIN, cluster_file, free_port

REPO = Path(__file__).resolve().parents[1]
APP = ('[app]\nkind = "successive_halving"\niter_times = [1, 2]\niterations = [20, 40]\njob_demand_max = 2\n'
       'slowdown = [1, 1, 1.2, 1.5]\n[context]\ncluster_size = 8\nn_avg = 1\n')
ONE_LINE_MESSAGES = ("Task was destroyed but it is pending", "cannot reuse already awaited coroutine")


def run(coro, timeout: float = 240):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not met in {timeout} s")
        await asyncio.sleep(0.05)


class Proc:
    """A command line in its own process, its stdout and stderr read as they come."""

    def __init__(self, *argv: str, cwd: Path = REPO):
        self.argv, self.cwd = [sys.executable, *argv], cwd
        self.out: list[str] = []
        self.err: list[str] = []
        self.proc: asyncio.subprocess.Process | None = None
        self._readers: list[asyncio.Task] = []

    async def start(self) -> Proc:
        self.proc = await asyncio.create_subprocess_exec(*self.argv, cwd=self.cwd, stdin=asyncio.subprocess.DEVNULL,
                                                         stdout=asyncio.subprocess.PIPE,
                                                         stderr=asyncio.subprocess.PIPE)
        self._readers = [asyncio.create_task(self._read(self.proc.stdout, self.out)),
                         asyncio.create_task(self._read(self.proc.stderr, self.err))]
        return self

    @staticmethod
    async def _read(stream: asyncio.StreamReader, into: list[str]) -> None:
        while line := await stream.readline():
            into.append(line.decode(errors="replace").rstrip("\n"))

    async def wait(self, timeout: float = 90.0) -> int:
        assert self.proc is not None
        try:
            code = await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
            raise AssertionError(f"{self.argv[2:4]} did not exit in {timeout} s; stderr:\n{self.stderr}") from None
        await asyncio.gather(*self._readers)
        return code

    def signal(self, sig: int) -> None:
        assert self.proc is not None and self.proc.returncode is None
        self.proc.send_signal(sig)

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        for task in self._readers:
            task.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)

    @property
    def stderr(self) -> str:
        return "\n".join(self.err)


class Served(Proc):
    """``themis-arbiter serve`` on a fixed loopback port (so a restart comes back at the same address)."""

    def __init__(self, tmp_path: Path, port: int | None = None, *extra: str):
        self.port = port or free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.db = tmp_path / "arbiter.db"
        super().__init__("-m", "arbiter.cli", "serve", "--cluster", str(cluster_file(tmp_path)), "--port",
                         str(self.port), "--db", str(self.db), "--admin-token", ADMIN, "--lease", "30",
                         "--report-timeout", "1", "--bid-timeout", "1", "--coalesce", "0.2", *extra)

    async def start(self) -> Served:
        await super().start()
        await until(lambda: any('"serving"' in line or " serving " in line for line in self.err)
                    or self.proc.returncode is not None, 60, "arbiter serving")
        assert self.proc.returncode is None, self.stderr
        return self

    async def apps(self) -> dict[str, pb.AppState]:
        async with channel(self.target) as ch:
            reply = await pb_grpc.ArbiterStub(ch).ListApps(pb.ListAppsRequest(), metadata=bearer(ADMIN), timeout=10)
        return {a.app: a for a in reply.apps}

    async def until_app(self, app: str, predicate, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            state = (await self.apps()).get(app)
            if state is not None and predicate(state):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{app}: {what}: not in {timeout} s; arbiter log:\n{self.stderr[-3000:]}")
            await asyncio.sleep(0.1)


def agent(tmp_path: Path, target: str, name: str, *extra: str) -> Proc:
    app = tmp_path / "tiny.toml"
    app.write_text(APP)
    return Proc("-m", "agent.cli", "run", str(app), "--arbiter", target, "--name", name, "--quiet",
                "--workdir", str(tmp_path / "runs"), *extra)


def the_line(proc: Proc, prog: str = "themis-agent") -> str:
    """A failing command says exactly one line on stderr, and no traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.err) == 1, proc.stderr
    line = proc.err[0]
    assert line.startswith(f"{prog}: "), line
    return line


# -- the table ------------------------------------------------------------------------------------


def test_every_exit_code_is_in_the_documented_table():
    doc = (REPO / "docs" / "agents.md").read_text()
    rows = {int(m.group(1)) for m in re.finditer(r"^\| (\d+) \|", doc, re.M)}
    assert set(exits.CODES) <= rows, sorted(set(exits.CODES) - rows)
    assert len(set(exits.CODES)) == len(exits.CODES)


# -- no arbiter at the address ------------------------------------------------------------------


def test_no_arbiter_is_one_line_and_exit_3_for_the_agent_and_the_admin_commands(tmp_path):
    dead = f"127.0.0.1:{free_port()}"  # nothing listens here
    cred = tmp_path / "kept.cred"
    cred.write_text("app_not-checked-before-connecting\n")

    async def scenario():
        first = await agent(tmp_path, dead, "first", "--token", "reg_x").start()  # a first run: Register fails
        later = await agent(tmp_path, dead, "later", "--credential-file", str(cred), "--connect-timeout", "1").start()
        status = await Proc("-m", "arbiter.cli", "status", "--arbiter", dead, "--admin-token", ADMIN).start()
        return [(p, await p.wait()) for p in (first, later, status)]

    (first, c1), (later, c2), (status, c3) = run(scenario())
    for proc, code, prog in ((first, c1, "themis-agent"), (later, c2, "themis-agent"), (status, c3, "themis-arbiter")):
        line = the_line(proc, prog)
        assert code == exits.UNREACHABLE, (code, line)
        assert f"unreachable: no arbiter answered at {dead}" in line and "Connection refused" in line, line
        assert "themis-arbiter serve" in line and "--arbiter HOST:PORT" in line, line  # the fix
    assert "no Welcome in" in later.err[0]


# -- tokens and credentials, an app removed, a second agent, Ctrl-C ---------------------------------


def test_refusals_removal_take_over_and_ctrl_c_each_say_one_line_with_their_exit_code(tmp_path):
    async def scenario():
        server = await Served(tmp_path).start()
        procs: list[Proc] = []

        async def started(name: str, *extra: str) -> Proc:
            proc = await agent(tmp_path, server.target, name, *extra).start()
            procs.append(proc)
            return proc

        async def token(app: str) -> str:
            return await issue_token(server.target, app, ADMIN)

        try:
            # a registration token the arbiter does not know
            bad = await started("badtoken", "--token", "reg_not-a-token")
            assert await bad.wait() == exits.REFUSED
            # no token and no credential
            none = await started("notoken", "--credential-file", str(tmp_path / "none.cred"))
            assert await none.wait() == exits.REFUSED
            # a stale credential file: the app registered again elsewhere
            stale_file = tmp_path / "stale.cred"
            first = await started("stale", "--token", await token("stale"), "--credential-file", str(stale_file))
            await server.until_app("stale", lambda a: a.connected, "connected")
            first.signal(signal.SIGINT)  # Ctrl-C
            assert await first.wait() == exits.INTERRUPTED
            async with channel(server.target) as ch:  # registered again: the file's credential is revoked
                await pb_grpc.ArbiterStub(ch).Register(pb.RegisterRequest(app="stale"),
                                                       metadata=bearer(await token("stale")), timeout=10)
            stale = await started("stale", "--credential-file", str(stale_file))
            assert await stale.wait() == exits.REFUSED

            # a running agent, a second one refused, a third one taking over
            running = await started("twice", "--token", await token("twice"), "--credential-file",
                                    str(tmp_path / "twice.cred"))
            await server.until_app("twice", lambda a: a.connected, "connected")
            second = await started("twice", "--credential-file", str(tmp_path / "twice.cred"))
            assert await second.wait() == exits.REPLACED
            assert running.proc.returncode is None  # the running one goes on
            third = await started("twice", "--credential-file", str(tmp_path / "twice.cred"), "--take-over")
            assert await running.wait() == exits.REPLACED

            # removed by an admin, and revoked by an admin, while running
            removed = await started("gone", "--token", await token("gone"))
            revoked = await started("cut", "--token", await token("cut"))
            for app in ("gone", "cut"):
                await server.until_app(app, lambda a: a.connected, "connected")
            rm = await Proc("-m", "arbiter.cli", "remove-app", "gone", "--arbiter", server.target,
                            "--admin-token", ADMIN).start()
            rv = await Proc("-m", "arbiter.cli", "revoke-credential", "cut", "--arbiter", server.target,
                            "--admin-token", ADMIN).start()
            assert (await rm.wait(), await rv.wait()) == (0, 0), rm.stderr + rv.stderr
            assert await removed.wait() == exits.REMOVED
            assert await revoked.wait() == exits.REFUSED
            third.signal(signal.SIGTERM)  # a kill: stopped as on Ctrl-C, with 143
            assert await third.wait() == exits.TERMINATED

            # an admin command with a token the arbiter does not take
            wrong = await Proc("-m", "arbiter.cli", "status", "--arbiter", server.target, "--admin-token",
                               "adm_wrong").start()
            assert await wrong.wait() == exits.REFUSED
            return bad, none, first, stale, second, running, removed, revoked, wrong, third
        finally:
            for proc in procs:
                await proc.close()
            await server.close()

    bad, none, interrupted, stale, second, replaced, removed, revoked, wrong, killed = run(scenario())
    line = the_line(bad)
    assert "refused" in line and "PERMISSION_DENIED" in line and "themis-arbiter issue-token badtoken" in line
    line = the_line(none)
    assert "no credential" in line and "none.cred" in line and "--token" in line and "issue-token notoken" in line
    line = the_line(interrupted)
    assert "interrupted (Ctrl-C)" in line, line
    line = the_line(stale)
    assert "UNAUTHENTICATED" in line and "delete" in line and "stale.cred" in line and "issue-token stale" in line
    line = the_line(second)
    assert "ALREADY_EXISTS" in line and "--take-over" in line, line
    line = the_line(replaced)
    assert line.startswith("themis-agent: replaced: ") and "--take-over" in line, line
    line = the_line(removed)
    assert line.startswith("themis-agent: removed: ") and "removed by an admin" in line \
        and "issue-token gone" in line, line
    line = the_line(revoked)
    assert line.startswith("themis-agent: revoked: ") and "issue-token cut" in line, line
    assert "Traceback" not in killed.stderr and killed.err[-1].startswith("themis-agent: twice: interrupted (SIGTERM)")
    assert any("took over" in line for line in killed.err), killed.stderr
    line = the_line(wrong, "themis-arbiter")
    assert "refused" in line and "PERMISSION_DENIED" in line and "--admin-token" in line, line


def test_debug_adds_the_traceback_before_the_line(tmp_path):
    dead = f"127.0.0.1:{free_port()}"

    async def scenario():
        proc = await agent(tmp_path, dead, "dbg", "--token", "reg_x", "--debug").start()
        return proc, await proc.wait()

    proc, code = run(scenario())
    assert code == exits.UNREACHABLE
    assert "Traceback" in proc.stderr and proc.err[-1].startswith("themis-agent: unreachable: "), proc.stderr


# -- the python API -------------------------------------------------------------------------------


def test_app_runner_raises_one_line_exceptions_with_the_exit_code(tmp_path, capsys):
    from agent.client import AgentStopped, NoCredential
    from agent.runner import AppRunner
    from hyperparam_adapters.hyperband import HyperbandAdapter

    dead = f"127.0.0.1:{free_port()}"

    def adapter():
        return HyperbandAdapter({"lr": [0.1]}, max_resource=3, eta=3, iter_time=0.05)

    async def create(**kw):
        return await AppRunner.create(adapter(), [sys.executable, "train.py"], app="api", arbiter=dead,
                                      workdir=str(tmp_path / "w"), quiet=True, **kw)

    async def scenario():
        with pytest.raises(AgentStopped) as unreachable:
            await create(token="reg_x")
        with pytest.raises(NoCredential) as none:
            await create(credential_file=tmp_path / "missing.cred")
        with pytest.raises(exits.Stopped) as no_admin:
            await AppRunner.token(dead, "api", ADMIN)
        return unreachable.value, none.value, no_admin.value

    unreachable, none, no_admin = run(scenario())
    for exc, code in ((unreachable, exits.UNREACHABLE), (none, exits.REFUSED), (no_admin, exits.UNREACHABLE)):
        assert "\n" not in str(exc) and exc.exit_code == code, (str(exc), exc.exit_code)
    assert str(unreachable).startswith(f"unreachable: no arbiter answered at {dead}") \
        and "themis-arbiter serve" in str(unreachable)
    assert isinstance(none, ValueError) and "issue-token api" in str(none) and "missing.cred" in str(none)
    with pytest.raises(SystemExit) as ended, exits.one_line_errors("search.py"):
        raise unreachable
    assert ended.value.code == exits.UNREACHABLE
    assert capsys.readouterr().err == f"search.py: {unreachable}\n"


# -- an arbiter restarted under a running agent; how serve logs and stops -----------------------------


def test_an_agent_under_a_restarted_arbiter_ends_cleanly_and_serve_says_when_it_stops(tmp_path):
    async def scenario():
        server = await Served(tmp_path).start()  # stderr is a pipe: JSON logs (--log-format auto)
        later: Served | None = None
        proc = await agent(tmp_path, server.target, "survivor", "--token",
                           await issue_token(server.target, "survivor", ADMIN), "--speedup", "4").start()
        try:
            await server.until_app("survivor", lambda a: a.connected and len(a.leases) > 0, "holding GPUs")
            server.signal(signal.SIGTERM)
            assert await server.wait() == 0, server.stderr
            # the agent has tried the empty port at least once before the arbiter is back
            await until(lambda: any("Connection refused" in line for line in proc.err), 60, "a refused reconnect")
            later = await Served(tmp_path, server.port, "--log-format", "human").start()
            code = await proc.wait(180)
            assert code == 0, proc.stderr
            later.signal(signal.SIGINT)
            assert await later.wait() == exits.INTERRUPTED, later.stderr
            return server, later, proc
        finally:
            await proc.close()
            await server.close()
            if later is not None:
                await later.close()

    first, second, proc = run(scenario())
    for message in ONE_LINE_MESSAGES:
        assert message not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert any("reconnected to" in line for line in proc.err), proc.stderr
    summary = json.loads(proc.out[-1])
    assert summary["app"] == "survivor" and summary["connects"] >= 2, summary
    # the first arbiter: JSON lines, the last saying it stopped and what the journal keeps
    records = [json.loads(line) for line in first.err]
    last = records[-1]
    assert last["msg"].startswith("arbiter stopped (SIGTERM): 1 app, ") and "journaled" in last["msg"], last
    assert last["signal"] == "SIGTERM" and last["apps"] == 1 and last["leases"] >= 1, last
    # the second: lines for a person, the last one too
    assert not any(line.startswith("{") for line in second.err), second.stderr
    assert re.match(r"\d\d:\d\d:\d\d INFO +arbiter stopped \(SIGINT\): \d+ apps?, \d+ leases? journaled",
                    second.err[-1]), second.err[-1]
    assert "Traceback" not in second.stderr


@pytest.fixture(autouse=True)
def _no_tty_env(monkeypatch):
    """What the child processes see: no forced colours or terminals from the test runner's environment."""
    for name in ("FORCE_COLOR", "THEMIS_ADMIN_TOKEN", "THEMIS_TLS_CA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    yield

