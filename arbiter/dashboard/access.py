"""Who may read the dashboard.

On loopback (the default) anyone who can reach the port can read it, as with the metrics: the page
is read-only and shows no credential. Off loopback every request needs a viewer token: issued and
revoked in the arbiter's journal like the apps' tokens (``Store.add_viewer`` / ``revoke_viewer``;
:func:`issue_viewer_token`), stored only as a hash, and checked on every request, so a revoked
token is refused at once (an open live stream ends at its next keep-alive).

A script sends ``Authorization: Bearer TOKEN``. A browser opens ``URL?token=TOKEN`` once: the reply
sets an HttpOnly, SameSite=Strict cookie (Secure under TLS) and sends the browser to the same URL
without the token, so the token does not stay in the address bar, the history or a shared link;
the page's scripts never see it. Refusals never echo a token. Off loopback the page should be
served over TLS (:func:`tls_context`, the same PEM pair as the gRPC side).
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

COOKIE = "themis_viewer"
TOKEN_PREFIX = "view_"

Verifier = Callable[[str], "str | None"]  # token -> the viewer's name, or None (unknown or revoked)


class ViewerStore(Protocol):
    def add_viewer(self, token: str, name: str) -> None: ...

    def viewer(self, token: str) -> str | None: ...


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``); any other name or address, and
    the wildcard, is off loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def new_viewer_token() -> str:
    """A bearer secret for a viewer, prefixed with its kind (it never starts with '-')."""
    return f"{TOKEN_PREFIX}{secrets.token_urlsafe(32)}"


def issue_viewer_token(store: ViewerStore, name: str) -> str:
    """A new viewer token for ``name``, journaled (as a hash) before it is returned."""
    if not isinstance(name, str) or not name.strip() or len(name) > 200:
        raise ValueError(f"a viewer needs a name of 1-200 characters, got {name!r}")
    token = new_viewer_token()
    store.add_viewer(token, name)
    return token


def store_verifier(store: ViewerStore) -> Verifier:
    """Check tokens against the journal's viewer tokens."""
    return store.viewer


def fixed_verifier(tokens: dict[str, str]) -> Verifier:
    """Check tokens against a fixed ``token -> name`` table (a test, a one-off viewer), in constant
    time per token."""

    def verify(token: str) -> str | None:
        for known, name in tokens.items():
            if hmac.compare_digest(known.encode(), token.encode()):
                return name
        return None

    return verify


def tls_context(cert: str | Path, key: str | Path) -> ssl.SSLContext:
    """A server TLS context from a PEM certificate chain and key (the arbiter's --tls-cert/--tls-key);
    a bad pair is a ValueError naming the files."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--tls-cert {cert} / --tls-key {key}: cannot serve TLS with them: {exc}") from None
    return context


def bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer`` header."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    return value.strip() or None if scheme.lower() == "bearer" else None
