"""Restart costs per model (D32): the benchmark that measures them through the launcher, the sourced
table that ships them, and the simulator option that charges them (the default stays 35 s)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from agent.placement import load_profiles
from agent.restart_costs import RestartCostError, load_restart_costs, read_table, restart_delays
from arbiter.cluster import cluster_from_mapping
from arbiter.policies import make_policy
from simulator.engine import DEFAULT_RESTART_S, Simulation
from simulator.runs import simulate
from simulator.workload import AppSpec, JobSpec, Workload

ROOT = Path(__file__).resolve().parents[1]
C = 1.0  # an arrival on an idle cluster is served one coalescing window later (D10)


# -- the benchmark --------------------------------------------------------------------------------------


def test_the_quick_benchmark_measures_real_stops_and_restarts(tmp_path):
    out = tmp_path / "restart_cost.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "restart_cost.py"), "--quick", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["machine"]["cpu_count"] >= 1 and len(result["load_average_1min"]) == 2
    assert result["settings"]["quick"] and result["settings"]["reps"] == 1
    cells = result["sizes"]
    assert list(cells) == result["settings"]["sizes"] == ["cnn-8", "mlp-2x256"]
    for name, cell in cells.items():
        assert cell["device"] in ("cpu", "cuda"), name
        assert len(cell["stop_s"]) == 2 and len(cell["restart_s"]) == 1  # stop, restart, last stop
        for seconds in (*cell["stop_s"], *cell["restart_s"], cell["cold_start_s"]):
            assert 0 < seconds < 600 and math.isfinite(seconds), (name, cell)
        assert cell["stop_plus_restart_s"] == pytest.approx(cell["stop_median_s"] + cell["restart_median_s"], abs=2e-3)
        # the checkpoint the stopped run wrote: fp32 weights and AdamW's two moments, 12 bytes a parameter,
        # plus the pickle's framing and the RNG state
        assert 12 * cell["parameters"] / 1e6 <= cell["checkpoint_mb"] + 0.05 <= 12 * cell["parameters"] / 1e6 + 0.2
    assert cells["mlp-2x256"]["parameters"] > 10 * cells["cnn-8"]["parameters"]
    assert "Restart cost through the launcher" in done.stdout and "mlp-2x256" in done.stdout


# -- the table ----------------------------------------------------------------------------------------


def test_every_profiled_model_has_a_sourced_restart_cost():
    measurements, models = read_table()
    assert set(models) == set(load_profiles(user=False))  # the slowdown table's models, no more, no fewer
    for name, m in measurements.items():
        assert m.source.startswith(("[H]", "[L]")), name
        assert m.stop_s[0] <= m.stop_s[1] and m.restart_s[0] <= m.restart_s[1]
    for name, cost in models.items():
        assert cost.source.startswith(("[H]", "[N]", "[P]")), name
        assert cost.measurement.source.startswith("[H]"), name  # GPU measurements only for GPU clusters
    # the measurements reported from the H200, as reported, and the midpoint rule
    h200 = {n: (m.checkpoint_mb, m.stop_s, m.restart_s) for n, m in measurements.items() if n.startswith("h200-")}
    assert h200 == {"h200-resnet50": (307, (1.0, 1.3), (7.5, 8.1)),
                    "h200-mlp-4x4096": (806, (2.1, 2.7), (7.6, 12.2)),
                    "h200-transformer-350m": (4900, (4.7, 9.1), (8.5, 10.9))}
    assert models["resnet50"].cost_s == pytest.approx(1.15 + 7.8)
    assert models["vgg16"].cost_s == pytest.approx(2.4 + 9.9)
    assert all(0 < c < DEFAULT_RESTART_S for c in restart_delays("profiles").values())


def test_the_cpu_rows_are_the_benchmarks_committed_results():
    """The [L] rows are benchmarks/results/restart_cost.json's numbers, not typed in."""
    measurements, _ = read_table()
    result = json.loads((ROOT / "benchmarks" / "results" / "restart_cost.json").read_text())
    cpu = {n: m for n, m in measurements.items() if m.source.startswith("[L]")}
    assert cpu and {n.removeprefix("cpu-") for n in cpu} == set(result["sizes"])
    for name, m in cpu.items():
        cell = result["sizes"][name.removeprefix("cpu-")]
        assert m.checkpoint_mb == cell["checkpoint_mb"]
        assert m.stop_s == (min(cell["stop_s"]), max(cell["stop_s"]))
        assert m.restart_s == (min(cell["restart_s"]), max(cell["restart_s"]))


