"""``themis-arbiter``: run the arbiter service, and talk to a running one.

    themis-arbiter serve --cluster NAME|FILE [--port 50051] [--db PATH] [--mqtt URL]
                         [--policy themis] [--fairness-knob 0.8] [--lease 600] [--metrics-port 9464]
    themis-arbiter issue-token APP [--arbiter HOST:PORT] [--admin-token T]
    themis-arbiter status [--arbiter HOST:PORT] [--admin-token T]
    themis-arbiter drain MACHINE [--resume] [--arbiter HOST:PORT] [--admin-token T]
    themis-arbiter remove-app APP | revoke-credential APP [--arbiter HOST:PORT] [--admin-token T]
    themis-arbiter demo [--seconds 60] [--contention deepshare]
    themis-arbiter cluster-from-slurm [--name NAME] [--gres-type g{index}] [--from FILE] > cluster.toml
    themis-arbiter slurm-sync [--arbiter HOST:PORT] [--admin-token T] [--from FILE]

``serve`` keeps its journal in ``--db`` (default ``themis-arbiter.db`` here) and, without an admin
token given (``--admin-token`` or THEMIS_ADMIN_TOKEN), writes one to ``<db>.admin-token``. Logs go
to stderr: one JSON object per line (``--log-format json``; the default when stderr is not a
terminal: a service's log) or a line for a person (``human``; the default on a terminal). On
SIGTERM or SIGINT it stops and says so in a last line (apps, leases, the journal), then exits 0
(SIGTERM) or 130 (SIGINT). Every command that cannot go on says one line with the cause and the fix
and exits with the code of ``protos.exits`` (docs/agents.md); ``--debug`` adds the traceback.
``demo`` starts an arbiter and two agents in one process on loopback (short leases, emulated jobs)
and prints rounds, grants and expiries as they happen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import signal
import sys
import traceback
from pathlib import Path

from arbiter.rank import RANKS
from protos import exits
from protos.exits import Stopped

DEFAULT_TARGET = "127.0.0.1:50051"


class JsonLogs(logging.Formatter):
    """One JSON object per line: time, level, logger, message and the record's ``fields``."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"t": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class HumanLogs(logging.Formatter):
    """A line for a person (issue 36, item 5): local time, level, message, then the fields as
    ``key=value`` (numbers to 3 decimals, lists and maps compact)."""

    def format(self, record: logging.LogRecord) -> str:
        import datetime

        when = datetime.datetime.fromtimestamp(record.created).strftime("%H:%M:%S")
        fields = " ".join(f"{k}={_human(v)}" for k, v in getattr(record, "fields", {}).items())
        line = f"{when} {record.levelname:<7} {record.getMessage()}" + (f"  {fields}" if fields else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _human(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".") if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple, set)):
        return "[" + ",".join(_human(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_human(v)}" for k, v in value.items()) + "}"
    text = str(value)
    return json.dumps(text) if (not text or any(c.isspace() for c in text)) else text


LOG_FORMATS = ("auto", "human", "json")


def _logging(level: str = "INFO", fmt: str = "json") -> None:
    """Logs on stderr: ``json`` (one object per line, for a service's log), ``human``, or ``auto``:
    human on a terminal, else JSON."""
    if fmt == "auto":
        fmt = "human" if sys.stderr.isatty() else "json"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(HumanLogs() if fmt == "human" else JsonLogs())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def _tls_ca(args: argparse.Namespace) -> bytes | None:
    """The CA certificate to check a TLS arbiter against: --tls-ca, else THEMIS_TLS_CA; None: plain."""
    path = getattr(args, "tls_ca", None) or os.environ.get("THEMIS_TLS_CA")
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise Stopped("usage", f"--tls-ca {path}: {exc.strerror or exc}", "give the CA certificate (PEM) of the "
                      "arbiter's TLS certificate", exits.USAGE) from None


def _admin_token(args: argparse.Namespace) -> str:
    token = args.admin_token or os.environ.get("THEMIS_ADMIN_TOKEN")
    if not token and Path(f"{args.db}.admin-token").exists():
        token = Path(f"{args.db}.admin-token").read_text().strip()
    if not token:
        raise Stopped("no_admin_token", f"no admin token given, and none kept in {args.db}.admin-token",
                      "give --admin-token (or THEMIS_ADMIN_TOKEN), or --db of the arbiter's journal (serve writes "
                      "its admin token next to it)", exits.REFUSED)
    return token


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {port}")
    return port


