"""The arbiter service against real agents on loopback: rounds, leases, access control, bad input.

Every test starts a real ``ArbiterServer`` (gRPC, SQLite journal, the real auction) on a free port;
agents are ``AgentClient`` objects with the real fairness and bidding code, or a ``RawStream`` that
sends what a good agent never would.
"""

from __future__ import annotations

import asyncio
import math
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent.agent import Agent
from agent.client import AgentClient, channel
from arbiter.service import MAX_BID_ROWS
from protos import themis_pb2 as pb
from protos import themis_pb2_grpc as pb_grpc
from tests.service_kit import (
    ADMIN,
    RawStream,
    admin_stub,
    arbiter,
    credential,
    free_port,
    halving_app,
    start_agent,
    target,
    wait_for,
)

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
DENIED = grpc.StatusCode.PERMISSION_DENIED.value[0]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def _no_gpu_twice(clients) -> set[str]:
    seen: set[str] = set()
    for c in clients:
        assert not (seen & set(c.held)), f"{c.app} holds a GPU someone else holds"
        seen |= set(c.held)
    return seen


def test_two_agents_share_the_cluster_and_no_gpu_is_granted_twice(tmp_path):
    async def scenario():
        async with arbiter(tmp_path, lease_s=2.0) as server:
            a, ta = await start_agent(server, "alpha", halving_app(jobs=4))
            b, tb = await start_agent(server, "beta", halving_app(jobs=4))
            await wait_for(lambda: len(a.held) == len(b.held) == 4)
            stub, meta, ch = admin_stub(server)
            leases = await stub.ListLeases(pb.ListLeasesRequest(), metadata=meta)
            assert {x.gpu: x.app for x in leases.leases} == {**{g: "alpha" for g in a.held},
                                                             **{g: "beta" for g in b.held}}
            # leases expire and are re-auctioned: watch several rounds pass with the union intact
            first = server.service.rounds_run
            await wait_for(lambda: server.service.rounds_run >= first + 3, 15)
            assert len(_no_gpu_twice([a, b])) <= 8
            history = await stub.RoundHistory(pb.RoundHistoryRequest(limit=5), metadata=meta)
            assert history.rounds and history.rounds[0].round_id > history.rounds[-1].round_id
            assert any(r.bidders for r in history.rounds)
            for r in history.rounds:  # where the round's time went: parts of latency_s, each measured
                assert r.reports_s + r.bids_s + r.allocation_s <= r.latency_s
                assert (r.reports_s > 0) == bool(r.rho) and (r.bids_s > 0) == bool(r.bidders) and r.allocation_s > 0
            apps = await stub.ListApps(pb.ListAppsRequest(), metadata=meta)
            assert {x.app for x in apps.apps} == {"alpha", "beta"} and all(x.connected for x in apps.apps)
            for c in (a, b):
                c.stop()
            await asyncio.gather(ta, tb)
            await ch.close()

    run(scenario())


def test_hostile_bids_are_rejected_with_reasons_and_the_round_goes_on(tmp_path):
    async def scenario():
        async with arbiter(tmp_path, lease_s=30.0, policy="themis", fairness_knob=0.0) as server:
            raw = RawStream(server, "mallory", await credential(server, "mallory"))
            raw.send(hello=pb.Hello(app="mallory", demand=8))
            await raw.next("welcome")
            good, task = await start_agent(server, "good", halving_app(jobs=4))
            request = await raw.next("rho_request")
            raw.send(report=pb.RhoReport(round_id=request.round_id, app="mallory", rho=math.inf, demand=8))
            offer = await raw.next("offer")
            gpus = [p.gpu for p in offer.gpus]
            rid = offer.round_id
            bad = [
                pb.Bid(round_id=rid, app="mallory", rho_old=math.inf, rows=[pb.BidRow(gpus=["nope"], rho=1.0)]),
                pb.Bid(round_id=rid, app="mallory", rho_old=math.inf,
                       rows=[pb.BidRow(gpus=[gpus[0], gpus[0]], rho=1.0)]),
                pb.Bid(round_id=rid, app="mallory", rho_old=math.nan, rows=[]),
                pb.Bid(round_id=rid, app="mallory", rho_old=math.inf, rows=[pb.BidRow(gpus=gpus[:1], rho=-1.0)]),
                pb.Bid(round_id=rid, app="mallory", rho_old=math.inf,  # one row past the limit (D7, D18)
                       rows=[pb.BidRow(gpus=gpus[:1], rho=1.0 + k) for k in range(MAX_BID_ROWS + 1)]),
                pb.Bid(round_id=rid - 1, app="mallory", rho_old=math.inf, rows=[]),
                pb.Bid(round_id=rid, app="good", rho_old=math.inf, rows=[]),
            ]
            for b in bad:
                raw.send(bid=b)
            await wait_for(lambda: len(raw.of("rejection")) >= len(bad))
            rejections = raw.of("rejection")
            reasons = " | ".join(r.reason for r in rejections)
            assert [r.code for r in rejections].count(DENIED) == 1, reasons
            assert all(r.code in (INVALID, DENIED) and r.reason for r in rejections)
            for needle in ("not offered", "twice", "rho_old", "rho must be finite", "not open", "cannot send",
                           f"{MAX_BID_ROWS + 1} rows, more than the limit of {MAX_BID_ROWS}"):
                assert needle in reasons, needle
            # the round completes for everyone else: the good agent gets GPUs
            await wait_for(lambda: len(good.held) > 0)
            assert not (set(good.held) & {g for m in raw.of("grant") for g in (p.gpu for p in m.gpus)})
            good.stop()
            await task
            await raw.close()

    run(scenario())


