"""One agent's stream as the service holds it: what to send it, why it ends, and bytes that are no message.

Values shared by the service's jobs -- the agent streams (``arbiter.streams``) own the streams, the
round driver and the admin API send on them or end them -- so they sit below all three.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field

import grpc

from protos import themis_pb2 as pb

OUTBOX_LIMIT = 1000  # messages queued to one agent before it counts as stuck and its stream is ended
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
DENIED = grpc.StatusCode.PERMISSION_DENIED.value[0]
REASON_NAMES = 5  # names of an agent's message quoted back in a rejection, each cut to ...
NAME_QUOTE = 64  # ... this many characters: a rejection never echoes megabytes


@dataclass(frozen=True)
class StreamEnd:
    """Why the arbiter ends an agent's stream: the final Goodbye and the gRPC status after it."""

    why: str
    reason: str
    gpus: tuple[str, ...] = ()

    # why -> (status, whether a new stream may pick up where this one ended)
    KINDS = {
        "removed": (grpc.StatusCode.PERMISSION_DENIED, False),
        "revoked": (grpc.StatusCode.UNAUTHENTICATED, False),
        "replaced": (grpc.StatusCode.ABORTED, False),
        "too_slow": (grpc.StatusCode.RESOURCE_EXHAUSTED, True),
        "shutting_down": (grpc.StatusCode.UNAVAILABLE, True),
        "finished": (grpc.StatusCode.OK, False),
        "invalid": (grpc.StatusCode.INVALID_ARGUMENT, True),
    }

    @property
    def status(self) -> grpc.StatusCode:
        return self.KINDS[self.why][0]

    @property
    def reconnect(self) -> bool:
        return self.KINDS[self.why][1]

    def goodbye(self) -> pb.ArbiterMessage:
        return pb.ArbiterMessage(goodbye=pb.Goodbye(why=self.why, reason=self.reason, reconnect=self.reconnect,
                                                    gpus=list(self.gpus)))


@dataclass
class Connection:
    """One agent's open stream: what to send it, when it was last heard from, and why it ends."""

    app: str
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    last_seen: float = 0.0
    limit: int = OUTBOX_LIMIT
    ending: StreamEnd | None = None

    def send(self, message: pb.ArbiterMessage) -> None:
        if self.ending is not None:
            return
        if self.outbox.qsize() >= self.limit:
            self.end(StreamEnd("too_slow", f"{self.limit} messages were queued to {self.app!r} and not read; "
                                           "reconnect and resume"))
            return
        self.outbox.put_nowait(message)

    def end(self, end: StreamEnd) -> None:
        """The first reason wins; the Connect handler sends it as Goodbye and ends the call with its status."""
        if self.ending is None:
            self.ending = end
            self.closed.set()


@dataclass(frozen=True)
class Unparsable:
    """A request whose bytes are not the message the method takes."""

    what: str
    reason: str


class ParseGuard(grpc.aio.ServerInterceptor):
    """Lets the Arbiter service see unparsable requests instead of gRPC failing them with UNKNOWN or,
    on a stream, ending it with OK: a unary call is refused with INVALID_ARGUMENT and the parser's
    reason; on the agent stream the message becomes an :class:`Unparsable` the service rejects with
    a reason (the stream stays open)."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if handler is None or handler.request_deserializer is None or not method.startswith("/themis.v1.Arbiter/"):
            return handler
        parse_strict, name = handler.request_deserializer, method.rsplit("/", 1)[-1]

        def parse(data: bytes):
            try:
                return parse_strict(data)
            except Exception as exc:
                return Unparsable(name, f"could not parse the {name} request ({len(data)} bytes): {exc}")

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                if isinstance(request, Unparsable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
                return await inner(request, context)

            return handler._replace(request_deserializer=parse, unary_unary=unary)
        return handler._replace(request_deserializer=parse)


def quote(names) -> str:
    """Names from an agent's message, as a rejection quotes them: a few, each cut short."""
    names = list(names)
    shown = [n if len(n) <= NAME_QUOTE else n[:NAME_QUOTE] + "..." for n in names[:REASON_NAMES]]
    more = f" and {len(names) - REASON_NAMES} more" if len(names) > REASON_NAMES else ""
    return f"{shown}{more}"


def bearer(context: grpc.aio.ServicerContext) -> str | None:
    """The call's ``authorization: Bearer`` secret, if it has one."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return None


def new_secret(kind: str) -> str:
    """A bearer secret, prefixed with its kind so that it never starts with '-'.

    A bare token_urlsafe starts with '-' one time in 64, and a command line then reads
    ``--token -abc`` as a missing value (seen in CI).
    """
    return f"{kind}_{secrets.token_urlsafe(32)}"
