"""Network contention (D35): the combination rule on hand-made placements with the table's own values,
the table and class files, the simulator with contention on and off, preemption, the policy hook and
the command line."""

from __future__ import annotations

import csv
import hashlib
import json
import math
from pathlib import Path

import pytest

from agent.placement import load_profiles
from arbiter.cluster import load_cluster
from arbiter.contention import (
    FLOOR,
    ContentionError,
    JobKind,
    Placed,
    job_ratios,
    load_classes,
    load_table,
    parse_classes,
    parse_table,
    ratio_of,
)
from arbiter.policies import make_policy
from simulator.cli import main
from simulator.contention import ContentionModel
from simulator.engine import Simulation
from simulator.metrics import summarize
from simulator.workloads import load_workload
from simulator.workloads.deepshare import load_trace

ROOT = Path(__file__).resolve().parents[1]
CSV = ROOT / "agent" / "profiles" / "contention_deepshare.csv"
SHA256 = "326e7d3083c389e6f50f60769b5cd501944fed32b0c4cae94d0ad9a6bfef65d2"  # README-deepshare.md


def cells() -> dict[tuple[str, str], float]:
    """The table read with the csv module alone: (row kind, column kind) -> ratio."""
    rows = list(csv.reader(CSV.read_text(encoding="utf-8-sig").splitlines()))
    header = rows[0][1:]
    return {(r[0], c): float(v) for r in rows[1:] for c, v in zip(header, r[1:])}


TABLE = load_table()
CELLS = cells()


def job(cls: str, gpus: int, *machines: str) -> Placed:
    """A job of ``gpus`` GPUs spread evenly over ``machines``."""
    per = gpus // len(machines)
    return Placed.on(cls, [m for m in machines for _ in range(per)])


def test_the_shipped_table_is_deepshares_unchanged():
    assert hashlib.sha256(CSV.read_bytes()).hexdigest() == SHA256
    assert SHA256 in (CSV.parent / "README-deepshare.md").read_text()
    assert len(CELLS) == 36 * 36
    # the paper (section III): MoE next to FSDP reaches a contention sensitivity of 3.00
    worst = min(v for (row, col), v in CELLS.items() if row.startswith("MoE,") and col.startswith("FSDP,"))
    assert round(1 / worst, 2) == 3.00
    assert TABLE.classes == ("MobileNetV3", "GraphSage", "FSDP", "Transformer-XL", "DLRM", "MoE")


def test_two_spread_jobs_on_the_same_machines_each_get_their_own_row():
    moe, fsdp = job("MoE", 8, "m0", "m1", "m2", "m3"), job("FSDP", 8, "m0", "m1", "m2", "m3")
    ratios = job_ratios(TABLE, {"moe": moe, "fsdp": fsdp})
    assert ratios["moe"] == CELLS[("MoE,8,4", "FSDP,8,4")]
    assert ratios["fsdp"] == CELLS[("FSDP,8,4", "MoE,8,4")]
    assert ratios["moe"] != ratios["fsdp"]  # the table is not symmetric


def test_a_job_on_one_machine_is_untouched_and_slows_nobody():
    alone = job("MoE", 8, "m0")
    spread = job("FSDP", 4, "m0", "m1")
    ratios = job_ratios(TABLE, {"alone": alone, "spread": spread})
    assert ratios == {"alone": 1.0, "spread": 1.0}


def test_sharing_one_machine_of_several_is_enough_and_no_shared_machine_is_no_contention():
    a = job("Transformer-XL", 4, "m0", "m1")
    b = job("DLRM", 4, "m1", "m2")
    c = job("MoE", 2, "m2", "m3")
    ratios = job_ratios(TABLE, {"a": a, "b": b, "c": c})
    assert ratios["a"] == CELLS[("Transformer-XL,4,2", "DLRM,4,2")]
    assert ratios["c"] == max(FLOOR, CELLS[("MoE,2,2", "DLRM,4,2")])
    assert ratios["b"] == max(FLOOR, min(CELLS[("DLRM,4,2", "Transformer-XL,4,2")], CELLS[("DLRM,4,2", "MoE,2,2")]))
    assert job_ratios(TABLE, {"a": a, "c": c}) == {"a": 1.0, "c": 1.0}


