"""One simulation and a batch of them over seeds: the unit every command and experiment runs.

Kept apart from ``simulator.cli`` (issue 11 item 8) so the experiments, the strategic study and
the benchmarks import the runs without importing the command line that imports them back.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from agent.restart_costs import restart_delays
from agent.termination import ConvergenceRule
from arbiter.admission import make_admission
from arbiter.cluster import load_cluster
from arbiter.policies import make_policy
from arbiter.rounds import DEFAULT_COALESCE_S
from simulator.engine import DEFAULT_RESTART_S, Simulation
from simulator.metrics import summarize
from simulator.run_store import RunStore, console
from simulator.workloads import load_workload

THEMIS_NAMES = ("themis", "themis-aware")  # Themis, and Themis with contention priced (D36)
PAYMENTS = ("exact", "bounds")  # how a Themis winner's c_i is settled in a simulation (D42)

if TYPE_CHECKING:
    from simulator.ray_sweep import RayCluster

__all__ = ["run_seeds", "simulate", "simulate_quietly"]



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
    strategy: tuple[str, float, Sequence[str]] | None = None,
    rank: str = "reported",
    max_contenders: int | None = None,
    min_bidders: int = 1,
    resplit: str = "now",
    reclaim: bool = True,
    admission: str | None = None,
    convergence: str | None = None,
    contention: str | None = None,
    preempt_at: float | None = None,
    restart_costs: str | None = None,
    record_rounds: str | Path | None = None,
    payments: str = "exact",
) -> dict[str, Any]:
    """One simulation, returned as its summary (the unit every command and experiment uses).

    ``strategy`` = (name, level, apps) makes those apps bid through ``simulator.strategic`` (``"*"``
    for every app), ranked by ``rank`` (D21: the liars' reported rho, or the one the arbiter computes
    with measured slowdowns); unlike ``agent_factory`` it can be sent to another process. Plugins the parent
    loaded (``simulator.plugins``) are loaded here too, so a worker process knows their names.
    ``max_contenders`` caps Themis's auction as the service does (D20; None, the default: no cap).
    ``min_bidders`` 2 lets no Themis auction have a single bidder (D41; 1, the default: D6).
    ``resplit="rent-or-buy"`` defers growth re-splits by the ski-rental rule (D23; default "now", D11).
    ``reclaim=False`` lets leases beyond a fair share run out while apps that hold nothing wait (D27).
    ``admission`` (``NAME[:ARG]``, e.g. ``fifo:1.2``) puts an admission policy in front of the policy
    (D33); ``convergence`` (``MIN_DELTA:PATIENCE[:abs]``) ends jobs whose loss stopped improving
    (D34). Naming either adds their numbers to the summary (``simulator.blocks``).
    ``contention`` (a contention table's CSV, or ``deepshare`` for the shipped one) slows every job by
    the jobs that share its machines (D35); ``preempt_at`` (with it) preempts a job whose contention
    ratio falls to that or below, as DeepShare does at 0.6.
    ``restart_costs`` (``profiles``: ``agent/profiles/restart_costs.toml``, or a table of that form)
    makes each app's jobs pay their model's measured restart cost instead of ``restart`` (D32).
    ``record_rounds`` (a file) records every round for ``themis-sim view`` (``simulator.recording``);
    the summary is the same with or without it.
    ``payments="bounds"`` lets bounds on c_i decide Themis's lotteries where they can (D39, D42): the
    same grants, so the same run, and no re-solve for a lottery the bounds decide; the summary then
    says ``payments``, counts ``bounded_lotteries``, and gives an app whose c_i were bounded
    ``hidden_payment_bounds`` instead of a ``mean_hidden_payment``."""
    from simulator.plugins import load_from_env

    load_from_env()
    the_cluster = load_cluster(cluster)
    the_workload = load_workload(workload, seed=seed, **(workload_knobs or {}))
    if strategy is not None:
        from simulator.strategic import liar_factory

        name, level, liars = strategy
        chosen = {a.app_id for a in the_workload.apps} if "*" in liars else set(liars)
        agent_factory = liar_factory(chosen, name, level, seed)
    options: dict[str, Any] = {"fairness_knob": fairness_knob, "max_contenders": max_contenders} if policy in THEMIS_NAMES else {}
    if policy in THEMIS_NAMES and min_bidders != 1:
        options["min_bidders"] = min_bidders
    if payments not in PAYMENTS:
        raise ValueError(f"payments must be one of {', '.join(PAYMENTS)}, got {payments!r}")
    bounds = payments == "bounds" and policy in THEMIS_NAMES
    if bounds:
        options["exact_payments"] = False
    sim = Simulation(
        the_cluster, the_workload, make_policy(policy, **options), lease_s=lease, restart_s=restart,
        coalesce_s=coalesce, expiry_window_s=expiry_window, seed=seed, agent_factory=agent_factory,
        resplit=resplit, rank=rank, reclaim=reclaim, admission=make_admission(admission),
        convergence=ConvergenceRule.parse(convergence) if convergence is not None else None,
        contention=_contention_model(contention, preempt_at),
        restart_costs=restart_delays(restart_costs) if restart_costs is not None else None,
    )
    recorder = None
    if record_rounds is not None:
        from simulator.recording import RoundRecorder

        settings = {"policy": policy, "cluster": the_cluster.name, "workload": the_workload.name, "seed": seed,
                    "lease_s": lease, "restart_s": restart, "coalesce_s": coalesce,
                    "expiry_window_s": sim.engine.expiry_window_s, "rank": rank, "reclaim": reclaim,
                    "resplit": resplit, **options, "admission": admission, "convergence": convergence,
                    "contention": contention, "preempt_at": preempt_at, "restart_costs": restart_costs}
        meta = {"title": f"{policy}: {the_workload.name} on {the_cluster.name}, seed {seed}", "policy": policy,
                "workload": the_workload.name, "cluster": the_cluster.name, "seed": seed}
        recorder = RoundRecorder(sim, record_rounds, meta=meta,
                                 settings={k: v for k, v in settings.items() if v is not None})
    if show_progress and not console.is_terminal:
        result = sim.run(progress=_app_lines(f"{policy} on {the_cluster.name}", sim))
    elif show_progress:
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
    if recorder is not None:
        recorder.close()
    summary = summarize(result, fairness_knob=fairness_knob if policy in THEMIS_NAMES else None, lease_s=lease,
                     restart_s=restart, coalesce_s=coalesce, expiry_window_s=sim.engine.expiry_window_s, seed=seed,
                     workload_source=the_workload.source,
                     **({"max_contenders": max_contenders} if policy in THEMIS_NAMES and max_contenders else {}),
                     **({"min_bidders": min_bidders} if policy in THEMIS_NAMES and min_bidders != 1 else {}),
                     **({"resplit": resplit} if resplit != "now" else {}),
                     **({} if reclaim else {"reclaim": False}),
                     **({"contention": contention} if contention is not None else {}),
                     **({"preempt_at": preempt_at} if preempt_at is not None else {}),
                     **({"restart_costs": restart_costs} if restart_costs is not None else {}),
                     **({"payments": payments, "bounded_lotteries": result.bounded} if bounds else {}))
    if admission is not None or convergence is not None:
        from simulator.blocks import add_blocks

        add_blocks(summary, sim, result.apps)
    return summary


def _contention_model(table: str | None, preempt_at: float | None):
    """D35's model for ``simulate``'s ``contention`` and ``preempt_at`` (None: contention off)."""
    if table is None:
        if preempt_at is not None:
            raise ValueError("preempting by contention ratio needs a contention table (--contention)")
        return None
    from simulator.contention import ContentionModel

    return ContentionModel.load(table, preempt_at)


def simulate_quietly(**kw: Any) -> dict[str, Any]:
    """``simulate`` without a progress bar (for worker processes)."""
    return simulate(show_progress=False, **kw)


def simulate_and_keep(folder: str, code: str, job: dict[str, Any]) -> dict[str, Any]:
    """Worker side of :func:`run_seeds`: simulate ``job`` and keep its summary at once, so an
    interrupted experiment keeps every run that finished."""
    return RunStore(Path(folder), code).keep(job, simulate_quietly(**job))


def _on_ray(cluster: "RayCluster", jobs: Sequence[dict[str, Any]], label: str, total: int,
            store: RunStore | None) -> list[dict[str, Any]]:
    """The runs as Ray tasks: each summary kept by this process as it arrives (a worker may be on
    another machine), one line per finished run with how many are still running."""
    from simulator.ray_sweep import elapsed, run_name, run_on_ray

    started = time.monotonic()
    kept = total - len(jobs)
    console.print(f"{label}: {len(jobs)} runs as Ray tasks on {cluster.address}"
                  + (f" ({kept} kept)" if kept else ""), highlight=False)

    def line(done: int, running: int) -> None:
        console.print(f"{label}: {kept + done} of {total} simulations done, {running} running on Ray, "
                      f"{elapsed(started)} elapsed", highlight=False)

    return run_on_ray(cluster, simulate_quietly, jobs, names=[run_name(j) for j in jobs], progress=line,
                      keep=(lambda i, summary: store.keep(jobs[i], summary)) if store is not None else None)


def _progress_lines(label: str, total: int, kept: int) -> Callable[[int], None]:
    """Progress as one plain line per finished run, for a log file or a pipe (a long experiment
    under ``nohup`` or in CI), where a live bar shows nothing until the end."""
    started = time.monotonic()
    if kept:
        console.print(f"{label}: {kept} of {total} simulations kept, {total - kept} to run", highlight=False)

    def line(done: int) -> None:
        minutes, seconds = divmod(int(time.monotonic() - started), 60)
        console.print(f"{label}: {kept + done} of {total} simulations done, {minutes}:{seconds:02d} elapsed",
                      highlight=False)

    return line


def _app_lines(label: str, sim: Simulation) -> Callable[[float], None]:
    """Progress of one simulation off a terminal (``themis-sim run`` into a log or a pipe, where the
    live bar shows nothing until the end): a line when it starts and one each time another tenth of
    its apps has finished, with the simulated time reached."""
    started = time.monotonic()
    total = len(sim.workload.apps)
    step = max(1, math.ceil(total / 10))
    console.print(f"{label}: {total} apps to simulate; a line every {step} finished", highlight=False)
    said = 0

    def tick(now: float) -> None:
        nonlocal said
        done = sum(1 for r in sim.runs.values() if r.finished_at is not None)
        if done > said and done >= min(total, said + step):
            said = done
            minutes, seconds = divmod(int(time.monotonic() - started), 60)
            console.print(f"{label}: {done} of {total} apps done, {now / 3600:.1f} simulated hours, "
                          f"{minutes}:{seconds:02d} elapsed", highlight=False)

    return tick


def run_seeds(runs: Sequence[dict[str, Any]], seeds: Sequence[int], workers: "int | RayCluster | None",
              label: str, store: RunStore | None = None) -> list[list[dict[str, Any]]]:
    """Every run (``simulate`` keyword arguments) at every seed, in parallel processes with a
    progress bar -- or, when ``workers`` is a :class:`~simulator.ray_sweep.RayCluster`, as Ray tasks;
    per run, its summaries in seed order. With a ``store``, runs it keeps are taken from it and only
    the others are simulated (each kept as soon as it ends)."""
    from simulator.ray_sweep import RayCluster
    from simulator.seeds import run_parallel

    jobs = [{**run, "seed": seed} for run in runs for seed in seeds]
    done: list[dict[str, Any] | None] = [store.get(job) if store else None for job in jobs]
    todo = [i for i, summary in enumerate(done) if summary is None]
    if store is not None:
        store.reused += len(jobs) - len(todo)
        store.simulated += len(todo)
    if isinstance(workers, RayCluster):
        for i, summary in zip(todo, _on_ray(workers, [jobs[i] for i in todo], label, len(jobs), store)):
            done[i] = summary
        k = len(seeds)
        return [done[i * k:(i + 1) * k] for i in range(len(runs))]  # type: ignore[misc]
    if store is not None:
        calls = [{"folder": str(store.folder), "code": store.code, "job": jobs[i]} for i in todo]
        fn: Any = simulate_and_keep
    else:
        calls, fn = [jobs[i] for i in todo], simulate_quietly
    kept = len(jobs) - len(todo)
    if console.is_terminal:
        with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("simulations"),
                      TextColumn(f"({kept} kept)" if kept else ""), TimeElapsedColumn(), console=console,
                      transient=True) as bar:
            task = bar.add_task("runs", total=len(jobs), completed=kept)
            fresh = run_parallel(fn, calls, workers=workers,
                                 progress=lambda n: bar.update(task, completed=kept + n))
    else:
        fresh = run_parallel(fn, calls, workers=workers, progress=_progress_lines(label, len(jobs), kept))
    for i, summary in zip(todo, fresh):
        done[i] = summary
    k = len(seeds)
    return [done[i * k:(i + 1) * k] for i in range(len(runs))]  # type: ignore[misc]
