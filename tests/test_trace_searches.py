"""User traces that describe searches (issue 13 item 6): the optional kind and phases columns."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator.runs import simulate
from simulator.workload import AppSpec, JobSpec
from simulator.workloads import load_workload
from simulator.workloads.trace_csv import TraceError, load_trace_csv

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "trace_searches.csv"
BASE = "app,job,arrival_s,gpus,iterations,iter_time_s,model"
FULL = f"{BASE},kind,phases"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "searches.csv"
    path.write_text(text)
    return path


def test_extended_rows_become_apps_of_their_kind(tmp_path):
    path = write(tmp_path, f"""{FULL}
sh,c0,5,1,3,0.5,lm,successive_halving,3;9;27
fx,a,0,2,100,0.25,resnet50,fixed,
sh,c1,5,2,3,0.6,lm,successive_halving, 3 ; 9 ; 27
cs,t,0,4,500,0.1,gnmt,curve_stopping,
sh,c2,5,1,3,0.5,lm,successive_halving,3;9;27
sh,c3,5,1,3,0.5,lm,successive_halving,3;9;27
plain,p,7,1,10,1,vgg16,,
""")
    w = load_trace_csv(path, seed=1)
    assert [(a.app_id, a.kind) for a in w.apps] == [
        ("fx", "fixed"), ("cs", "curve_stopping"), ("sh", "successive_halving"), ("plain", "fixed")]
    sh = w.apps[2]
    assert sh == AppSpec("sh", 5.0, "lm", "successive_halving",
                         (JobSpec("sh/c0", 3.0, 0.5, 1), JobSpec("sh/c1", 3.0, 0.6, 2),
                          JobSpec("sh/c2", 3.0, 0.5, 1), JobSpec("sh/c3", 3.0, 0.5, 1)),
                         phase_iterations=(3.0, 9.0, 27.0), seed=sh.seed)
    assert w.apps[1].jobs == (JobSpec("cs/t", 500.0, 0.1, 4),) and w.apps[1].phase_iterations == ()
    assert load_trace_csv(path, seed=1) == w


def test_kind_column_alone_describes_fixed_and_curve_stopping_apps(tmp_path):
    path = write(tmp_path, f"{BASE},kind\na,j,0,1,10,0.5,lm,curve_stopping\nb,k,3,1,10,0.5,lm,fixed\n")
    assert [a.kind for a in load_workload(str(path)).apps] == ["curve_stopping", "fixed"]


def test_shipped_search_trace_has_every_kind():
    w = load_workload(str(EXAMPLE))
    kinds = {a.kind for a in w.apps}
    assert kinds == {"fixed", "successive_halving", "curve_stopping"}
    for app in w.apps:
        if app.kind == "successive_halving":
            assert len(app.jobs) >= 2 ** (len(app.phase_iterations) - 1) and len(app.phase_iterations) >= 2
            assert all(j.iterations == app.phase_iterations[0] for j in app.jobs)


def test_shipped_search_trace_runs_and_each_kind_stops_its_own_way(tmp_path):
    summary = simulate(cluster="testbed-64", workload=str(EXAMPLE), policy="themis", show_progress=False)
    specs = {a.app_id: a for a in load_workload(str(EXAMPLE)).apps}
    apps = {a["app"]: a for a in summary["apps"]}
    assert summary["apps_count"] == len(apps) == len(specs) == 6
    assert all(a["finish_s"] is not None and a["finish_s"] > specs[name].arrival_s for name, a in apps.items())
    assert {name: a["kind"] for name, a in apps.items()} == {name: s.kind for name, s in specs.items()}
    # The same trace with every app fixed: curve stopping ends jobs before their cap, halving runs
    # the survivors' later phases beyond phase 1.
    as_fixed = tmp_path / "as_fixed.csv"
    as_fixed.write_text("".join(
        line.rsplit(",", 2)[0] + ",fixed,\n" if line.count(",") == 8 and not line.startswith("app,") else line + "\n"
        for line in EXAMPLE.read_text().splitlines()))
    fixed = simulate(cluster="testbed-64", workload=str(as_fixed), policy="themis", show_progress=False)
    assert {a["kind"] for a in fixed["apps"]} == {"fixed"}
    twin = {a["app"]: a["gpu_time_s"] for a in fixed["apps"]}

    def used(kind: str, run: dict[str, float]) -> float:
        return sum(run[name] for name, spec in specs.items() if spec.kind == kind)

    actual = {name: a["gpu_time_s"] for name, a in apps.items()}
    assert used("curve_stopping", actual) < 0.9 * used("curve_stopping", twin)
    assert used("successive_halving", actual) > 2 * used("successive_halving", twin)


@pytest.mark.parametrize(
    ("body", "line", "reason"),
    [
        (f"{FULL}\na,j,0,1,10,0.5,lm,hyperband,\n", 2, "kind must be one of fixed, successive_halving, curve_stopping"),
        (f"{FULL}\na,j,0,1,10,0.5,lm,fixed,10;20\n", 2,
         "phases are for successive_halving apps only; this row is fixed"),
        (f"{FULL}\na,j,0,1,10,0.5,lm,,10\n", 2, "this row is fixed"),
        (f"{FULL}\na,j,0,1,10,0.5,lm,curve_stopping,10\n", 2, "this row is curve_stopping"),
        (f"{FULL}\na,j,0,1,10,0.5,lm,successive_halving,\n", 2, "needs phases"),
        (f"{BASE},kind\na,j,0,1,10,0.5,lm,successive_halving\n", 2, "needs phases"),
        (f"{FULL}\na,j,0,1,10,0.5,lm,successive_halving,10;x\n", 2, "phases[1] must be a number, got 'x'"),
        (f"{FULL}\na,j,0,1,10,0.5,lm,successive_halving,10;;20\n", 2, "phases[1] must be a number, got ''"),
        (f"{FULL}\na,j,0,1,10,0.5,lm,successive_halving,10;-2\n", 2, "phases[1] must be > 0"),
        (f"{FULL}\na,j,0,1,10,0.5,lm,successive_halving,10;inf\n", 2, "phases[1] must be finite"),
        (f"{FULL}\na,j,0,1,12,0.5,lm,successive_halving,10;20\n", 2, "must equal phases[0] = 10, got 12"),
        (f"{FULL}\na,j,0,1,10,0.5,lm,fixed,\na,k,0,1,10,0.5,lm,curve_stopping,\n", 3,
         "app 'a' is fixed on line 2 but curve_stopping here; an app has one kind"),
        (f"{FULL}\na,j,0,1,10,0.5,lm,successive_halving,10;20\na,k,0,1,10,0.5,lm,successive_halving,10;30\n", 3,
         "app 'a' has phases 10;20 on line 2 but 10;30 here"),
        (f"{FULL}\nb,x,0,1,5,1,lm,fixed,\na,j,0,1,10,0.5,lm,successive_halving,10;20;40\n"
         "a,k,0,1,10,0.5,lm,successive_halving,10;20;40\na,l,0,1,10,0.5,lm,successive_halving,10;20;40\n", 3,
         "successive_halving app 'a' has 3 jobs, too few to halve 2 times for its 3 phases (needs >= 4 jobs"),
        (f"{FULL}\na,j,0,1,10,0.5,lm,fixed\n", 2, "expected 9 columns"),
        (f"{BASE},phases\na,j,0,1,10,0.5,lm,10\n", 1, "header must be exactly"),
        (f"{BASE},kind,phases,extra\n", 1, "header must be exactly"),
    ],
)
def test_bad_search_rows_name_file_line_and_reason(tmp_path, body, line, reason):
    path = write(tmp_path, body)
    with pytest.raises(TraceError) as err:
        load_workload(str(path))
    assert str(err.value).startswith(f"{path}:{line}: ")
    assert reason in str(err.value)
