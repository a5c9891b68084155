"""``themis-sim`` (or ``python -m simulator``): run, compare, reproduce the paper, study lying.

    themis-sim run --cluster sim-256 --workload small --policy themis --out results/run
    themis-sim compare --policies themis,gandiva,tiresias,optimus,slaq --out results/compare
    themis-sim experiment fig9 --out results/fig9
    themis-sim strategic --strategy overreport-spread --levels 0,20,40 --out results/lying
    themis-sim pool fig16 --out results/fig16-all results/fig16-a/fig16.json results/fig16-b/fig16.json
    themis-sim run --workload workload2 --record-rounds --out results/w2 && themis-sim view results/w2

Every run writes ``summary.json``; compare and the experiments also write PNG plots. Every command
takes ``--plugin FILE_OR_MODULE`` (repeatable) to add policies, workloads or strategies from
outside the repository (``simulator.plugins``), and run/compare/strategic take
``--workload-knob NAME=VALUE`` (repeatable; VALUE is JSON, else a string) for the workload's knobs;
``--profiles FILE`` adds models to the slowdown table (``agent.placement.use_profiles``).
compare, experiment and strategic keep each finished run in ``OUT/runs`` (``simulator.run_store``),
so the same command with more seeds, or after an interruption, simulates only what is missing;
``--fresh`` simulates everything again. ``pool`` joins the seeds of saved results of the same
figure and settings (run apart, say on two machines) into one result with intervals and plots
(``simulator.pooling``).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from arbiter.cluster import ClusterFileError, shipped_clusters
from arbiter.policies import POLICIES
from arbiter.rank import RANKS
from arbiter.rounds import DEFAULT_COALESCE_S
from simulator.engine import DEFAULT_RESTART_S, RESPLITS
from simulator.metrics import write_summary
from simulator.pooling import POOLABLE
from simulator.run_store import RunStore
from simulator.runs import PAYMENTS, run_seeds, simulate
from simulator.strategic import STRATEGIES
from simulator.workloads import known_workloads

DEFAULT_POLICIES = "themis,gandiva,tiresias,optimus,slaq"
console = Console(stderr=True)
out_console = Console()  # as wide as the terminal, else $COLUMNS, else 80


@dataclass(frozen=True)
class Column:
    """A column of the summary table: its header, the summary key, how a value is printed (format,
    divided by scale, unit for the verdict), which way is better (-1 lower, +1 higher, 0 not ranked),
    the metric in words and ``keep``: when the table must be narrow, the columns with the largest
    ``keep`` are left out first (they stay in the JSON)."""

    label: str
    key: str
    spec: str = "{:.2f}"
    scale: float = 1.0
    better: int = -1
    keep: int = 0
    words: str = ""
    unit: str = ""


HEADLINE = [
    Column("policy", "policy", "{}", better=0),
    Column("max rho", "max_rho", keep=1, words="max rho"),
    Column("max, Tid>=10m", "max_rho_floor", keep=10, words="max rho of the apps with T_id >= 10 min"),
    Column("p99", "p99_rho", keep=9, words="p99 rho"),
    Column("mean", "mean_rho", keep=3, words="mean rho"),
    Column("Jain", "jain_rho", "{:.3f}", better=1, keep=2, words="Jain"),
    Column("max rho_sh", "max_rho_share", keep=7, words="max rho_sh"),
    Column("rho_sh>1", "share_rho_share_gt_1", "{:.0%}", keep=11),
    Column("JCT h", "avg_jct", scale=3600.0, keep=6, words="JCT", unit=" h"),
    Column("GPU h", "gpu_time", "{:.0f}", 3600.0, keep=4, words="GPU time", unit=" GPU-h"),
    Column("place", "mean_placement_score", "{:.3f}", better=1, keep=8, words="placement"),
    Column("rst/job", "restarts_per_job", "{:.1f}", keep=5, words="restarts/job"),
    Column("by bids", "by_bids", "{:.0%}", better=0, keep=12),
    Column("wall s", "wall_seconds", "{:.0f}", better=0, keep=13),
]

#: The metrics the verdict under the compare table weighs (a reader's first questions).
VERDICT = ("max_rho", "mean_rho", "jain_rho", "avg_jct", "gpu_time", "restarts_per_job")


def _by_bids(s: dict[str, Any]) -> dict[str, Any] | float | None:
    """GPUs placed by bids (auction and reserve, D9 D14) in rounds with bidders; None for a policy
    without an auction."""
    if s.get("policy") != "themis" or "share_auction" not in s or "share_queue" not in s:
        return None
    a, q = s["share_auction"], s["share_queue"]
    if isinstance(a, dict):
        values = [x + y for x, y in zip(a["values"], q["values"])]
        from simulator.seeds import interval

        return interval(values)
    return a + q


def _mean(value: Any) -> float | None:
    if isinstance(value, dict):
        return value.get("mean")
    return value if isinstance(value, int | float) else None


def _half(value: Any) -> float:
    return value.get("half", 0.0) if isinstance(value, dict) else 0.0


@dataclass
class Layout:
    """What the summary table shows: its columns, per row the values of every column of HEADLINE,
    the columns left out because they equal a shown one in every row (with that one), and those
    left out because the table would be wider than the terminal."""

    shown: list[Column]
    rows: list[dict[str, Any]]
    same_as: dict[str, str] = field(default_factory=dict)
    no_room: list[str] = field(default_factory=list)


def _cell(value: Any, col: Column) -> str:
    from simulator.seeds import fmt

    if value is None:
        return "-"
    return value if col.key == "policy" else fmt(value, col.spec, col.scale)


def _printed(value: Any, col: Column) -> list[str]:
    """Every number behind a cell as printed: each seed's value, or the one value."""
    from simulator.seeds import fmt

    if isinstance(value, dict) and value.get("values"):
        return [fmt(v, col.spec, col.scale) for v in value["values"]]
    return [_cell(value, col)]


