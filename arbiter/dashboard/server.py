"""The dashboard's web server: the page, its JSON API (``/api/v1``) and the live stream, on aiohttp in
the caller's event loop.

aiohttp, because the arbiter is one asyncio process (grpc.aio, aiomqtt): a second server in the same
loop reads the round driver's state without threads or locks, and aiohttp brings its own HTTP
server (no ASGI server to pick and run), server-sent events as a plain streaming response, TLS
from an ``ssl.SSLContext``, and a long maintenance record.

The API is read-only and versioned by its path; docs/service.md ("Dashboard") documents every
reply with an example. Errors are JSON ``{"error": "..."}`` with 400 (a bad parameter, named),
401 (a viewer token is needed or was refused) or 404 (a round that is not kept).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from aiohttp import web

from arbiter.dashboard.access import COOKIE, Verifier, bearer, is_loopback
from arbiter.dashboard.model import API_VERSION, EVENT_KINDS, to_json
from arbiter.dashboard.source import DashboardSource, NotKept

log = logging.getLogger("themis.dashboard")

STATIC = Path(str(resources.files("arbiter.dashboard") / "static"))
KEEPALIVE_S = 15.0
MAX_LIMIT = 5000
ENDPOINTS = {
    "cluster": "/api/v1/cluster?at=ROUND",
    "apps": "/api/v1/apps?at=ROUND&history=N",
    "app": "/api/v1/apps/{app}?history=N",
    "app_rounds": "/api/v1/apps/{app}/rounds?limit=N&before=ROUND",
    "rounds": "/api/v1/rounds?limit=N&before=ROUND&app=APP",
    "round": "/api/v1/rounds/{id}",
    "fairness": "/api/v1/fairness?points=N",
    "events": "/api/v1/events?limit=N&before=SEQ&kind=K1,K2&app=APP",
    "settings": "/api/v1/settings",
    "timeline": "/api/v1/timeline",
    "stream": "/api/v1/stream",
}
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
                               "form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
SOURCE = web.AppKey("source", DashboardSource)
STREAMS = web.AppKey("streams", set)
VIEWER = web.RequestKey("viewer", str)  # the name the request's viewer token was issued to


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(data, separators=(",", ":")), status=status, content_type="application/json",
                        headers={"Cache-Control": "no-store"})


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status)


class BadParameter(ValueError):
    pass


def _int(request: web.Request, name: str, default: int | None, lo: int, hi: int) -> int | None:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadParameter(f"{name} must be an integer, got {raw[:40]!r}") from None
    if not lo <= value <= hi:
        raise BadParameter(f"{name} must be within {lo}-{hi}, got {value}")
    return value


def _text(request: web.Request, name: str) -> str | None:
    raw = request.query.get(name)
    if raw is not None and len(raw) > 200:
        raise BadParameter(f"{name} is longer than 200 characters")
    return raw or None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _guarded(verify: Verifier | None, require_token: bool, secure: bool):
    """The access rule (``arbiter.dashboard.access``) and the parameter errors, around every handler."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if require_token:
            assert verify is not None
            query_token = request.query.get("token")
            token = query_token or bearer(request.headers.get("Authorization")) or request.cookies.get(COOKIE)
            viewer = verify(token) if token else None
            if viewer is None:
                return _refused(request, "a viewer token is required" if not token
                                else "this viewer token is unknown or was revoked")
            request[VIEWER] = viewer
            if query_token:
                rest = {k: v for k, v in request.query.items() if k != "token"}
                target = request.path + (f"?{urlencode(rest)}" if rest else "")
                reply = web.HTTPSeeOther(target)
                reply.set_cookie(COOKIE, query_token, httponly=True, secure=secure, samesite="Strict", path="/")
                raise reply
        try:
            return await handler(request)
        except BadParameter as exc:
            return _error(400, str(exc))
        except NotKept as exc:
            return _error(404, str(exc.args[0]) if exc.args else "not kept")

    return guard