def _limit(text: str) -> tuple[str, float]:
    from dataclasses import fields

    from arbiter.limits import Limits

    name, sep, value = text.partition("=")
    names = [f.name for f in fields(Limits)]
    if not sep or name not in names:
        raise argparse.ArgumentTypeError(f"a limit is NAME=VALUE with NAME one of {', '.join(names)}; got {text!r}")
    try:
        return name, (float(value) if name.endswith("_s") else int(value))
    except ValueError:
        raise argparse.ArgumentTypeError(f"limit {name}: not a number: {value!r}") from None


def _limits(pairs: list[tuple[str, float]]):
    from arbiter.limits import Limits

    limits = Limits(**dict(pairs))
    try:
        limits.check()
    except ValueError as exc:
        raise Stopped("usage", str(exc), "see --limit in themis-arbiter serve --help", exits.USAGE) from None
    return limits


def cmd_serve(args: argparse.Namespace) -> int:
    from arbiter.cluster import ClusterFileError
    from arbiter.server import ArbiterServer, ServerConfig
    from arbiter.store import StoreError

    _logging(args.log_level, args.log_format)
    config = ServerConfig(
        cluster=args.cluster, host=args.host, port=args.port, db=Path(args.db), mqtt=args.mqtt,
        admin_token=args.admin_token, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
        tls_cert=Path(args.tls_cert) if args.tls_cert else None, tls_key=Path(args.tls_key) if args.tls_key else None,
        policy=args.policy, fairness_knob=args.fairness_knob, lease_s=args.lease, coalesce_s=args.coalesce,
        report_timeout_s=args.report_timeout, bid_timeout_s=args.bid_timeout, max_contenders=args.max_contenders,
        min_bidders=args.min_bidders, rank=args.rank, reclaim=args.reclaim, idle_s=args.idle_s, profiles=tuple(Path(p) for p in args.profiles),
        admission=args.admission, http=args.http, contention=args.contention,
        limits=_limits(args.limit),
    )
    if bool(args.tls_cert) != bool(args.tls_key):
        raise Stopped("usage", "--tls-cert and --tls-key go together", "give both, or neither", exits.USAGE)

    async def serve() -> int:
        server = ArbiterServer(config)
        try:
            await server.start()
        except (ClusterFileError, StoreError, ValueError, OSError) as exc:
            print(f"themis-arbiter: {exc}", file=sys.stderr)
            return 2
        loop = asyncio.get_running_loop()
        got: asyncio.Future = loop.create_future()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda s=sig: got.done() or got.set_result(s))
        sig = signal.Signals(await got)
        await server.stop(why=sig.name)  # its last log line: "arbiter stopped (SIGTERM): ..."
        return exits.INTERRUPTED if sig == signal.SIGINT else exits.OK

    return asyncio.run(serve())


def cmd_issue_token(args: argparse.Namespace) -> int:
    from protos.rpc import issue_token

    print(asyncio.run(issue_token(args.arbiter, args.app, _admin_token(args), model=args.model or "",
                                  tls_ca=_tls_ca(args))))
    return 0


def cmd_viewer_token(args: argparse.Namespace) -> int:
    """``issue-viewer-token NAME`` prints a new dashboard token; ``revoke-viewer-token NAME`` ends
    every token of that name."""
    from protos.rpc import viewer_token

    revoke = args.command == "revoke-viewer-token"
    reply = asyncio.run(viewer_token(args.arbiter, args.name, _admin_token(args), revoke=revoke, tls_ca=_tls_ca(args)))
    print(f"revoked {reply.revoked} viewer token(s) of {reply.name}" if revoke else reply.token)
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    """Drain a machine: no new grants there; its leases run out (before maintenance, or when the
    cluster engine reports the node down)."""
    from protos import themis_pb2 as pb
    from protos import themis_pb2_grpc as pb_grpc
    from protos.rpc import channel

    async def drain():
        async with channel(args.arbiter, _tls_ca(args)) as ch:
            stub = pb_grpc.ArbiterStub(ch)
            return await stub.DrainMachine(pb.DrainMachineRequest(machine=args.machine,
                                                                  resume=getattr(args, "resume", False)),
                                           metadata=[("authorization", f"Bearer {_admin_token(args)}")])

    state = asyncio.run(drain())
    if args.command == "drain":
        print(json.dumps({"drained": list(state.drained_machines)}))
    return 0