@pytest.mark.parametrize("text, says", [
    ("[models.a]\nmeasurement = 'x'\nsource = 's'\n", "needs a non-empty [measurements] table"),
    ("[measurements.x]\nwhat = 'w'\ndevice = 'd'\ncheckpoint_mb = 1\nstop_s = [2, 1]\nrestart_s = [1, 2]\n"
     "source = 's'\n[models.a]\nmeasurement = 'x'\nsource = 's'\n", "measurements.x.stop_s must be"),
    ("[measurements.x]\nwhat = 'w'\ndevice = 'd'\ncheckpoint_mb = 1\nstop_s = [1, 2]\nrestart_s = [1, 2]\n"
     "source = 's'\n[models.a]\nmeasurement = 'y'\nsource = 's'\n", "models.a.measurement 'y' is not a measurement"),
    ("[measurements.x]\nwhat = 'w'\ndevice = 'd'\ncheckpoint_mb = 1\nstop_s = [1, 2]\nrestart_s = [1, 2]\n"
     "[models.a]\nmeasurement = 'x'\nsource = 's'\n", "measurements.x: missing source"),
])
def test_a_bad_table_is_refused_naming_the_file_and_the_key(tmp_path, text, says):
    path = tmp_path / "costs.toml"
    path.write_text(text)
    with pytest.raises(RestartCostError, match=f"^{path}: .*") as refused:
        load_restart_costs(path)
    assert says in str(refused.value)


# -- the simulator ------------------------------------------------------------------------------------


def machine(gpus: int, slots: int):
    return cluster_from_mapping({"name": "one-machine", "racks": [{"machines": [{"gpus": gpus, "slots": slots}]}]})


def grow(model: str) -> Workload:
    """Two 2-GPU jobs share a 2-GPU machine; when the short one ends the long one takes both GPUs
    and restarts once (as tests/test_simulator.py's D11 test)."""
    jobs = (JobSpec("short", 100.0, 2.0, 2), JobSpec("long", 400.0, 2.0, 2))
    return Workload("grow", (AppSpec("a", 0.0, model, "fixed", jobs),))


@pytest.mark.parametrize("model", ["resnet50", "vgg16"])
def test_per_model_restart_costs_charge_the_tables_value_and_the_default_stays_35_s(model):
    costs = restart_delays("profiles")
    short_done = C + 100.0 * 2.0
    default = Simulation(machine(2, 2), grow(model), make_policy("themis"))
    measured = Simulation(machine(2, 2), grow(model), make_policy("themis"), restart_costs=costs)
    (plain,), (per_model,) = default.run().apps, measured.run().apps
    assert plain.restarts == per_model.restarts == 1
    assert plain.finished_at == pytest.approx(short_done + DEFAULT_RESTART_S + 300.0)
    assert per_model.finished_at == pytest.approx(short_done + costs[model] + 300.0)
    assert plain.finished_at - per_model.finished_at == pytest.approx(DEFAULT_RESTART_S - costs[model])
    # the bids carry the same cost (D17)
    assert plain.agent.restart_s == DEFAULT_RESTART_S and per_model.agent.restart_s == costs[model]


def test_a_table_of_35_s_for_every_model_gives_the_default_run_field_for_field(tmp_path):
    """The option is additive: at D11's constant for every model, ``simulate`` (what ``themis-sim run``
    and ``compare`` call) gives the default run's summary; the shipped table's run names its table."""
    flat = tmp_path / "flat.toml"
    flat.write_text("[measurements.d11]\nwhat = 'D11'\ndevice = 'any'\ncheckpoint_mb = 1\nstop_s = [0, 0]\n"
                    "restart_s = [35, 35]\nsource = 'D11'\n"
                    + "".join(f"[models.{m}]\nmeasurement = 'd11'\nsource = 'D11'\n" for m in load_profiles(user=False)))
    kw = dict(cluster="testbed-64", workload="small", policy="themis", show_progress=False)
    volatile = ("wall_seconds", "restart_costs")
    default = simulate(**kw)
    same = simulate(**kw, restart_costs=str(flat))
    assert "restart_costs" not in default and same["restart_costs"] == str(flat)
    assert {k: v for k, v in same.items() if k not in volatile} == {k: v for k, v in default.items() if k not in volatile}
    measured = simulate(**kw, restart_costs="profiles")
    assert measured["restart_costs"] == "profiles" and measured["restart_s"] == DEFAULT_RESTART_S
    assert measured["avg_jct"] < default["avg_jct"]  # restarts of 9-12 s instead of 35 s


def test_the_command_line_takes_a_table_and_refuses_a_bad_one(tmp_path, capsys):
    from simulator.cli import main

    args = ["run", "--cluster", "testbed-64", "--workload", "small", "--out"]
    assert main([*args, str(tmp_path / "measured"), "--restart-costs", "profiles"]) == 0
    assert json.loads((tmp_path / "measured" / "summary.json").read_text())["restart_costs"] == "profiles"
    bad = tmp_path / "bad.toml"
    bad.write_text("[models.vgg16]\nmeasurement = 'x'\nsource = 's'\n")
    with pytest.raises(SystemExit, match=f"themis-sim: {bad}: needs a non-empty \\[measurements\\] table"):
        main([*args, str(tmp_path / "bad"), "--restart-costs", str(bad)])


def test_a_workload_model_without_a_restart_cost_is_refused():
    with pytest.raises(ValueError, match=r"names models with no restart cost: \['vgg16'\]"):
        Simulation(machine(2, 2), grow("vgg16"), make_policy("themis"), restart_costs={"resnet50": 9.0})
    with pytest.raises(ValueError, match="restart costs must be finite seconds >= 0"):
        Simulation(machine(2, 2), grow("vgg16"), make_policy("themis"), restart_costs={"vgg16": -1.0})