def _best(layout: Layout, col: Column) -> str | None:
    """The best mean of a ranked column as printed (ties share it), or None."""
    shown = [(_cell(r[col.key], col).split("±")[0], _mean(r[col.key])) for r in layout.rows
             if _mean(r[col.key]) is not None]
    if not col.better or len(shown) < 2:
        return None
    pick = min if col.better < 0 else max
    return pick(shown, key=lambda t: t[1])[0]


def _table(layout: Layout, title: str) -> Table:
    """The table of ``layout``: one row per policy; a value over seeds shows its mean with the
    half-width of its 95% interval under it, so that ten columns fit 80 characters; the best
    mean of each ranked column has a * and is bold green (issue 11)."""
    best = {col.key: _best(layout, col) for col in layout.shown}
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0),
                  caption="*: best mean in its column (lower is better except Jain, place)"
                  if any(best.values()) else None, caption_justify="left", title_justify="left")
    for col in layout.shown:
        table.add_column(col.label, justify="left" if col.key == "policy" else "right")
    for r in layout.rows:
        cells = []
        for col in layout.shown:
            text = _cell(r[col.key], col)
            if col.key == "policy" or text == "-":
                cells.append(text)
                continue
            mean, _, half = text.partition("±")
            star = "*" if best[col.key] == mean else ""
            shown = f"{mean}{star}" + (f"\n±{half}" if half else "")
            cells.append(f"[bold green]{shown}[/]" if star else shown)
        table.add_row(*cells)
    return table


def _layout(summaries: Sequence[dict[str, Any]], width: int | None = None) -> Layout:
    """Which columns the table shows. A column with no value in any row is left out; so is one
    whose printed values equal an earlier column's in every row and every seed (in the demo max
    rho, its value above the 10-minute floor and p99 were the same numbers), two numbers at least: one
    number equal to another is a coincidence (a run's 100% of rho_sh > 1 and 100% by bids). With
    ``width``, the columns with the largest ``keep`` go until the table fits it (issue 36 item 5)."""
    rows = [{c.key: _by_bids(s) if c.key == "by_bids" else s.get(c.key) for c in HEADLINE} for s in summaries]
    layout = Layout([], rows)
    printed: dict[str, list[str]] = {}
    for col in HEADLINE:
        cells = [_cell(r[col.key], col) for r in rows]
        if col.key != "policy" and all(c == "-" for c in cells):
            continue
        numbers = [v for r in rows for v in _printed(r[col.key], col) if v != "-"]
        cells += numbers
        twin = next((k for k, seen in printed.items() if k != "policy" and seen == cells), None)
        if len(numbers) < 2:
            twin = None
        if twin is not None:
            layout.same_as[col.label] = next(c.label for c in HEADLINE if c.key == twin)
            continue
        printed[col.key] = cells
        layout.shown.append(col)
    if width is not None:
        measure = Console(width=10_000, file=io.StringIO())  # the natural width, not clamped to the terminal
        while len(layout.shown) > 2 and measure.measure(_table(layout, "")).maximum > width:
            drop = max(layout.shown, key=lambda c: c.keep)
            layout.shown.remove(drop)
            layout.no_room.insert(0, drop.label)
    return layout