def cmd_app_call(args: argparse.Namespace) -> int:
    """``remove-app`` (the app leaves for good) and ``revoke-credential`` (its credentials stop
    working; it keeps its leases until they run out), issue 12 item 3."""
    from protos import themis_pb2 as pb
    from protos import themis_pb2_grpc as pb_grpc
    from protos.rpc import bearer, channel

    async def call():
        async with channel(args.arbiter, _tls_ca(args)) as ch:
            stub = pb_grpc.ArbiterStub(ch)
            if args.command == "remove-app":
                return await stub.RemoveApp(pb.RemoveAppRequest(app=args.app), metadata=bearer(_admin_token(args)),
                                            timeout=10)
            return await stub.RevokeCredential(pb.RevokeCredentialRequest(app=args.app),
                                               metadata=bearer(_admin_token(args)), timeout=10)

    state = asyncio.run(call())
    print(json.dumps({"app": state.app, "active": state.active, "connected": state.connected,
                      "gpus": sorted(x.gpu for x in state.leases)}))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from protos import themis_pb2 as pb
    from protos import themis_pb2_grpc as pb_grpc
    from protos.rpc import channel

    async def status() -> dict:
        meta = [("authorization", f"Bearer {_admin_token(args)}")]
        async with channel(args.arbiter, _tls_ca(args)) as ch:
            stub = pb_grpc.ArbiterStub(ch)
            cluster = await stub.GetClusterState(pb.ClusterStateRequest(), metadata=meta, timeout=10)
            apps = await stub.ListApps(pb.ListAppsRequest(), metadata=meta, timeout=10)
            rounds = await stub.RoundHistory(pb.RoundHistoryRequest(limit=args.rounds), metadata=meta, timeout=10)
        return {
            "cluster": cluster.cluster, "size": cluster.size, "free": len(cluster.free),
            "drained": list(cluster.drained_machines), "round_id": cluster.round_id,
            "settings": MessageToDict(cluster.settings),
            # rho: on what the app holds after the last round it took part in (issue 11, item 2)
            "apps": [{"app": a.app, "connected": a.connected, "idle": a.idle, "demand": a.demand,
                      "model": a.model or None,
                      "rho": a.last_rho if math.isfinite(a.last_rho) else None,
                      "gpus": len(a.leases), "held": sorted(x.gpu for x in a.leases)} for a in apps.apps],
            "rounds": [MessageToDict(r) for r in rounds.rounds],
            # the latest apps that left, newest first (issue 36: status forgot them)
            "departed": [{"app": d.app, "why": d.why, "arrived": d.arrived, "left": d.left,
                          "rho": d.last_rho if math.isfinite(d.last_rho) else None,
                          "gpu_hours": d.gpu_seconds / 3600} for d in apps.departed],
        }

    state = asyncio.run(status())
    if args.json:
        print(json.dumps(state, indent=1, default=str))
    else:
        _print_status(state)
    return 0


def _clock(t: float) -> str:
    """A time as the status tables show it: local time of day (and the date if not today)."""
    import datetime

    when = datetime.datetime.fromtimestamp(t)
    return when.strftime("%H:%M:%S" if when.date() == datetime.date.today() else "%Y-%m-%d %H:%M")


