"""Admission policies in front of the scheduling policy (Blox's admission block, D33): the policies
themselves, the round engine that both the simulator and the service drive, the simulator's
summary and command line, and a real arbiter started with ``--admission``."""

from __future__ import annotations

import asyncio
import json

import pytest

from agent.agent import Agent
from agent.appsched import JobInfo, SingleJobApp
from arbiter.admission import AcceptAll, AdmissionContext, FifoAdmission, WaitingApp, make_admission
from arbiter.cluster import load_cluster
from arbiter.policies import make_policy
from arbiter.rounds import RoundEngine
from arbiter.store import Store
from simulator.cli import main as sim_main
from simulator.runs import simulate
from tests.service_kit import arbiter, cluster_file, halving_app, start_agent, wait_for

# -- the policies ------------------------------------------------------------------------------


def test_make_admission_reads_name_and_argument():
    assert isinstance(make_admission(None), AcceptAll)
    assert isinstance(make_admission("accept-all"), AcceptAll)
    fifo = make_admission("fifo:1.2")
    assert isinstance(fifo, FifoAdmission) and fifo.threshold == 1.2 and fifo.spec() == "fifo:1.2"
    assert make_admission("fifo").spec() == "fifo:1"


@pytest.mark.parametrize("text, words", [
    ("lottery:2", "unknown admission policy 'lottery'"),
    ("fifo:lots", "must be a number"),
    ("fifo:0", "threshold"),
    ("fifo:-1", "threshold"),
    ("fifo:inf", "threshold"),
    ("accept-all:2", "takes no argument"),
])
def test_a_bad_admission_is_refused_with_what_and_why(text, words):
    with pytest.raises(ValueError, match=words):
        make_admission(text)


def test_fifo_admits_in_arrival_order_while_the_admitted_demand_is_within_the_threshold():
    line = [WaitingApp("a", 0.0, 4), WaitingApp("b", 1.0, 8), WaitingApp("c", 2.0, 1), WaitingApp("d", 3.0, 1)]
    fifo = FifoAdmission(1.0)
    # Blox's rule: the last one let in may take the total past the threshold, the next waits
    assert fifo.admit(line, AdmissionContext(8, 0, 0)) == ["a", "b"]
    assert fifo.admit(line, AdmissionContext(8, 8, 2)) == ["a"]
    assert fifo.admit(line, AdmissionContext(8, 9, 2)) == []
    assert FifoAdmission(1.5).admit(line, AdmissionContext(8, 0, 0)) == ["a", "b", "c"]  # 12 <= 12, then 13
    assert FifoAdmission(2.0).admit(line, AdmissionContext(8, 0, 0)) == ["a", "b", "c", "d"]
    # strict FIFO: an app that has not said its demand holds the ones behind it
    assert fifo.admit([WaitingApp("x", 0.0, None), *line], AdmissionContext(8, 0, 0)) == []


# -- the round engine (simulator and service) ----------------------------------------------------


def one_job(demand: int, start: float = 0.0) -> Agent:
    return Agent(SingleJobApp(JobInfo(10_000.0, 1.0, demand_max=demand, job_id="j"), start_time=start))


def cluster8(tmp_path):
    return load_cluster(str(cluster_file(tmp_path)))


def test_a_waiting_app_is_not_asked_offered_granted_or_reclaimed_for_but_counts_in_n_avg(tmp_path):
    engine = RoundEngine(cluster8(tmp_path), make_policy("tiresias"), lease_s=100.0, admission=make_admission("fifo:1"))
    agents = {"a": one_job(8), "b": one_job(4), "c": one_job(2)}
    for t, (name, agent) in enumerate(agents.items()):
        engine.add_app(name, float(t))
        engine.set_demand(name, agent.app.demand_now(), float(t))
    assert engine.waiting_apps() == ["c"] and engine.admitted_at.keys() == {"a", "b"}
    result = engine.run_round(5.0, agents)
    assert result.waiting == ("c",)
    assert "c" not in result.rho and all(g.app != "c" for g in result.grants)
    assert engine.held("a") and not engine.held("c")
    assert engine.starving() == ["b"]  # b holds nothing and was admitted; c is not starving: it waits
    # D33: c contends (it is in the system) from its arrival: everyone's N_avg counts it
    assert engine.n_avg("a", 5.0) == pytest.approx((1 * 1 + 2 * 1 + 3 * 3) / 5)
    # a leaves: the admitted demand falls to 4, c goes in, and a round is due for it
    engine.remove_app("a", 10.0)
    assert engine.waiting_apps() == [] and engine.admitted_at["c"] == 10.0
    assert engine.round_due(10.0 + engine.coalesce_s)
    result = engine.run_round(11.0, {k: v for k, v in agents.items() if k != "a"})
    assert result.waiting == () and engine.held("c")


