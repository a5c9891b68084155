"""Kept runs (simulator.run_store): more seeds simulate only the new ones, a kept run is what a new
simulation returns, changed code or arguments are not reused, unreadable files are set aside."""

from __future__ import annotations

import json
from pathlib import Path

from simulator.experiments import Setup
from simulator.run_store import RunStore, code_fingerprint
from simulator.runs import run_seeds

ROOT = Path(__file__).resolve().parents[1]
TRACE = str(ROOT / "examples" / "trace.csv")
RUNS = [{"cluster": "testbed-64", "workload": TRACE, "policy": "themis"},
        {"cluster": "testbed-64", "workload": TRACE, "policy": "fifo"}]


def _outcome(summary: dict) -> dict:
    """A summary without its timings (the only fields two identical simulations may differ in)."""
    return json.loads(json.dumps({k: v for k, v in summary.items() if k != "wall_seconds"}))


def test_more_seeds_simulate_only_the_new_ones_and_a_kept_run_is_a_fresh_one(tmp_path):
    folder = tmp_path / "runs"
    first = RunStore(folder)
    two = run_seeds(RUNS, [0, 1], 2, "two seeds", first)  # kept by the worker processes
    assert (first.reused, first.simulated) == (0, 4)
    assert len(list(folder.glob("*.json"))) == 4

    more = RunStore(folder)
    three = run_seeds(RUNS, [0, 1, 2], 1, "three seeds", more)
    assert (more.reused, more.simulated) == (4, 2)
    assert len(list(folder.glob("*.json"))) == 6
    for kept, earlier in zip(three, two):
        assert [s["seed"] for s in kept] == [0, 1, 2]
        assert [_outcome(s) for s in kept[:2]] == [_outcome(s) for s in earlier]
        assert kept[:2] == earlier  # kept and fresh summaries are alike, so they aggregate alike

    fresh = RunStore(tmp_path / "elsewhere", reuse=False)
    again = run_seeds(RUNS, [0, 1, 2], 1, "fresh", fresh)
    assert (fresh.reused, fresh.simulated) == (0, 6)
    assert [[_outcome(s) for s in per_run] for per_run in again] == [[_outcome(s) for s in r] for r in three]


def test_changed_code_or_arguments_get_other_keys():
    store = RunStore(Path("unused"), code="a")
    job = {**RUNS[0], "seed": 0}
    assert store.key(job) == RunStore(Path("unused"), code="a").key(dict(reversed(list(job.items()))))
    assert store.key(job) != RunStore(Path("unused"), code="b").key(job)
    assert store.key(job) != store.key({**job, "seed": 1})
    assert store.key(job) != store.key({**job, "workload_knobs": {"load": 0.9}})
    assert store.key({**job, "strategy": ("misestimate", 5.0, ("*",))}) != store.key(
        {**job, "strategy": ("misestimate", 10.0, ("*",))})
    assert len(code_fingerprint()) == 64 and code_fingerprint() == code_fingerprint()


def test_an_edited_trace_file_gets_another_key(tmp_path):
    trace = tmp_path / "mine.csv"
    trace.write_text(Path(TRACE).read_text())
    store = RunStore(tmp_path / "runs", code="a")
    job = {"cluster": "testbed-64", "workload": str(trace), "policy": "fifo", "seed": 0}
    before = store.key(job)
    trace.write_text(Path(TRACE).read_text().replace(",0,", ",60,", 1))
    assert store.key(job) != before
    # the same for a file named by a workload knob (Workload 1 or 2 on a trace of one's own)
    knob = {"cluster": "testbed-64", "workload": "workload2", "policy": "fifo", "seed": 0,
            "workload_knobs": {"trace": str(trace)}}
    before = store.key(knob)
    trace.write_text(Path(TRACE).read_text())
    assert store.key(knob) != before


def test_the_fingerprint_covers_the_users_profile_tables(tmp_path, monkeypatch):
    table = tmp_path / "mine.toml"
    table.write_text("# one table\n")
    monkeypatch.setenv("THEMIS_PROFILES", str(table))
    before = code_fingerprint()
    table.write_text("# another table\n")
    assert code_fingerprint() != before


def test_an_unreadable_kept_run_is_set_aside_and_simulated_again(tmp_path):
    store = RunStore(tmp_path / "runs")
    job = {**RUNS[1], "seed": 0}
    store.folder.mkdir(parents=True)
    store.path(job).write_text('{"job": {"cut off')
    [[summary]] = run_seeds(RUNS[1:], [0], 1, "corrupt", store)
    assert (store.reused, store.simulated) == (0, 1)
    assert summary["policy"] == "fifo" and summary["seed"] == 0
    assert store.path(job).with_suffix(".corrupt").read_text() == '{"job": {"cut off'
    assert RunStore(store.folder).get(job) is not None