def _print_status(state: dict) -> None:
    """``status`` for a person (issue 36): the cluster in a line, then the apps and the recent rounds
    as tables, times in local time, rho to two decimals ("-": none yet, inf: holds nothing)."""
    import datetime

    from rich.console import Console
    from rich.table import Table

    console = Console()
    s = state["settings"]
    console.print(f"[b]{state['cluster']}[/]: {state['size']} GPUs, {state['free']} free"
                  + (f", drained: {', '.join(state['drained'])}" if state["drained"] else "")
                  + f"; round {state['round_id']}; policy {s.get('policy', '?')}, lease {s.get('leaseS', 0):g} s, "
                  + f"rank {s.get('rank', '?')}")
    apps = Table(title="apps", title_justify="left")
    for col in ("app", "agent", "demand", "GPUs", "rho", "model"):
        apps.add_column(col, justify="left" if col in ("app", "agent", "model") else "right")
    for a in state["apps"]:
        agent = "connected" if a["connected"] else ("idle" if a.get("idle") else "away")
        rho = "-" if a["rho"] is None else f"{a['rho']:.2f}"
        apps.add_row(a["app"], agent, str(a["demand"]), str(a["gpus"]), rho, a["model"] or "")
    console.print(apps if state["apps"] else "no apps")
    if state.get("departed"):
        gone = Table(title="apps that left (latest first)", title_justify="left")
        for col in ("app", "why", "arrived", "left", "took", "GPU-h", "last rho"):
            gone.add_column(col, justify="left" if col in ("app", "why") else "right")
        for d in state["departed"]:
            took = d["left"] - d["arrived"]
            gone.add_row(d["app"], d["why"], _clock(d["arrived"]), _clock(d["left"]),
                         f"{took / 60:.1f} min" if took < 3600 else f"{took / 3600:.1f} h", f"{d['gpu_hours']:.2f}",
                         "-" if d["rho"] is None else f"{d['rho']:.2f}")
        console.print(gone)
    rounds = Table(title="recent rounds", title_justify="left")
    for col in ("round", "time", "offered", "bidders", "granted", "idle", "s"):
        rounds.add_column(col, justify="right")
    for r in state["rounds"]:
        when = datetime.datetime.fromtimestamp(r.get("now", 0)).strftime("%H:%M:%S")
        granted = ", ".join(f"{app} {n}" for app, n in sorted(r.get("granted", {}).items())) or "-"
        rounds.add_row(str(r.get("roundId", "")), when, str(r.get("offered", 0)), str(len(r.get("bidders", []))),
                       granted, str(r.get("idle", 0)), f"{r.get('latencyS', 0):.2f}")
    console.print(rounds if state["rounds"] else "no rounds yet")


def cmd_demo(args: argparse.Namespace) -> int:
    """The demo lives a layer up (``themis_demo``): it needs the agents too, so it runs as its own
    program (``python -m themis_demo.service``) and the arbiter package imports nothing above it."""
    import subprocess

    argv = [sys.executable, "-m", "themis_demo.service", "--seconds", str(args.seconds)]
    if args.mqtt:
        argv += ["--mqtt", args.mqtt]
    if args.contention:
        argv += ["--contention", args.contention]
    return subprocess.run(argv).returncode