def test_a_waiting_app_goes_in_when_an_admitted_one_wants_less(tmp_path):
    engine = RoundEngine(cluster8(tmp_path), make_policy("themis"), admission=make_admission("fifo:1"))
    engine.add_app("a", 0.0)
    engine.set_demand("a", 12, 0.0)
    engine.add_app("b", 1.0)
    engine.set_demand("b", 2, 1.0)
    assert engine.waiting_apps() == ["b"]
    engine.set_demand("a", 6, 2.0)  # e.g. a rung ended
    assert engine.waiting_apps() == []


def test_an_idle_app_neither_waits_in_line_nor_counts_as_admitted(tmp_path):
    engine = RoundEngine(cluster8(tmp_path), make_policy("themis"), admission=make_admission("fifo:1"))
    for t, (name, demand) in enumerate([("a", 9), ("b", 2), ("c", 2)]):
        engine.add_app(name, float(t))
        engine.set_demand(name, demand, float(t))
    assert engine.waiting_apps() == ["b", "c"]
    engine.set_idle("b", True, 5.0)  # its agent went away: c does not wait behind it
    engine.set_idle("a", True, 5.0)  # and a's demand no longer fills the cluster
    assert engine.waiting_apps() == ["b"]


def test_accept_all_is_the_default_and_nobody_ever_waits(tmp_path):
    engine = RoundEngine(cluster8(tmp_path), make_policy("themis"))
    assert isinstance(engine.admission, AcceptAll)
    for t in range(5):
        engine.add_app(f"x{t}", float(t))
        engine.set_demand(f"x{t}", 8, float(t))
    assert engine.waiting == set() and engine.run_round(10.0, {f"x{t}": one_job(8) for t in range(5)}).waiting == ()


def test_the_waiting_apps_survive_a_restart_through_the_journal(tmp_path):
    engine = RoundEngine(cluster8(tmp_path), make_policy("themis"), admission=make_admission("fifo:1"))
    for t, (name, demand) in enumerate([("a", 8), ("b", 4), ("c", 2), ("d", 1)]):
        engine.add_app(name, float(t))
        engine.set_demand(name, demand, float(t))
    store = Store(tmp_path / "j.db")
    store.save(engine.state(), settings={})
    state, _ = store.load()
    assert state.waiting == {"c", "d"}
    again = RoundEngine(cluster8(tmp_path), make_policy("themis"), admission=make_admission("fifo:1"))
    again.restore(state)
    assert again.waiting_apps() == ["c", "d"]
    # restarted with accept-all, the next check lets them in
    loose = RoundEngine(cluster8(tmp_path), make_policy("themis"))
    loose.restore(state)
    loose.open_round(10.0).close()
    assert loose.waiting == set()


# -- the simulator ---------------------------------------------------------------------------------


def test_fifo_admission_in_the_simulator_keeps_rho_counting_from_arrival():
    common = dict(cluster="testbed-64", workload="small", policy="tiresias", show_progress=False)
    loose = simulate(**common, admission="accept-all")
    tight = simulate(**common, admission="fifo:0.5")
    assert loose["admission"] == "accept-all" and loose["admission_waited"] == 0
    assert tight["admission"] == "fifo:0.5" and tight["admission_waited"] > 0
    assert tight["admission_max_wait_s"] > 0
    apps = sorted(tight["apps"], key=lambda a: (a["arrival_s"], a["app"]))
    admitted = [a["arrival_s"] + a["admission_wait_s"] for a in apps]
    assert admitted == sorted(admitted)  # first in, first admitted
    for a in apps:
        # the wait is part of the app's completion time and of its rho (D33)
        assert a["jct_s"] >= a["admission_wait_s"]
        assert a["first_gpu_s"] >= a["admission_wait_s"]
        assert a["rho"] * a["ideal_s"] == pytest.approx(a["jct_s"])
    # accept-all is exactly the run without an admission policy
    plain = simulate(**common)
    skip = {"wall_seconds", "apps"}
    assert {k: v for k, v in plain.items() if k not in skip} == \
        {k: v for k, v in loose.items() if k not in skip and k in plain}
    assert [{k: a[k] for k in p} for a, p in zip(loose["apps"], plain["apps"])] == plain["apps"]


