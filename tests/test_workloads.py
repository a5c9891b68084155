"""Workloads (paper 6.1): the registry, user CSV traces, Workload 1/2 from Philly, the generator."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from pathlib import Path

import pytest

from agent.placement import load_profiles
from simulator.workload import AppSpec, JobSpec
from simulator.workloads import WorkloadError, known_workloads, load_workload
from simulator.workloads.hyperband import halving_phases
from simulator.workloads.philly import (
    ITER_TIME_S,
    densest_window_start,
    group_into_apps,
    read_philly,
    split_group,
)
from simulator.workloads.synthetic import network_intensive
from simulator.workloads.trace_csv import HEADER, TraceError, load_trace_csv

ROOT = Path(__file__).resolve().parents[1]
USER_HEADER = ",".join(HEADER)
PHILLY_HEADER = "timestamp,duration,num_gpus,gpu_time,cluster"


def write(tmp_path: Path, text: str, name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- registry -------------------------------------------------------------------------------------


def test_registry_knows_the_names_and_aliases():
    assert {"workload1", "philly", "workload2", "hyperband", "synthetic", "small"} <= set(known_workloads())


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(WorkloadError) as err:
        load_workload("workload3")
    assert "workload3" in str(err.value)
    for name in ("workload1", "workload2", "synthetic", "small", "hyperband", "philly"):
        assert name in str(err.value)


def test_unknown_knob_is_named():
    with pytest.raises(WorkloadError, match="no knob 'aps'.*apps"):
        load_workload("synthetic", aps=3)


def test_missing_csv_path_is_reported(tmp_path):
    with pytest.raises(WorkloadError, match="no such trace file"):
        load_workload(str(tmp_path / "nope.csv"))


# --- user CSV traces ------------------------------------------------------------------------------

GOOD = f"""# comment lines and blank lines are skipped
{USER_HEADER}
b,x,50,2,100,0.5,lm

