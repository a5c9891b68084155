"""``themis-sim`` (or ``python -m simulator``): run, compare, reproduce the paper, study lying.

    themis-sim run --cluster sim-256 --workload small --policy themis --out results/run
    themis-sim compare --policies themis,gandiva,tiresias,optimus,slaq --out results/compare
    themis-sim experiment fig9 --out results/fig9
    themis-sim strategic --strategy overreport-spread --levels 0,20,40 --out results/lying

Every run writes ``summary.json``; compare and the experiments also write PNG plots.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from arbiter.cluster import ClusterFileError, load_cluster
from arbiter.policies import POLICIES, make_policy
from arbiter.rounds import DEFAULT_COALESCE_S
from simulator.engine import DEFAULT_RESTART_S, Simulation
from simulator.metrics import summarize, write_summary
from simulator.workloads import load_workload

DEFAULT_POLICIES = "themis,gandiva,tiresias,optimus,slaq"
console = Console(stderr=True)
out_console = Console(width=160)


def simulate(
    *,
    cluster: str,
    workload: str,
    policy: str,
    fairness_knob: float = 0.8,
    lease: float = 600.0,
    restart: float = DEFAULT_RESTART_S,
    coalesce: float = DEFAULT_COALESCE_S,
    expiry_window: float | None = None,
    seed: int = 0,
    show_progress: bool = True,
    workload_knobs: dict[str, Any] | None = None,
    agent_factory=None,
) -> dict[str, Any]:
    """One simulation, returned as its summary (the unit every command and experiment uses)."""
    the_cluster = load_cluster(cluster)
    the_workload = load_workload(workload, seed=seed, **(workload_knobs or {}))
    options = {"fairness_knob": fairness_knob} if policy == "themis" else {}
    sim = Simulation(
        the_cluster, the_workload, make_policy(policy, **options), lease_s=lease, restart_s=restart,
        coalesce_s=coalesce, expiry_window_s=expiry_window, seed=seed, agent_factory=agent_factory,
    )
    if show_progress:
        with Progress(TextColumn(f"[bold]{policy}[/] on {the_cluster.name}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("apps done, t={task.fields[t]:.0f}s"), TimeElapsedColumn(), console=console,
                      transient=True) as bar:
            task = bar.add_task("sim", total=len(the_workload.apps), t=0.0)

            def tick(now: float) -> None:
                done = sum(1 for r in sim.runs.values() if r.finished_at is not None)
                bar.update(task, completed=done, t=now)

            result = sim.run(progress=tick)
    else:
        result = sim.run()
    return summarize(result, fairness_knob=fairness_knob if policy == "themis" else None, lease_s=lease,
                     restart_s=restart, coalesce_s=coalesce, expiry_window_s=sim.engine.expiry_window_s, seed=seed,
                     workload_source=the_workload.source)


HEADLINE = [
    ("policy", "policy", "{}"),
    ("max rho", "max_rho", "{:.2f}"),
    ("mean rho", "mean_rho", "{:.2f}"),
    ("Jain(rho)", "jain_rho", "{:.3f}"),
    ("rho<=1", "share_rho_le_1", "{:.0%}"),
    ("avg JCT (h)", "avg_jct", "{:.2f}"),
    ("GPU time (h)", "gpu_time", "{:.1f}"),
    ("placement", "mean_placement_score", "{:.3f}"),
    ("makespan (h)", "makespan", "{:.1f}"),
    ("rounds", "rounds", "{}"),
    ("wall (s)", "wall_seconds", "{:.1f}"),
]


def summary_table(summaries: Sequence[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for name, _, _ in HEADLINE:
        table.add_column(name, justify="right")
    for s in summaries:
        cells = []
        for _, key, fmt in HEADLINE:
            value = s[key]
            if key in ("avg_jct", "gpu_time", "makespan"):
                value = value / 3600
            cells.append(fmt.format(value))
        table.add_row(*cells)
    return table


def _add_common(p: argparse.ArgumentParser, *, policy: bool = True) -> None:
    p.add_argument("--cluster", default="sim-256", help="testbed-64, sim-256 or a cluster TOML file")
    p.add_argument("--workload", default="small",
                   help="small, workload1, workload2, synthetic, or a CSV trace "
                        "(app,job,arrival_s,gpus,iterations,iter_time_s,model)")
    if policy:
        p.add_argument("--policy", default="themis", choices=sorted(POLICIES))
    p.add_argument("--fairness-knob", type=float, default=0.8, help="f of D6 (themis only)")
    p.add_argument("--lease", type=float, default=600.0, help="lease length in seconds (D10)")
    p.add_argument("--restart", type=float, default=DEFAULT_RESTART_S, help="restart delay in seconds (D11)")
    p.add_argument("--coalesce", type=float, default=DEFAULT_COALESCE_S,
                   help="seconds of events coalesced into one round (D10); larger is faster, coarser")
    p.add_argument("--expiry-window", type=float, default=None,
                   help="seconds a lease expiry waits for others to join its round (D10; default lease/10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="output folder")


def cmd_run(args: argparse.Namespace) -> int:
    summary = simulate(cluster=args.cluster, workload=args.workload, policy=args.policy,
                       fairness_knob=args.fairness_knob, lease=args.lease, restart=args.restart,
                       coalesce=args.coalesce, expiry_window=args.expiry_window, seed=args.seed)
    path = write_summary(summary, args.out)
    out_console.print(summary_table([summary], f"{args.workload} on {args.cluster}"))
    console.print(f"wrote {path}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from simulator.plots import compare_plots

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise SystemExit(f"themis-sim: unknown policies {unknown}; choose from {', '.join(sorted(POLICIES))}")
    summaries = []
    for policy in policies:
        s = simulate(cluster=args.cluster, workload=args.workload, policy=policy,
                     fairness_knob=args.fairness_knob, lease=args.lease, restart=args.restart,
                     coalesce=args.coalesce, expiry_window=args.expiry_window, seed=args.seed)
        write_summary(s, args.out / policy)
        summaries.append(s)
    out_console.print(summary_table(summaries, f"{args.workload} on {args.cluster}"))
    plots = compare_plots(summaries, args.out)
    (args.out / "comparison.json").write_text(json.dumps(
        [{k: v for k, v in s.items() if k != "apps"} for s in summaries], indent=1))
    console.print("wrote " + ", ".join(str(p) for p in [args.out / "comparison.json", *plots]))
    return 0


def cmd_experiment(args: argparse.Namespace) -> int:
    from simulator.experiments import EXPERIMENTS, run_experiment

    if args.name not in EXPERIMENTS:
        raise SystemExit(f"themis-sim: unknown experiment {args.name!r}; choose from {', '.join(EXPERIMENTS)}")
    run_experiment(args.name, args.out, quick=args.quick, seed=args.seed)
    return 0


def cmd_strategic(args: argparse.Namespace) -> int:
    from simulator.strategic import run_strategic

    levels = [float(x) for x in args.levels.split(",") if x.strip()]
    run_strategic(strategy=args.strategy, levels=levels, liars=args.liars, cluster=args.cluster,
                  workload=args.workload, seed=args.seed, out=args.out, fairness_knob=args.fairness_knob,
                  lease=args.lease, seeds=args.seeds)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="themis-sim", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="simulate one policy")
    _add_common(p)
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("compare", help="simulate several policies on the same workload")
    _add_common(p, policy=False)
    p.add_argument("--policies", default=DEFAULT_POLICIES)
    p.set_defaults(func=cmd_compare)
    p = sub.add_parser("experiment", help="reproduce one of the paper's figures")
    p.add_argument("name")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smaller workloads and fewer points")
    p.set_defaults(func=cmd_experiment)
    p = sub.add_parser("strategic", help="one or more lying apps among truthful ones (paper Fig. 15)")
    _add_common(p, policy=False)
    p.add_argument("--strategy", required=True)
    p.add_argument("--levels", default="0,10,20,30,40,50,60,70,80,90,100", help="lie sizes in percent")
    p.add_argument("--liars", type=int, default=1)
    p.add_argument("--seeds", type=int, default=3, help="average over this many seeds")
    p.set_defaults(func=cmd_strategic)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ClusterFileError, ValueError) as exc:
        console.print(f"[red]themis-sim: {exc}[/]")
        return 2


if __name__ == "__main__":
    sys.exit(main())
