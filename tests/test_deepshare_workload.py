"""DeepShare's setting: its trace as a workload, its cluster, its baselines' orderings and placement,
and ``themis-sim experiment deepshare`` end to end on a slice."""

from __future__ import annotations

import csv
import json
import math
import random
from pathlib import Path

import pytest

from arbiter.cluster import load_cluster
from arbiter.policies import make_policy
from arbiter.policies.base import RoundContext
from arbiter.policies.spread import spread_choices, spread_placement
from protos.messages import RhoReport
from simulator import deepshare_experiment
from simulator.contention import ContentionModel
from simulator.engine import Simulation
from simulator.experiments import run_experiment
from simulator.metrics import summarize
from simulator.workloads import WorkloadError, load_workload, split_workload
from simulator.workloads.deepshare import load_trace

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "deepshare"
REAL0 = DATA / "traces" / "real" / "trace0.json"
CLUSTER = load_cluster("deepshare-4x8")


def isolated() -> dict[str, float]:
    rows = list(csv.reader((DATA / "isolated_thp.csv").read_text(encoding="utf-8-sig").splitlines()))
    return {r[0]: float(r[1]) for r in rows[1:]}


def test_the_cluster_is_four_machines_of_eight_gpus_in_one_rack():
    assert CLUSTER.size == 32 and len(CLUSTER.machines) == 4
    assert {len(g) for g in CLUSTER.machines.values()} == {8}
    assert len({CLUSTER.position(g)[0] for g in CLUSTER.gpus}) == 1


def test_real0_becomes_256_one_job_apps_at_time_zero_with_deepshares_work():
    trace = json.loads(REAL0.read_text())
    workload = load_workload("deepshare")
    assert len(workload.apps) == len(trace) == 256
    assert all(a.arrival_s == 0 and a.kind == "fixed" and len(a.jobs) == 1 for a in workload.apps)
    assert sum(a.demand_max for a in workload.apps) == sum(j["gpu_demand"] for j in trace.values()) == 1252
    thp = isolated()
    nodes = {2: 2, 4: 4, 8: 4}  # the spread DeepShare's LAS and SRTF try first on 4 nodes
    for app in workload.apps:
        entry = trace[app.app_id.removeprefix("ds-").lstrip("0") or "0"]
        job = app.jobs[0]
        assert (app.model, job.gpus) == (entry["model"], entry["gpu_demand"])
        seconds = entry["total_samples_to_train"] / thp[f"{entry['model']},{job.gpus},{nodes[job.gpus]}"]
        assert job.iterations == pytest.approx(seconds, rel=1e-12)
        assert job.iter_time_s == job.gpus  # one iteration a second on the whole demand
    hours = [a.jobs[0].iterations / 3600 for a in workload.apps]
    assert 0.9 < min(hours) and max(hours) < 1.4  # DeepShare: "about an hour" alone
    assert workload.profile_tables and Path(workload.profile_tables[0]).name == "deepshare.toml"


def test_a_trace_file_by_name_colon_path_and_a_slice(tmp_path):
    episode = DATA / "traces" / "train" / "jobset1_episode2.json"
    assert split_workload(f"deepshare:{episode}") == ("deepshare", {"path": str(episode)})
    assert split_workload("workload2") == ("workload2", {})
    assert split_workload("C:/traces/x.csv") == ("C:/traces/x.csv", {})
    a = load_workload(f"deepshare:{episode}", jobs=5)
    b = load_workload("deepshare", path=str(episode), jobs=5)
    assert a == b and [x.app_id for x in a.apps] == ["ds-000", "ds-001", "ds-002", "ds-003", "ds-004"]
    with pytest.raises(WorkloadError, match="not both"):
        load_workload(f"deepshare:{episode}", path=str(episode))


@pytest.mark.parametrize("jobs, problem", [
    ({"0": {"model": "MoE", "gpu_demand": 8}}, "missing total_samples_to_train"),
    ({"0": {"model": "MoE", "gpu_demand": 3, "total_samples_to_train": 10}}, "no throughput for 'MoE' on 3 GPUs"),
    ({"0": {"model": "BERT", "gpu_demand": 8, "total_samples_to_train": 10}}, "no throughput for 'BERT'"),
    ({"0": {"model": "MoE", "gpu_demand": 0, "total_samples_to_train": 10}}, "gpu_demand must be"),
    ({"0": {"model": "MoE", "gpu_demand": 8, "total_samples_to_train": -1}}, "total_samples_to_train must be"),
    ({}, "non-empty object"),
])
def test_a_bad_trace_is_refused_naming_the_file_and_the_job(tmp_path, jobs, problem):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(jobs))
    with pytest.raises(WorkloadError, match=problem) as err:
        load_trace(path)
    assert str(path) in str(err.value) and ("job '0'" in str(err.value) or not jobs)


