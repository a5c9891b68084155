"""Shared pieces of the service tests: a real arbiter on loopback, real agents, a raw stream.

Nothing here stands in for the project's own components: the arbiter is ``ArbiterServer`` (real
gRPC server, SQLite journal, PuLP/HiGHS auction), agents are ``AgentClient`` with the real fairness
and bidding code. ``RawStream`` speaks the wire protocol by hand, to send what a good agent never
would.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from pathlib import Path

import grpc

from agent.agent import Agent
from agent.appsched import SuccessiveHalvingApp
from agent.client import AgentClient, channel, issue_token, register
from arbiter.server import ArbiterServer, ServerConfig
from protos import themis_pb2 as pb
from protos import themis_pb2_grpc as pb_grpc

ADMIN = "test-admin-token"
CLUSTER_8 = """
name = "test-8"
[[racks]]
name = "r0"
machines = [{ gpus = 4, slots = 2, count = 2 }]
"""


def cluster_file(tmp_path: Path, text: str = CLUSTER_8) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def halving_app(jobs: int = 4, demand: int = 1) -> SuccessiveHalvingApp:
    app = SuccessiveHalvingApp([10.0 + k for k in range(jobs)], [1000.0, 2000.0], job_demand_max=demand,
                               slowdown=(1.0, 1.1, 1.5, 2.0))
    app.start_time = time.time()
    return app


@contextlib.asynccontextmanager
async def arbiter(tmp_path: Path, **config):
    config.setdefault("cluster", str(cluster_file(tmp_path)))
    config.setdefault("db", tmp_path / "arbiter.db")
    config.setdefault("report_timeout_s", 1.0)
    config.setdefault("bid_timeout_s", 1.0)
    server = ArbiterServer(ServerConfig(port=0, admin_token=ADMIN, **config))
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace=0.2)


def target(server: ArbiterServer) -> str:
    return f"127.0.0.1:{server.port}"


async def credential(server: ArbiterServer, app: str) -> str:
    token = await issue_token(target(server), app, ADMIN)
    return await register(target(server), app, token)


async def start_agent(server: ArbiterServer, name: str, app=None) -> tuple[AgentClient, asyncio.Task]:
    client = AgentClient(Agent(app or halving_app()), name, target(server), await credential(server, name),
                         backoff_s=(0.05, 0.5))
    task = asyncio.create_task(client.run())
    await asyncio.wait_for(client.welcomed.wait(), 5)
    return client, task


async def wait_for(predicate, timeout: float = 10.0, step: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(step)


def admin_stub(server: ArbiterServer) -> tuple[pb_grpc.ArbiterStub, list, grpc.aio.Channel]:
    ch = channel(target(server))
    return pb_grpc.ArbiterStub(ch), [("authorization", f"Bearer {ADMIN}")], ch


class RawStream:
    """A hand-driven Connect stream: send any AgentMessage, read what the arbiter answers."""

    def __init__(self, server: ArbiterServer, app: str, cred: str):
        self.app = app
        self.out: asyncio.Queue = asyncio.Queue()
        self.inbox: list[pb.ArbiterMessage] = []
        self.channel = channel(target(server))
        self.call = pb_grpc.ArbiterStub(self.channel).Connect(self._gen(), metadata=[("authorization", f"Bearer {cred}")])
        self._reader = asyncio.create_task(self._read())

    async def _gen(self):
        while True:
            msg = await self.out.get()
            if msg is None:
                return
            yield msg

    async def _read(self):
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            async for msg in self.call:
                self.inbox.append(msg)

    def send(self, **kind) -> None:
        self.out.put_nowait(pb.AgentMessage(**kind))

    def of(self, kind: str) -> list:
        return [getattr(m, kind) for m in self.inbox if m.WhichOneof("kind") == kind]

    async def read_out(self, timeout: float = 60.0) -> None:
        """Wait until every message of an ended call is in ``inbox``: a call is done when its status
        arrives, and messages before it may still wait in the reader."""
        await asyncio.wait_for(asyncio.shield(self._reader), timeout)

    async def next(self, kind: str, after: int = 0, timeout: float = 10.0):
        await wait_for(lambda: len(self.of(kind)) > after, timeout)
        return self.of(kind)[after]

    async def close(self) -> None:
        self.out.put_nowait(None)
        self.call.cancel()
        self._reader.cancel()
        with contextlib.suppress(BaseException):
            await self._reader
        await self.channel.close()


def free_port() -> int:
    """A loopback port nothing listens on now (for a metrics endpoint, a broker, a dead arbiter)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Door:
    """A TCP relay in front of a server: :meth:`shut` refuses new connections (a dial is refused
    at once, as by a host that is down), :meth:`cut` also breaks those already through (a network
    failure). gRPC reuses an open connection for a new channel to the same target, so only a cut
    keeps a client out that is connected now."""

    def __init__(self, port: int):
        self.upstream = port
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def open(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)

    def shut(self) -> None:
        """Refuse new connections from now on."""
        if self._server is not None:
            self._server.close()
            self._server = None

    def cut(self) -> None:
        """Shut, and break every connection already through."""
        self.shut()
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True)
        self._writers -= {writer, up_writer}


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.transport.abort()