def _scontrol_nodes(args: argparse.Namespace) -> str | None:
    """``scontrol --oneliner show nodes`` (or the saved output ``--from``); None after an error."""
    import subprocess

    if args.from_file:
        try:
            return Path(args.from_file).read_text()
        except OSError as exc:
            print(f"themis-arbiter: {args.command}: cannot read {args.from_file}: {exc.strerror}", file=sys.stderr)
            return None
    try:
        return subprocess.run(["scontrol", "--oneliner", "show", "nodes"], capture_output=True, text=True,
                              check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        print(f"themis-arbiter: {args.command}: scontrol failed: {detail}", file=sys.stderr)
        return None


def cmd_slurm_sync(args: argparse.Namespace) -> int:
    """Drain in the arbiter every machine Slurm reports drained, down or failing (run it from cron
    or a Slurm ``SlurmctldParameters`` hook): leases there run out and nothing new is granted."""
    import grpc

    from arbiter.slurm_nodes import parse_nodes, unavailable

    text = _scontrol_nodes(args)
    if text is None:
        return 1
    nodes = parse_nodes(text)
    if not nodes:  # garbage, or scontrol said something else: cron must hear of it
        print("themis-arbiter: slurm-sync: no node lines (NodeName=...) in the scontrol output", file=sys.stderr)
        return 1
    drained, failed = [], []
    for machine in unavailable(nodes):
        args.machine = machine
        try:
            cmd_drain(args)
            drained.append(machine)
        except grpc.aio.AioRpcError as exc:  # e.g. a node the arbiter's cluster file leaves out
            failed.append(machine)
            print(f"themis-arbiter: slurm-sync: {machine}: {exc.details()}", file=sys.stderr)
    print(json.dumps({"drained_now": drained, "failed": failed}))
    return 1 if failed else 0  # a non-zero exit is what cron reports


def cmd_cluster_from_slurm(args: argparse.Namespace) -> int:
    from arbiter.slurm_nodes import cluster_toml, parse_nodes

    text = _scontrol_nodes(args)
    if text is None:
        return 1
    try:
        toml = cluster_toml(parse_nodes(text, args.gres_type), args.name)
    except ValueError as exc:
        print(f"themis-arbiter: cluster-from-slurm: {exc}", file=sys.stderr)
        return 1
    import tomllib

    from arbiter.cluster import cluster_from_mapping

    cluster_from_mapping(tomllib.loads(toml), "<generated>")  # what we write must load
    sys.stdout.write(toml)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="themis-arbiter", description="The Themis arbiter service")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the arbiter")
    s.add_argument("--cluster", required=True, help="testbed-64, sim-256 or a cluster TOML file")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    s.add_argument("--port", type=_port, default=50051, help="0-65535; 0 picks a free port (default 50051)")
    s.add_argument("--db", default="themis-arbiter.db", help="SQLite journal (created if missing)")
    s.add_argument("--mqtt", help="broker URL, e.g. mqtt://127.0.0.1:1883 (default: in-memory events)")
    s.add_argument("--policy", help="themis (default) or a baseline: gandiva, tiresias, optimus, slaq, fifo, drf")
    s.add_argument("--fairness-knob", type=float, help="f of D6 (default 0.8)")
    s.add_argument("--lease", type=float, help="lease length in seconds (default 600, D10)")
    s.add_argument("--coalesce", type=float, help="seconds of events coalesced into one round (default 1)")
    s.add_argument("--report-timeout", type=float, help="seconds agents have to report rho (default 2)")
    s.add_argument("--bid-timeout", type=float, help="seconds agents have to bid (default 2)")
    s.add_argument("--max-contenders", type=int,
                   help="bidders the auction takes per round, worst first; 0 = no cap (default 16, D20)")
    s.add_argument("--min-bidders", type=int,
                   help="the least number of apps a Themis auction takes: 2 leaves no auction with a single "
                        "bidder (D41, an option); default 1 (D6)")
    s.add_argument("--rank", choices=RANKS,
                   help="what ranks the apps (D21): for apps an admin bound to a model (issue-token --model), "
                        "their claimed work at that model's slowdowns (measured, the default), or the rho "
                        "every app reports (reported)")
    s.add_argument("--no-reclaim", dest="reclaim", action="store_const", const=False, default=None,
                   help="let every lease run to its end; by default a round ends the leases an app holds "
                        "beyond its fair share while an app that holds nothing waits (D27)")
    s.add_argument("--admission", metavar="NAME[:ARG]",
                   help="an admission policy in front of the policy (D33): accept-all (default) or fifo:X -- apps "
                        "are let in in arrival order while the admitted apps want at most X times the cluster's "
                        "GPUs; the others wait, asked nothing and granted nothing, their rho counting")
    s.add_argument("--idle", type=float, dest="idle_s",
                   help="seconds an app with no agent connected and nothing held stays counted in N_avg "
                        "before it goes idle (default: the lease and a minute)")
    s.add_argument("--limit", action="append", default=[], metavar="NAME=VALUE", type=_limit,
                   help="a bound before and around authentication (repeatable): "
                        "unauthenticated=4 (streams with an unknown credential read at once), first_message_s=5, "
                        "hello_s=10 (an authenticated stream's Hello deadline), hellos=20 and registers=20 "
                        "(per app in a burst), per_s=2 (their refill a second); docs/service.md")
    s.add_argument("--profiles", action="append", default=[], metavar="FILE",
                   help="a slowdown table (agent/profiles/slowdowns.toml's form) adding models to bind apps to; "
                        "repeatable")
    s.add_argument("--contention", metavar="deepshare|FILE",
                   help="model network contention between jobs that share machines (D35) with this table "
                        "(deepshare: the shipped one; or a CSV of its form): agents report their running jobs, "
                        "offers carry who runs on their machines, jobs' ratios go to MQTT and /metrics "
                        "(default: off)")
    s.add_argument("--admin-token", help="admin token (default: THEMIS_ADMIN_TOKEN or <db>.admin-token)")
    s.add_argument("--metrics-port", type=_port, help="serve Prometheus metrics on this port")
    s.add_argument("--metrics-host", default="127.0.0.1",
                   help="address the metrics listen on (default loopback only: they need no token)")
    s.add_argument("--tls-cert", help="PEM certificate chain; with --tls-key the server speaks TLS: gRPC (agents "
                                      "and admin calls) and the metrics (HTTPS)")
    s.add_argument("--tls-key", help="PEM private key")
    s.add_argument("--http", metavar="HOST:PORT",
                   help="serve the web dashboard and its JSON API here (e.g. 127.0.0.1:8080); off loopback it "
                        "asks for viewer tokens (issue-viewer-token) and uses --tls-cert/--tls-key when given")
    s.add_argument("--log-level", default="INFO", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    s.add_argument("--log-format", default="auto", choices=LOG_FORMATS,
                   help="json: one object per line (a service's log); human: a line for a person; auto (default): "
                        "human on a terminal, else json")
    s.set_defaults(func=cmd_serve)
    t = sub.add_parser("issue-token", help="issue a registration token for an app (admin)")
    t.add_argument("app")
    t.add_argument("--model", help="the app's model in the arbiter's profile table: its placement slowdowns, "
                                   "which a measured rank applies to the work it claims (D21)")
    dr = sub.add_parser("drain", help="give a machine no new grants; its leases run out (admin)")
    dr.add_argument("machine")
    dr.add_argument("--resume", action="store_true", help="put a drained machine back in service")
    dr.set_defaults(func=cmd_drain)
    rm = sub.add_parser("remove-app", help="remove an app for good: leases end, credentials revoked (admin)")
    rm.add_argument("app")
    rm.set_defaults(func=cmd_app_call)
    rv = sub.add_parser("revoke-credential", help="revoke an app's credentials; its leases run out (admin)")
    rv.add_argument("app")
    rv.set_defaults(func=cmd_app_call)
    ss = sub.add_parser("slurm-sync", help="drain the machines Slurm reports drained, down or failing (admin)")
    ss.add_argument("--from", dest="from_file", help="read saved `scontrol --oneliner show nodes` output instead")
    ss.set_defaults(func=cmd_slurm_sync)
    vt = sub.add_parser("issue-viewer-token", help="a token that reads the web dashboard off loopback (admin)")
    vt.add_argument("name", help="who it is for (a person or a script; not an app)")
    vr = sub.add_parser("revoke-viewer-token", help="end every dashboard token of NAME at once (admin)")
    vr.add_argument("name")
    for v in (vt, vr):
        v.set_defaults(func=cmd_viewer_token)
    st = sub.add_parser("status", help="cluster, apps and recent rounds of a running arbiter (admin)")
    st.add_argument("--rounds", type=int, default=5)
    st.add_argument("--json", action="store_true", help="print JSON instead of tables")
    for p in (t, dr, ss, rm, rv, vt, vr, st):
        p.add_argument("--arbiter", default=DEFAULT_TARGET)
        p.add_argument("--admin-token")
        p.add_argument("--db", default="themis-arbiter.db", help="find the admin token next to this journal")
        p.add_argument("--tls-ca", help="CA certificate (PEM) of a TLS arbiter (default: THEMIS_TLS_CA)")
    t.set_defaults(func=cmd_issue_token)
    st.set_defaults(func=cmd_status)
    d = sub.add_parser("demo", help="an arbiter and two agents on loopback, in one process")
    d.add_argument("--seconds", type=float, default=60.0)
    d.add_argument("--mqtt", help="also publish events to this broker")
    d.add_argument("--contention", metavar="deepshare|FILE",
                   help="model network contention between jobs sharing machines (D35) with this table")
    d.set_defaults(func=cmd_demo)
    cs = sub.add_parser("cluster-from-slurm", help="write a cluster file from `scontrol show nodes` (issue 6)")
    cs.add_argument("--name", default="slurm", help="the cluster's name (default slurm)")
    cs.add_argument("--gres-type", default="g{index}", help="GRES type naming per GPU index (default g{index})")
    cs.add_argument("--from", dest="from_file", help="read saved `scontrol --oneliner show nodes` output instead")
    cs.set_defaults(func=cmd_cluster_from_slurm)
    for each in sub.choices.values():
        each.add_argument("--debug", action="store_true", help="show the traceback of an error, not only its line")
    args = parser.parse_args(argv)
    import grpc

    try:
        return args.func(args)
    except grpc.aio.AioRpcError as exc:  # an admin call: unreachable (3), token refused (4), else the answer (1)
        stopped = exits.rpc_stopped(
            exc, getattr(args, "arbiter", DEFAULT_TARGET), what=f"{args.command} call",
            tls=bool(getattr(args, "tls_ca", None) or os.environ.get("THEMIS_TLS_CA")),
            refused_fix="give its admin token: --admin-token (or THEMIS_ADMIN_TOKEN), or --db of its journal "
                        "(the token is kept next to it)")
        if stopped.why == "failed":  # the arbiter's own answer (NOT_FOUND, INVALID_ARGUMENT, ...): said as it is
            stopped = Stopped(args.command, exits.rpc_cause(exc), None, exits.FAILED)
        if args.debug:
            traceback.print_exception(exc)
        return exits.say("themis-arbiter", stopped)
    except (Exception, KeyboardInterrupt) as exc:  # one line with the cause and the fix
        return exits.say("themis-arbiter", exc, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