def test_an_experiment_setup_keeps_its_runs_in_its_output_folder(tmp_path):
    first = Setup(tmp_path, quick=True, seed=0, seeds=2, workers=1, policies=None)
    runs = first.run(RUNS[1:], "setup")
    assert (first.store.reused, first.store.simulated) == (0, 2)
    assert first.store.folder == tmp_path / "runs"
    again = Setup(tmp_path, quick=True, seed=0, seeds=3, workers=1, policies=None)
    more = again.run(RUNS[1:], "setup")
    assert (again.store.reused, again.store.simulated) == (2, 1)
    assert more[0]["max_rho"]["values"][:2] == runs[0]["max_rho"]["values"]
    assert len(more[0]["max_rho"]["values"]) == 3


def _mark_kept_runs(folder: Path, field: str, value: float) -> int:
    """Overwrite ``field`` in every kept summary: a value no simulation gives, so a command that
    shows it has read the store instead of simulating."""
    for path in folder.glob("*.json"):
        kept = json.loads(path.read_text())
        kept["summary"][field] = value
        path.write_text(json.dumps(kept))
    return len(list(folder.glob("*.json")))


def test_compare_keeps_its_runs_and_more_seeds_simulate_only_the_new_ones(tmp_path):
    from simulator.cli import main

    base = ["compare", "--cluster", "testbed-64", "--workload", TRACE, "--policies", "themis,fifo",
            "--workers", "1", "--out", str(tmp_path)]
    assert main([*base, "--seeds", "1"]) == 0  # one seed in this process, with its progress bar
    assert _mark_kept_runs(tmp_path / "runs", "max_rho", 1234.5) == 2
    assert main([*base, "--seeds", "2"]) == 0
    rows = json.loads((tmp_path / "comparison.json").read_text())
    assert [r["max_rho"]["values"][0] for r in rows] == [1234.5, 1234.5]  # seed 0 read, not simulated
    assert all(r["max_rho"]["values"][1] < 1234.5 for r in rows)  # seed 1 simulated
    assert len(list((tmp_path / "runs").glob("*.json"))) == 4
    assert main([*base, "--seeds", "2", "--fresh"]) == 0
    rows = json.loads((tmp_path / "comparison.json").read_text())
    assert all(max(r["max_rho"]["values"]) < 1234.5 for r in rows)


def test_the_strategic_study_keeps_its_runs(tmp_path):
    from simulator.cli import main

    argv = ["strategic", "--strategy", "overreport-spread", "--levels", "0,50", "--seeds", "1", "--workers", "1",
            "--cluster", "testbed-64", "--workload", TRACE, "--liar", "speech", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert _mark_kept_runs(tmp_path / "runs", "gpu_time", 777.0) == 2
    assert main(argv) == 0
    result = json.loads((tmp_path / "strategic.json").read_text())
    assert [p["gpu_time"]["mean"] for p in result["points"]] == [777.0, 777.0]


def test_the_strategic_study_runs_with_the_restart_coalesce_and_expiry_window_it_is_given(tmp_path):
    """``strategic`` took --restart, --coalesce and --expiry-window and ran with the defaults
    (found in review)."""
    from simulator.cli import main

    argv = ["strategic", "--strategy", "overreport-spread", "--levels", "0,50", "--seeds", "1", "--workers", "1",
            "--cluster", "testbed-64", "--workload", TRACE, "--liar", "speech", "--out", str(tmp_path),
            "--restart", "5", "--coalesce", "2", "--expiry-window", "7"]
    assert main(argv) == 0
    kept = [json.loads(p.read_text())["summary"] for p in (tmp_path / "runs").glob("*.json")]
    assert len(kept) == 2
    assert {(s["restart_s"], s["coalesce_s"], s["expiry_window_s"]) for s in kept} == {(5.0, 2.0, 7.0)}


def test_progress_in_a_log_is_one_line_per_finished_run(tmp_path, capsys):
    """Under nohup or in CI stderr is a file, where a live bar shows nothing until the end."""
    store = RunStore(tmp_path / "runs")
    run_seeds(RUNS[1:], [0], 1, "first", store)
    capsys.readouterr()
    run_seeds(RUNS[1:], [0, 1, 2], 1, "logged", store)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("logged:")]
    assert lines[0] == "logged: 1 of 3 simulations kept, 2 to run"
    assert [ln.split(", ")[0] for ln in lines[1:]] == ["logged: 2 of 3 simulations done",
                                                       "logged: 3 of 3 simulations done"]


def test_the_fingerprint_skips_code_that_only_runs_or_draws_simulations(tmp_path):
    from simulator.run_store import NOT_OUTCOME, _tree_digest

    (tmp_path / "simulator").mkdir()
    for name in ("simulator/engine.py", "simulator/plots.py", "simulator/cli.py"):
        (tmp_path / name).write_text("# v1\n")
    assert {"simulator/plots.py", "simulator/cli.py"} <= NOT_OUTCOME
    before = _tree_digest(tmp_path)
    (tmp_path / "simulator" / "plots.py").write_text("# a new plot\n")
    (tmp_path / "simulator" / "cli.py").write_text("# a new flag\n")
    _tree_digest.cache_clear()
    assert _tree_digest(tmp_path) == before
    (tmp_path / "simulator" / "engine.py").write_text("# v2\n")
    _tree_digest.cache_clear()
    assert _tree_digest(tmp_path) != before