def test_the_worst_neighbour_sets_the_ratio():
    target = job("MoE", 8, "m0", "m1")
    light = job("GraphSage", 8, "m0", "m1")
    heavy = job("FSDP", 8, "m0", "m1")
    expected = min(CELLS[("MoE,8,2", "GraphSage,8,2")], CELLS[("MoE,8,2", "FSDP,8,2")])
    assert ratio_of(TABLE, target, [light, heavy]) == max(FLOOR, expected) < 1


def test_the_floor_holds_where_the_table_goes_below_it():
    (row, col), lowest = min(CELLS.items(), key=lambda kv: kv[1])
    assert lowest < FLOOR
    r_cls, r_gpus, r_nodes = row.split(",")
    c_cls, c_gpus, c_nodes = col.split(",")
    target = Placed(JobKind(r_cls, int(r_gpus), int(r_nodes)), frozenset({"m0", "m1"}))
    other = Placed(JobKind(c_cls, int(c_gpus), int(c_nodes)), frozenset({"m1", "m2"}))
    assert ratio_of(TABLE, target, [other]) == FLOOR
    assert ratio_of(TABLE, target, [other], floor=0.1) == lowest


def test_kinds_the_table_does_not_list_are_read_at_the_nearest():
    assert TABLE.key(JobKind("MoE", 8, 4)) == ("MoE", 8, 4)
    assert TABLE.key(JobKind("MoE", 6, 3)) == ("MoE", 8, 4)
    assert TABLE.key(JobKind("MoE", 16, 4)) == ("MoE", 8, 4)
    assert TABLE.key(JobKind("MoE", 3, 2)) == ("MoE", 4, 2)
    assert TABLE.key(JobKind("MoE", 2, 2)) == ("MoE", 2, 2)
    with pytest.raises(ContentionError, match="no class 'BERT'"):
        TABLE.key(JobKind("BERT", 8, 2))


@pytest.mark.parametrize("text, problem", [
    ("x,\"A,2,2\"\n\"A,2,2\",1.5\n", "in \\(0, 1\\]"),
    ("x,\"A,2,2\"\n\"A,2,2\",abc\n", "not a number"),
    ("x,\"A,2\"\n\"A,2,2\",0.5\n", "line 1, column 2"),
    ("x,\"A,2,2\",\"B,2,2\"\n\"A,2,2\",0.5,0.5\n", "same job kinds"),
    ("x,\"A,2,2\"\n\"A,2,2\",0.5,0.4\n", "line 2 has 2 ratios"),
    ("x,\"A,2,4\"\n\"A,2,4\",0.5\n", "machines <= GPUs"),
])
def test_a_bad_table_is_refused_naming_file_and_place(text, problem):
    with pytest.raises(ContentionError, match=problem) as err:
        parse_table(text, "mine.csv")
    assert str(err.value).startswith("mine.csv")


def test_every_profile_model_has_a_class_of_the_table_with_a_source():
    classes = load_classes()
    profiles = load_profiles(user=False)
    for name, profile in profiles.items():
        assert classes.class_of(name, profile.category, TABLE) in TABLE.classes
        assert classes.sources[f"models.{name}"]
    for cls in TABLE.classes:
        assert classes.class_of(cls, "other", TABLE) == cls
    for category in ("cv", "nlp", "speech"):
        assert classes.class_of("someone-elses-model", category, TABLE) in TABLE.classes
    with pytest.raises(ContentionError, match="no contention class"):
        classes.class_of("someone-elses-model", "other", TABLE)


def test_the_class_mapping_follows_its_own_rule():
    """contention_classes.toml's [D2]: S2 <= 1.29 -> MobileNetV3, above -> Transformer-XL."""
    classes = load_classes()
    for name, profile in load_profiles(user=False).items():
        expected = "MobileNetV3" if profile.slowdown[2] <= 1.29 else "Transformer-XL"
        assert classes.models[name] == expected, name


def test_a_bad_class_file_is_refused():
    with pytest.raises(ContentionError, match="exactly class"):
        parse_classes('[models.x]\nclass = "MoE"\n', "c.toml")
    with pytest.raises(ContentionError, match="unknown top-level"):
        parse_classes('[things.x]\nclass = "MoE"\nsource = "s"\n', "c.toml")
    odd = parse_classes('[models.x]\nclass = "Nope"\nsource = "s"\n', "c.toml")
    with pytest.raises(ContentionError, match="'Nope'"):
        odd.class_of("x", "cv", TABLE)


# -- the simulator --------------------------------------------------------------------------------