a,j1,10,4,1000,0.25,resnet50
a,j2,10,1,2000,0.5,resnet50
"""


def test_good_csv_loads_into_fixed_apps_sorted_by_arrival(tmp_path):
    path = write(tmp_path, GOOD)
    w = load_workload(str(path), seed=3)
    assert [a.app_id for a in w.apps] == ["a", "b"]
    a, b = w.apps
    assert a == AppSpec("a", 10.0, "resnet50", "fixed",
                        (JobSpec("a/j1", 1000.0, 0.25, 4), JobSpec("a/j2", 2000.0, 0.5, 1)), seed=a.seed)
    assert b.jobs == (JobSpec("b/x", 100.0, 0.5, 2),) and b.model == "lm" and b.kind == "fixed"
    assert a.demand_max == 5
    assert load_workload(str(path), seed=3) == w  # same seed, same loss seeds


def test_shipped_example_trace_loads():
    w = load_workload(str(ROOT / "examples" / "trace.csv"))
    assert 3 <= len(w.apps) <= 10
    assert all(a.kind == "fixed" for a in w.apps)
    assert [a.arrival_s for a in w.apps] == sorted(a.arrival_s for a in w.apps)


@pytest.mark.parametrize(
    ("body", "line", "reason"),
    [
        ("app,job,arrival,gpus,iterations,iter_time_s,model\n", 1, "header must be exactly"),
        (f"{USER_HEADER}\na,j,0,1,10,0.5\n", 2, "expected 7 columns"),
        (f"{USER_HEADER}\na,j,0,1,10,0.5,lm,extra\n", 2, "expected 7 columns"),
        (f"{USER_HEADER}\na,j,soon,1,10,0.5,lm\n", 2, "arrival_s must be a number"),
        (f"{USER_HEADER}\na,j,0,two,10,0.5,lm\n", 2, "gpus must be a whole number"),
        (f"{USER_HEADER}\na,j,0,1.5,10,0.5,lm\n", 2, "gpus must be a whole number"),
        (f"{USER_HEADER}\na,j,-1,1,10,0.5,lm\n", 2, "arrival_s must be >= 0"),
        (f"{USER_HEADER}\na,j,0,0,10,0.5,lm\n", 2, "gpus must be >= 1"),
        (f"{USER_HEADER}\na,j,0,1,0,0.5,lm\n", 2, "iterations must be > 0"),
        (f"{USER_HEADER}\na,j,0,1,-5,0.5,lm\n", 2, "iterations must be > 0"),
        (f"{USER_HEADER}\na,j,0,1,10,0,lm\n", 2, "iter_time_s must be > 0"),
        (f"{USER_HEADER}\na,j,0,1,nan,0.5,lm\n", 2, "iterations must be finite"),
        (f"{USER_HEADER}\na,j,0,1,10,0.5,gpt5\n", 2, "unknown model 'gpt5'"),
        (f"{USER_HEADER}\na,j,0,1,10,0.5,lm\nb,k,0,1,10,0.5,lm\na,j,0,1,10,0.5,lm\n", 4,
         "duplicate job 'j' of app 'a' (first on line 2)"),
        (f"{USER_HEADER}\na,j,0,1,10,0.5,lm\na,k,5,1,10,0.5,lm\n", 3, "arrives at 0 s on line 2 but at 5 s"),
        (f"{USER_HEADER}\na,j,0,1,10,0.5,lm\na,k,0,1,10,0.5,gnmt\n", 3, "an app has one model"),
        ("", 1, "empty trace"),
        (f"{USER_HEADER}\n", 1, "no jobs"),
    ],
)
def test_csv_errors_name_file_line_and_reason(tmp_path, body, line, reason):
    path = write(tmp_path, body)
    with pytest.raises(TraceError) as err:
        load_trace_csv(path)
    message = str(err.value)
    assert message.startswith(f"{path}:{line}: ")
    assert reason in message
    assert isinstance(err.value, ValueError) and err.value.line == line


def test_csv_errors_also_come_through_load_workload(tmp_path):
    path = write(tmp_path, f"{USER_HEADER}\na,j,0,1,10,0.5,lm\na,j,0,1,10,0.5,lm\n")
    with pytest.raises(TraceError, match=rf"{path}:3: duplicate"):
        load_workload(str(path))


# --- Workload 1: reading and grouping the Philly trace ---------------------------------------------

TINY_PHILLY = f"""{PHILLY_HEADER}
2017-10-09 10:00:00,100.0,1,100.0,c1
2017-10-09 10:04:00,200.0,1,200.0,c1
2017-10-09 10:02:00,50.0,2,100.0,c1
2017-10-09 10:13:00,300.0,1,300.0,c1
2017-10-09 10:30:00,400.0,1,400.0,c1
2017-10-09 10:01:00,60.0,1,60.0,c2
2017-10-09 10:03:00,70.0,2,140.0,c1
2017-10-09 09:00:00,10.0,1,10.0,c2
2017-10-24 09:00:00,10.0,1,10.0,c2
2017-10-24 09:05:00,10.0,1,10.0,c2
"""


def test_grouping_same_cluster_same_gpus_within_the_gap(tmp_path):
    jobs = read_philly(write(tmp_path, TINY_PHILLY))
    groups = group_into_apps(jobs, gap_s=600)
    lines = [[j.line for j in g] for g in groups]
    # submission order; c1/1-GPU chains 10:00 -> 10:04 -> 10:13 (each within 10 min of the previous),
    # 10:30 is 17 min after 10:13 so it starts anew; 2-GPU jobs and cluster c2 are separate apps
    assert lines == [[9], [2, 3, 5], [7], [4, 8], [6], [10, 11]]
    assert [[j.line for j in g] for g in group_into_apps(jobs, gap_s=60)][:3] == [[9], [2], [7]]


def test_split_group_makes_near_equal_consecutive_parts(tmp_path):
    jobs = read_philly(write(tmp_path, TINY_PHILLY))
    parts = split_group(tuple(jobs[:7]), 3)
    assert [len(p) for p in parts] == [3, 2, 2] and sum(parts, ()) == tuple(jobs[:7])
    assert split_group(tuple(jobs[:3]), None) == [tuple(jobs[:3])]


def test_workload1_from_a_philly_file_path(tmp_path):
    path = write(tmp_path, TINY_PHILLY)
    w = load_workload(str(path), window_start="2017-10-09", window_days=14, max_apps=None)
    # multi-job apps only: the c1/1-GPU chain (3 jobs) and c1/2-GPU pair; the 24th is out of the window
    assert [len(a.jobs) for a in w.apps] == [3, 2]
    assert w.apps[0].arrival_s == 10 * 3600  # 10:00, relative to the window start, unscaled
    pair = w.apps[1]
    assert pair.arrival_s == 10 * 3600 + 120  # its first job, 10:02
    assert [j.gpus for j in pair.jobs] == [2, 2]
    # work is preserved: iterations x iteration time = duration x GPUs
    assert [j.iterations * j.iter_time_s for j in pair.jobs] == pytest.approx([100.0, 140.0])
    with_single = load_workload(str(path), include_single=True, max_apps=None)
    assert [len(a.jobs) for a in with_single.apps] == [1, 3, 1, 2, 1]


def test_densest_window_of_the_real_trace_is_the_default():
    jobs = read_philly(ROOT / "data" / "philly" / "philly-jobs.csv")
    assert len(jobs) == 82_247
    assert densest_window_start(jobs, 14).date().isoformat() == "2017-10-09"


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ("2017-10-09 10:00:00,100.0,1,100.0", "expected 5 columns"),
        ("yesterday,100.0,1,100.0,c1", "timestamp must be"),
        ("2017-10-09 10:00:00,-3,1,-3,c1", "duration must be > 0"),
        ("2017-10-09 10:00:00,100.0,0,0,c1", "num_gpus must be >= 1"),
        ("2017-10-09 10:00:00,100.0,2,100.0,c1", "gpu_time 100.0 is not duration x num_gpus"),
        ("2017-10-09 10:00:00,100.0,1,100.0,", "cluster must not be empty"),
    ],
)
def test_corrupt_philly_line_fails_with_file_and_line(tmp_path, row, reason):
    lines = TINY_PHILLY.splitlines()
    lines.insert(4, row)
    path = write(tmp_path, "\n".join(lines) + "\n", name="philly.csv")
    with pytest.raises(TraceError) as err:
        load_workload(str(path))
    assert str(err.value).startswith(f"{path}:5: ") and reason in str(err.value)


def test_workload1_defaults_shape_and_model_mix():
    w = load_workload("workload1")
    assert w.name == "workload1" and len(w.apps) == 300
    assert all(a.kind == "fixed" and len(a.jobs) >= 2 for a in w.apps)
    assert max(len(a.jobs) for a in w.apps) <= 100
    assert [a.arrival_s for a in w.apps] == sorted(a.arrival_s for a in w.apps)
    assert all(j.iter_time_s > 0 and j.iterations > 0 for a in w.apps for j in a.jobs)
    everything = load_workload("philly", max_apps=None)
    categories = load_profiles()
    share = Counter(categories[a.model].category for a in everything.apps)
    total = len(everything.apps)
    assert total > 1000
    for category, expected in {"cv": 0.10, "nlp": 0.60, "speech": 0.30}.items():
        assert abs(share[category] / total - expected) < 0.04, (category, share)
    # iteration times stay within +-20% of each model's range
    for a in everything.apps[:200]:
        lo, hi = ITER_TIME_S[a.model]
        assert all(0.8 * lo <= j.iter_time_s <= 1.2 * hi for j in a.jobs)


def test_workload1_is_deterministic_and_seeded():
    assert load_workload("workload1", seed=5) == load_workload("workload1", seed=5)
    assert load_workload("workload1", seed=5) != load_workload("workload1", seed=6)


# --- Workload 2: successive halving over Workload 1's arrivals --------------------------------------


def test_halving_phases_split_the_budget_evenly():
    # paper 4.3.3: 4 jobs, B = 10,000, median 100 s -> about 8, 16, 36 iterations per phase
    phases = halving_phases(4, 10_000, 100.0)
    assert phases == pytest.approx([25 / 3, 50 / 3, 100 / 3])
    assert [4 * phases[0] * 100, 2 * phases[1] * 100, phases[2] * 100] == pytest.approx([10_000 / 3] * 3)


def test_workload2_follows_the_halving_pattern():
    w1 = load_workload("workload1")
    w2 = load_workload("hyperband")
    assert [a.arrival_s for a in w2.apps] == [a.arrival_s for a in w1.apps]
    assert [a.model for a in w2.apps] == [a.model for a in w1.apps]
    for a1, a2 in zip(w1.apps, w2.apps):
        n = len(a2.jobs)
        k = min(6, int(math.log2(len(a1.jobs))))  # the largest power of two up to the app's jobs, <= 64
        assert a2.kind == "successive_halving" and n == 2**k
        assert len(a2.phase_iterations) == k + 1
        median = statistics.median(j.iter_time_s for j in a2.jobs)
        per_phase = [(n // 2**i) * iters * median for i, iters in enumerate(a2.phase_iterations)]
        assert per_phase == pytest.approx([per_phase[0]] * (k + 1))
        budget = sum(j.iterations * j.iter_time_s for j in a1.jobs)
        assert sum(per_phase) == pytest.approx(budget)
        assert len({j.gpus for j in a2.jobs}) == 1 and a2.jobs[0].gpus in (1, 2, 4, 8)
    assert statistics.fmean(a.jobs[0].gpus for a in w2.apps) > 2 * statistics.fmean(
        j.gpus for a in w1.apps for j in a.jobs)


# --- the synthetic generator and small ---------------------------------------------------------------


def test_network_fraction_zero_and_one():
    heavy = set(network_intensive(load_profiles()))
    assert heavy == {"alexnet", "vgg16", "vgg19", "lm", "transformer", "bidaf", "gnmt"}
    none = load_workload("synthetic", apps=40, network_fraction=0.0)
    every = load_workload("synthetic", apps=40, network_fraction=1.0)
    assert not {a.model for a in none.apps} & heavy
    assert {a.model for a in every.apps} <= heavy
    half = load_workload("synthetic", apps=40, network_fraction=0.5)
    assert sum(a.model in heavy for a in half.apps) == 20
    # the models do not move the arrivals or the work
    assert [a.arrival_s for a in none.apps] == [a.arrival_s for a in every.apps]


def test_load_sets_the_arrival_rate():
    low = load_workload("synthetic", apps=30, load=0.5)
    high = load_workload("synthetic", apps=30, load=1.0)
    assert [2 * h.arrival_s for h in high.apps] == pytest.approx([lo.arrival_s for lo in low.apps])
    assert [a.jobs for a in low.apps] == [a.jobs for a in high.apps]
    # offered load: work over the arrival span on 256 GPUs is near the target for many apps
    many = load_workload("synthetic", apps=400, load=0.8, seed=1)
    work = sum(j.iterations * j.iter_time_s for a in many.apps for j in a.jobs)
    assert work / (many.apps[-1].arrival_s * 256) == pytest.approx(0.8, rel=0.15)


@pytest.mark.parametrize("kind", ["fixed", "successive_halving", "curve_stopping"])
def test_kind_and_app_size(kind):
    w = load_workload("synthetic", apps=10, app_size=8, kind=kind, gpus=2)
    assert all(a.kind == kind and len(a.jobs) == 8 for a in w.apps)
    assert all(j.gpus == 2 for a in w.apps for j in a.jobs)
    if kind == "successive_halving":
        assert all(len(a.phase_iterations) == 4 for a in w.apps)
    ranged = load_workload("synthetic", apps=30, app_size=(2, 5), kind=kind)
    assert {len(a.jobs) for a in ranged.apps} <= {2, 3, 4, 5}


def test_kind_lists_and_mixed():
    two = load_workload("synthetic", apps=40, kind=["fixed", "curve_stopping"])
    assert {a.kind for a in two.apps} == {"fixed", "curve_stopping"}
    assert {a.kind for a in load_workload("synthetic", apps=40, kind="mixed").apps} == {
        "fixed", "successive_halving", "curve_stopping"}


def test_synthetic_is_deterministic_per_seed():
    assert load_workload("synthetic", seed=7, kind="mixed") == load_workload("synthetic", seed=7, kind="mixed")
    assert load_workload("synthetic", seed=7) != load_workload("synthetic", seed=8)


def test_synthetic_rejects_bad_knobs():
    with pytest.raises(WorkloadError, match="kind"):
        load_workload("synthetic", kind="random_search")
    with pytest.raises(WorkloadError, match="network_fraction"):
        load_workload("synthetic", network_fraction=1.5)


def test_small_is_small_and_fixed():
    w = load_workload("small")
    assert w.name == "small" and 20 <= len(w.apps) <= 30
    assert {a.kind for a in w.apps} == {"fixed", "successive_halving"}
    assert w == load_workload("small")
    assert w.apps[-1].arrival_s < 2 * 3600


def test_a_row_of_empty_fields_is_not_skipped(tmp_path):
    path = write(tmp_path, f"{USER_HEADER}\n,,,,,,\n")
    with pytest.raises(TraceError, match=r":2: app and job must not be empty"):
        load_trace_csv(path)


def test_contended_offers_twice_what_testbed_64_can_do():
    """The main job's workload (issue 11): the generator at offered load 2 on 64 GPUs (what ``load``
    means is test_load_sets_the_arrival_rate's), small's kinds of apps, its own name."""
    w = load_workload("contended")
    assert w.name == "contended" and len(w.apps) == 48 and w == load_workload("contended")
    assert {a.kind for a in w.apps} == {"fixed", "successive_halving"}
    same = load_workload("synthetic", apps=48, app_size=(2, 8), kind=["fixed", "successive_halving"], load=2.0,
                         cluster_gpus=64, job_duration_s=(600.0, 3600.0))
    assert w.apps == same.apps
    assert load_workload("contended", seed=1) != w


# --- AppSpec's phases (issue 13 item 6: traces can now set them) ---------------------------------


@pytest.mark.parametrize(
    ("kind", "phases", "reason"),
    [
        ("fixed", (10.0,), "phase_iterations are for successive_halving apps, not fixed"),
        ("curve_stopping", (10.0, 20.0), "not curve_stopping"),
        ("successive_halving", (10.0, 0.0), "must be finite and > 0"),
        ("successive_halving", (10.0, math.inf), "must be finite and > 0"),
        ("successive_halving", (), "needs phase_iterations"),
        ("successive_halving", (1.0, 2.0, 3.0), "2 jobs cannot be halved 2 times"),
    ],
)
def test_app_spec_refuses_phases_that_cannot_run(kind, phases, reason):
    import re

    jobs = (JobSpec("a/j0", 10.0, 1.0, 1), JobSpec("a/j1", 10.0, 1.0, 1))
    with pytest.raises(ValueError, match=re.escape(reason)):
        AppSpec("a", 0.0, "lm", kind, jobs, phases)
