"""User profile tables (issue 13 item 6): a TOML file adds models to the shipped slowdown table
for a simulation, in this process and in the worker processes it starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.placement import (
    PROFILES_ENV,
    SHIPPED_TABLE,
    ProfileError,
    load_profiles,
    model_slowdown,
    override_notes,
    use_profiles,
)
from agent.profiler import Profiler
from simulator.runs import simulate, simulate_quietly
from simulator.seeds import run_parallel
from simulator.workloads import load_workload
from simulator.workloads.trace_csv import TraceError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "profiles_example.toml"
NEW_MODEL = """[models.bert-huge]
category = "other"
slowdown = [1.0, 1.0, 2.5, 4.0]
source = "test table"
"""
TRACE = """app,job,arrival_s,gpus,iterations,iter_time_s,model
bert,j0,0,4,2000,0.5,bert-huge
bert,j1,0,4,2000,0.5,bert-huge
res,j0,30,2,1000,0.25,resnet50
"""


@pytest.fixture(autouse=True)
def shipped_table_only(monkeypatch):
    """Every test starts without user tables, and whatever it sets is undone after it (setenv first:
    monkeypatch restores only variables it has seen, and use_profiles writes os.environ itself)."""
    monkeypatch.setenv(PROFILES_ENV, "")
    monkeypatch.delenv(PROFILES_ENV)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_use_profiles_adds_models_to_every_default_load(tmp_path):
    table_path = write(tmp_path, "mine.toml", NEW_MODEL)
    shipped = load_profiles()
    assert "bert-huge" not in shipped
    returned = use_profiles(table_path)
    assert os.environ[PROFILES_ENV] == str(table_path.resolve())
    table = load_profiles()
    assert table == returned and set(table) == set(shipped) | {"bert-huge"}
    assert table["bert-huge"].slowdown == (1.0, 1.0, 2.5, 4.0) and table["bert-huge"].table == str(table_path)
    assert table["resnet50"] == shipped["resnet50"] and shipped["resnet50"].table == SHIPPED_TABLE
    assert model_slowdown("bert-huge") == (1.0, 1.0, 2.5, 4.0)
    assert Profiler.for_model("bert-huge", 0.5).prior == (1.0, 1.0, 2.5, 4.0)
    assert "bert-huge" not in load_profiles(user=False)
    use_profiles()
    assert PROFILES_ENV not in os.environ and "bert-huge" not in load_profiles()
    with pytest.raises(ProfileError, match="unknown model 'bert-huge'.*--profiles"):
        model_slowdown("bert-huge")


def test_the_shipped_example_table_adds_its_models():
    table = use_profiles(EXAMPLE)
    assert {"bert-large", "mobilenet-v2"} <= set(table) and override_notes(table) == []


def test_tables_apply_in_order_and_a_relative_path_survives_a_change_of_directory(tmp_path, monkeypatch):
    write(tmp_path, "a.toml", NEW_MODEL)
    write(tmp_path, "b.toml", NEW_MODEL.replace("bert-huge", "t5-small").replace("2.5, 4.0", "1.5, 2.0"))
    monkeypatch.chdir(tmp_path)
    use_profiles("a.toml", "b.toml")
    monkeypatch.chdir(ROOT)
    table = load_profiles()
    assert table["bert-huge"].table == str(tmp_path / "a.toml") and table["t5-small"].slowdown[3] == 2.0


def test_a_fresh_interpreter_and_worker_processes_see_the_added_models(tmp_path):
    use_profiles(write(tmp_path, "mine.toml", NEW_MODEL))
    probe = "from agent.placement import load_profiles; print(load_profiles()['bert-huge'].slowdown)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    assert out.stdout.strip() == "(1.0, 1.0, 2.5, 4.0)"
    trace = write(tmp_path, "trace.csv", TRACE)
    run = {"cluster": "testbed-64", "workload": str(trace), "policy": "themis"}
    summaries = run_parallel(simulate_quietly, [{**run, "seed": 0}, {**run, "seed": 1}], workers=2)
    for summary in summaries:
        assert {a["app"]: a["model"] for a in summary["apps"]} == {"bert": "bert-huge", "res": "resnet50"}
        assert all(a["finish_s"] is not None for a in summary["apps"])


def test_a_trace_naming_a_new_model_runs_with_the_table_and_is_refused_without_it(tmp_path):
    trace = write(tmp_path, "trace.csv", TRACE)
    with pytest.raises(TraceError) as err:
        load_workload(str(trace))
    message = str(err.value)
    assert message.startswith(f"{trace}:2: unknown model 'bert-huge'")
    assert "resnet50" in message and "--profiles" in message and PROFILES_ENV in message
    use_profiles(write(tmp_path, "mine.toml", NEW_MODEL))
    summary = simulate(cluster="testbed-64", workload=str(trace), policy="themis", show_progress=False)
    apps = {a["app"]: a for a in summary["apps"]}
    assert apps["bert"]["model"] == "bert-huge" and all(a["finish_s"] is not None for a in apps.values())


def test_the_slowdown_of_an_added_model_is_what_the_simulation_uses(tmp_path):
    # Two 8-GPU jobs on 4-GPU machines must spread; a steeper table makes the same app slower.
    trace = write(tmp_path, "trace.csv",
                  "app,job,arrival_s,gpus,iterations,iter_time_s,model\n"
                  "w,j0,0,16,4000,2.0,net\nw,j1,0,16,4000,2.0,net\n")
    flat = NEW_MODEL.replace("bert-huge", "net").replace("2.5, 4.0", "1.0, 1.0")
    steep = NEW_MODEL.replace("bert-huge", "net").replace("2.5, 4.0", "3.0, 4.0")
    finish = {}
    for name, text in (("flat", flat), ("steep", steep)):
        use_profiles(write(tmp_path, f"{name}.toml", text))
        summary = simulate(cluster="testbed-64", workload=str(trace), policy="themis", show_progress=False)
        finish[name] = summary["apps"][0]["jct_s"]
    assert finish["steep"] > 1.5 * finish["flat"]


def test_replacing_a_shipped_model_needs_override_and_is_noted(tmp_path):
    lm = NEW_MODEL.replace("bert-huge", "lm")
    with pytest.raises(ProfileError) as err:
        use_profiles(write(tmp_path, "clash.toml", lm))
    assert f"clash.toml: models.lm is already in {SHIPPED_TABLE}; set override = true" in str(err.value)
    assert PROFILES_ENV not in os.environ
    table = use_profiles(write(tmp_path, "over.toml", lm + "override = true\n"))
    assert table["lm"].slowdown == (1.0, 1.0, 2.5, 4.0) and load_profiles()["lm"] == table["lm"]
    assert override_notes(table) == [f"model 'lm': slowdowns from {tmp_path / 'over.toml'} "
                                     f"replace those of {SHIPPED_TABLE}"]
    with pytest.raises(ProfileError, match=r"models.bert-huge says override = true but no earlier table has"):
        use_profiles(write(tmp_path, "typo.toml", NEW_MODEL + "override = true\n"))


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (None, "cannot read profile table"),
        ("[models.x\n", "invalid TOML"),
        ("[other]\na = 1\n", "needs a non-empty [models] table"),
        (NEW_MODEL + "[extra]\nb = 2\n", "unknown top-level key(s) extra"),
        (NEW_MODEL.replace('source = "test table"\n', ""), "models.bert-huge.source must say"),
        (NEW_MODEL.replace('category = "other"\n', ""), "models.bert-huge.category must be one of"),
        (NEW_MODEL.replace("[1.0, 1.0, 2.5, 4.0]", "[1.0, 2.5, 4.0]"), "models.bert-huge.slowdown must be a list of 4"),
        (NEW_MODEL.replace("[1.0, 1.0, 2.5, 4.0]", "[1.0, 1.0, 0.5, 4.0]"), "models.bert-huge.slowdown[2] must be"),
        (NEW_MODEL.replace("[1.0, 1.0, 2.5, 4.0]", "[1.0, 1.0, 2.5, inf]"), "models.bert-huge.slowdown[3] must be"),
        (NEW_MODEL.replace("[1.0, 1.0, 2.5, 4.0]", "[1.0, 3.0, 2.5, 4.0]"),
         "models.bert-huge.slowdown must not decrease"),
        (NEW_MODEL + "speed = 2\n", "models.bert-huge has unknown key(s) speed"),
        (NEW_MODEL + 'override = "yes"\n', "models.bert-huge.override must be true or false"),
    ],
)
def test_bad_user_tables_name_file_and_key_and_change_nothing(tmp_path, text, reason):
    path = tmp_path / "bad.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ProfileError) as err:
        use_profiles(path)
    assert str(err.value).startswith(f"{path}: ") and reason in str(err.value)
    assert PROFILES_ENV not in os.environ


def test_a_bad_table_in_the_environment_is_named_when_loaded(tmp_path, monkeypatch):
    missing = tmp_path / "gone.toml"
    monkeypatch.setenv(PROFILES_ENV, str(missing))
    with pytest.raises(ProfileError, match=f"{missing}: cannot read profile table.*listed in {PROFILES_ENV}"):
        load_profiles()
