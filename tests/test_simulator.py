"""Behavioural tests of the event-driven simulator (``simulator.engine``).

Every expected number here is computed from the workload by hand (Eq. 1 speeds, D1 slowdowns, the
1 s round-coalescing window of D10, the restart delay of D11), or checked against an independent
observer: a ``progress`` callback that looks at the lease table and every job after each event and
integrates what must have happened until the next one.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

from agent.placement import load_profiles
from arbiter.cluster import Cluster, cluster_from_mapping
from arbiter.policies import POLICIES, make_policy
from arbiter.rounds import DEFAULT_COALESCE_S
from simulator.apps import STOP_TOLERANCE
from simulator.engine import RESTART_CAUSES, JobRun, Simulation, SimulationResult, app_rho
from simulator.metrics import summarize
from simulator.workload import AppSpec, JobSpec, Workload

PROFILES = load_profiles()
C = DEFAULT_COALESCE_S  # an arrival on an idle cluster is served one coalescing window later


def machine(gpus: int = 8, slots: int = 4, name: str = "one-machine") -> Cluster:
    return cluster_from_mapping({"name": name, "racks": [{"machines": [{"gpus": gpus, "slots": slots}]}]})


def mixed_cluster() -> Cluster:
    """21 GPUs on two racks: 8-GPU (4 slots), 4-GPU and 1-GPU machines, so placement matters."""
    return cluster_from_mapping({"name": "mixed-21", "racks": [
        {"machines": [{"gpus": 8, "slots": 4}, {"gpus": 4, "slots": 4}]},
        {"machines": [{"gpus": 4, "slots": 4}, {"gpus": 1, "count": 5}]},
    ]})


def fixed_app(app_id: str, jobs: list[tuple[str, float, float, int]], *, arrival: float = 0.0,
              model: str = "resnet50") -> AppSpec:
    return AppSpec(app_id, arrival, model, "fixed", tuple(JobSpec(*j) for j in jobs))


def contended(seed: int = 0, n: int = 9) -> Workload:
    """All three kinds of app, 2-8 GPUs per job, arriving faster than the 21 GPUs drain them."""
    rng = random.Random(seed)
    models = ["vgg16", "lm", "resnet50", "deepspeech", "transformer"]
    apps = []
    for k in range(n):
        kind = ("fixed", "successive_halving", "curve_stopping")[k % 3]
        gpus = rng.choice([2, 4, 8])
        n_jobs = 4 if kind == "successive_halving" else rng.choice([1, 2, 3])
        jobs = tuple(JobSpec(f"a{k}-j{i}", rng.randint(200, 800), rng.uniform(0.5, 2.0), gpus)
                     for i in range(n_jobs))
        phases = (150.0, 300.0, 400.0) if kind == "successive_halving" else ()
        apps.append(AppSpec(f"a{k}", k * 60.0, rng.choice(models), kind, jobs, phases, seed=k))
    return Workload("contended", tuple(apps))


# -- an independent observer ---------------------------------------------------------------------


@dataclass
class JobSnap:
    obj: object  # the JobRun itself, to notice when the engine replaces it
    gpus: tuple[str, ...]
    rate: float
    ready_at: float
    restarts: int
    started: bool
    demand: int


@dataclass
class Snap:
    t: float
    leased: int
    held: dict[str, frozenset[str]]
    done: dict[tuple[str, str], float]  # iterations run so far, per (app, job)
    jobs: dict[tuple[str, str], JobSnap]
    gpu_seconds: dict[str, float]
    busy: dict[str, float]


class Observer:
    """Snapshots the simulation after every event (the engine's ``progress`` hook) and checks what
    must hold at every instant: no GPU held twice, each job runs on GPUs its app holds, jobs of an
    app never share a GPU."""

    def __init__(self, sim: Simulation):
        self.sim = sim
        self.snaps: list[Snap] = []

    def __call__(self, now: float) -> None:
        sim = self.sim
        held = {name: sim.engine.held(name) for name in sim.engine.apps}
        seen: set[str] = set()
        for name, gpus in held.items():
            assert not gpus & seen, f"t={now}: {name} holds GPUs someone else holds"
            seen |= gpus
        assert len(seen) == len(sim.engine.leases)
        jobs, done = {}, {}
        for name, run in sim.runs.items():
            for job, k in run.app.losses.done.items():
                done[name, job] = k
            if run.finished_at is not None:
                assert not held.get(name), f"{name} finished but still holds GPUs"
                continue
            used: set[str] = set()
            for job_id, jr in run.jobs.items():
                assert set(jr.gpus) <= held.get(name, frozenset()), f"t={now}: {job_id} runs on GPUs {name} does not hold"
                assert not set(jr.gpus) & used, f"t={now}: two jobs of {name} share a GPU"
                used |= set(jr.gpus)
                jobs[name, job_id] = JobSnap(jr, jr.gpus, jr.rate, jr.ready_at, jr.restarts, jr.started, jr.demand)
        self.snaps.append(Snap(
            now, len(sim.engine.leases), held, done, jobs,
            {n: r.gpu_seconds for n, r in sim.runs.items()},
            {n: r.busy_gpu_seconds for n, r in sim.runs.items()},
        ))

    def pairs(self):
        return zip(self.snaps, self.snaps[1:])

    def leased_gpu_seconds(self, until: float) -> float:
        total = sum(a.leased * (b.t - a.t) for a, b in self.pairs())
        return total + self.snaps[-1].leased * (until - self.snaps[-1].t)


def observed_run(cluster: Cluster, workload: Workload, policy: str = "themis", **kw) -> tuple[SimulationResult, Observer]:
    sim = Simulation(cluster, workload, make_policy(policy), **kw)
    obs = Observer(sim)
    return sim.run(progress=obs), obs


def eq1_rate(cluster: Cluster, spec: AppSpec, job: JobSpec, gpus: tuple[str, ...], phase_demand: int) -> float:
    """Eq. 1 from first principles: min(|G|, demand) / (iter_time * S(G)), S by D1 level. A
    successive-halving job's demand doubles each phase (paper 4.3.2), so it is passed in."""
    s = 1.0 if len(gpus) <= 1 else PROFILES[spec.model].slowdown[cluster.locality(gpus)]
    demand = job.gpus if spec.kind != "successive_halving" else phase_demand
    assert demand % job.gpus == 0
    return min(len(gpus), demand) / (job.iter_time_s * s)


# -- work and GPU time ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", sorted(PROFILES))
def test_lone_job_in_one_machine_finishes_at_work_over_speed(model: str):
    """S = 1 at levels 0 and 1 for every shipped model, so 4 GPUs of one machine run 1000
    iterations of 2 s at 4x: done 500 s after the first round, which is 1 s after arrival."""
    assert PROFILES[model].slowdown[:2] == (1.0, 1.0)
    arrival, iters, t_iter, gpus = 100.0, 1000.0, 2.0, 4
    w = Workload("one", (fixed_app("a", [("j", iters, t_iter, gpus)], arrival=arrival, model=model),))
    r = Simulation(machine(8, 4), w, make_policy("themis")).run()
    (run,) = r.apps
    assert run.finished_at == pytest.approx(arrival + C + iters * t_iter / gpus, abs=1e-9)
    assert run.gpu_seconds == pytest.approx(gpus * iters * t_iter / gpus)
    assert run.busy_gpu_seconds == pytest.approx(run.gpu_seconds)
    assert run.scored == pytest.approx(run.busy_gpu_seconds)  # placement score 1
    assert run.restarts == 0
    assert run.finished_at <= r.makespan <= run.finished_at + C  # makespan is the last finish (see test_makespan_is_the_last_finish)
    # alone all its life, N_avg = 1: rho = (C + T_id) / T_id with T_id = budget / demand
    assert app_rho(run, r.cluster_size) == pytest.approx((C + 500.0) / 500.0)


def test_demand_above_what_fits_runs_at_the_cap():
    """A job asking for 8 GPUs on a 4-GPU cluster runs on the 4 it gets, at 4x (Eq. 1's min)."""
    w = Workload("big", (fixed_app("a", [("j", 800.0, 1.0, 8)]),))
    r = Simulation(machine(4, 4), w, make_policy("fifo")).run()
    assert r.apps[0].finished_at == pytest.approx(C + 800.0 / 4)


@pytest.mark.parametrize("policy", ["themis", "fifo"])
def test_gpu_time_is_conserved(policy: str):
    cluster = mixed_cluster()
    w = contended(seed=1)
    r, obs = observed_run(cluster, w, policy, lease_s=150.0)
    total = sum(a.gpu_seconds for a in r.apps)
    # the sum over apps of GPU time is the integral of leased GPUs over time ...
    assert total == pytest.approx(obs.leased_gpu_seconds(r.makespan), rel=1e-9)
    assert obs.snaps[-1].leased == 0
    # ... which cannot exceed the cluster
    assert total <= r.cluster_size * r.makespan * (1 + 1e-12)
    s = summarize(r)
    assert 0 < s["utilization"] <= 1 + 1e-12
    for run in r.apps:
        assert run.busy_gpu_seconds <= run.gpu_seconds * (1 + 1e-12), run.spec.app_id
        assert run.scored <= run.busy_gpu_seconds * (1 + 1e-12)
    # per app and per interval: GPU time grows by the GPUs held, busy time by the GPUs jobs run on
    for a, b in obs.pairs():
        dt = b.t - a.t
        for name in a.gpu_seconds:
            if name not in a.held:
                assert b.gpu_seconds[name] == a.gpu_seconds[name]
                continue
            assert b.gpu_seconds[name] - a.gpu_seconds[name] == pytest.approx(len(a.held[name]) * dt, abs=1e-6)
            busy = sum(len(j.gpus) for (app, _), j in a.jobs.items() if app == name) * dt
            assert b.busy[name] - a.busy[name] == pytest.approx(busy, abs=1e-6)
    # every fixed job ran exactly its iterations, no more, no less
    for run in r.apps:
        if run.spec.kind == "fixed":
            for job in run.spec.jobs:
                assert run.app.losses.done[job.job_id] == pytest.approx(job.iterations, abs=1e-5)


def test_every_job_progresses_at_eq1_speed_on_the_gpus_it_holds():
    """Between two events, each job runs min(|G|, demand) / (iter_time * S(G)) iterations per
    second (S from its model's profile at its GPUs' D1 level), except during a restart delay; jobs
    without GPUs do not progress."""
    cluster = mixed_cluster()
    w = contended(seed=2)
    specs = {(a.app_id, j.job_id): (a, j) for a in w.apps for j in a.jobs}
    _, obs = observed_run(cluster, w, "themis", lease_s=150.0, restart_s=35.0)
    levels = set()
    for a, b in obs.pairs():
        for key, before in a.done.items():
            if key[0] in a.held and key in a.jobs and a.jobs[key].gpus:
                js = a.jobs[key]
                spec, job = specs[key]
                assert js.rate == pytest.approx(eq1_rate(cluster, spec, job, js.gpus, js.demand), rel=1e-12)
                levels.add(cluster.locality(js.gpus))
                expected = max(0.0, b.t - max(a.t, js.ready_at)) * js.rate
            else:
                expected = 0.0
            assert b.done[key] - before == pytest.approx(expected, rel=1e-9, abs=1e-5), (key, a.t, b.t)
    assert levels >= {0, 1}  # the scenario exercises more than one locality level


# -- placement (Eq. 1 with S) ----------------------------------------------------------------------


@pytest.mark.parametrize("model", ["vgg16", "lm", "resnet50", "deepspeech"])
def test_job_spread_across_racks_runs_slower_by_level3_slowdown(model: str):
    """Two racks of one 2-GPU machine each: the only 4 GPUs are across racks (D1 level 3). FIFO
    grants all four (Themis would keep lm, whose level-3 slowdown exceeds 2, on one machine)."""
    cluster = cluster_from_mapping({"name": "two-racks", "racks": [
        {"machines": [{"gpus": 2}]}, {"machines": [{"gpus": 2}]}]})
    w = Workload("x", (fixed_app("a", [("j", 1000.0, 2.0, 4)], arrival=100.0, model=model),))
    r = Simulation(cluster, w, make_policy("fifo")).run()
    (run,) = r.apps
    s3 = PROFILES[model].slowdown[3]
    assert run.finished_at == pytest.approx(100.0 + C + 1000.0 * 2.0 * s3 / 4, rel=1e-12)
    assert run.scored / run.busy_gpu_seconds == pytest.approx(1 / s3)


@pytest.mark.parametrize("model", ["vgg16", "transformer"])
def test_job_spread_across_machines_of_one_rack_runs_slower_by_level2_slowdown(model: str):
    cluster = cluster_from_mapping({"name": "one-rack", "racks": [{"machines": [{"gpus": 2, "count": 2}]}]})
    w = Workload("x", (fixed_app("a", [("j", 1000.0, 2.0, 4)], model=model),))
    r = Simulation(cluster, w, make_policy("themis")).run()
    s2 = PROFILES[model].slowdown[2]
    assert r.apps[0].finished_at == pytest.approx(C + 1000.0 * 2.0 * s2 / 4, rel=1e-12)


# -- restarts (D11) --------------------------------------------------------------------------------


@pytest.mark.parametrize("restart_s", [0.0, 35.0])
def test_lone_app_that_wins_back_its_leases_keeps_running_without_restart(restart_s: float):
    """Leases of 50 s expire ten times during the job; the app wins the same GPUs back each time
    (it is alone and uses the whole cluster), so it never restarts and finishes on time."""
    w = Workload("lone", (fixed_app("a", [("j", 1000.0, 2.0, 4)], arrival=100.0),))
    sim = Simulation(machine(4, 4), w, make_policy("themis"), lease_s=50.0, restart_s=restart_s, keep_rounds=True)
    r = sim.run()
    (run,) = r.apps
    expiries = [rr for rr in r.round_results if rr.expired]
    assert len(expiries) >= 9
    for rr in expiries:  # every expiry round hands the same four GPUs straight back
        assert {lease.gpu for lease in rr.expired} == set(machine(4, 4).gpus)
        assert [(g.app, g.gpus) for g in rr.grants] == [("a", frozenset(machine(4, 4).gpus))]
    assert run.restarts == 0
    assert run.finished_at == pytest.approx(100.0 + C + 500.0)


@pytest.mark.parametrize("restart_s", [0.0, 35.0])
def test_job_whose_gpu_set_grows_pays_one_restart(restart_s: float):
    """Two 2-GPU jobs share a 2-GPU machine one GPU each (D3's even split); when the short one
    ends, the long one takes both GPUs: one restart, charged once, then twice the speed."""
    w = Workload("grow", (fixed_app("a", [("short", 100.0, 2.0, 2), ("long", 400.0, 2.0, 2)]),))
    r = Simulation(machine(2, 2), w, make_policy("themis"), restart_s=restart_s).run()
    (run,) = r.apps
    short_done = C + 100.0 * 2.0  # one GPU each
    assert run.restarts == 1
    assert run.restarts_by == {"resplit": 1}  # the app's GPUs stayed the same; its jobs changed
    assert run.finished_at == pytest.approx(short_done + restart_s + (400.0 - 100.0) * 2.0 / 2)


def test_rent_or_buy_moves_a_grown_job_once_the_idle_gpu_has_cost_its_restart():
    """D23 on the case above: when the short job ends, moving the long one onto both GPUs costs a
    restart of 35 s on 2 GPUs (70 GPU-s); keeping it leaves 1 GPU idle, so it keeps its GPU for
    70 s (35 iterations at one GPU's speed), then restarts once on both."""
    w = Workload("grow", (fixed_app("a", [("short", 100.0, 2.0, 2), ("long", 400.0, 2.0, 2)]),))
    r = Simulation(machine(2, 2), w, make_policy("themis"), restart_s=35.0, resplit="rent-or-buy").run()
    (run,) = r.apps
    short_done = C + 100.0 * 2.0
    waited = 35.0 * 2 / 1
    assert run.restarts == 1 and run.deferred == 1
    assert run.finished_at == pytest.approx(short_done + waited + 35.0 + (300.0 - waited / 2.0) * 2.0 / 2)


def test_rent_or_buy_takes_two_growths_in_one_restart():
    """Three 3-GPU jobs on a 3-GPU machine, one GPU each (Tiresias hands a lone app the whole
    machine; the rule is the app's own, whatever the policy). The first short job ends: the long job
    would move onto 2 GPUs (70 GPU-s of restart) while 1 GPU idles, so it waits. The second ends
    40 s later (40 GPU-s paid): moving onto all 3 now costs 105 GPU-s with 2 GPUs idle, so it waits
    (105 - 40) / 2 = 32.5 s more and then restarts once, where moving at once restarts it twice."""
    jobs = [("s1", 100.0, 2.0, 3), ("s2", 120.0, 2.0, 3), ("long", 1000.0, 2.0, 3)]
    w = Workload("grow-twice", (fixed_app("a", jobs),))
    now = Simulation(machine(3, 3), w, make_policy("tiresias"), restart_s=35.0).run().apps[0]
    rent = Simulation(machine(3, 3), w, make_policy("tiresias"), restart_s=35.0, resplit="rent-or-buy").run().apps[0]
    assert now.restarts == 2
    assert now.restart_gaps == {"first": 1, "<=2min": 1}  # 40 s apart: past the first's 35 s delay
    assert rent.restarts == 1 and rent.deferred == 2 and rent.restart_gaps == {"first": 1}
    moved_at = C + 240.0 + (105.0 - 40.0) / 2
    s = PROFILES["resnet50"].slowdown[1]  # three slots of one machine
    left = 1000.0 - (moved_at - C) / 2.0
    assert rent.finished_at == pytest.approx(moved_at + 35.0 + left * 2.0 * s / 3)


def test_rent_or_buy_never_defers_to_a_time_the_clock_cannot_reach():
    """Late in a long run the rent still owed can be too small to move the clock (now + owed ==
    now); deferring then would wake the app at the same instant forever, so it re-splits instead."""
    w = Workload("grow", (fixed_app("a", [("long", 400.0, 2.0, 2)]),))
    sim = Simulation(machine(2, 2), w, make_policy("tiresias"), restart_s=35.0, resplit="rent-or-buy")
    sim._arrive(w.apps[0])
    run = sim.runs["a"]
    run.jobs["long"] = JobRun("long", gpus=("r0-m0-g0",), started=True)
    sim.now = 3e10
    run.renting = (sim.now, 70.0 * (1 - 1e-8), 1)  # 7e-7 GPU-s owed on 1 idle GPU
    assert sim.now + 7e-7 == sim.now
    assert not sim._rent(run, {"long": 1}, {"long": 2}, 2)
    run.renting = (sim.now, 35.0, 1)  # half paid: it waits the other 35 s
    assert sim._rent(run, {"long": 1}, {"long": 2}, 2) and run.resplit_at == sim.now + 35.0


def test_an_unknown_resplit_is_refused():
    with pytest.raises(ValueError, match="unknown resplit 'later'"):
        Simulation(machine(2, 2), Workload("w", ()), make_policy("themis"), resplit="later")


def test_restarts_are_counted_by_what_happened_to_the_apps_gpus():
    """Issue 13, item 5: each restart is put down to its app's GPUs growing, shrinking, moving, or
    staying the same while its jobs are re-split. An app that arrives to half a machine and takes
    the rest when the other app ends restarts only because it grew; under short leases and
    contention every restart has exactly one cause, and the summary adds them up."""
    w = Workload("grow-app", (fixed_app("b", [("short", 100.0, 2.0, 2)]),
                              fixed_app("a", [("long", 1000.0, 2.0, 4)], arrival=1.0)))
    r = Simulation(machine(4, 4), w, make_policy("themis"), restart_s=35.0).run()
    runs = {run.spec.app_id: run for run in r.apps}
    assert runs["b"].restarts == 0 and runs["b"].restarts_by == {}
    assert runs["a"].restarts >= 1 and runs["a"].restarts_by == {"grew": runs["a"].restarts}

    r = Simulation(mixed_cluster(), contended(seed=3), make_policy("themis"), lease_s=100.0, restart_s=35.0).run()
    assert all(sum(run.restarts_by.values()) == run.restarts for run in r.apps)
    assert all(sum(run.restart_gaps.values()) == run.restarts for run in r.apps)
    summary = summarize(r)
    assert sum(summary["restart_gaps"].values()) == summary["restarts"]
    assert set(summary["restarts_by_cause"]) == set(RESTART_CAUSES)
    assert sum(summary["restarts_by_cause"].values()) == summary["restarts"] > 0
    assert sum(1 for n in summary["restarts_by_cause"].values() if n) >= 2


def test_restart_delay_is_charged_exactly_when_a_jobs_gpus_change():
    """Under contention with short leases GPUs move between apps. Whenever a job's restart count
    goes up, its GPU set has just changed and it may not run for ``restart_s``; a job whose
    (non-empty) GPU set is unchanged is never charged; and finish times move with restart_s."""
    restart_s = 35.0
    cluster = mixed_cluster()
    w = contended(seed=3)
    r, obs = observed_run(cluster, w, "themis", lease_s=100.0, restart_s=restart_s)
    charged = 0
    for a, b in obs.pairs():
        for key, nb in b.jobs.items():
            na = a.jobs.get(key)
            if na is None or na.obj is not nb.obj:
                continue  # a job (re)entering the app's job list
            if nb.restarts > na.restarts:
                charged += nb.restarts - na.restarts
                assert nb.restarts == na.restarts + 1, key
                assert nb.gpus and nb.gpus != na.gpus, key
                assert nb.ready_at == pytest.approx(b.t + restart_s), key
            else:
                assert nb.ready_at == na.ready_at or not na.started, key
                if na.gpus and nb.gpus:
                    assert nb.gpus == na.gpus, f"{key} moved at t={b.t} without a restart"
    assert charged > 0
    assert sum(run.restarts for run in r.apps) >= charged
    r0 = Simulation(cluster, w, make_policy("themis"), lease_s=100.0, restart_s=0.0).run()
    assert r0.makespan < r.makespan


# -- determinism -----------------------------------------------------------------------------------


def _summary(seed: int, policy: str = "themis") -> dict:
    r = Simulation(mixed_cluster(), contended(seed=4), make_policy(policy), lease_s=150.0, seed=seed).run()
    s = summarize(r)
    s.pop("wall_seconds")
    return s


@pytest.mark.parametrize("policy", ["themis", "gandiva"])
def test_same_seed_gives_identical_summary(policy: str):
    assert _summary(5, policy) == _summary(5, policy)
    _summary(6, policy)  # another seed runs too (it may or may not differ)


# -- app kinds -------------------------------------------------------------------------------------


def test_successive_halving_app_halves_its_jobs_each_phase():
    """8 one-GPU jobs, 4 phases: 8, 4, 2, 1 jobs of 1, 2, 4, 8 GPUs run, the survivors are the better half
    by loss, unused GPUs go back, and the app ends when the last job does."""
    phases = (100.0, 200.0, 300.0, 400.0)
    jobs = tuple(JobSpec(f"j{k}", 1.0, 1.0, 1) for k in range(8))
    w = Workload("sh", (AppSpec("a", 0.0, "resnet50", "successive_halving", jobs, phases, seed=3),))
    sim = Simulation(machine(8, 4), w, make_policy("themis"), restart_s=0.0)
    seen: list[tuple[float, int, list[str], int, int]] = []

    def watch(now: float) -> None:
        run = sim.runs["a"]
        if run.finished_at is not None:
            return
        app = run.app
        state = (app.current_phase(), app.phase_jobs(), sum(1 for j in run.jobs.values() if j.gpus),
                 len(sim.engine.held("a")))
        if not seen or seen[-1][1:] != state:
            if seen and app.current_phase() > seen[-1][1]:  # a phase just ended: check who survived
                losses = {j: app.losses.loss(j) for j in seen[-1][2]}
                best = sorted(losses, key=lambda j: (losses[j], j))[: len(losses) // 2]
                assert sorted(best) == app.phase_jobs()
            seen.append((now, *state))

    r = sim.run(progress=watch)
    running = [(phase, len(ids), n_run, n_held) for _, phase, ids, n_run, n_held in seen if n_run]
    # paper 4.3.2: each phase doubles the survivors' demand, so the app keeps all 8 GPUs
    assert running == [(1, 8, 8, 8), (2, 4, 4, 8), (3, 2, 2, 8), (4, 1, 1, 8)]
    ends = [t for t, *_ in seen if _[2]]
    assert ends == pytest.approx([C, C + 100.0, C + 200.0, C + 275.0])
    (run,) = r.apps
    assert run.app.current_phase() == 5 and run.app.finished()
    assert run.finished_at == pytest.approx(C + 100.0 + 200.0 / 2 + 300.0 / 4 + 400.0 / 8)
    # each surviving job ran exactly the iterations of the phases it reached
    reached = {j: len({phase for _, phase, ids, *_ in seen if j in ids}) for j in run.app.losses.done}
    for j, done in run.app.losses.done.items():
        assert done == pytest.approx(sum(phases[: reached[j]]), abs=1e-5), j


def test_curve_stopping_app_stops_jobs_when_their_curves_flatten():
    jobs = tuple(JobSpec(f"j{k}", 5000.0, 0.1, 1) for k in range(4))
    w = Workload("cs", (AppSpec("c", 0.0, "resnet50", "curve_stopping", jobs, seed=1),))
    sim = Simulation(mixed_cluster(), w, make_policy("themis"), restart_s=0.0)
    stopped_at: dict[str, float] = {}

    def watch(now: float) -> None:
        for job in sim.runs["c"].app.jobs:
            if job.stopped and job.job_id not in stopped_at:
                stopped_at[job.job_id] = now

    r = sim.run(progress=watch)
    (run,) = r.apps
    app = run.app
    assert all(job.stopped for job in app.jobs)
    early = [job for job in app.jobs if job.done < 0.9 * job.max_iterations]
    assert early, "no job stopped before its iteration cap"
    for job in app.jobs:
        assert job.done <= job.max_iterations
        # it ran (one GPU each, from the first round) exactly until it stopped
        assert stopped_at[job.job_id] == pytest.approx(C + job.done * 0.1, abs=1e-6)
    for job in early:
        # stopped because the app's fit said flat: the true curve is close to its floor there
        curve = app.losses.curves[job.job_id]
        assert curve.loss(job.done) - curve.b2 < 10 * STOP_TOLERANCE
        assert len(job.losses) >= 3  # a fit needs three reports
    assert run.finished_at == pytest.approx(max(stopped_at.values()))


# -- every policy ----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_finishes_a_contended_workload_without_double_leases(policy: str):
    cluster = mixed_cluster()
    w = contended(seed=5)
    sim = Simulation(cluster, w, make_policy(policy), lease_s=120.0, keep_rounds=True)
    obs = Observer(sim)
    r = sim.run(progress=obs)
    assert r.policy == policy
    assert all(run.finished_at is not None for run in r.apps)
    assert all(run.finished_at >= run.spec.arrival_s for run in r.apps)
    assert all(run.app.finished() for run in r.apps)
    assert r.rounds == len(r.round_results) > 0
    contended_rounds = 0
    for rr in r.round_results:
        given: set[str] = set()
        for g in rr.grants:
            assert g.gpus <= rr.offered, f"round {rr.round_id}: granted GPUs that were not free"
            assert not g.gpus & given, f"round {rr.round_id}: a GPU granted twice"
            given |= g.gpus
            assert len(g.gpus) <= rr.unmet.get(g.app, 0)  # never more than the app asked for
        contended_rounds += sum(rr.unmet.values()) > len(rr.offered)
    assert contended_rounds > 0  # the workload really is contended
    assert obs.snaps[-1].leased == 0
    summary = summarize(r)
    assert summary["apps_count"] == len(w.apps)
    assert all(math.isfinite(a["rho"]) and a["rho"] > 0 for a in summary["apps"])


# -- errors ----------------------------------------------------------------------------------------


def test_unknown_model_is_rejected_with_a_clear_error():
    w = Workload("bad", (fixed_app("a", [("j", 10.0, 1.0, 1)], model="no-such-net"),))
    with pytest.raises(ValueError, match=r"'bad'.*no profile.*no-such-net"):
        Simulation(machine(), w, make_policy("themis"))


def test_negative_restart_delay_is_rejected():
    w = Workload("ok", (fixed_app("a", [("j", 10.0, 1.0, 1)]),))
    with pytest.raises(ValueError, match="restart"):
        Simulation(machine(), w, make_policy("themis"), restart_s=-1.0)


# -- regressions: engine bugs found by these tests and fixed -----------------------------------------


def test_job_keeps_its_gpu_when_a_sibling_finishes():
    w = Workload("keep", (fixed_app("a", [("short", 100.0, 1.0, 1), ("long", 200.0, 1.0, 1)]),))
    r = Simulation(machine(2, 2), w, make_policy("fifo"), restart_s=35.0).run()
    assert r.apps[0].restarts == 0
    assert r.apps[0].finished_at == pytest.approx(C + 200.0)


def test_makespan_is_the_last_finish():
    w = Workload("one", (fixed_app("a", [("j", 100.0, 1.0, 1)]),))
    r = Simulation(machine(2, 2), w, make_policy("fifo")).run()
    assert r.makespan == r.apps[0].finished_at == C + 100.0


def test_next_phase_gets_free_gpus_without_waiting_for_a_lease_expiry():
    jobs = (JobSpec("j0", 1.0, 1.0, 1), JobSpec("j1", 1.0, 1.0, 1), JobSpec("j2", 1.0, 1.0, 1),
            JobSpec("j3", 1.0, 2.0, 1))
    w = Workload("sh", (AppSpec("a", 0.0, "resnet50", "successive_halving", jobs, (100.0, 100.0)),))
    r = Simulation(machine(4, 4), w, make_policy("fifo"), restart_s=0.0).run()
    # phase 1 ends with the 2 s/iteration straggler at C + 200; phase 2's two survivors run side by
    # side on the idle GPUs (at most one more coalescing window): done by C + 300 + C
    assert r.apps[0].finished_at <= C + 200.0 + 100.0 + C + 1e-9


def test_halving_survivors_pay_a_restart_whenever_their_gpus_change():
    """A job that finished its phase early and goes on as a survivor keeps its record, so its move
    to new GPUs in the next phase is charged like any other (D11)."""
    c = cluster_from_mapping({"name": "m4", "racks": [{"machines": [{"gpus": 4}]}]})
    jobs = (JobSpec("j0", 1, 1.0, 1), JobSpec("j1", 1, 1.0, 1), JobSpec("j2", 1, 1.0, 1), JobSpec("j3", 1, 2.0, 1))
    w = Workload("b3", (AppSpec("a", 0.0, "resnet50", "successive_halving", jobs, (100.0, 100.0)),))
    sim = Simulation(c, w, make_policy("fifo"), restart_s=35.0)
    paid: dict[str, int] = {}

    def watch(now: float) -> None:
        run = sim.runs.get("a")
        if run is not None and run.finished_at is None:
            for job_id, jr in run.jobs.items():
                paid[job_id] = jr.restarts

    r = sim.run(progress=watch)
    (run,) = r.apps
    ran_phase_2 = [j for j, done in run.app.losses.done.items() if done > 100.0 + 1e-6]
    assert len(ran_phase_2) == 2
    # both survivors resume on other GPUs (phase 2 doubles their demand), so both pay
    assert all(paid[j] >= 1 for j in ran_phase_2)
    assert sum(paid[j] for j in ran_phase_2) == run.restarts


def test_a_job_whose_end_rounds_to_now_finishes_instead_of_stalling_the_clock():
    """8 GPUs at 1e-5 s per iteration from t = 3e5 s: 5e-6 iterations were left (above the 1e-6
    iteration tolerance) at 7.9e5 iterations per second, so the job's next event was now + 6e-12 s,
    which rounds to now; the loop ran forever at the same instant (found in review)."""
    from arbiter.cluster import load_cluster

    spec = AppSpec("a0", 3e5, "resnet50", "fixed", (JobSpec("j0", 125506902.57394217, 1e-5, 8),))
    sim = Simulation(load_cluster("testbed-64"), Workload("w", (spec,)), make_policy("fifo"))
    seen = {"now": None, "repeats": 0}

    def tick(now: float) -> None:
        seen["repeats"] = seen["repeats"] + 1 if now == seen["now"] else 0
        seen["now"] = now
        assert seen["repeats"] < 10_000, f"the clock stands still at {now!r}"

    result = sim.run(progress=tick)
    (run,) = result.apps
    assert run.finished_at == pytest.approx(3e5 + 125506902.57394217 * 1e-5 / 8, rel=1e-3)