def test_access_control(tmp_path):
    async def scenario():
        async with arbiter(tmp_path) as server:
            cred_a = await credential(server, "a")
            await credential(server, "b")
            async with channel(target(server)) as ch:
                stub = pb_grpc.ArbiterStub(ch)
                as_a = [("authorization", f"Bearer {cred_a}")]
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.GetApp(pb.GetAppRequest(app="b"), metadata=as_a)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert (await stub.GetApp(pb.GetAppRequest(app="a"), metadata=as_a)).app == "a"
                as_admin = [("authorization", f"Bearer {ADMIN}")]
                assert (await stub.GetApp(pb.GetAppRequest(app="b"), metadata=as_admin)).app == "b"
                with pytest.raises(grpc.aio.AioRpcError) as err:  # not a made-up state with rho inf
                    await stub.GetApp(pb.GetAppRequest(app="nosuch"), metadata=as_admin)
                assert err.value.code() == grpc.StatusCode.NOT_FOUND and "never registered" in err.value.details()
                for call, req in ((stub.ListLeases, pb.ListLeasesRequest()), (stub.IssueToken, pb.IssueTokenRequest(app="x")),
                                  (stub.UpdateSettings, pb.SettingsUpdate(lease_s=1.0))):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call(req, metadata=as_a)
                    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ListLeases(pb.ListLeasesRequest())
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                token = (await stub.IssueToken(pb.IssueTokenRequest(app="c"), metadata=[("authorization", f"Bearer {ADMIN}")])).token
                with pytest.raises(grpc.aio.AioRpcError) as err:  # a token for c does not register d
                    await stub.Register(pb.RegisterRequest(app="d"), metadata=[("authorization", f"Bearer {token}")])
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                await stub.Register(pb.RegisterRequest(app="c"), metadata=[("authorization", f"Bearer {token}")])
                with pytest.raises(grpc.aio.AioRpcError) as err:  # registration tokens are single-use
                    await stub.Register(pb.RegisterRequest(app="c"), metadata=[("authorization", f"Bearer {token}")])
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            # a stream that claims another app is refused; one with no credential too
            raw = RawStream(server, "a", cred_a)
            raw.send(hello=pb.Hello(app="b", demand=1))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await raw.call.read()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            await raw.close()
            anon = RawStream(server, "a", "forged")
            anon.send(hello=pb.Hello(app="a", demand=1))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await anon.call.read()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            await anon.close()

    run(scenario())


def test_a_silent_agent_is_treated_as_not_bidding(tmp_path):
    async def scenario():
        async with arbiter(tmp_path, report_timeout_s=0.3, bid_timeout_s=0.3, fairness_knob=0.0) as server:
            silent = RawStream(server, "silent", await credential(server, "silent"))
            silent.send(hello=pb.Hello(app="silent", demand=8))
            await silent.next("welcome")
            good, task = await start_agent(server, "good", halving_app(jobs=4))
            await silent.next("rho_request")
            await wait_for(lambda: len(good.held) == 4)
            stub, meta, ch = admin_stub(server)
            history = await stub.RoundHistory(pb.RoundHistoryRequest(limit=10), metadata=meta)
            assert any("no rho report" in r.rejected.get("silent", "") for r in history.rounds)
            good.stop()
            await task
            await silent.close()
            await ch.close()

    run(scenario())


def test_an_agent_that_reconnects_resumes_its_leases(tmp_path):
    async def scenario():
        async with arbiter(tmp_path, lease_s=60.0) as server:
            a, task = await start_agent(server, "a", halving_app(jobs=4))
            await wait_for(lambda: len(a.held) == 4)
            held = dict(a.held)
            server.service.conns["a"].closed.set()  # the arbiter drops the stream
            await wait_for(lambda: a.connects >= 2 and a.welcomed.is_set())
            assert set(a.held) == set(held)
            assert all(a.held[g].position == held[g].position for g in held)
            # the agent knows the round of every lease it holds, and its Release names it
            leases = server.service.engine.leases
            assert a.known_round == max(leases.lease(g).round_id for g in held) > 0
            known, freed = a.known_round, sorted(held)[:2]
            a.release(freed)
            await wait_for(lambda: all(leases.lease(g) is None or leases.lease(g).round_id > known for g in freed))
            a.stop()
            await task

    run(scenario())


