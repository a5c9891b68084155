"""Dialing the arbiter: the gRPC channel, bearer metadata and the token calls both sides need.

Agents (``agent.client``) and the arbiter's own command line (``themis-arbiter issue-token``,
``status``, ``drain``) talk to a running arbiter the same way. This module sits under both, next to
the wire contract, so the arbiter package needs nothing from the agent package (issue 12, item 7).
"""

from __future__ import annotations

import grpc

from protos import themis_pb2 as pb
from protos import themis_pb2_grpc as pb_grpc

KEEPALIVE = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
             ("grpc.keepalive_permit_without_calls", 1)]


def channel(target: str, tls_ca: bytes | None = None) -> grpc.aio.Channel:
    """An asyncio channel to ``target`` (HOST:PORT); TLS checked against ``tls_ca`` when given."""
    if tls_ca is not None:
        return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(tls_ca), options=KEEPALIVE)
    return grpc.aio.insecure_channel(target, options=KEEPALIVE)


def bearer(token: str) -> list[tuple[str, str]]:
    """Call metadata carrying ``token`` (admin token, registration token or app credential)."""
    return [("authorization", f"Bearer {token}")]


async def register(target: str, app: str, token: str, *, tls_ca: bytes | None = None) -> str:
    """Trade an admin-issued registration token for the app's credential (revoking any older one)."""
    async with channel(target, tls_ca) as ch:
        reply = await pb_grpc.ArbiterStub(ch).Register(pb.RegisterRequest(app=app), metadata=bearer(token), timeout=10)
    return reply.credential


async def issue_token(target: str, app: str, admin_token: str, *, tls_ca: bytes | None = None,
                      model: str = "") -> str:
    """An admin's registration token for ``app``, good for one Register call; ``model`` binds the
    app to a model of the arbiter's profile table (D21; empty: as before)."""
    async with channel(target, tls_ca) as ch:
        reply = await pb_grpc.ArbiterStub(ch).IssueToken(pb.IssueTokenRequest(app=app, model=model),
                                                         metadata=bearer(admin_token), timeout=10)
    return reply.token


async def viewer_token(target: str, name: str, admin_token: str, *, revoke: bool = False,
                       tls_ca: bytes | None = None) -> pb.ViewerTokenReply:
    """An admin's dashboard viewer token for ``name`` (or, with ``revoke``, the end of all of them)."""
    async with channel(target, tls_ca) as ch:
        stub = pb_grpc.ArbiterStub(ch)
        call = stub.RevokeViewerToken if revoke else stub.IssueViewerToken
        return await call(pb.ViewerTokenRequest(name=name), metadata=bearer(admin_token), timeout=10)
