"""``themis-agent``: what an app would bid, and an agent that joins a running arbiter.

    themis-agent rho-table APP.toml --gpus 1,2,4,8,16 [--level machine]

prints JSON {"<gpus>": rho, ...}: the app's finish-time fairness (Eq. 1/2, D2-D4) if it held that
many GPUs from now until it finishes, placed at the given locality level (D1).

    themis-agent run APP.toml --arbiter HOST:PORT --token T [--name NAME] [--speedup X]

registers the app with an admin-issued token (or reuses the credential kept in
``--credential-file``), connects, and runs the app's jobs emulated on the GPUs it is granted
(``agent.emulated``) until they finish. It prints a line per grant, revocation and trial result and a
progress bar, and keeps rho over time, the GPUs held and the trials in
``<--workdir>/<app>/<run id>/record.jsonl`` with a plot ``rho_gpus.png`` (``agent.emulated_record``).
When it cannot go on -- no arbiter answers, the token or credential is refused or revoked, an admin
removed the app, another agent took it over, Ctrl-C -- it prints one line with the cause and the
fix and exits with the code of ``protos.exits`` (docs/agents.md, "When the agent stops: exit
codes"); ``--debug`` adds the traceback (issue 36, item 4).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from agent.app_config import AppConfigError, load_app
from agent.fairness import finish_time_fairness
from agent.placement import Position

LEVELS = {"slot": 0, "machine": 1, "rack": 2, "cluster": 3}


def placed(n: int, level: int) -> list[Position]:
    """n GPUs that span exactly ``level`` (one slot; slots of one machine; machines of one rack;
    racks), so S(G) is the profile's value at that level."""
    if level == 0:
        return [("r0", "m0", "s0")] * n
    if level == 1:
        return [("r0", "m0", f"s{k}") for k in range(n)]
    if level == 2:
        return [("r0", f"m{k}", "s0") for k in range(n)]
    return [(f"r{k}", f"m{k}", "s0") for k in range(n)]


def _counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus wants a comma-separated list of integers, got {text!r}") from None
    if not counts or any(c < 0 for c in counts):
        raise argparse.ArgumentTypeError("--gpus wants non-negative GPU counts")
    return counts


def _json_number(x: float) -> float | str:
    return "Infinity" if math.isinf(x) else round(x, 10)


def rho_table(args: argparse.Namespace) -> int:
    try:
        app, ctx = load_app(args.app)
    except AppConfigError as exc:
        print(f"themis-agent: {exc}", file=sys.stderr)
        return 2
    level = LEVELS[args.level]
    table = {
        str(n): _json_number(
            finish_time_fairness(
                app, placed(n, level), now=ctx.now, n_avg=ctx.n_avg, cluster_size=ctx.cluster_size
            )
        )
        for n in args.gpus
    }
    print(json.dumps(table))
    return 0