def test_admin_can_change_settings_add_and_drain_machines(tmp_path):
    async def scenario():
        async with arbiter(tmp_path, lease_s=1.0) as server:
            stub, meta, ch = admin_stub(server)
            s = await stub.UpdateSettings(pb.SettingsUpdate(policy="fifo", lease_s=2.0), metadata=meta)
            assert (s.policy, s.lease_s) == ("fifo", 2.0) and server.service.engine.policy.name == "fifo"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.UpdateSettings(pb.SettingsUpdate(fairness_knob=1.5), metadata=meta)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert s.max_contenders == 16  # D20's default
            s = await stub.UpdateSettings(pb.SettingsUpdate(policy="themis", max_contenders=3), metadata=meta)
            assert s.max_contenders == 3 and server.service.engine.policy.max_contenders == 3
            s = await stub.UpdateSettings(pb.SettingsUpdate(max_contenders=0), metadata=meta)
            assert s.max_contenders == 0 and server.service.engine.policy.max_contenders is None  # 0: no cap
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.UpdateSettings(pb.SettingsUpdate(max_contenders=-1), metadata=meta)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_contenders" in err.value.details()
            assert s.min_bidders == 1 and server.service.engine.policy.min_bidders == 1  # D6, the default
            s = await stub.UpdateSettings(pb.SettingsUpdate(min_bidders=2), metadata=meta)
            assert s.min_bidders == 2 and server.service.engine.policy.min_bidders == 2  # D41's option
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.UpdateSettings(pb.SettingsUpdate(min_bidders=0), metadata=meta)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_bidders" in err.value.details()
            assert server.service.settings.min_bidders == 2  # the refused change lost nothing
            await stub.UpdateSettings(pb.SettingsUpdate(policy="fifo"), metadata=meta)
            state = await stub.DrainMachine(pb.DrainMachineRequest(machine="r0-m0"), metadata=meta)
            assert list(state.drained_machines) == ["r0-m0"]
            state = await stub.AddMachine(pb.AddMachineRequest(rack="r1", gpus=2, slots=1), metadata=meta)
            assert state.size == 10
            a, task = await start_agent(server, "a", halving_app(jobs=8))
            await wait_for(lambda: len(a.held) == 6)  # 4 on r0-m1 and 2 on the new machine
            assert not any(g.startswith("r0-m0-") for g in a.held)
            assert {g for g in a.held if g.startswith("r1-")} == {"r1-m2-g0", "r1-m2-g1"}
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.DrainMachine(pb.DrainMachineRequest(machine="nowhere"), metadata=meta)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            state = await stub.DrainMachine(pb.DrainMachineRequest(machine="r0-m0", resume=True), metadata=meta)
            assert not list(state.drained_machines)
            await wait_for(lambda: len(a.held) == 8)  # r0-m0's GPUs are offered again, at once
            assert sum(g.startswith("r0-m0-") for g in a.held) == 2
            a.stop()
            await task
            await ch.close()

    run(scenario())


def test_a_restarted_arbiter_restores_leases_apps_and_settings(tmp_path):
    async def scenario():
        async with arbiter(tmp_path, lease_s=120.0) as server:
            a, task = await start_agent(server, "a", halving_app(jobs=4))
            await wait_for(lambda: len(a.held) == 4)
            before = {x.gpu: (x.app, x.expires_at) for x in server.service.engine.leases}
            n_avg_clock = server.service.engine.state().contention
            stub, meta, ch = admin_stub(server)
            await stub.UpdateSettings(pb.SettingsUpdate(fairness_knob=0.5, min_bidders=2), metadata=meta)
            await ch.close()
            a.stop()
            await task
        async with arbiter(tmp_path) as server:
            engine = server.service.engine
            assert {x.gpu: (x.app, x.expires_at) for x in engine.leases} == before
            assert "a" in engine.apps and engine.state().contention >= n_avg_clock
            assert server.service.settings.fairness_knob == 0.5 and server.service.settings.lease_s == 120.0
            assert server.service.settings.min_bidders == 2 and engine.policy.min_bidders == 2

    run(scenario())


def test_health_and_metrics_endpoints(tmp_path):
    port = free_port()

    async def scenario():
        async with arbiter(tmp_path, metrics_port=port, lease_s=1.0) as server:
            async with channel(target(server)) as ch:
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="themis.v1.Arbiter"))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            a, task = await start_agent(server, "a", halving_app(jobs=2))
            await wait_for(lambda: server.service.rounds_run >= 2)
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())
            assert "themis_round_latency_seconds_count" in text and "themis_connected_agents 1.0" in text
            a.stop()
            await task

    run(scenario())


