"""``themis-demo``: rounds of Themis on the paper's 64-GPU testbed, in one process.

A dozen successive-halving apps (models from paper Table 4) arrive over an hour of virtual time.
Each round the arbiter asks every app for its rho, lets the worst (1 - f) fraction bid with their
real bid tables, runs the partial-allocation auction, hands the leftover to the others and grants
10-minute leases; apps train on what they hold, halve their jobs between phases and give their
GPUs back when they finish. The output is one line per round and a table per app at the end.

This is a small stand-in until the simulator (issue 3) replaces it as the main job: it charges no
restart cost (D11) and uses made-up losses to pick each phase's survivors.
"""

from __future__ import annotations

import argparse
import random
import time

from rich.console import Console
from rich.table import Table

from agent.agent import Agent
from agent.appsched import SuccessiveHalvingApp
from agent.fairness import ideal_time, job_time, split_allocation
from agent.placement import load_profiles
from arbiter.cluster import load_cluster
from arbiter.policies import make_policy
from arbiter.rounds import RoundEngine

STEP_S = 10.0


def make_apps(n: int, rng: random.Random) -> list[tuple[str, float, SuccessiveHalvingApp, str]]:
    profiles = load_profiles()
    models = sorted(profiles)
    apps = []
    arrival = 0.0
    for k in range(n):
        model = rng.choice(models)
        jobs = rng.choice([4, 8, 8, 16])
        phases = jobs.bit_length()
        iter_time = rng.uniform(1.0, 3.0)
        times = [iter_time * rng.uniform(0.8, 1.25) for _ in range(jobs)]
        iterations = [rng.choice([400, 600, 800])] * phases
        app = SuccessiveHalvingApp(
            times, iterations, job_demand_max=rng.choice([1, 2, 4]), slowdown=profiles[model].slowdown,
            start_time=arrival,
        )
        apps.append((f"app{k:02d}", arrival, app, model))
        arrival += rng.expovariate(1 / 300.0)
    return apps


def train(app: SuccessiveHalvingApp, gpus, dt: float, rng: random.Random) -> None:
    """Run the app's current jobs for ``dt`` seconds on ``gpus`` (paper Eq. 1 speeds)."""
    jobs = app.jobs_in_phase(app.current_phase(), gpus)
    for job, chunk in split_allocation(jobs, gpus):
        seconds_per_iter = job_time(job, chunk) / job.iters_remaining
        app.advance(job.job_id, dt / seconds_per_iter)
    if app.phase_done():
        jobs_now = app.phase_jobs()
        rng.shuffle(jobs_now)
        app.end_phase(jobs_now[: max(1, len(jobs_now) // 2)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="themis-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="testbed-64")
    parser.add_argument("--apps", type=int, default=12)
    parser.add_argument("--fairness-knob", type=float, default=0.8)
    parser.add_argument("--lease", type=float, default=600.0, help="lease length in seconds (D10)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)

    console = Console()
    rng = random.Random(args.seed)
    cluster = load_cluster(args.cluster)
    engine = RoundEngine(
        cluster, make_policy("themis", fairness_knob=args.fairness_knob), lease_s=args.lease, seed=args.seed
    )
    pending = make_apps(args.apps, rng)
    apps = {name: app for name, _, app, _ in pending}
    models = {name: model for name, _, _, model in pending}
    agents = {name: Agent(app) for name, app in apps.items()}
    arrived: dict[str, float] = {}
    finished: dict[str, tuple[float, float]] = {}  # app -> (finish time, N_avg at finish)
    now, rounds, wall = 0.0, 0, time.perf_counter()
    console.print(f"[bold]Themis demo[/] on {cluster.name} ({cluster.size} GPUs), {args.apps} apps, "
                  f"f = {args.fairness_knob}, leases of {args.lease:.0f} s")
    while pending or engine.apps:
        while pending and pending[0][1] <= now:
            name, at, _, _ = pending.pop(0)
            engine.add_app(name, now)
            arrived[name] = now
            console.print(f"[dim]{now:7.0f}s[/] {name} arrives ({models[name]}, "
                          f"{len(apps[name].iter_times)} jobs)")
        if engine.round_due(now):
            result = engine.run_round(now, {a: agents[a] for a in engine.apps})
            rounds += 1
            if result.expired:
                by_app: dict[str, int] = {}
                for lease in result.expired:
                    by_app[lease.app] = by_app.get(lease.app, 0) + 1
                console.print(f"[dim]{now:7.0f}s[/] [yellow]leases expire[/]: "
                              + ", ".join(f"{a} -{n}" for a, n in sorted(by_app.items())))
            won = ", ".join(f"{g.app}+{len(g.gpus)}{'' if g.source == 'auction' else '(leftover)'}"
                            for g in result.grants)
            console.print(f"[dim]{now:7.0f}s[/] [cyan]round {result.round_id}[/]: {len(result.offered)} free, "
                          f"bidders {', '.join(result.bidders) or '-'}; grants {won or '-'}; "
                          f"idle {len(result.idle)}")
        for name in sorted(engine.apps):
            gpus = [cluster.position(g) for g in sorted(engine.held(name))]
            if gpus:
                train(apps[name], gpus, STEP_S, rng)
            if apps[name].finished():
                n_avg = engine.n_avg(name, now + STEP_S)
                engine.remove_app(name, now + STEP_S)
                finished[name] = (now + STEP_S, n_avg)
                console.print(f"[dim]{now + STEP_S:7.0f}s[/] [green]{name} finishes[/] and frees its GPUs")
        now += STEP_S

    table = Table(title=f"Apps on {cluster.name}: {rounds} rounds, {time.perf_counter() - wall:.1f} s wall")
    for col in ("app", "model", "arrived (s)", "finished (s)", "N_avg", "rho = T_sh / T_id"):
        table.add_column(col, justify="right")
    for name in sorted(apps):
        end, n_avg = finished[name]
        rho = (end - arrived[name]) / ideal_time(apps[name], n_avg=n_avg, cluster_size=cluster.size)
        table.add_row(name, models[name], f"{arrived[name]:.0f}", f"{end:.0f}", f"{n_avg:.2f}", f"{rho:.2f}")
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