def ones_table(path: Path) -> Path:
    """The shipped table's kinds with every ratio 1: contention on, but nobody slowed."""
    rows = list(csv.reader(CSV.read_text(encoding="utf-8-sig").splitlines()))
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(rows[0])
        for r in rows[1:]:
            w.writerow([r[0]] + ["1.0"] * (len(r) - 1))
    return path


def outcome(summary: dict) -> dict:
    drop = {"wall_seconds", "mean_contention_ratio"}
    apps = [{k: v for k, v in a.items() if k not in ("mean_ratio", "running_s", "preempted")} for a in summary["apps"]]
    return {**{k: v for k, v in summary.items() if k not in drop and k != "apps"}, "apps": apps}


def simulate(workload, cluster: str, policy: str, model: ContentionModel | None, **kw):
    sim = Simulation(load_cluster(cluster), workload, make_policy(policy), contention=model, **kw)
    return sim, summarize(sim.run())


@pytest.mark.parametrize("policy", ["themis", "tiresias"])
def test_contention_that_slows_nobody_leaves_the_outcome_as_it_is_without(policy, tmp_path):
    """Contention off (the default) and on with all ratios 1 give the same run to the last digit:
    the hook changes no rate, no event, no decision."""
    workload = load_workload("synthetic", seed=3, apps=12, load=1.5)
    model = ContentionModel(load_table(ones_table(tmp_path / "ones.csv")), load_classes())
    _, off = simulate(workload, "testbed-64", policy, None)
    sim, on = simulate(workload, "testbed-64", policy, model)
    assert outcome(off) == outcome(on)
    assert off["mean_contention_ratio"] == on["mean_contention_ratio"] == 1.0
    assert all(a["running_s"] is None for a in off["apps"])
    assert all(a["running_s"] > 0 for a in on["apps"])
    assert sim.policy.contention is sim.contention


def two_moe_jobs(tmp_path: Path, short: float, long: float) -> Path:
    """Two 8-GPU MoE jobs whose work is ``short`` and ``long`` seconds alone."""
    from simulator.workloads.deepshare import isolated_throughputs

    thp = isolated_throughputs()[("MoE", 8, 4)]
    path = tmp_path / "two.json"
    path.write_text(json.dumps({"0": {"model": "MoE", "gpu_demand": 8, "total_samples_to_train": short * thp},
                                "1": {"model": "MoE", "gpu_demand": 8, "total_samples_to_train": long * thp}}))
    return path


def test_two_spread_moe_jobs_run_at_the_tables_ratio_until_one_finishes(tmp_path):
    """DeepShare's LAS spreads both 8-GPU jobs over the 4 nodes (2 GPUs each): each runs at
    MoE,8,4 next to MoE,8,4; once the shorter one ends the other runs alone at full speed."""
    short, long = 3000.0, 5000.0
    workload = load_trace(two_moe_jobs(tmp_path, short, long))
    sim, s = simulate(workload, "deepshare-4x8", "deepshare-las", ContentionModel.load(), lease_s=300.0,
                      restart_s=0.0)
    r = CELLS[("MoE,8,4", "MoE,8,4")]
    start = min(a["finish_s"] - a["jct_s"] for a in s["apps"])  # both submitted at 0
    first = min(sim.runs.values(), key=lambda run: run.finished_at)
    second = max(sim.runs.values(), key=lambda run: run.finished_at)
    placed_at = 1.0  # the first round: arrival + the coalescing window (D10)
    assert start == 0.0
    assert first.finished_at == pytest.approx(placed_at + short / r, rel=1e-9)
    assert second.finished_at == pytest.approx(first.finished_at + (long - short), rel=1e-9)
    assert first.contention.mean_ratio == pytest.approx(r)
    assert second.contention.mean_ratio == pytest.approx((short / r * r + (long - short)) / (short / r + long - short))
    assert s["mean_contention_ratio"] < 1


