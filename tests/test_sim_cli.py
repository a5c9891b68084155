"""themis-sim from the command line: run, compare, bad traces, the strategic study."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simulator.cli import main

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "examples" / "trace.csv"
REQUIRED = {"policy", "max_rho", "mean_rho", "gpu_time", "avg_jct", "makespan", "wall_seconds", "apps"}


def test_run_writes_a_summary(tmp_path):
    assert main(["run", "--cluster", "testbed-64", "--workload", str(TRACE), "--policy", "themis",
                 "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert REQUIRED <= set(summary)
    assert summary["policy"] == "themis" and summary["cluster"] == "testbed-64"
    assert len(summary["apps"]) == 5 and all(a["rho"] > 0 for a in summary["apps"])
    assert summary["max_rho"] == max(a["rho"] for a in summary["apps"])
    assert 0 < summary["utilization"] <= 1


def test_compare_writes_one_summary_per_policy_and_plots(tmp_path):
    assert main(["compare", "--cluster", "testbed-64", "--workload", str(TRACE), "--policies", "themis,fifo,drf",
                 "--out", str(tmp_path)]) == 0
    for policy in ("themis", "fifo", "drf"):
        assert json.loads((tmp_path / policy / "summary.json").read_text())["policy"] == policy
    for png in ("rho_cdf.png", "gpu_time.png", "placement_cdf.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def test_a_bad_trace_line_is_reported_with_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("app,job,arrival_s,gpus,iterations,iter_time_s,model\na,j0,0,2,100,0.5,vgg16\na,j1,0,-1,100,0.5,vgg16\n")
    assert main(["run", "--workload", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "bad.csv" in err and ":3" in err


def test_unknown_policy_and_experiment_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        main(["compare", "--policies", "themis,nope", "--workload", str(TRACE), "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        main(["experiment", "fig99", "--out", str(tmp_path)])


def test_strategic_study_writes_points_for_each_level(tmp_path):
    assert main(["strategic", "--strategy", "overreport-spread", "--levels", "0,50", "--seeds", "1",
                 "--cluster", "testbed-64", "--workload", str(TRACE), "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "strategic.json").read_text())
    assert [p["level"] for p in result["points"]] == [0.0, 50.0]
    assert result["points"][0]["liar_jct_vs_truthful"] == 1.0
    assert (tmp_path / "strategic.png").exists()


def test_experiment_fig15_quick_writes_json_and_png(tmp_path):
    assert main(["experiment", "fig15", "--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "fig15.json").read_text())
    assert result["figure"] == "fig15" and result["seeds"] == 3
    assert [p["level"] for p in result["points"]] == [0, 25, 50, 100]
    assert (tmp_path / "strategic.png").read_bytes()[:4] == b"\x89PNG"


def test_contention_clusters_halve_and_quarter_sim_256():
    from arbiter.cluster import load_cluster
    from simulator.experiments import shrunk

    assert load_cluster(shrunk(2)).size == 128
    assert load_cluster(shrunk(4)).size == 64
    quarter = load_cluster(shrunk(4))
    assert sorted({len(g) for g in quarter.machines.values()}) == [1, 4, 8]
