"""Network contention in the service (D35): a real arbiter on loopback (``serve --contention``), real
agents running emulated jobs, a real Mosquitto; and the profiler's measured ratio on its own.

What is checked end to end: an agent's running jobs reach the arbiter, the offer to another app
carries them as the neighbourhood of the offered GPUs' machines, an emulated job next to another
app's multi-machine job runs at the table's ratio, its profiler measures that ratio, and the
arbiter publishes it on MQTT and /metrics. Expected values are computed from the shipped table and
class mapping, not written in.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request

import pytest

from agent.agent import Agent
from agent.appsched import SuccessiveHalvingApp
from agent.client import AgentClient, issue_token, register
from agent.emulated import EmulatedJobs
from agent.placement import load_profiles
from agent.profiler import RATIO_WINDOW, Profiler
from arbiter.contention import Placed, load_classes, load_table, ratio_of
from arbiter.events import job_contention_topic
from protos import themis_pb2 as pb
from protos.messages import Neighbour
from tests.service_kit import ADMIN, RawStream, arbiter, credential, free_port, target, wait_for
from tests.test_service_faults import Watch, mosquitto  # noqa: F401 - the broker fixture

# three machines of two GPUs: a 3-GPU job spans two of them and leaves a GPU free next to it
CLUSTER_3x2 = """
name = "net-6"
[[racks]]
name = "r0"
machines = [{ gpus = 2, slots = 1, count = 3 }]
"""


def net_6(tmp_path) -> str:
    path = tmp_path / "net-6.toml"  # not cluster.toml: the kit writes its own there
    path.write_text(CLUSTER_3x2)
    return str(path)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


class Recording(Agent):
    """The real agent, keeping every offer it bid on and every rho request it answered."""

    def __init__(self, app):
        super().__init__(app)
        self.offers = []
        self.requests = []

    def bid(self, offer):
        self.offers.append(offer)
        return super().bid(offer)

    def report(self, request):
        self.requests.append(request)
        return super().report(request)


def one_job(gpus: int, iterations: float = 1e7) -> SuccessiveHalvingApp:
    """An app of one job that uses ``gpus`` GPUs and runs for as long as a test takes."""
    app = SuccessiveHalvingApp([1.0], [iterations], job_demand_max=gpus, slowdown=load_profiles()["vgg16"].slowdown)
    app.start_time = 0.0
    return app


def class_of(model: str) -> str:
    profile = load_profiles()[model]
    return load_classes().class_of(model, profile.category, load_table())


async def bound_agent(server, name: str, model: str, app, *, emulate: bool = True):
    """An agent whose app an admin bound to ``model`` (its contention class comes from it)."""
    token = await issue_token(target(server), name, ADMIN, model=model)
    cred = await register(target(server), name, token)
    client = AgentClient(Recording(app), name, target(server), cred, backoff_s=(0.05, 0.5))
    tasks = [asyncio.create_task(client.run())]
    jobs = None
    if emulate:
        jobs = EmulatedJobs(client, app, tick_s=0.02)
        tasks.append(asyncio.create_task(jobs.run()))
    await asyncio.wait_for(client.welcomed.wait(), 5)
    return client, jobs, tasks


async def stop(*runs) -> None:
    for client, _, tasks in runs:
        client.stop()
        for t in tasks[1:]:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def machines_of(server, gpus) -> list[str]:
    position = server.service.engine.cluster.position
    return [position(g)[1] for g in sorted(gpus)]


def test_an_offer_carries_the_neighbourhood_of_another_apps_multi_machine_job(tmp_path):
    async def scenario():
        async with arbiter(tmp_path, cluster=net_6(tmp_path), contention="deepshare",
                           policy="themis-aware", lease_s=60.0) as server:
            a = await bound_agent(server, "a", "vgg16", one_job(3))
            view = server.service.contention
            await wait_for(lambda: len(server.service.engine.held("a")) == 3 and "a" in dict(view.jobs()))
            held_a = server.service.engine.held("a")
            assert len(set(machines_of(server, held_a))) == 2  # the job spans two machines
            b = await bound_agent(server, "b", "resnet50", one_job(1), emulate=False)
            await wait_for(lambda: b[0].agent.offers)
            offer = b[0].agent.offers[0]
            near = set(machines_of(server, offer.gpus)) & set(machines_of(server, held_a))
            assert near, "a GPU next to a's job is offered"
            mine = Neighbour(class_of("vgg16"), 3, 2)
            assert offer.neighbourhood == {m: (mine,) for m in sorted(near)}
            # b is told the same on its stream once it runs there; a hears of nobody (b runs no job yet)
            assert a[0].contention == ("deepshare", class_of("vgg16")) and a[0].neighbourhood == {}
            await stop(a, b)

    run(scenario())


CLUSTER_2x4 = """
name = "net-8"
[[racks]]
name = "r0"
machines = [{ gpus = 4, slots = 1, count = 2 }]
"""


def test_a_rho_request_carries_the_neighbourhood_of_the_held_gpus(tmp_path):
    """D43 over gRPC: a's job takes six GPUs over both machines; c, then b, take one each of the two
    left; b still wants more. c's release opens a round that asks b for its rho: the request names
    a's job (class, GPUs, machines; no name) on the machine b holds, as a bid's offer would."""
    async def scenario():
        path = tmp_path / "net-8.toml"
        path.write_text(CLUSTER_2x4)
        async with arbiter(tmp_path, cluster=str(path), contention="deepshare", policy="themis-aware",
                           lease_s=600.0, reclaim=False) as server:
            engine = server.service.engine
            a = await bound_agent(server, "a", "vgg16", one_job(6))
            view = server.service.contention
            await wait_for(lambda: len(engine.held("a")) == 6 and "a" in dict(view.jobs()))
            assert len(set(machines_of(server, engine.held("a")))) == 2
            c = await bound_agent(server, "c", "resnet50", one_job(1), emulate=False)
            await wait_for(lambda: len(engine.held("c")) == 1)
            b = await bound_agent(server, "b", "resnet50", one_job(8), emulate=False)
            await wait_for(lambda: len(engine.held("b")) == 1)
            asked = b[0].agent.requests
            before = len(asked)
            c[0].release(sorted(engine.held("c")))
            await wait_for(lambda: len(asked) > before)
            request = asked[before]
            assert set(request.held) == set(engine.held("b"))
            (machine,) = machines_of(server, engine.held("b"))
            assert request.neighbourhood == {machine: (Neighbour(class_of("vgg16"), 6, 2),)}
            await stop(a, b, c)

    run(scenario())


def test_an_emulated_job_slowed_by_a_neighbour_reports_its_measured_ratio_on_mqtt_and_metrics(
        tmp_path, mosquitto):  # noqa: F811
    port = free_port()

    async def scenario():
        async with arbiter(tmp_path, cluster=net_6(tmp_path), contention="deepshare",
                           lease_s=60.0, mqtt=f"mqtt://127.0.0.1:{mosquitto.port}", metrics_port=port) as server:
            watch = Watch(mosquitto.port, "themis/net-6/apps/+/jobs/+/contention")
            await asyncio.wait_for(watch.ready.wait(), 5)
            a = await bound_agent(server, "a", "vgg16", one_job(3))
            view = server.service.contention
            await wait_for(lambda: "a" in dict(view.jobs()))
            b = await bound_agent(server, "b", "resnet50", one_job(3))
            engine = server.service.engine
            await wait_for(lambda: len(engine.held("b")) == 3 and "b" in dict(view.jobs()))
            table = load_table()
            spot_a, spot_b = machines_of(server, engine.held("a")), machines_of(server, engine.held("b"))
            expected = ratio_of(table, Placed.on(class_of("resnet50"), spot_b), [Placed.on(class_of("vgg16"), spot_a)])
            assert len(set(spot_b)) == 2 and set(spot_a) & set(spot_b) and expected < 1  # a contended placement
            topic = job_contention_topic("net-6", "b", "job0")

            def measured():
                got = [p for p in watch.on(topic) if p and p["measured"] is not None]
                return got[-1]["measured"] if got else None

            await wait_for(lambda: measured() is not None and abs(measured() - expected) < 1e-6, timeout=20)
            last = watch.on(topic)[-1]
            assert last["expected"] == pytest.approx(expected) and last["cls"] == class_of("resnet50")
            assert sorted(last["gpus"]) == sorted(engine.held("b")) and last["machines"] == 2
            assert b[1].ratios["job0"] == pytest.approx(expected)  # the emulated job runs at the table's ratio
            text = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())
            line = re.search(r'^themis_job_contention_ratio\{app="b",job="job0"\} (\S+)$', text, re.M)
            assert line and float(line.group(1)) == pytest.approx(expected)
            assert re.search(r'^themis_job_contention_expected\{app="a",job="job0"\} ', text, re.M)
            await stop(a, b)
            await watch.close()

    run(scenario())


def test_without_contention_nothing_changes_on_the_wire(tmp_path):
    async def scenario():
        async with arbiter(tmp_path) as server:
            assert server.service.contention is None
            stream = RawStream(server, "a", await credential(server, "a"))
            stream.send(hello=pb.Hello(app="a", demand=1))
            await stream.next("welcome")
            stream.send(jobs=pb.RunningJobs(app="a", jobs=[pb.RunningJob(job="j", gpus=["x"])]))
            rejection = await stream.next("rejection")
            assert rejection.what == "jobs" and "no contention model" in rejection.reason
            offer = await stream.next("rho_request")
            assert offer is not None and not stream.of("neighbourhood")
            await stream.close()

    run(scenario())


def test_job_reports_are_checked_against_the_apps_leases(tmp_path):
    async def scenario():
        async with arbiter(tmp_path, contention="deepshare") as server:
            stream = RawStream(server, "a", await credential(server, "a"))
            stream.send(hello=pb.Hello(app="a", demand=0))
            await stream.next("welcome")
            told = await stream.next("neighbourhood")
            assert told.table == "deepshare" and told.cls == "" and not told.neighbours
            gpu = sorted(server.service.engine.cluster.gpus)[0]
            stream.send(jobs=pb.RunningJobs(app="a", jobs=[pb.RunningJob(job="j", gpus=[gpu], cls="MoE")]))
            rejection = await stream.next("rejection")
            assert rejection.what == "jobs" and "does not hold" in rejection.reason and gpu in rejection.reason
            stream.send(jobs=pb.RunningJobs(app="a", jobs=[pb.RunningJob(job="a/b", gpus=[gpu])]))
            assert "job name" in (await stream.next("rejection", 1)).reason
            stream.send(jobs=pb.RunningJobs(app="a", jobs=[pb.RunningJob(job="j", gpus=[gpu], ratio=1.5)]))
            assert "ratio" in (await stream.next("rejection", 2)).reason
            assert server.service.contention.jobs() == {}
            await stream.close()

    run(scenario())


# -- the service's view of who runs where (arbiter.service_contention), on a real round engine ------


def engine_with(tmp_path, leases: dict[str, list[str]], expires_at: float = 100.0):
    from arbiter.cluster import load_cluster
    from arbiter.policies import make_policy
    from arbiter.rounds import RoundEngine

    engine = RoundEngine(load_cluster(net_6(tmp_path)), make_policy("themis"), lease_s=100.0)
    for app, gpus in leases.items():
        engine.add_app(app, 0.0)
        engine.leases.grant(app, gpus, now=0.0, expires_at=expires_at, round_id=1)
    return engine


def test_the_view_lists_other_apps_jobs_by_machine_and_charges_their_harm(tmp_path):
    from arbiter.service_contention import JobsRefused, ServiceContention
    from protos.messages import RunningJob

    engine = engine_with(tmp_path, {"a": ["r0-m0-g0", "r0-m0-g1", "r0-m1-g0"], "b": ["r0-m2-g0"]})
    view = ServiceContention(load_table(), "deepshare", engine, {"a": "vgg16"})
    assert view.report("a", [RunningJob("j", frozenset(engine.held("a")), cls="MoE")])
    assert view.kind("a") == class_of("vgg16")  # the bound model's class, not the agent's word
    assert view.report("b", [RunningJob("k", frozenset({"r0-m2-g0"}), cls="MoE")])
    assert view.kind("b") == "MoE"  # no model bound: the agent's
    spread = Neighbour(class_of("vgg16"), 3, 2)
    # b's own job on r0-m2 is not its neighbour; a machine where nobody else runs is left out
    assert view.neighbourhood("b", ["r0-m0", "r0-m1", "r0-m2"]) == {"r0-m0": (spread,), "r0-m1": (spread,)}
    assert view.neighbourhood("a", ["r0-m0", "r0-m1", "r0-m2"]) == {"r0-m2": (Neighbour("MoE", 1, 1),)}
    row = ["r0-m1-g1", "r0-m2-g1"]  # b's job over two machines, one of them a's
    a_job = Placed.on(class_of("vgg16"), ["r0-m0", "r0-m0", "r0-m1"])
    after = ratio_of(load_table(), a_job, [Placed.on("MoE", ["r0-m1", "r0-m2"])])
    assert view.harm("b", row) == pytest.approx(after) and after < 1
    assert view.harm("b", ["r0-m2-g1"]) == 1.0  # one machine: no NIC, no harm
    assert view.ratio_if("b", row) == pytest.approx(
        ratio_of(load_table(), Placed.on("MoE", ["r0-m1", "r0-m2"]), [a_job]))
    assert view.ratio("a") == 1.0  # b's job is on one machine
    with pytest.raises(JobsRefused, match="r0-m1-g1"):
        view.report("b", [RunningJob("k", frozenset({"r0-m1-g1"}))])
    assert view.kind("b") == "MoE"  # the refused report changed nothing


def test_a_job_whose_lease_ran_out_is_no_neighbour_and_a_job_without_a_class_is_left_out(tmp_path):
    from arbiter.service_contention import ServiceContention
    from protos.messages import RunningJob

    engine = engine_with(tmp_path, {"a": ["r0-m0-g0", "r0-m1-g0"], "c": ["r0-m2-g0", "r0-m1-g1"]}, expires_at=5.0)
    view = ServiceContention(load_table(), "deepshare", engine, {})
    view.report("a", [RunningJob("j", frozenset(engine.held("a")), cls="MoE")])
    view.report("c", [RunningJob("k", frozenset(engine.held("c")))])  # no model, no class named
    assert view.neighbourhood("c", ["r0-m0", "r0-m1"]) == {"r0-m0": (Neighbour("MoE", 2, 2),),
                                                          "r0-m1": (Neighbour("MoE", 2, 2),)}
    assert view.neighbourhood("a", ["r0-m1", "r0-m2"]) == {} and view.kind("c") is None
    assert [j.job for j in view.jobs()["a"]] == ["j"] and "c" not in view.jobs()
    engine.leases.expire(10.0)
    assert view.neighbourhood("c", ["r0-m0", "r0-m1"]) == {} and view.jobs() == {}


# -- the profiler's measured ratio ------------------------------------------------------------------

SLOWDOWN = (1.0, 1.2, 1.5, 2.0)
TWO_MACHINES = [("r0", "m0", "s0"), ("r0", "m0", "s1"), ("r0", "m1", "s0"), ("r0", "m1", "s1")]


def test_the_profilers_ratio_is_the_profiled_time_over_the_measured_one():
    p = Profiler(SLOWDOWN)
    p.profile_job("j", 2.0)
    expected = 2.0 * SLOWDOWN[2] / 4  # four GPUs over two machines of a rack: level 2
    assert p.contention_ratio("j") is None
    p.observe("j", expected / 0.5, TWO_MACHINES, 4)
    assert p.contention_ratio("j") == pytest.approx(0.5)
    p.observe("j", expected, TWO_MACHINES, 4)  # the neighbour left: the mean of the window's times
    assert p.contention_ratio("j") == pytest.approx(2 * expected / (expected / 0.5 + expected))
    for _ in range(RATIO_WINDOW):
        p.observe("j", expected, TWO_MACHINES, 4)
    assert p.contention_ratio("j") == pytest.approx(1.0)
    assert p.contention_ratios() == {"j": pytest.approx(1.0)}


def test_the_profilers_ratio_starts_again_when_the_job_moves_and_uses_the_prior_not_the_learned_slowdown():
    p = Profiler(SLOWDOWN, iter_time_serial=2.0, prior_weight=1.0)
    slow = 2.0 * SLOWDOWN[2] / 4 / 0.6
    for _ in range(50):
        p.observe("j", slow, TWO_MACHINES, 4)
    assert p.slowdown[2] > SLOWDOWN[2] * 1.5  # the learned S took the contention in ...
    assert p.contention_ratio("j") == pytest.approx(0.6)  # ... the ratio still shows it
    one_machine = TWO_MACHINES[:2]
    p.observe("j", 2.0 * SLOWDOWN[1] / 2, one_machine, 4)
    assert p.contention_ratio("j") == pytest.approx(1.0)
    p.forget_job("j")
    assert p.contention_ratio("j") is None and p.contention_ratios() == {}


def test_the_profilers_ratio_without_a_job_profile_uses_its_serial_time():
    p = Profiler(SLOWDOWN, iter_time_serial=3.0)
    p.observe("k", 3.0 * SLOWDOWN[2] / 4 / 0.8, TWO_MACHINES, 4)
    assert p.contention_ratio("k") == pytest.approx(0.8)
    nothing = Profiler(SLOWDOWN)
    nothing.observe("k", 1.0, TWO_MACHINES, 4)
    assert nothing.contention_ratio("k") is None  # no serial time known: nothing to compare with
    with pytest.raises(ValueError):
        p.profile_job("k", 0.0)


# -- the option and the demo --------------------------------------------------------------------------


def test_serve_refuses_a_contention_table_it_cannot_read(tmp_path):
    from arbiter.contention import ContentionError

    async def scenario():
        with pytest.raises(ContentionError, match="cannot read contention table"):
            async with arbiter(tmp_path, contention=str(tmp_path / "missing.csv")):
                pass

    run(scenario())


def test_the_demo_with_contention_prints_the_ratios_the_arbiter_publishes():
    import io
    import json

    from themis_demo.service import _demo

    out = io.StringIO()
    code = asyncio.run(_demo(40.0, None, out, speedup=400.0, lease_s=3.0, contention="deepshare"))
    text = out.getvalue()
    summary = json.loads(text[text.index("{"):])
    assert code == 0 and all(a["finished"] for a in summary["apps"]), text
    lines = re.findall(r"contention: \S+ on (\d+) GPUs over (\d+) machines? \(\S+\): table (\S+), measured (\S+)", text)
    assert lines, text
    for gpus, machines, table, measured in lines:
        assert int(machines) <= int(gpus)
        if int(machines) == 1:
            assert float(table) == 1.0
    assert all(0.35 <= a["lowest_ratio"] <= 1.0 for a in summary["apps"])


def test_a_runner_reports_its_real_jobs_and_their_measured_ratio_while_contention_is_modelled(tmp_path):
    """AppRunner with real job processes (agent.launcher) and the scripted client of the lease
    tests: once the arbiter has said it models contention, the running jobs, their GPUs and the
    ratio the profiler measured go out with ``report_jobs``."""
    import sys

    from agent.launcher import Launcher
    from agent.runner import AppRunner
    from hyperparam_adapters.hyperband import BracketTuner, Rung
    from tests.test_runner_leases import JOB, ScriptedClient, _step_until

    class Telling(ScriptedClient):
        contention = None

        def __init__(self, adapter):
            super().__init__(adapter)
            self.reported: list = []

        def report_jobs(self, jobs):
            self.reported.append(tuple(jobs))

    adapter = BracketTuner({"lr": [0.1]}, [[Rung(1, 1000)]], iter_time=0.05)
    script = tmp_path / "job.py"
    script.write_text(JOB)
    client = Telling(adapter)
    launcher = Launcher("a", [sys.executable, str(script), "0"], tmp_path / "w", grace_s=5.0,
                        env={"PYTHONPATH": str(__import__("pathlib").Path(__file__).resolve().parents[1])})
    runner = AppRunner(adapter, client, launcher, profiler=Profiler(iter_time_serial=0.05), quiet=True)
    client.welcomed.set()
    client.grant(["r0-m0-g0"], expires_at=2e9)
    try:
        _step_until(runner, lambda: launcher.live())
        assert client.reported == []  # no contention model said: nothing sent
        client.contention = ("deepshare", "MoE")
        _step_until(runner, lambda: any(j.ratio > 0 for jobs in client.reported for j in jobs))
        jobs = client.reported[-1]
        assert [(j.job, j.gpus) for j in jobs] == [(job, frozenset(run.gpus)) for job, run in launcher.live().items()]
        assert all(0 < j.ratio <= 1 for j in jobs)
        assert jobs[0].ratio == pytest.approx(min(1.0, runner.profiler.contention_ratio(jobs[0].job)), abs=0.011)
    finally:
        asyncio.run(launcher.shutdown(1))