def test_the_local_demo_runs_both_apps_to_completion():
    import io
    import json

    from themis_demo.service import _demo

    out = io.StringIO()
    code = asyncio.run(_demo(40.0, None, out, speedup=400.0, lease_s=3.0))
    text = out.getvalue()
    summary = json.loads(text[text.index("{"):])
    assert code == 0 and all(a["finished"] for a in summary["apps"]), text
    assert summary["rounds"] >= 3 and "granted" in text
    # both apps are bound to their models, so every report carried a work claim (D21), and none was
    # refused (a late report on a busy machine is another matter)
    from themis_demo.service import DEMO_MODELS

    assert {a["app"]: a["model"] for a in summary["apps"]} == DEMO_MODELS, text
    assert all(a["claims_refused"] == 0 for a in summary["apps"]), text


def test_secrets_never_start_with_a_dash_so_command_lines_take_them():
    """A token_urlsafe starts with '-' one time in 64; `--token -x` then fails to parse (a CI failure)."""
    from arbiter.service import new_secret

    drawn = [new_secret(kind) for kind in ("reg", "app", "admin") for _ in range(700)]
    assert not any(s.startswith("-") for s in drawn)
    assert len(set(drawn)) == len(drawn)


def test_the_agent_command_registers_connects_and_finishes(tmp_path):
    import json
    import subprocess
    import sys

    app_file = tmp_path / "tiny.toml"
    app_file.write_text('[app]\nkind = "successive_halving"\niter_times = [1, 2]\niterations = [20, 40]\n'
                        'job_demand_max = 2\nslowdown = [1, 1, 1.2, 1.5]\n[context]\ncluster_size = 8\nn_avg = 1\n')

    async def scenario():
        async with arbiter(tmp_path, lease_s=5.0) as server:
            from agent.client import issue_token

            token = await issue_token(target(server), "tiny", ADMIN)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "agent.cli", "run", str(app_file), "--arbiter", target(server), "--token", token,
                "--speedup", "20", "--credential-file", str(tmp_path / "cred"), "--workdir", str(tmp_path / "runs"),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 40)
            assert proc.returncode == 0, err.decode()[-2000:]
            result = json.loads(out.decode().strip().splitlines()[-1])
            assert result["app"] == "tiny" and result["finished_after_s"] > 0
            # issue 11 item 2: a line per grant, with the GPU ids and a finite rho on what it holds
            grants = [line for line in err.decode().splitlines() if "tiny: granted" in line]
            assert grants, err.decode()[-2000:]
            gpus = {g for line in grants for g in line.split("granted ")[1].split(";")[0].split(",")}
            assert gpus <= set(server.service.engine.cluster.gpus)
            assert any(not line.endswith(("rho -", "rho inf")) for line in grants)
            assert (tmp_path / "cred").read_text().strip()
            # ... and the run's record: grants with GPU ids, finite rho samples, every trial's end, the plot
            record = [json.loads(line) for line in open(result["record"])]
            assert result["record"].startswith(str(tmp_path / "runs" / "tiny"))
            what = [r["what"] for r in record]
            assert "grant" in what and what[-1] == "done"
            assert {g for r in record if r["what"] == "grant" for g in r["gpus"]} == gpus
            assert any(r["what"] == "rho" and r["rho"] is not None and r["rho"] > 0 for r in record)
            trials = [r for r in record if r["what"] == "trial"]
            assert sorted(r["job"] for r in trials) == ["job0", "job1"]  # 2 trials: one stopped, one done
            assert sorted(r["outcome"] for r in trials) == ["done", "stopped"]
            assert {r["iteration"] for r in trials} == {20.0, 60.0}
            assert result["plot"] and open(result["plot"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
            assert "tiny" not in server.service.engine.apps  # Done: it left the rounds
            assert not any(x.app == "tiny" for x in server.service.engine.leases)

    run(scenario())


def test_an_agent_without_a_name_bids_in_its_apps_own_order():
    """D7's salt is the app's name. The load benchmark and the demo built unnamed agents, so all
    500 apps ranked containers alike and the 256-GPU auctions served 16 of ~100 bidders, every one
    at c_i = 0; AgentClient now names an unnamed agent after its app, and keeps a given name."""
    unnamed = AgentClient(Agent(halving_app()), "app-7", "127.0.0.1:1", "credential")
    assert unnamed.agent.name == "app-7"
    named = AgentClient(Agent(halving_app(), name="own"), "app-8", "127.0.0.1:1", "credential")
    assert named.agent.name == "own"