def run_agent(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal
    import time
    from pathlib import Path

    from agent.client import AgentClient, AgentStopped, register_or_stop
    from agent.credential import CredentialFileError, keep_credential, read_credential
    from agent.emulated import EmulatedJobs, contention_class
    from agent.emulated_record import EmulatedRunRecord, TellingAgent
    from protos import exits

    if args.quiet:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    try:
        app, ctx = load_app(args.app)
    except AppConfigError as exc:
        print(f"themis-agent: {exc}", file=sys.stderr)
        return exits.USAGE
    if not (math.isfinite(args.speedup) and args.speedup > 0):  # before registering spends the token
        print(f"themis-agent: --speedup must be a positive number, got {args.speedup}", file=sys.stderr)
        return exits.USAGE
    app.start_time = time.time()
    name = args.name or Path(args.app).stem
    cred_file = Path(args.credential_file) if args.credential_file else None
    try:
        tls_ca = Path(args.tls_ca).read_bytes() if args.tls_ca else None
        credential = read_credential(cred_file) if cred_file else None
    except (OSError, CredentialFileError) as exc:
        print(f"themis-agent: {'--tls-ca: ' if not isinstance(exc, CredentialFileError) else ''}{exc}",
              file=sys.stderr)
        return exits.USAGE

    async def main_async() -> int:
        nonlocal credential
        if credential is None:
            if not args.token:
                kept = f" (none kept in {cred_file})" if cred_file else ""
                raise AgentStopped("no_credential", f"{name!r} has no credential{kept} and no --token",
                                   f"the first run needs a registration token: themis-agent run ... --token "
                                   f"\"$(themis-arbiter issue-token {name})\"")
            credential = await register_or_stop(args.arbiter, name, args.token, tls_ca=tls_ca)
            if cred_file:
                keep_credential(cred_file, credential)
        agent = TellingAgent(app, name=name)
        client = AgentClient(agent, name, args.arbiter, credential, tls_ca=tls_ca, take_over=args.take_over,
                             first_connect_timeout_s=args.connect_timeout, credential_file=cred_file)
        jobs = EmulatedJobs(client, app, speedup=args.speedup, cls=contention_class(ctx.model))
        record = EmulatedRunRecord(client, agent, args.workdir, trials=jobs.trials, quiet=args.quiet)
        jobs.on_result = record.trial
        loop = asyncio.get_running_loop()
        signalled: asyncio.Future = loop.create_future()
        for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C or a kill: stop cleanly, one line, 130 / 143
            loop.add_signal_handler(sig, lambda s=sig: signalled.done() or signalled.set_result(s))
        sampling = asyncio.create_task(record.sample_rho())
        runner = asyncio.create_task(client.run())
        working = asyncio.create_task(jobs.run())
        try:
            await asyncio.wait({runner, working, signalled}, return_when=asyncio.FIRST_COMPLETED)
            if signalled.done():
                sig = signal.Signals(signalled.result())
                client.stop()  # the stream closes; the app keeps its leases until they run out
                await asyncio.wait({runner}, timeout=5)
                if runner.done() and not runner.cancelled():
                    runner.exception()  # retrieved: a refusal that raced the signal says nothing more
                record.close(False, reason=f"interrupted ({sig.name})")
                print(f"themis-agent: {name}: interrupted ({'Ctrl-C' if sig == signal.SIGINT else sig.name}): "
                      "the emulated jobs stopped; the app's GPUs go back when their leases run out",
                      file=sys.stderr)
                return exits.INTERRUPTED if sig == signal.SIGINT else exits.TERMINATED
            if not working.done():  # the agent stopped first: removed, revoked, refused, unreachable
                why = runner.exception() or AgentStopped("ended", "the connection ended before the app finished")
                record.close(False, reason=str(why))
                raise why
            if working.exception() is not None:  # a bug in the emulation: not a finished app
                raise working.exception()
            await asyncio.wait_for(runner, 30)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            for task in (sampling, working, runner):
                task.cancel()
            await asyncio.wait({sampling, working, runner})  # nothing left pending at exit
        png = record.close(True)
        print(json.dumps({"app": name, "finished_after_s": round(jobs.finished_at - app.start_time, 1),
                          "connects": client.connects, "record": str(record.record.path),
                          "plot": str(png) if png else None}))
        return exits.OK

    return asyncio.run(main_async())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="themis-agent", description="Themis agent tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("rho-table", help="print an app's rho for given GPU counts, as JSON")
    p.add_argument("app", help="app description (TOML), e.g. examples/paper_4_3_3.toml")
    p.add_argument("--gpus", type=_counts, required=True, help="comma-separated GPU counts, e.g. 1,2,4,8,16")
    p.add_argument("--level", choices=list(LEVELS), default="machine",
                   help="locality of the GPUs (D1); default: one machine")
    p.set_defaults(func=rho_table)
    r = sub.add_parser("run", help="join an arbiter and run the app (jobs emulated on the granted GPUs)")
    r.add_argument("app", help="app description (TOML)")
    r.add_argument("--arbiter", default="127.0.0.1:50051", help="HOST:PORT of the arbiter")
    r.add_argument("--token", help="registration token (themis-arbiter issue-token), or the app credential")
    r.add_argument("--name", help="app name (default: the file name without .toml)")
    r.add_argument("--credential-file", help="where to keep the app credential for later runs")
    r.add_argument("--speedup", type=float, default=1.0, help="emulated jobs run this many times real time")
    r.add_argument("--tls-ca", help="CA certificate (PEM) to check the arbiter's TLS certificate")
    r.add_argument("--take-over", action="store_true",
                   help="replace an agent of the same app that is connected now (by default the arbiter "
                        "refuses a second one with ALREADY_EXISTS)")
    r.add_argument("--workdir", default="themis-runs",
                   help="where the run's record.jsonl and rho_gpus.png go, under <workdir>/<app>/<run id>/ "
                        "(default: ./themis-runs)")
    r.add_argument("--quiet", action="store_true", help="no lines or progress bar (warnings and errors only)")
    r.add_argument("--connect-timeout", type=float, default=120.0, metavar="S",
                   help="stop (exit 3) when no arbiter has answered for this long at the start (default 120 s)")
    r.set_defaults(func=run_agent)
    for each in (p, r):
        each.add_argument("--debug", action="store_true", help="show the traceback of an error, not only its line")
    args = parser.parse_args(argv)
    from protos.exits import say

    try:
        return args.func(args)
    except (Exception, KeyboardInterrupt) as exc:  # one line with the cause and the fix (docs/agents.md)
        return say("themis-agent", exc, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