def _refused(request: web.Request, why: str) -> web.StreamResponse:
    if request.path.startswith("/api/"):
        return _error(401, why + " (send Authorization: Bearer TOKEN)")
    page = ("<!doctype html><meta charset=utf-8><title>Themis dashboard</title>"
            f"<p>{why}. Open this address with <code>?token=</code> and the viewer token an operator "
            "issued you (it is kept in a cookie and taken out of the address).</p>")
    response = web.Response(text=page, status=401, content_type="text/html")
    response.headers["WWW-Authenticate"] = 'Bearer realm="themis-dashboard"'
    if COOKIE in request.cookies:
        response.del_cookie(COOKIE, path="/")
    return response


async def _headers(request: web.Request, response: web.StreamResponse) -> None:
    response.headers.update(HEADERS)
    if request.path.startswith("/static/") or request.path == "/":
        response.headers.setdefault("Cache-Control", "no-cache")


def make_app(source: DashboardSource, *, verify: Verifier | None = None, require_token: bool = False,
             secure: bool = False, keepalive_s: float = KEEPALIVE_S) -> web.Application:
    """The dashboard as an aiohttp application (``start`` serves it)."""
    if require_token and verify is None:
        raise ValueError("a dashboard that needs viewer tokens needs a verifier to check them")
    app = web.Application(middlewares=[_guarded(verify, require_token, secure)])
    app[SOURCE] = source
    app[STREAMS] = set()
    app.on_response_prepare.append(_headers)
    app.on_shutdown.append(_end_streams)
    api = Api(source, verify if require_token else None, keepalive_s)
    app.add_routes([
        web.get("/", _index),
        web.get("/api/v1", api.index),
        web.get("/api/v1/cluster", api.cluster),
        web.get("/api/v1/apps", api.apps),
        web.get("/api/v1/apps/{app}", api.app),
        web.get("/api/v1/apps/{app}/rounds", api.app_rounds),
        web.get("/api/v1/rounds", api.rounds),
        web.get("/api/v1/rounds/{round_id}", api.round),
        web.get("/api/v1/fairness", api.fairness),
        web.get("/api/v1/events", api.events),
        web.get("/api/v1/settings", api.settings),
        web.get("/api/v1/timeline", api.timeline),
        web.get("/api/v1/stream", api.stream),
        web.static("/static", STATIC, show_index=False, follow_symlinks=False),
    ])
    return app


async def _index(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC / "index.html")


async def _end_streams(app: web.Application) -> None:
    for task in list(app[STREAMS]):
        task.cancel()


