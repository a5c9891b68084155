"""What the command-line tools and the python API say when they cannot go on (issue 36, item 4).

``themis-agent``, ``themis-arbiter`` and ``AppRunner`` stop for a handful of reasons a person can
act on: no arbiter answers, the arbiter refuses the token or credential (or revoked it), an admin
removed the app, another agent took it over, Ctrl-C. Each says **one line** with the cause and the
fix, and the two commands exit with the code below (docs/agents.md, "When the agent stops: exit
codes"); a traceback only with ``--debug``. The python API raises :class:`Stopped` (the agent's
:class:`agent.client.AgentStopped` is one), whose ``str()`` is that line and whose ``exit_code`` is
what the commands would exit with.

The codes live here, under both the agent and the arbiter's command line, because the arbiter
package imports nothing of the agent (issue 12, item 7).
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Iterator

import grpc

__all__ = ["CODES", "Stopped", "exit_code_of", "one_line_errors", "rpc_stopped", "say"]

OK = 0
FAILED = 1  # the search failed (its trials kept failing), or an error not listed here
USAGE = 2  # a bad argument or app file (also argparse's own code)
UNREACHABLE = 3  # no arbiter answered at the address
REFUSED = 4  # no credential or token, or the arbiter refused or revoked it
REMOVED = 5  # an admin removed the app (themis-arbiter remove-app)
REPLACED = 6  # another agent of the app runs (ALREADY_EXISTS) or took over (--take-over)
INTERRUPTED = 130  # SIGINT: Ctrl-C (128 + 2)
TERMINATED = 143  # SIGTERM to an agent (128 + 15); the arbiter's serve exits 0 on SIGTERM

#: code -> (meaning, fix): the table in docs/agents.md (tests/test_errors_one_line.py keeps them equal)
CODES: dict[int, tuple[str, str]] = {
    OK: ("the search finished; the command did what it was asked; `serve` stopped by SIGTERM", "-"),
    FAILED: ("the search failed (`SearchFailed`: its runs kept failing), the arbiter refused an admin call "
             "(NOT_FOUND, INVALID_ARGUMENT, ...), or an internal error",
             "the line says which; `--debug` shows the traceback"),
    USAGE: ("a bad argument, app file or TLS file; `serve` could not start (the port taken, the journal in use)",
            "the line names it"),
    UNREACHABLE: ("no arbiter answered at the address (connection refused, no Welcome in time)",
                  "start it (`themis-arbiter serve`), or give the address of a running one (`--arbiter HOST:PORT`; "
                  "a TLS arbiter also needs `--tls-ca`)"),
    REFUSED: ("no credential and no registration token; the token was refused (unknown or used); the credential "
              "was refused or revoked; an admin command's token was refused",
              "a new registration token: `themis-arbiter issue-token APP`, given with `--token` (`token=`) after "
              "deleting a stale credential file; admin commands: `--admin-token` or `--db` of the arbiter's journal"),
    REMOVED: ("an admin removed the app (`themis-arbiter remove-app`); its leases ended",
              "to run it again, a new registration token (`themis-arbiter issue-token APP`)"),
    REPLACED: ("another agent of the app is connected (ALREADY_EXISTS), or one took over this one (`--take-over`)",
               "stop the other agent, or start this one with `--take-over` (`take_over=True`)"),
    INTERRUPTED: ("interrupted: Ctrl-C (SIGINT); jobs stopped, `serve` stopped", "-"),
    TERMINATED: ("`themis-agent` stopped by SIGTERM; jobs stopped", "-"),
}


def _one_line(text: str) -> str:
    return " ".join(text.split())


class Stopped(RuntimeError):
    """The tool or the search cannot go on. ``why`` is a short word (``unreachable``, ``refused``,
    ``removed``, ...), ``reason`` the cause, ``fix`` what to do; ``str()`` is one line,
    ``"<why>: <reason>; <fix>"``; ``exit_code`` is what ``themis-agent`` / ``themis-arbiter`` exit with."""

    def __init__(self, why: str, reason: str, fix: str | None = None, exit_code: int = FAILED) -> None:
        self.why, self.reason, self.fix, self.exit_code = why, _one_line(reason), fix and _one_line(fix), exit_code
        super().__init__(f"{why}: {self.reason}" + (f"; {self.fix}" if self.fix else ""))


def rpc_cause(exc: grpc.aio.AioRpcError) -> str:
    """A failed call's status in a few words: gRPC's "failed to connect to all addresses; last
    error: UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote host: Connection refused" becomes
    "UNAVAILABLE: Connection refused"."""
    details = exc.details() or ""
    if "last error:" in details:
        details = details.rsplit("last error:", 1)[1].rsplit(": ", 1)[-1].strip()
    return f"{exc.code().name}: {_one_line(details)}" if details else exc.code().name


def _connection_failed(exc: grpc.aio.AioRpcError) -> bool:
    """UNAVAILABLE from the channel (nothing listens, a reset, a TLS mismatch), not an arbiter's
    answer (it says UNAVAILABLE when its journal cannot be written: that is not "unreachable")."""
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return True
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    details = (exc.details() or "").lower()
    return any(w in details for w in ("failed to connect", "connection refused", "socket closed", "connection reset",
                                      "handshake", "dns", "connect failed", "end of tcp stream", "broken pipe",
                                      "ssl")) or not details


def unreachable(target: str, cause: str, *, tls: bool = False) -> Stopped:
    fix = ("start it (themis-arbiter serve) or give the address of a running one (--arbiter HOST:PORT)"
           + ("; check that --tls-ca is the CA of its certificate" if tls else "; a TLS arbiter needs --tls-ca"))
    return Stopped("unreachable", f"no arbiter answered at {target} ({cause})", fix, UNREACHABLE)


def rpc_stopped(exc: grpc.aio.AioRpcError, target: str, *, what: str, refused_fix: str,
                tls: bool = False) -> Stopped:
    """What a failed unary call (``what``: "registration", "status", ...) means for a person:
    unreachable (3), refused with ``refused_fix`` (4), else the arbiter's answer as it is (1)."""
    if _connection_failed(exc):
        return unreachable(target, rpc_cause(exc), tls=tls)
    if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return Stopped("refused", f"the arbiter at {target} refused the {what} ({rpc_cause(exc)})", refused_fix,
                       REFUSED)
    return Stopped("failed", f"the arbiter at {target} answered the {what} with {rpc_cause(exc)}", None, FAILED)