def summary_table(summaries: Sequence[dict[str, Any]], title: str, width: int | None = None) -> Table:
    """One row per policy (see ``_table``), the columns chosen by ``_layout``: those with values,
    no column twice, and with ``width`` no wider than that. rho_sh is the contention-normalised rho
    (time on a dedicated 1/N_avg share); 'by bids' the share of GPUs the auction and the reserve
    placed in rounds with bidders (D9, D14)."""
    return _table(_layout(summaries, width), title)


def _and(words: Sequence[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def print_summary(out: Console, summaries: Sequence[dict[str, Any]], title: str, json_name: str) -> None:
    """The summary table as wide as ``out``, and a line under it that names the columns left out
    and where they are."""
    layout = _layout(summaries, out.width)
    out.print(_table(layout, title))
    notes = []
    twins: dict[str, list[str]] = {}
    for label, twin in layout.same_as.items():
        twins.setdefault(twin, []).append(label)
    for twin, labels in twins.items():
        notes.append(f"{_and(labels)} {'equal' if len(labels) > 1 else 'equals'} {twin}"
                     + (" in every row" if len(summaries) > 1 else ""))
    if layout.no_room:
        notes.append(f"{_and(layout.no_room)} left out to fit {out.width} columns")
    seeds = any(isinstance(v, dict) and len(v.get("values", [])) > 1 for s in summaries for v in s.values())
    notes.append(("every metric, with every seed's value," if seeds else "every metric") + f" is in {json_name}")
    out.print("; ".join(notes) + ".", highlight=False)


def verdict(summaries: Sequence[dict[str, Any]]) -> str | None:
    """One line, computed from the rows of the compare table: where Themis wins and loses against
    the best of the other policies on the metrics of VERDICT (and, over seeds, where the 95%
    intervals are apart), or, without Themis, which policy is best on each. None for one row."""
    if len(summaries) < 2:
        return None
    cols = [c for key in VERDICT for c in HEADLINE if c.key == key]

    def shown(value: Any, col: Column) -> str:
        return _cell(_mean(value), col)

    themis = next((s for s in summaries if s.get("policy") == "themis"), None)
    if themis is None:
        parts = []
        for col in cols:
            have = [(s["policy"], s.get(col.key)) for s in summaries if _mean(s.get(col.key)) is not None]
            if len(have) < 2:
                continue
            pick = min if col.better < 0 else max
            top = pick(_mean(v) for _, v in have)
            text = shown(top, col)
            winners = [p for p, v in have if shown(v, col) == text]
            parts.append(f"{col.words} {_and(winners)} ({text}{col.unit})")
        return "Best per metric: " + ", ".join(parts) + "." if parts else None
    wins, losses, ties, apart = [], [], [], []
    for col in cols:
        mine = themis.get(col.key)
        others = [(s["policy"], s.get(col.key)) for s in summaries
                  if s is not themis and _mean(s.get(col.key)) is not None]
        if _mean(mine) is None or not others:
            continue
        pick = min if col.better < 0 else max
        name, theirs = pick(others, key=lambda t: _mean(t[1]))
        a, b = shown(mine, col), shown(theirs, col)
        if a == b:
            ties.append(f"{col.words} with {name} ({a}{col.unit})")
            continue
        said = f"{col.words} ({a} vs {name} {b}{col.unit})"
        (wins if col.better * (_mean(mine) - _mean(theirs)) > 0 else losses).append(said)
        if isinstance(mine, dict) and abs(_mean(mine) - _mean(theirs)) > _half(mine) + _half(theirs):
            apart.append(col.words)
    parts = []
    if wins:
        parts.append("wins on " + _and(wins))
    if losses:
        parts.append("loses on " + _and(losses))
    if ties:
        parts.append("ties on " + _and(ties))
    judged = len(wins) + len(losses)
    if judged and any(len(v.get("values", [])) > 1 for v in themis.values() if isinstance(v, dict)):
        if not apart:
            parts.append("95% intervals overlap on every one")
        elif len(apart) == judged:
            parts.append("95% intervals apart on every one")
        else:
            parts.append(f"95% intervals apart only on {_and(apart)}")
    return "Themis " + "; ".join(parts) + "." if parts else None


def _knob(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` with VALUE read as JSON (``2.5``, ``[2, 8]``, ``"fixed"``), else kept as text."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name.strip(), json.loads(value)
    except json.JSONDecodeError:
        return name.strip(), value


def _count(text: str) -> int:
    """--seeds and --workers: a whole number of at least 1 (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_plugin(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plugin", action="append", default=[], metavar="FILE_OR_MODULE",
                   help="a .py file or module that registers policies, workloads or strategies (repeatable)")


def _add_profiles(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profiles", action="append", default=[], metavar="FILE",
                   help="a slowdown table (agent/profiles/slowdowns.toml's format) whose models are added "
                        "for this run; repeatable, later files win only where they say override = true")


def _use_profiles(args: argparse.Namespace) -> None:
    """``--profiles``: checked before anything runs; worker processes inherit them (THEMIS_PROFILES)."""
    from agent.placement import ProfileError, override_notes, use_profiles

    if not getattr(args, "profiles", None):
        return
    try:
        table = use_profiles(*args.profiles)
    except ProfileError as exc:
        raise SystemExit(f"themis-sim: {exc}") from exc
    for note in override_notes(table):
        console.print(f"[yellow]{note}[/]")


def _add_common(p: argparse.ArgumentParser, *, policy: bool = True) -> None:
    p.add_argument("--cluster", default="sim-256", metavar="NAME_OR_TOML",
                   help=f"{', '.join(shipped_clusters())} or a cluster TOML file (default %(default)s)")
    p.add_argument("--workload", default="small", metavar="NAME_OR_CSV",
                   help=f"{', '.join(known_workloads())}, or a CSV trace "
                        "(app,job,arrival_s,gpus,iterations,iter_time_s,model); default %(default)s")
    if policy:
        p.add_argument("--policy", default="themis", choices=sorted(POLICIES), metavar="POLICY",
                       help="%(choices)s (default %(default)s)")
    p.add_argument("--fairness-knob", type=float, default=0.8, help="f of D6 (themis only)")
    p.add_argument("--max-contenders", type=int, default=None,
                   help="cap Themis's auction at the worst N bidders, as the service does (D20; default: no cap)")
    p.add_argument("--min-bidders", type=int, default=1,
                   help="the least number of apps a Themis auction takes (D41: 2 leaves no auction with a "
                        "single bidder; default %(default)s, D6)")
    p.add_argument("--lease", type=float, default=600.0, help="lease length in seconds (D10)")
    p.add_argument("--restart", type=float, default=DEFAULT_RESTART_S, help="restart delay in seconds (D11)")
    p.add_argument("--resplit", choices=RESPLITS, default="now", metavar="WHEN",
                   help="when an app whose GPUs grew moves its running jobs onto them: now (D11) or "
                        "rent-or-buy (D23: once the idle GPUs have cost what the restarts would)")
    p.add_argument("--no-reclaim", dest="reclaim", action="store_false",
                   help="leases beyond an app's fair share run to their end even while an app that holds "
                        "nothing waits (D27 ends them early, once per such app; on by default)")
    p.add_argument("--coalesce", type=float, default=DEFAULT_COALESCE_S,
                   help="seconds of events coalesced into one round (D10); larger is faster, coarser")
    p.add_argument("--expiry-window", type=float, default=None,
                   help="seconds a lease expiry waits for others to join its round (D10; default lease/10)")
    p.add_argument("--workload-knob", type=_knob, action="append", default=[], metavar="NAME=VALUE",
                   help="a knob of the workload's builder, e.g. load=2.5 or app_size=[2,8] (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="output folder")
    _add_plugin(p)
    _add_profiles(p)


def _add_payments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--payments", choices=PAYMENTS, default="exact",
                   help="exact: every Themis winner's c_i re-solved (D8, D16); bounds: a lottery that bounds "
                        "on c_i decide takes no re-solve (D39, D42): the same grants and the same run, c_i "
                        "reported as bounds (default %(default)s)")


def _payments(args: argparse.Namespace) -> dict[str, Any]:
    """--payments, named only when it is not the default (kept runs stay keyed as before)."""
    return {} if args.payments == "exact" else {"payments": args.payments}


def _add_ray(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray", metavar="ADDRESS",
                   help="run every (policy, setting, seed) as a Ray task instead of local processes: local "
                        "(start Ray here), auto (the cluster `ray start --head` runs here) or HOST:PORT; runs "
                        "land in OUT/runs as local ones do, and a failed one is tried once more")


def _add_fresh(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fresh", action="store_true",
                   help="simulate every run again instead of taking the runs kept in OUT/runs for the same "
                        "arguments and code (more seeds, or a resumed run, otherwise cost only the missing runs)")


def _add_blocks(p: argparse.ArgumentParser) -> None:
    p.add_argument("--admission", default=None, metavar="NAME[:ARG]",
                   help="an admission policy in front of the policy (D33): accept-all (what runs without the "
                        "flag) or fifo:X (apps admitted in arrival order while the admitted apps want at most X "
                        "times the cluster's GPUs; the others wait, their rho counting); adds its numbers to "
                        "summary.json")
    p.add_argument("--converge", default=None, metavar="MIN_DELTA:PATIENCE[:abs]",
                   help="loss-based termination (D34): end a job once its last PATIENCE loss reports improved "
                        "on its best by at most MIN_DELTA (a share of the loss, or absolute with :abs), e.g. "
                        "0.01:3; adds its numbers to summary.json")


def _blocks(args: argparse.Namespace) -> dict[str, Any]:
    """The admission policy and convergence rule, named only when given (kept runs stay keyed as before)."""
    out = {}
    if getattr(args, "admission", None) is not None:
        from arbiter.admission import make_admission

        make_admission(args.admission)  # a bad name fails now, not in a worker
        out["admission"] = args.admission
    if getattr(args, "converge", None) is not None:
        from agent.termination import ConvergenceRule

        ConvergenceRule.parse(args.converge)
        out["convergence"] = args.converge
    return out


def _add_contention(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contention", default=None, metavar="FILE",
                   help="network contention between jobs that share machines (D35): a contention table (CSV of "
                        "DeepShare's form, agent/profiles/contention_deepshare.csv) or 'deepshare' for that one; "
                        "each job runs at its placement speed times its ratio; adds mean_contention_ratio")
    p.add_argument("--preempt-at", type=float, default=None, metavar="RATIO",
                   help="with --contention: preempt a job whose contention ratio falls to RATIO or below "
                        "(DeepShare: 0.6); its app asks for GPUs again after one lease")


def _contention(args: argparse.Namespace, on_anyway: bool = False) -> dict[str, Any]:
    """The contention table and preemption ratio, named only when given (kept runs stay keyed as
    before). ``on_anyway``: the command turns contention on itself (``experiment deepshare``)."""
    out: dict[str, Any] = {}
    if getattr(args, "contention", None) is not None:
        from arbiter.contention import load_table

        load_table(args.contention)  # a bad file fails now, not in a worker
        out["contention"] = args.contention
    if getattr(args, "preempt_at", None) is not None:
        if "contention" not in out and not on_anyway:
            raise ValueError("--preempt-at needs --contention")
        out["preempt_at"] = args.preempt_at
    return out


def _add_restart_costs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--restart-costs", default=None, metavar="profiles|FILE",
                   help="each model's measured restart cost instead of --restart for every model (D32): "
                        "'profiles' (agent/profiles/restart_costs.toml) or a table of that form; default: "
                        "--restart for all")


def _restart_costs(args: argparse.Namespace) -> dict[str, Any]:
    """The restart-cost table, named only when given (kept runs stay keyed as before)."""
    source = getattr(args, "restart_costs", None)
    if source is None:
        return {}
    from agent.restart_costs import RestartCostError, restart_delays

    try:
        restart_delays(source)  # a bad table fails now, not in a worker
    except RestartCostError as exc:
        raise SystemExit(f"themis-sim: {exc}") from exc
    return {"restart_costs": source if source == "profiles" else str(Path(source).resolve())}


def _split_workload(args: argparse.Namespace) -> None:
    """``--workload NAME:FILE`` (``deepshare:trace.json``) as the workload NAME with the knob
    path=FILE, so a kept run is keyed by the file's contents."""
    from simulator.workloads import split_workload

    if isinstance(getattr(args, "workload", None), str):
        args.workload, knobs = split_workload(args.workload)
        args.workload_knob = [*getattr(args, "workload_knob", []), *knobs.items()]


def _run_options(args: argparse.Namespace) -> dict[str, Any]:
    """The resplit, reclaim and min-bidders settings, each named only when it is not the default (kept
    runs stay keyed as before)."""
    return (({"resplit": args.resplit} if args.resplit != "now" else {}) | ({} if args.reclaim else {"reclaim": False})
            | ({"min_bidders": args.min_bidders} if args.min_bidders != 1 else {}))


def cmd_run(args: argparse.Namespace) -> int:
    summary = simulate(cluster=args.cluster, workload=args.workload, policy=args.policy,
                       fairness_knob=args.fairness_knob, lease=args.lease, restart=args.restart,
                       coalesce=args.coalesce, expiry_window=args.expiry_window, seed=args.seed,
                       workload_knobs=dict(args.workload_knob) or None, max_contenders=args.max_contenders,
                       **_run_options(args), **_blocks(args), **_contention(args),
                       **_restart_costs(args), **_record(args), **_payments(args))
    path = write_summary(summary, args.out)
    print_summary(out_console, [summary], f"{args.policy}: {args.workload} on {args.cluster}, seed {args.seed}",
                  path.name)
    console.print(f"wrote {path}")
    return 0


def _record(args: argparse.Namespace) -> dict[str, Any]:
    """--record-rounds: the recording beside summary.json (named only when asked for)."""
    if not getattr(args, "record_rounds", False):
        return {}
    from arbiter.dashboard.recording import RECORDING

    return {"record_rounds": args.out / RECORDING}


def cmd_view(args: argparse.Namespace) -> int:
    """Serve a recorded run's rounds on the dashboard until interrupted."""
    import asyncio

    from arbiter.dashboard.recording import RECORDING, RecordingError, load_recording
    from arbiter.dashboard.server import start

    path = args.out / RECORDING
    console.print(f"reading {path} ...", highlight=False)
    try:
        source = load_recording(path)
    except RecordingError as exc:
        console.print(f"[red]themis-sim: {exc}[/]")
        return 2

    async def serve() -> None:
        dashboard = await start(args.host, args.port, source)
        print(f"serving {len(source.timeline().rounds)} rounds of {path} at {dashboard.url} (Ctrl-C stops)",
              flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await dashboard.stop()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from simulator.plots import compare_plots
    from simulator.seeds import aggregate

    policies = _policies(args.policies) or []
    seeds = list(range(args.seed, args.seed + args.seeds))
    common = dict(cluster=args.cluster, workload=args.workload, fairness_knob=args.fairness_knob, lease=args.lease,
                  restart=args.restart, coalesce=args.coalesce, expiry_window=args.expiry_window,
                  workload_knobs=dict(args.workload_knob) or None, max_contenders=args.max_contenders,
                  **_run_options(args), **_blocks(args), **_contention(args),
                  **_restart_costs(args), **_payments(args))
    store = RunStore(args.out / "runs", reuse=not args.fresh)
    if args.seeds == 1 and (args.workers or 1) == 1 and not getattr(args, "ray", None):
        per_policy = [[_simulate_kept(store, {"policy": p, "seed": seeds[0], **common})] for p in policies]
    else:
        per_policy = run_seeds([{"policy": p, **common} for p in policies], seeds, args.workers,
                               f"{len(policies)} policies x {len(seeds)} seeds", store)
    _say_kept(store)
    rows = []
    for policy, runs in zip(policies, per_policy):
        for seed, summary in zip(seeds, runs):
            write_summary(summary, args.out / policy if len(seeds) == 1 else args.out / policy / f"seed{seed}")
        rows.append(runs[0] if len(seeds) == 1 else aggregate(runs))
    from simulator.plots import seeds_text

    title = f"{args.workload} on {args.cluster}, {seeds_text(seeds)}" + (
        " (mean; under it ± 95% CI)" if len(seeds) > 1 else "")
    print_summary(out_console, rows, title, "comparison.json")
    plots = compare_plots([runs[0] for runs in per_policy], args.out, aggregated=rows if len(seeds) > 1 else None)
    (args.out / "comparison.json").write_text(json.dumps(
        [{k: v for k, v in s.items() if k != "apps"} for s in rows], indent=1))
    console.print("wrote " + ", ".join(str(p) for p in [args.out / "comparison.json", *plots]))
    line = verdict(rows)
    if line:
        out_console.print(line, highlight=False)
    return 0


def _simulate_kept(store: RunStore, job: dict[str, Any]) -> dict[str, Any]:
    """One run in this process with its progress bar, taken from ``store`` if kept there (a
    worker's runs go through ``simulator.runs.simulate_and_keep`` instead)."""
    kept = store.get(job)
    if kept is not None:
        store.reused += 1
        return kept
    store.simulated += 1
    return store.keep(job, simulate(**job))


def _say_kept(store: RunStore) -> None:
    if store.reused:
        console.print(store.tally())


def _policies(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [p.strip() for p in text.split(",")]
    unknown = [p for p in names if p not in POLICIES]
    if unknown:
        raise SystemExit(f"themis-sim: unknown policies {unknown}; choose from {', '.join(sorted(POLICIES))}")
    if len(set(names)) != len(names):
        raise SystemExit(f"themis-sim: --policies names a policy twice: {text!r}")
    return names


def cmd_experiment(args: argparse.Namespace) -> int:
    from simulator.experiments import EXPERIMENTS, run_experiment

    if args.name not in EXPERIMENTS:
        raise SystemExit(f"themis-sim: unknown experiment {args.name!r}; choose from {', '.join(EXPERIMENTS)}")
    run_experiment(args.name, args.out, quick=args.quick, seed=args.seed, seeds=args.seeds, workers=args.workers,
                   policies=_policies(args.policies), setup=args.setup, reuse=not args.fresh, **_blocks(args),
                   **_contention(args, on_anyway=args.name == "deepshare"), **_payments(args))
    return 0


def cmd_pool(args: argparse.Namespace) -> int:
    from simulator.pooling import PoolError, pool_files

    try:
        pooled = pool_files(args.name, args.results, args.out)
    except PoolError as exc:
        raise SystemExit(f"themis-sim pool: {exc}") from exc
    seeds = pooled["seeds"]
    console.print(f"{args.name}: {len(seeds)} seeds ({', '.join(map(str, seeds))}) pooled from {len(args.results)} "
                  f"results into {args.out / (args.name + '.json')}")
    return 0


def cmd_strategic(args: argparse.Namespace) -> int:
    from simulator.strategic_run import run_strategic

    levels = _levels(args.levels)
    liars: int | list[str] = [a.strip() for a in args.liar.split(",")] if args.liar else args.liars
    store = RunStore(args.out / "runs", reuse=not args.fresh)
    run_strategic(strategy=args.strategy, levels=levels, liars=liars, cluster=args.cluster,
                  workload=args.workload, seed=args.seed, out=args.out, fairness_knob=args.fairness_knob,
                  lease=args.lease, seeds=args.seeds, workers=args.workers, policy=args.policy,
                  workload_knobs=dict(args.workload_knob) or None, rank=args.rank,
                  max_contenders=args.max_contenders, store=store, restart=args.restart,
                  coalesce=args.coalesce, expiry_window=args.expiry_window, **_run_options(args))
    _say_kept(store)
    return 0


def _load_plugins(argv: Sequence[str] | None) -> None:
    """Plugins first: the parser's policy choices must include what they register."""
    from simulator.plugins import PluginError, load_from_env, load_plugins

    pre = argparse.ArgumentParser(add_help=False)
    _add_plugin(pre)
    known, _ = pre.parse_known_args(argv)
    try:
        load_plugins(known.plugin)
        load_from_env()
    except PluginError as exc:
        raise SystemExit(f"themis-sim: {exc}") from exc


def _out_problem(out: Path) -> str | None:
    """Why ``out`` cannot become the output folder (a file is there, or its nearest existing
    parent is a file or not writable), or None."""
    if out.exists():
        return None if out.is_dir() else "a file is there"
    parent = next(p for p in out.absolute().parents if p.exists())
    if not parent.is_dir():
        return f"{parent} is a file"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"{parent} is not writable"


def _levels(text: str) -> list[float]:
    """--levels: distinct finite percentages, at least one (each strategy checks its own range)."""
    try:
        levels = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--levels: comma-separated lie sizes in percent, got {text!r}") from None
    if not levels or not all(math.isfinite(x) for x in levels) or len(set(levels)) != len(levels):
        raise ValueError(f"--levels: give distinct finite lie sizes in percent, got {text!r}")
    return levels


class _Help(argparse.HelpFormatter):
    """argparse's help, with no line broken inside a hyphenated name (overreport-spread)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class _Later(Sequence[str]):
    """Choices argparse checks and lists only when it must (a value to check, --help, an error):
    the experiments' names come with matplotlib, which ``run`` does not need."""

    def __init__(self, names: Callable[[], Sequence[str]]):
        self._names = names

    def __getitem__(self, i):  # type: ignore[override]
        return list(self._names())[i]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._names()))

    def __contains__(self, name: object) -> bool:
        return name in self._names()


def _experiment_names() -> list[str]:
    from simulator.experiments import EXPERIMENTS

    return list(EXPERIMENTS)


def main(argv: Sequence[str] | None = None) -> int:
    _load_plugins(argv)
    parser = argparse.ArgumentParser(prog="themis-sim", description=__doc__.splitlines()[0], formatter_class=_Help)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", formatter_class=_Help, help="simulate one policy")
    _add_common(p)
    _add_blocks(p)
    _add_contention(p)
    _add_restart_costs(p)
    _add_payments(p)
    p.add_argument("--record-rounds", action="store_true",
                   help="record every round (bidders, PF rows, c_i, draws, leftover, the map) beside summary.json "
                        "as rounds.jsonl.gz, for themis-sim view (off by default: it costs time and disk)")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("view", formatter_class=_Help,
                       help="serve a run recorded with --record-rounds on the dashboard, with a time slider")
    p.add_argument("out", type=Path, metavar="OUT", help="the run's output folder (where summary.json is)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    p.add_argument("--port", type=int, default=8765, help="port (0: any free one; default %(default)s)")
    _add_plugin(p)
    p.set_defaults(func=cmd_view)
    p = sub.add_parser("compare", formatter_class=_Help, help="simulate several policies on the same workload")
    _add_common(p, policy=False)
    _add_blocks(p)
    _add_contention(p)
    _add_restart_costs(p)
    _add_payments(p)
    p.add_argument("--policies", default=DEFAULT_POLICIES, metavar="P1,P2,...",
                   help=f"comma-separated, from {', '.join(sorted(POLICIES))} (default %(default)s)")
    p.add_argument("--seeds", type=_count, default=1, help="seeds --seed, --seed + 1, ...: mean and 95%% interval")
    p.add_argument("--workers", type=_count, default=None, help="processes for the seeds (default: the machine's cores)")
    _add_ray(p)
    _add_fresh(p)
    p.set_defaults(func=cmd_compare)
    p = sub.add_parser("experiment", formatter_class=_Help, help="reproduce one of the paper's figures")
    p.add_argument("name", choices=_Later(_experiment_names), metavar="NAME", help="%(choices)s")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0, help="the first seed")
    p.add_argument("--seeds", type=_count, default=5, help="seeds per point: mean and 95%% interval")
    p.add_argument("--workers", type=_count, default=None, help="processes (default: the machine's cores)")
    _add_ray(p)
    p.add_argument("--policies", default=None, metavar="P1,P2,...",
                   help=f"comma-separated, from {', '.join(sorted(POLICIES))} (default: themis and the paper's "
                        "baselines)")
    p.add_argument("--quick", action="store_true", help="smaller workloads and fewer points")
    p.add_argument("--setup", choices=("sim", "paper"), default="sim", metavar="SETUP",
                   help="sim: every figure on sim-256, Fig. 12 with Workload 2 (default); paper: Figs. 9-12 on "
                        "testbed-64 as the paper ran them, Fig. 12 with Workload 1")
    _add_fresh(p)
    _add_plugin(p)
    _add_profiles(p)
    _add_blocks(p)
    _add_contention(p)
    _add_payments(p)
    p.set_defaults(func=cmd_experiment)
    p = sub.add_parser("pool", formatter_class=_Help,
                       help="pool the seeds of saved experiment results (same figure and settings)")
    p.add_argument("name", choices=POOLABLE, metavar="NAME", help="the figure: %(choices)s")
    p.add_argument("results", nargs="+", type=Path, metavar="RESULT_JSON")
    p.add_argument("--out", type=Path, required=True, help="folder for the pooled JSON and plots")
    p.set_defaults(func=cmd_pool)
    p = sub.add_parser("strategic", formatter_class=_Help,
                       help="one or more lying apps among truthful ones (paper Fig. 15)")
    _add_common(p)
    p.add_argument("--strategy", required=True, choices=sorted(STRATEGIES), metavar="NAME",
                   help="how the liars bid (simulator/strategic.py): %(choices)s")
    p.add_argument("--levels", default="0,10,20,30,40,50,60,70,80,90,100", help="lie sizes in percent")
    p.add_argument("--liars", type=int, default=1, help="the first K apps of the workload lie")
    p.add_argument("--liar", default=None, help="comma-separated app ids that lie (instead of --liars)")
    p.add_argument("--seeds", type=_count, default=5, help="seeds: mean and 95%% interval")
    p.add_argument("--workers", type=_count, default=None, help="processes (default: the machine's cores)")
    _add_ray(p)
    p.add_argument("--rank", choices=RANKS, default="reported", metavar="RANK",
                   help="the rho that ranks the liars (D21), %(choices)s: as they report it, or computed by the "
                        "arbiter with their measured slowdowns (default %(default)s)")
    _add_fresh(p)
    p.set_defaults(func=cmd_strategic)
    args = parser.parse_args(argv)
    _use_profiles(args)
    if getattr(args, "ray", None):
        if args.workers:
            console.print("[red]themis-sim: --ray and --workers go apart: Ray's cluster decides how many run at once[/]")
            return 2
        from simulator.ray_sweep import RayCluster

        args.workers = RayCluster(args.ray)
    problem = _out_problem(args.out)  # now, not after an hour of simulation; nothing is created yet
    if problem:
        console.print(f"[red]themis-sim: --out {args.out}: cannot use it as the output folder: {problem}[/]")
        return 2
    _split_workload(args)
    try:
        return args.func(args)
    except (ClusterFileError, ValueError) as exc:
        console.print(f"[red]themis-sim: {exc}[/]")
        return 2
    except RuntimeError as exc:
        from simulator.ray_sweep import RunFailed

        if not isinstance(exc, RunFailed):
            raise
        console.print(f"[red]themis-sim: {exc}[/]")
        return 1


if __name__ == "__main__":
    sys.exit(main())