def test_a_job_preempted_at_a_low_ratio_waits_a_lease_and_the_other_runs_alone(tmp_path):
    """MoE next to MoE (8 GPUs on 4 nodes) is at 0.534, below DeepShare's 0.6: the second job
    placed is preempted at once, waits one lease, comes back and is preempted again while the
    first runs; the first runs alone at full speed."""
    short, long = 3000.0, 3000.0
    workload = load_trace(two_moe_jobs(tmp_path, short, long))
    assert CELLS[("MoE,8,4", "MoE,8,4")] <= 0.6
    sim, s = simulate(workload, "deepshare-4x8", "deepshare-las", ContentionModel.load(preempt_at=0.6),
                      lease_s=300.0, restart_s=0.0)
    runs = sorted(sim.runs.values(), key=lambda run: run.finished_at)
    assert runs[0].contention.mean_ratio == 1.0 and runs[1].contention.mean_ratio == 1.0
    assert runs[0].contention.preempted == 0 and runs[1].contention.preempted >= 1
    assert runs[0].finished_at == pytest.approx(1.0 + short, rel=1e-9)
    assert runs[1].finished_at >= runs[0].finished_at + long - 1e-6
    assert all(a["preempted"] is not None for a in s["apps"])


def test_a_policy_sees_the_ratios_through_its_contention_view(tmp_path):
    workload = load_trace(two_moe_jobs(tmp_path, 3000.0, 5000.0))
    sim = Simulation(load_cluster("deepshare-4x8"), workload, make_policy("deepshare-las"), lease_s=300.0,
                     restart_s=0.0, contention=ContentionModel.load())
    seen = []

    def look(now: float) -> None:
        view = sim.policy.contention
        if now > 10 and not seen:
            a, b = sorted(sim.runs)
            gpus_of_b = sim.runs[b].jobs[f"{b}/j0"].gpus
            seen.append((view.kind(a), view.ratio(a), view.ratio_if(a, gpus_of_b), view.ratio_if(a, gpus_of_b[:1])))

    sim.run(progress=look)
    r = CELLS[("MoE,8,4", "MoE,8,4")]
    assert seen == [("MoE", r, r, 1.0)]


def test_every_app_gets_a_class_and_a_model_without_one_is_refused_by_name():
    workload = load_workload("small")
    sim = Simulation(load_cluster("sim-256"), workload, make_policy("fifo"), contention=ContentionModel.load())
    assert set(sim.contention.cls) == {a.app_id for a in workload.apps}
    assert set(sim.contention.cls.values()) <= set(TABLE.classes)
    bare = ContentionModel(TABLE, parse_classes("", "bare.toml"))
    with pytest.raises(ContentionError, match=r"workload 'small', app '.*': model '.*' .* has no contention class"):
        Simulation(load_cluster("sim-256"), workload, make_policy("fifo"), contention=bare)


# -- the command line -----------------------------------------------------------------------------


def test_run_with_contention_on_the_deepshare_trace(tmp_path):
    out = tmp_path / "run"
    trace = ROOT / "data" / "deepshare" / "traces" / "train" / "jobset0_episode0.json"
    assert main(["run", "--cluster", "deepshare-4x8", "--workload", f"deepshare:{trace}", "--workload-knob", "jobs=12",
                 "--policy", "deepshare-las", "--lease", "300", "--restart", "0", "--contention", "deepshare",
                 "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["contention"] == "deepshare" and s["workload"] == "deepshare" and len(s["apps"]) == 12
    assert 0 < s["mean_contention_ratio"] < 1
    assert s["avg_jct_s"] == pytest.approx(s["avg_jct"]) and s["max_jct_s"] >= s["p90_jct_s"] > 0
    assert all(a["running_s"] > 0 and 0 < a["mean_ratio"] <= 1 for a in s["apps"])


def test_a_bad_contention_file_and_preemption_without_a_table_are_refused(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("x,\"A,2,2\"\n\"A,2,2\",7\n")

    def said() -> str:
        return " ".join(capsys.readouterr().err.split())  # the console wraps long lines

    assert main(["run", "--workload", "small", "--contention", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "bad.csv" in said()
    assert main(["run", "--workload", "small", "--preempt-at", "0.6", "--out", str(tmp_path / "o")]) == 2
    assert "--preempt-at needs --contention" in said()
    assert main(["run", "--workload", "small", "--contention", str(tmp_path / "none.csv"),
                 "--out", str(tmp_path / "o")]) == 2
    assert "cannot read contention table" in said()


def test_the_mean_ratio_is_one_when_contention_is_off():
    workload = load_workload("deepshare", jobs=6)
    _, s = simulate(workload, "deepshare-4x8", "deepshare-las", None, lease_s=300.0, restart_s=0.0)
    assert s["mean_contention_ratio"] == 1.0 and math.isfinite(s["avg_jct_s"])