def exit_code_of(exc: BaseException) -> int:
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED
    return getattr(exc, "exit_code", FAILED) if isinstance(getattr(exc, "exit_code", None), int) else FAILED


def say(prog: str, exc: BaseException, *, debug: bool = False, internal: bool = True) -> int:
    """Print what ended ``prog`` on stderr, one line (with the traceback first when ``debug``), and
    return its exit code. An exception without an ``exit_code`` is an internal error (a bug): one
    line naming it and ``--debug`` when ``internal``."""
    if debug:
        traceback.print_exception(exc)
    if isinstance(exc, KeyboardInterrupt):
        line = "interrupted (Ctrl-C)"
    elif isinstance(exc, Stopped) or isinstance(getattr(exc, "exit_code", None), int):
        line = str(exc)
    elif isinstance(exc, grpc.aio.AioRpcError):
        line = f"failed: {rpc_cause(exc)}"
    else:
        line = f"internal error: {type(exc).__name__}: {_one_line(str(exc))}" + (
            "" if debug or not internal else " (run with --debug for the traceback)")
    print(f"{prog}: {line}", file=sys.stderr, flush=True)
    return exit_code_of(exc)


@contextlib.contextmanager
def one_line_errors(prog: str, *, debug: bool = False) -> Iterator[None]:
    """For a script around ``AppRunner``: a :class:`Stopped` (unreachable, refused, removed,
    replaced) or Ctrl-C ends the program with one line on stderr and the documented exit code;
    other exceptions go on as they are (with their traceback)::

        with one_line_errors("search.py"):
            asyncio.run(main())
    """
    try:
        yield
    except (Stopped, KeyboardInterrupt) as exc:
        raise SystemExit(say(prog, exc, debug=debug)) from None