def test_themis_sim_takes_admission_and_refuses_a_bad_one(tmp_path, capsys):
    assert sim_main(["run", "--cluster", "testbed-64", "--workload", "small", "--policy", "tiresias",
                     "--admission", "fifo:0.5", "--out", str(tmp_path / "run")]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["admission"] == "fifo:0.5" and summary["admission_waited"] > 0
    assert sim_main(["run", "--workload", "small", "--admission", "fifo:x", "--out", str(tmp_path / "bad")]) == 2
    assert "must be a number" in capsys.readouterr().err


# -- a real arbiter ---------------------------------------------------------------------------------


def test_a_real_arbiter_with_fifo_admission_holds_an_app_back_until_room_is_made(tmp_path):
    def gauge(server, name):
        return next(s.value for m in server.service.metrics.registry.collect() for s in m.samples if s.name == name)

    async def scenario():
        async with arbiter(tmp_path, admission="fifo:1.0", lease_s=600.0, coalesce_s=0.05) as server:
            engine = server.service.engine
            a, ta = await start_agent(server, "a", halving_app(8))  # wants all 8 GPUs: admitted
            b, tb = await start_agent(server, "b", halving_app(4))  # admitted: 8 <= 1.0 x 8 as it came
            c, tc = await start_agent(server, "c", halving_app(2))  # 12 > 8: waits
            await wait_for(lambda: engine.held("a") and server.service.rounds_run >= 1)
            assert engine.waiting_apps() == ["c"] and not engine.held("c")
            await wait_for(lambda: gauge(server, "themis_apps_waiting_admission") == 1.0)
            arrived = engine.apps["c"].arrived
            assert engine.n_avg("c", server.service.clock()) == pytest.approx(3.0)  # it contends while it waits
            a.done()  # a's search ends: its GPUs come back and c goes in
            await wait_for(lambda: "a" not in engine.apps)
            assert engine.waiting_apps() == []
            await wait_for(lambda: bool(engine.held("c")))
            assert engine.apps["c"].arrived == arrived  # its finish time still counts from its arrival
            for client in (b, c):
                client.stop()
            await asyncio.gather(ta, tb, tc, return_exceptions=True)

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_themis_arbiter_serve_refuses_a_bad_admission(tmp_path, capsys):
    from arbiter.cli import main as arbiter_main

    code = arbiter_main(["serve", "--cluster", str(cluster_file(tmp_path)), "--db", str(tmp_path / "a.db"),
                         "--port", "0", "--admission", "fifo:nope", "--admin-token", "t"])
    assert code == 2
    assert "fifo:nope" in capsys.readouterr().err


# -- Blox's trace and the experiment ---------------------------------------------------------------------


def test_blox_philly_draws_trace_jobs_with_poisson_arrivals_and_a_daily_spike():
    from simulator.workloads import WorkloadError, load_workload
    from simulator.workloads.blox_philly import MAX_DURATION_S, MIN_DURATION_S

    steady = load_workload("blox-philly", seed=1, jobs=240, rate_per_hour=4.0)
    spiked = load_workload("blox-philly", seed=1, jobs=240, rate_per_hour=4.0, spike_jobs=5, spike_hour=6.0)
    assert load_workload("blox-philly", seed=1, jobs=240, rate_per_hour=4.0) == steady  # seeded
    assert len(steady.apps) == 240 and all(len(a.jobs) == 1 and a.kind == "fixed" for a in steady.apps)
    for app in steady.apps:
        job = app.jobs[0]
        assert job.gpus <= 16 and MIN_DURATION_S < job.iterations * job.iter_time_s / job.gpus < MAX_DURATION_S
    last = max(a.arrival_s for a in steady.apps)
    assert 240 / 4.0 * 0.7 < last / 3600 < 240 / 4.0 * 1.3  # about jobs / rate hours
    extra = [a for a in spiked.apps if a.app_id.endswith("s")]
    days = int((last - 6 * 3600) // 86_400) + 1
    assert len(extra) == 5 * days and all(6 * 3600 <= a.arrival_s % 86_400 < 7 * 3600 for a in extra)
    # a spike leaves the regular jobs where they were
    assert sorted(a.arrival_s for a in spiked.apps if not a.app_id.endswith("s")) == \
        sorted(a.arrival_s for a in steady.apps)
    with pytest.raises(WorkloadError, match="spike_hour"):
        load_workload("blox-philly", spike_hour=24.0)


def test_the_blox_admission_experiment_writes_json_and_plots(tmp_path, monkeypatch):
    from simulator import blox_experiment
    from simulator.experiments import run_experiment

    # a small stream (the published run's scale is 250 jobs on 32 GPUs: minutes per Themis run)
    monkeypatch.setitem(blox_experiment.SCALES, "sim", blox_experiment.Scale(8, 6.0, 3, 40))
    result = run_experiment("blox-admission", tmp_path, quick=True, seeds=1, workers=1, policies=["tiresias"])
    saved = json.loads((tmp_path / "blox-admission.json").read_text())
    assert saved["admissions"] == ["accept-all", "fifo:1.2"] and saved["gpus"] == 8
    for workload in ("steady", "spike"):
        point = saved["points"][workload]["tiresias"]["fifo:1.2"]
        assert {"tracked_jct", "tracked_jct_change", "max_rho", "first_gpu_s", "admission_waited"} <= set(point)
    assert result["blox_claims"]["steady"]["fifo:1.2"] == -0.15
    assert (tmp_path / "tracked_jct_change.png").stat().st_size and (tmp_path / "max_rho.png").stat().st_size
    with pytest.raises(ValueError, match="sweeps the admission policy itself"):
        run_experiment("blox-admission", tmp_path, quick=True, seeds=1, workers=1, admission="fifo:1")
