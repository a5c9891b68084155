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


@pytest.mark.parametrize("argv", [
    ["experiment", "fig12", "--seeds", "0"], ["experiment", "fig12", "--workers", "0"],
    ["compare", "--workers", "-1"], ["compare", "--seeds", "two"], ["strategic", "--strategy", "truthful", "--seeds", "0"],
])
def test_seeds_and_workers_below_one_are_refused_naming_the_flag(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--out", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    flag = argv[-2]
    assert f"argument {flag}:" in err and ("at least 1" in err or "whole number" in err)
    assert not (tmp_path / "runs").exists()  # nothing ran


@pytest.mark.parametrize("argv, said", [
    (["run", "--workload", "synthetic", "--workload-knob", "apps=abc"], "knob apps wants a number"),
    (["run", "--workload", "synthetic", "--workload-knob", "kind=3"], "knob kind wants a string"),
    (["strategic", "--strategy", "noisy", "--levels", "200"], "strategy noisy: a lie size is a percentage >= 0 and at most 100"),
    (["strategic", "--strategy", "noisy", "--levels", "0,abc"], "--levels: comma-separated lie sizes"),
    (["strategic", "--strategy", "noisy", "--levels", "50,50"], "--levels: give distinct finite lie sizes"),
    (["compare", "--policies", "themis,themis"], "names a policy twice"),
])
def test_bad_flag_values_are_refused_by_name_before_anything_runs(argv, said, tmp_path, capsys):
    """Each of these was a traceback from deep inside (a TypeError in the workload builder, a
    simulation that stalled on a 200% noise) or ran with the bad value (a policy twice)."""
    try:
        code = main([*argv, "--seeds", "1", "--out", str(tmp_path / "o")] if argv[0] != "run"
                    else [*argv, "--out", str(tmp_path / "o")])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 2
        said_where = str(exc.code)
    else:
        said_where = ""
    assert code == 2
    assert said in " ".join((said_where + capsys.readouterr().err).split())
    assert not (tmp_path / "o" / "runs").exists() or not any((tmp_path / "o" / "runs").iterdir())


def test_an_out_that_cannot_be_a_folder_is_refused_before_simulating(tmp_path, capsys):
    taken = tmp_path / "summary.json"
    taken.write_text("{}")
    assert main(["run", "--workload", str(TRACE), "--out", str(taken)]) == 2
    assert "cannot use it as the output folder: a file is there" in " ".join(capsys.readouterr().err.split())
    assert taken.read_text() == "{}"
    assert main(["run", "--workload", str(TRACE), "--out", str(taken / "deeper")]) == 2
    # the console wraps long paths anywhere, even inside a word: compare without any whitespace
    assert "summary.jsonisafile" in "".join(capsys.readouterr().err.split())


def test_strategic_study_writes_points_for_each_level(tmp_path):
    assert main(["strategic", "--strategy", "overreport-spread", "--levels", "0,50", "--seeds", "2", "--workers", "1",
                 "--cluster", "testbed-64", "--workload", str(TRACE), "--liar", "speech", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "strategic.json").read_text())
    assert [p["level"] for p in result["points"]] == [0.0, 50.0]
    assert result["liars"] == ["speech"] and result["policy"] == "themis" and result["seeds"] == [0, 1]
    assert result["rank"] == "reported"
    truthful = result["points"][0]
    assert truthful["liar_jct_vs_truthful"]["values"] == [1.0, 1.0] and truthful["share_seeds_liar_gained"] == 0
    assert 0 <= truthful["liar_hidden_payment"]["mean"] < 1
    assert (tmp_path / "strategic.png").exists()


def test_experiment_fig15_quick_writes_json_and_png(tmp_path):
    assert main(["experiment", "fig15", "--quick", "--seeds", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "fig15.json").read_text())
    assert result["figure"] == "fig15" and len(result["seeds"]) == 2
    assert [p["level"] for p in result["points"]] == [0, 25, 50, 100]
    assert all(len(p["liar_jct_vs_truthful"]["values"]) == 2 for p in result["points"])
    assert (tmp_path / "strategic.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "clusters" / "fig15-64.toml").exists()  # written with the results, not into the repo
    measured = result["measured_rank"]  # D21: the same study, the liar ranked by measured slowdowns
    assert result["rank"] == "reported" and measured["rank"] == "measured"
    assert [p["level"] for p in measured["points"]] == [0, 25, 50, 100]
    assert measured["points"][0]["liar_jct_s"] == result["points"][0]["liar_jct_s"]
    assert (tmp_path / "rank-measured" / "strategic.png").read_bytes()[:4] == b"\x89PNG"


def test_contention_clusters_halve_and_quarter_sim_256(tmp_path):
    from arbiter.cluster import load_cluster
    from simulator.experiments import shrunk

    assert load_cluster(shrunk(2, tmp_path)).size == 128
    assert load_cluster(shrunk(4, tmp_path)).size == 64
    quarter = load_cluster(shrunk(4, tmp_path))
    assert sorted({len(g) for g in quarter.machines.values()}) == [1, 4, 8]
    assert shrunk(4, tmp_path).startswith(str(tmp_path))


def test_compare_over_seeds_writes_every_seed_and_intervals(tmp_path):
    assert main(["compare", "--cluster", "testbed-64", "--workload", str(TRACE), "--policies", "themis,fifo",
                 "--seeds", "3", "--seed", "4", "--workers", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "comparison.json").read_text())
    assert [r["policy"] for r in rows] == ["themis", "fifo"]
    for r in rows:
        assert r["seeds"] == [4, 5, 6]
        per_seed = [json.loads((tmp_path / r["policy"] / f"seed{k}" / "summary.json").read_text()) for k in (4, 5, 6)]
        stat = r["max_rho"]
        assert stat["values"] == [s["max_rho"] for s in per_seed]
        assert stat["ci95"][0] <= stat["mean"] <= stat["ci95"][1]
    assert (tmp_path / "max_rho.png").read_bytes()[:4] == b"\x89PNG"


def test_summaries_say_where_gpus_came_from_and_the_contention_normalised_rho(tmp_path):
    assert main(["run", "--cluster", "testbed-64", "--workload", str(TRACE), "--policy", "themis",
                 "--out", str(tmp_path)]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["share_auction"] + s["share_queue"] + s["share_leftover"] == pytest.approx(1.0)
    assert s["granted_by"]["auction"] > 0 and s["noncanonical_auctions"] == 0
    for a in s["apps"]:
        # time on a dedicated 1/N_avg share is never longer than Eq. 1's T_id (paper 4.3.1)
        assert a["rho_share"] >= a["rho"] - 1e-9
    assert s["max_rho_share"] == max(a["rho_share"] for a in s["apps"])
    assert s["max_rho_floor"] <= s["max_rho"] and s["p99_rho"] <= s["max_rho"]


def test_experiments_take_a_policy_list_and_seeds(tmp_path):
    from simulator.experiments import run_experiment

    result = run_experiment("fig13", tmp_path, quick=True, seeds=2, workers=2, policies=["themis", "fifo"])
    assert set(result["policies"]) == {"themis", "fifo"}
    point = result["policies"]["themis"]["max_rho"][0]
    assert len(point["values"]) == 2 and point["half"] >= 0
    assert (tmp_path / "max_rho.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_table_marks_the_best_value_of_each_column():
    """issue 11: the main job's table shows at a glance who wins what (lower is better except Jain)."""
    from rich.console import Console

    from simulator.cli import summary_table

    rows = [{"policy": "a", "max_rho": 2.0, "jain_rho": 0.9, "gpu_time": 7200.0},
            {"policy": "b", "max_rho": 1.5, "jain_rho": 0.5, "gpu_time": 7200.0},
            {"policy": "c", "max_rho": {"mean": 3.0, "half": 0.1}, "jain_rho": 0.7, "gpu_time": 9000.0}]
    console = Console(width=250, record=True, color_system=None)
    console.print(summary_table(rows, "t"))
    text = console.export_text()
    lines = {line.split()[0]: line for line in text.splitlines() if line.split() and line.split()[0] in "abc"}
    assert "1.50*" in lines["b"] and "2.00*" not in lines["a"] and "3.00*" not in lines["c"]
    assert "0.900*" in lines["a"] and "0.500*" not in lines["b"]
    assert lines["a"].count("2*") == 1 and lines["b"].count("2*") == 1  # a tie marks both (GPU h 2)
    assert "±0.10" in text  # a value over seeds: its interval under its mean


def test_profiles_flag_adds_a_model_for_the_run_and_bad_tables_stop_it(tmp_path, monkeypatch):
    """issue 13 item 6: a trace naming a model of the user's own table runs with --profiles (over
    seeds in worker processes too) and is refused, naming the flag, without it."""
    from simulator.plugins import ENV

    monkeypatch.setenv("THEMIS_PROFILES", "")  # restored after the test, whatever the run records
    monkeypatch.setenv(ENV, "")
    trace = tmp_path / "new_model.csv"
    trace.write_text("app,job,arrival_s,gpus,iterations,iter_time_s,model\n"
                     "a,j0,0,2,400,0.5,bert-large\nb,j0,30,2,400,0.5,mobilenet-v2\n")
    table = ROOT / "examples" / "profiles_example.toml"
    assert main(["run", "--cluster", "testbed-64", "--workload", str(trace), "--out", str(tmp_path / "no")]) == 2
    assert main(["compare", "--profiles", str(table), "--cluster", "testbed-64", "--workload", str(trace),
                 "--policies", "themis,tiresias", "--seeds", "2", "--workers", "2", "--out", str(tmp_path / "yes")]) == 0
    summary = json.loads((tmp_path / "yes" / "themis" / "seed1" / "summary.json").read_text())
    assert {a["app"] for a in summary["apps"]} == {"a", "b"}
    bad = tmp_path / "bad.toml"
    bad.write_text("[models.x]\ncategory = 'other'\nslowdown = [1.0, 1.0]\n")
    with pytest.raises(SystemExit, match="bad.toml"):
        main(["run", "--profiles", str(bad), "--workload", str(trace), "--out", str(tmp_path / "bad")])


def test_max_contenders_caps_the_simulated_auction_as_the_service_does(tmp_path):
    """D20 as a simulator option (issue 13 item 7): ``--max-contenders N`` reaches ThemisPolicy, so
    no auction of the run has more than N contenders, while the uncapped run has bigger ones."""
    from arbiter.cluster import load_cluster
    from arbiter.policies import make_policy
    from simulator.engine import Simulation
    from simulator.workloads import load_workload

    def widest(cap):
        sim = Simulation(load_cluster("sim-256"), load_workload("small", seed=0),
                         make_policy("themis", max_contenders=cap), keep_rounds=True, seed=0)
        rounds = sim.run().round_results
        return max(len(r.decision.auction.contenders) for r in rounds if r.decision and r.decision.auction)

    assert widest(None) > 2 and widest(2) == 2
    assert main(["run", "--workload", "small", "--max-contenders", "2", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["max_contenders"] == 2
    assert main(["run", "--workload", "small", "--max-contenders", "0", "--out", str(tmp_path / "zero")]) == 2


def test_resplit_reaches_run_compare_and_strategic(tmp_path):
    """``--resplit rent-or-buy`` (D23) is used by every command that takes it, not just parsed: the
    two-job app of ``test_simulator`` defers its growth once, and the summaries say so."""
    trace = tmp_path / "grow.csv"
    trace.write_text("app,job,arrival_s,gpus,iterations,iter_time_s,model\n"
                     "a,short,0,2,100,2.0,resnet50\na,long,0,2,400,2.0,resnet50\n"
                     "b,only,5000,1,50,2.0,resnet50\n")
    cluster = tmp_path / "two.toml"
    cluster.write_text('name = "two"\n[[racks]]\nmachines = [ { gpus = 2, slots = 2 } ]\n')
    common = ["--cluster", str(cluster), "--workload", str(trace), "--resplit", "rent-or-buy"]
    assert main(["run", *common, "--policy", "tiresias", "--out", str(tmp_path / "run")]) == 0
    run = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert run["resplit"] == "rent-or-buy" and sum(a["deferred_resplits"] for a in run["apps"]) >= 1
    assert main(["compare", *common, "--policies", "tiresias", "--out", str(tmp_path / "cmp")]) == 0
    assert json.loads((tmp_path / "cmp" / "tiresias" / "summary.json").read_text())["resplit"] == "rent-or-buy"
    assert main(["strategic", *common, "--policy", "tiresias", "--strategy", "noisy", "--levels", "10",
                 "--liar", "b", "--seeds", "1", "--workers", "1", "--out", str(tmp_path / "lie")]) == 0
    kept = [json.loads(p.read_text()) for p in (tmp_path / "lie" / "runs").rglob("*.json")]
    assert kept and all(k["summary"].get("resplit") == "rent-or-buy" for k in kept)


def test_payments_bounds_runs_the_same_simulation_and_reports_c_i_as_bounds(tmp_path):
    """``--payments bounds`` (D42): lotteries that bounds on c_i decide take no re-solve, and since
    the draw meets the same c_i either way, every grant and so every outcome is the exact run's;
    only the hidden payments are reported differently, as bounds around the exact values."""
    common = ["--cluster", "sim-256", "--workload", "small", "--policy", "themis", "--seed", "0"]
    assert main(["run", *common, "--out", str(tmp_path / "exact")]) == 0
    assert main(["run", *common, "--payments", "bounds", "--out", str(tmp_path / "bounds")]) == 0
    exact = json.loads((tmp_path / "exact" / "summary.json").read_text())
    bounds = json.loads((tmp_path / "bounds" / "summary.json").read_text())
    assert "payments" not in exact and "bounded_lotteries" not in exact
    assert bounds["payments"] == "bounds" and bounds["bounded_lotteries"] > 0
    payment_fields = {"mean_hidden_payment", "hidden_payment_bounds"}
    for key in set(exact) | set(bounds):
        if key not in {"apps", "wall_seconds", "payments", "bounded_lotteries", "zeroed_auctions", "zeroed_first"}:
            assert exact[key] == bounds[key], key
    assert bounds["zeroed_auctions"] <= exact["zeroed_auctions"]  # a zero the bounds did not prove is not counted
    bounded = 0
    for e, b in zip(exact["apps"], bounds["apps"], strict=True):
        assert {k: v for k, v in e.items() if k not in payment_fields} == \
            {k: v for k, v in b.items() if k not in payment_fields}
        if "hidden_payment_bounds" in b:
            bounded += 1
            lo, hi = b["hidden_payment_bounds"]
            assert b["mean_hidden_payment"] is None
            assert lo - 1e-12 <= e["mean_hidden_payment"] <= hi + 1e-12
        else:
            assert b["mean_hidden_payment"] == pytest.approx(e["mean_hidden_payment"], abs=1e-12)
    assert bounded > 0
    assert main(["compare", "--cluster", "sim-256", "--workload", "small", "--policies", "themis,tiresias",
                 "--payments", "bounds", "--out", str(tmp_path / "cmp")]) == 0
    compared = json.loads((tmp_path / "cmp" / "themis" / "summary.json").read_text())
    assert compared["payments"] == "bounds" and compared["max_rho"] == exact["max_rho"]
    assert "payments" not in json.loads((tmp_path / "cmp" / "tiresias" / "summary.json").read_text())


def test_payments_refuses_what_it_does_not_know():
    from simulator.runs import simulate

    with pytest.raises(ValueError, match="payments must be one of exact, bounds"):
        simulate(cluster="sim-256", workload="small", policy="themis", payments="approximate", show_progress=False)
    with pytest.raises(SystemExit):
        main(["run", "--workload", "small", "--payments", "approximate", "--out", "unused"])