@dataclass
class Api:
    source: DashboardSource
    verify: Verifier | None
    keepalive_s: float

    async def index(self, request: web.Request) -> web.Response:
        return _json({"api": API_VERSION, "about": to_json(self.source.about()), "endpoints": ENDPOINTS,
                      "event_kinds": list(EVENT_KINDS)})

    def _at(self, request: web.Request) -> int | None:
        return _int(request, "at", None, 0, 2**62)

    async def cluster(self, request: web.Request) -> web.Response:
        return _json(to_json(self.source.cluster(self._at(request))))

    async def apps(self, request: web.Request) -> web.Response:
        return _json(to_json(self.source.apps(self._at(request), _int(request, "history", 32, 0, 100_000))))

    async def app(self, request: web.Request) -> web.Response:
        view = self.source.app(request.match_info["app"], _int(request, "history", 100_000, 0, 1_000_000))
        return _json(to_json(view))

    async def app_rounds(self, request: web.Request) -> web.Response:
        rounds = self.source.app_rounds(request.match_info["app"], _int(request, "limit", 50, 1, MAX_LIMIT),
                                        _int(request, "before", None, 0, 2**62))
        return _json({"app": request.match_info["app"], "rounds": to_json(rounds)})

    async def rounds(self, request: web.Request) -> web.Response:
        briefs = self.source.rounds(_int(request, "limit", 50, 1, MAX_LIMIT), _int(request, "before", None, 0, 2**62),
                                    _text(request, "app"))
        return _json({"rounds": to_json(briefs)})

    async def round(self, request: web.Request) -> web.Response:
        raw = request.match_info["round_id"]
        if not raw.isdigit() or len(raw) > 18:
            raise BadParameter(f"a round id is a number, got {raw[:40]!r}")
        view = self.source.round(int(raw))
        return _json({**to_json(view), "bidders": list(view.bidders)})

    async def fairness(self, request: web.Request) -> web.Response:
        return _json(to_json(self.source.fairness(_int(request, "points", 2000, 2, 100_000))))

    async def events(self, request: web.Request) -> web.Response:
        kinds_raw = _text(request, "kind")
        kinds = frozenset(k for k in (kinds_raw or "").split(",") if k) or None
        unknown = sorted((kinds or frozenset()) - set(EVENT_KINDS))
        if unknown:
            raise BadParameter(f"unknown event kind {unknown[0]!r}; kinds are {', '.join(EVENT_KINDS)}")
        events = self.source.events(_int(request, "limit", 100, 1, MAX_LIMIT), _int(request, "before", None, 0, 2**62),
                                    kinds, _text(request, "app"))
        return _json({"events": to_json(events)})

    async def settings(self, request: web.Request) -> web.Response:
        return _json({"settings": to_json(dict(self.source.settings())), "about": to_json(self.source.about())})

    async def timeline(self, request: web.Request) -> web.Response:
        return _json(to_json(self.source.timeline()))

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: ``state``, ``round``, ``event``, ``settings``, ``layout``, ``resync``
        (read everything again), each with its JSON as data; a comment line as keep-alive."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        streams: set = request.app[STREAMS]
        task = asyncio.current_task()
        streams.add(task)
        sub = self.source.subscribe()
        token = request.cookies.get(COOKIE) or bearer(request.headers.get("Authorization"))
        try:
            await response.write(b"retry: 2000\nevent: hello\ndata: {}\n\n")
            while True:
                try:
                    change = await asyncio.wait_for(sub.get(), self.keepalive_s)
                except TimeoutError:
                    if self.verify is not None and (not token or self.verify(token) is None):
                        await response.write(b"event: revoked\ndata: {}\n\n")
                        break
                    await response.write(b": keep-alive\n\n")
                    continue
                await response.write(f"event: {change.kind}\ndata: {change.data}\n\n".encode())
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            sub.close()
            streams.discard(task)
        with contextlib.suppress(ConnectionResetError, RuntimeError):
            await response.write_eof()
        return response


@dataclass
class Dashboard:
    """A running dashboard; ``await stop()`` ends it (and its live streams)."""

    runner: web.AppRunner
    host: str
    port: int
    secure: bool

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.secure else 'http'}://{host}:{self.port}/"

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start(host: str, port: int, source: DashboardSource, *, verify: Verifier | None = None,
                ssl_context=None, require_token: bool | None = None, keepalive_s: float = KEEPALIVE_S) -> Dashboard:
    """Serve ``source`` on ``host:port`` (0: any free port) in the running event loop.

    Off loopback every request needs a viewer token that ``verify`` accepts (``require_token``
    defaults to "not loopback"; True asks for tokens on loopback too). ``ssl_context`` serves TLS
    (``arbiter.dashboard.access.tls_context``); off loopback without it, tokens cross the network in
    the clear, which is logged as a warning."""
    if require_token is None:
        require_token = not is_loopback(host)
    if require_token and verify is None:
        raise ValueError(f"the dashboard on {host} (off loopback) needs viewer tokens: give a verifier "
                         "(arbiter.dashboard.access.store_verifier), or serve it on 127.0.0.1")
    if not is_loopback(host) and ssl_context is None:
        log.warning("the dashboard on %s is served without TLS: viewer tokens cross the network in the clear", host)
    app = make_app(source, verify=verify, require_token=require_token, secure=ssl_context is not None,
                   keepalive_s=keepalive_s)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(exc.errno, f"the dashboard cannot listen on {host}:{port}: {exc.strerror}") from None
    bound = runner.addresses[0][1] if runner.addresses else port  # the port the OS picked for port 0
    return Dashboard(runner, host, bound, ssl_context is not None)