def test_a_trace_that_is_not_json_is_refused_with_its_line(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{\n"0": {"model": "MoE",,}\n}')
    with pytest.raises(WorkloadError, match=r"t\.json:2: not JSON"):
        load_trace(path)


# -- the baselines -------------------------------------------------------------------------------


def context(free, unmet, attained=None, reports=None, held=None) -> RoundContext:
    return RoundContext(round_id=1, now=0.0, free=frozenset(free), unmet=unmet, held=held or {a: frozenset() for a in unmet},
                        position=CLUSTER.position, rng=random.Random(0), seed=0, reports=reports or {},
                        attained=attained or {}, arrived={a: 0.0 for a in unmet})


def report(demand: int, remaining: float = math.inf) -> RhoReport:
    return RhoReport(rho=math.inf, demand=demand, remaining_s=remaining)


def machines_of(gpus) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in gpus:
        out[CLUSTER.position(g)[1]] = out.get(CLUSTER.position(g)[1], 0) + 1
    return out


def test_deepshares_spread_puts_each_job_over_as_many_nodes_as_divide_it():
    assert spread_choices(2, 4) == [2] and spread_choices(4, 4) == [4, 2] and spread_choices(8, 4) == [4, 2]
    assert spread_choices(1, 4) == [1] and spread_choices(6, 4) == [3, 2]
    free = sorted(CLUSTER.gpus)
    assert machines_of(spread_placement(8, free, CLUSTER.position)) == {f"r0-m{i}": 2 for i in range(4)}
    assert machines_of(spread_placement(4, free, CLUSTER.position)) == {f"r0-m{i}": 1 for i in range(4)}
    assert machines_of(spread_placement(2, free, CLUSTER.position)) == {"r0-m0": 1, "r0-m1": 1}
    # machine 3 has one GPU free: an 8-GPU job goes 4 + 4 on the first machines with 4 free
    crowded = [g for g in free if not g.startswith("r0-m3-") or g == "r0-m3-g7"]
    assert machines_of(spread_placement(8, crowded, CLUSTER.position)) == {"r0-m0": 4, "r0-m1": 4}
    assert spread_placement(8, ["r0-m0-g0", "r0-m1-g0", "r0-m2-g0"], CLUSTER.position) is None


def test_serving_stops_at_the_first_job_that_does_not_fit():
    free = [g for g in CLUSTER.gpus if g.startswith(("r0-m0-", "r0-m1-")) and int(g[-1]) < 2]  # 2 + 2 free
    busy = frozenset(g for g in CLUSTER.gpus if g not in free)  # the rest of the cluster: another app's
    ctx = context(free, {"big": 8, "small": 2}, attained={"big": 100.0, "small": 0.0},
                  reports={"big": report(8), "small": report(2)},
                  held={"big": frozenset(), "small": frozenset(), "other": busy})
    assert make_policy("deepshare-las").allocate(ctx, {}).granted == {}  # big first, does not fit: nothing
    granted = make_policy("las").allocate(ctx, {}).granted  # small first (least service)
    assert list(granted) == ["small"] and len(granted["small"]) == 2


def test_each_baseline_orders_by_its_own_key():
    apps = {"a": 4, "b": 2, "c": 8}
    attained = {"a": 4 * 1000.0, "b": 2 * 1800.0, "c": 0.0}  # time scheduled: a 1000 s, b 1800 s, c none
    reports = {"a": report(4, 1000.0), "b": report(2, 3000.0), "c": report(8, 2000.0)}
    ctx = context(sorted(CLUSTER.gpus), apps, attained, reports)
    assert make_policy("las").order(ctx) == ["c", "b", "a"]  # least GPU-seconds: c 0, b 3600, a 4000
    assert make_policy("srtf").order(ctx) == ["a", "c", "b"]  # least remaining time
    assert make_policy("deepshare-las").order(ctx) == ["b", "a", "c"]  # most time scheduled first
    srtf = make_policy("deepshare-srtf")
    first = context(sorted(CLUSTER.gpus), apps, reports={"a": report(4, 4000.0), "b": report(2, 4000.0),
                                                          "c": report(8, 2000.0)})
    assert srtf.order(first) == ["a", "b", "c"]  # nothing done yet: ties by name
    # progress: a 1 - 1000/4000, b 1 - 3000/4000, c 1 - 2000/2000 -> least progress first
    assert srtf.order(ctx) == ["c", "b", "a"]
    # an app that has left is forgotten
    srtf.order(context(sorted(CLUSTER.gpus), {"a": 4}, reports={"a": report(4, 1000.0)}, held={"a": frozenset()}))
    assert set(srtf.first) == {"a"}


def test_the_spread_baselines_draw_nothing_at_random():
    workload = load_workload("deepshare", jobs=12)
    outcomes = []
    for seed in (0, 1):
        sim = Simulation(CLUSTER, workload, make_policy("deepshare-srtf"), lease_s=300.0, restart_s=0.0, seed=seed,
                         contention=ContentionModel.load())
        s = summarize(sim.run())
        outcomes.append([(a["app"], a["finish_s"], a["mean_ratio"]) for a in s["apps"]])
    assert outcomes[0] == outcomes[1]


def test_deepshares_jct_counts_whole_rounds_of_running():
    assert deepshare_experiment.deepshare_jct(1.0) == 300.0
    assert deepshare_experiment.deepshare_jct(300.0) == 300.0
    assert deepshare_experiment.deepshare_jct(300.5) == 600.0
    assert math.isnan(deepshare_experiment.deepshare_jct(None))


# -- the experiment --------------------------------------------------------------------------------


def test_the_experiment_end_to_end_on_a_slice(tmp_path, monkeypatch):
    monkeypatch.setattr(deepshare_experiment, "QUICK_JOBS", 10)
    result = run_experiment("deepshare", tmp_path, quick=True, seeds=2, workers=1,
                            policies=["deepshare-las", "deepshare-srtf", "themis"])
    saved = json.loads((tmp_path / "deepshare.json").read_text())
    assert saved["policies"].keys() == {"deepshare-las", "deepshare-srtf", "themis"}
    assert saved["cluster"] == "deepshare-4x8" and saved["workload_knobs"]["jobs"] == 10
    assert saved["settings"]["lease"] == 300.0 and saved["settings"]["restart"] == 0.0
    assert set(saved["jct_definitions"]) == {"from_submission", "deepshare"}
    las, themis = saved["policies"]["deepshare-las"], saved["policies"]["themis"]
    assert las["seeds"] == [0] and las["deterministic"] and themis["seeds"] == [0, 1]
    for row in saved["policies"].values():
        for key in ("avg_jct_s", "p90_jct_s", "max_jct_s", "deepshare_avg_jct_s", "makespan", "utilization",
                    "mean_contention_ratio", "max_rho", "p99_rho", "jain_rho"):
            assert key in row and math.isfinite(row[key]["mean"]), key
        assert row["deepshare_avg_jct_s"]["mean"] <= row["avg_jct_s"]["mean"] + 300  # queueing left out
        assert 0 < row["mean_contention_ratio"]["mean"] <= 1
    assert "avg_jct_s_vs_deepshare-srtf" in saved["relative"]["themis"]
    for app in saved["apps"]["themis"]:
        assert app["deepshare_jct_s"] % 300 == 0 and app["deepshare_jct_s"] >= app["running_s"]
    for png in ("jct_cdf.png", "ratio_cdf.png", "tradeoff.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    assert result["runs_simulated"] == 4  # one seed for each deterministic policy, two for Themis
    again = run_experiment("deepshare", tmp_path, quick=True, seeds=2, workers=1,
                           policies=["deepshare-las", "deepshare-srtf", "themis"])
    assert again["runs_reused"] == 4 and again["runs_simulated"] == 0


def test_a_gang_no_spread_of_the_cluster_can_hold_asks_for_what_one_can_and_blocks_no_one_for_good():
    """Head-of-line with gangs: an app asking for more than the whole cluster would stop every app
    behind it for ever; it is asked for the most a spread of the cluster can hold."""
    free = sorted(CLUSTER.gpus)
    ctx = context(free, {"huge": 64, "small": 2}, attained={"huge": 0.0, "small": 5.0},
                  reports={"huge": report(64), "small": report(2)})
    granted = make_policy("las").allocate(ctx, {}).granted
    assert len(granted["huge"]) == len(free) and "small" not in granted
