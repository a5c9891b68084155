"""The paper's setups for Figs. 9-12 (issue 13 item 3): ``themis-sim experiment --setup paper`` runs
them on testbed-64, Fig. 12 with Workload 1 on testbed-64 shrunk to 1/2 and 1/4."""

from __future__ import annotations

import json

import pytest

import simulator.experiments as experiments
from arbiter.cluster import load_cluster
from simulator.cli import main
from simulator.experiments import run_experiment, scaled_workload_knobs, shrunk


@pytest.fixture
def recorded(monkeypatch):
    """Experiments that record the runs they would simulate instead of simulating them."""
    calls: list[list[dict]] = []

    def fake_run(self, runs, label):
        calls.append([dict(r) for r in runs])
        return [{"policy": r["policy"], "first": {"apps": []}} for r in runs]

    monkeypatch.setattr(experiments.Setup, "run", fake_run)
    monkeypatch.setattr(experiments, "_policy_sweep", lambda *a, **k: {})
    monkeypatch.setattr(experiments, "compare_plots", lambda *a, **k: [])
    return calls


def test_setup_option_is_parsed_and_defaults_to_sim(monkeypatch, tmp_path):
    seen: list[dict] = []
    monkeypatch.setattr(experiments, "run_experiment", lambda name, out, **kw: seen.append({"name": name, **kw}))
    assert main(["experiment", "fig12", "--setup", "paper", "--seeds", "1", "--out", str(tmp_path)]) == 0
    assert main(["experiment", "fig9", "--out", str(tmp_path)]) == 0
    assert main(["experiment", "fig9", "--fresh", "--out", str(tmp_path)]) == 0
    assert [(s["name"], s["setup"]) for s in seen] == [("fig12", "paper"), ("fig9", "sim"), ("fig9", "sim")]
    assert [s["reuse"] for s in seen] == [True, True, False]  # --fresh: kept runs are not read


def test_paper_fig12_is_workload1_on_testbed_64_and_its_halves(recorded, tmp_path):
    result = run_experiment("fig12", tmp_path, seeds=1, workers=1, policies=["themis", "tiresias"], setup="paper")
    assert len(recorded) == 3
    clusters = [{r["cluster"] for r in level} for level in recorded]
    assert clusters[0] == {"testbed-64"}
    assert [load_cluster(next(iter(c))).size for c in clusters] == [64, 32, 16]
    assert all(r["workload"] == "workload1" for level in recorded for r in level)
    assert all(r["workload_knobs"] == {"max_apps": 75, "arrival_scale": pytest.approx(300 / 1040)}
               for level in recorded for r in level)
    assert [r["policy"] for r in recorded[2]] == ["themis", "tiresias"]
    written = json.loads((tmp_path / "fig12.json").read_text())
    assert written["setup"] == "paper" and written["cluster"] == "testbed-64" and written["workload"] == "workload1"
    assert written["clusters"] == ["testbed-64", "testbed-64/2", "testbed-64/4"] and written["gpus"] == [64, 32, 16]
    assert "quick_does_not_reproduce" not in result


def test_sim_fig12_keeps_workload2_on_sim_256(recorded, tmp_path):
    result = run_experiment("fig12", tmp_path, seeds=1, workers=1, policies=["themis"])
    assert [load_cluster(level[0]["cluster"]).size for level in recorded] == [256, 128, 64]
    assert recorded[0][0] == {"cluster": "sim-256", "workload": "workload2", "policy": "themis", "workload_knobs": {}}
    assert result["setup"] == "sim" and result["workload"] == "workload2"


def test_paper_figs_9_to_11_run_both_workloads_on_testbed_64(recorded, tmp_path):
    result = run_experiment("fig9", tmp_path, seeds=1, workers=1, policies=["themis", "optimus"], setup="paper")
    assert [[(r["cluster"], r["workload"]) for r in call] for call in recorded] == [
        [("testbed-64", "workload1")] * 2, [("testbed-64", "workload2")] * 2]
    assert result["workloads"]["workload2"]["workload_knobs"]["max_apps"] == 75


def test_quick_paper_setup_sizes_the_synthetic_load_for_64_gpus_and_says_what_it_misses(recorded, tmp_path):
    result = run_experiment("fig12", tmp_path, quick=True, seeds=1, workers=1, policies=["themis"], setup="paper")
    assert recorded[0][0]["workload"] == "synthetic"
    assert recorded[0][0]["workload_knobs"] == {"apps": 30, "kind": "fixed", "load": 1.5, "cluster_gpus": 64}
    assert result["quick_does_not_reproduce"] and any("Philly" in c for c in result["quick_does_not_reproduce"])


def test_shrinking_testbed_64_keeps_its_machine_kinds(tmp_path):
    assert shrunk(1, tmp_path, "testbed-64") == "testbed-64"
    for fraction, gpus, kinds in ((2, 32, {2: 4, 4: 6}), (4, 16, {2: 2, 4: 3})):
        path = shrunk(fraction, tmp_path, "testbed-64")
        assert path.startswith(str(tmp_path))  # written with the results, not into the repo
        small = load_cluster(path)
        assert small.size == gpus and small.name == f"testbed-64/{fraction}"
        sizes = [len(g) for g in small.machines.values()]
        assert {n: sizes.count(n) for n in set(sizes)} == kinds
        # a 4-GPU NC24 machine keeps its two K80 boards (slots)
        assert all(len({small.gpus[g].slot for g in gs}) == len(gs) // 2 for gs in small.machines.values())


@pytest.mark.parametrize("fraction, message", [(8, "cannot shrink testbed-64"), (3, "cannot shrink testbed-64"),
                                               (0, "whole number >= 1"), (2.5, "whole number >= 1")])
def test_shrinking_refuses_what_cannot_keep_the_kinds(tmp_path, fraction, message):
    with pytest.raises(ValueError, match=message):
        shrunk(fraction, tmp_path, "testbed-64")


def test_bad_setups_are_refused_with_a_clear_message(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["experiment", "fig12", "--setup", "testbed", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "--setup" in err and "invalid choice" in err and "'paper'" in err
    # the paper ran Figs. 13-16 in its simulator: --setup paper is refused for them, before any run
    assert main(["experiment", "fig13", "--setup", "paper", "--quick", "--out", str(tmp_path / "f13")]) == 2
    assert "applies to fig9, fig10, fig11, fig12" in capsys.readouterr().err
    assert not (tmp_path / "f13").exists()
    with pytest.raises(ValueError, match="unknown setup 'testbed'"):
        run_experiment("fig12", tmp_path, setup="testbed")


def test_workload1_scaled_for_testbed_64_keeps_sim_256s_load_per_gpu():
    from simulator.workloads import load_workload

    assert scaled_workload_knobs(256) == {}
    knobs = scaled_workload_knobs(64)
    assert knobs["max_apps"] == 75 and scaled_workload_knobs(32)["max_apps"] == 38
    full, small = load_workload("workload1", seed=0), load_workload("workload1", seed=0, **knobs)
    assert len(small.apps) == 75
    # the same arrival scale as Workload 1 on sim-256, so a quarter of the apps over about the same span
    assert "arrivals x0.2885" in full.source and "arrivals x0.2885" in small.source
    span = [max(a.arrival_s for a in w.apps) for w in (full, small)]
    assert 0.8 < span[1] / span[0] < 1.2
    with pytest.raises(ValueError):
        scaled_workload_knobs(0)
