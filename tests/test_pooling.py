"""Pooling saved results (``themis-sim pool``): seeds run apart give exactly the result of one run
over all of them, and results that are not the same experiment are refused with the field named.
The simulations are stood in for by summaries that depend on the setting and the seed: pooling only
reads saved JSON, and the experiments' own aggregation (``simulator.seeds``) is the real one."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

import simulator.experiments as experiments
from simulator.cli import main
from simulator.experiments import Setup
from simulator.pooling import PoolError, pool_files, pool_results
from simulator.seeds import METRICS


def fake_summary(run: dict, seed: int) -> dict:
    """A run summary whose every metric depends on the run's settings and the seed."""
    cluster = Path(str(run["cluster"])).stem  # a shrunk cluster's file lies in the experiment's folder
    setting = json.dumps({k: v for k, v in run.items() if k not in ("workload_knobs", "cluster")} | {"c": cluster},
                         sort_keys=True, default=str)
    base = zlib.crc32(f"{setting}|{seed}".encode()) / 2**32
    return {"policy": run["policy"], "workload": run["workload"], "cluster": cluster, "seed": seed,
            "fairness_knob": run.get("fairness_knob", 0.8), "lease_s": run.get("lease", 600.0), "apps": [],
            # per-run outcomes that are no metric, as simulator.metrics writes them
            "restart_gaps": {"first": seed + 1, "<=35s": int(base * 100)},
            "restarts_by_cause": {"grew": int(base * 1000)}, "granted_by": {"auction": seed},
            **{m: 1.0 + base * (k + 1) for k, m in enumerate(METRICS)}}


@pytest.fixture
def fake_runs(monkeypatch):
    def run_seeds(runs, seeds, workers, label, store):
        return [[fake_summary(r, s) for s in seeds] for r in runs]

    monkeypatch.setattr(experiments, "run_seeds", run_seeds)


def result_of(figure: str, tmp_path, first: int, count: int) -> dict:
    out = tmp_path / f"{figure}-{first}-{count}"
    setup = Setup(out, quick=True, seed=first, seeds=count, workers=1, policies=["themis", "tiresias"])
    result = experiments.EXPERIMENTS[figure](setup)
    (out / f"{figure}.json").write_text(json.dumps(result))
    return json.loads((out / f"{figure}.json").read_text())


@pytest.mark.parametrize("figure", ["fig12", "fig16"])
def test_results_of_one_seed_each_pool_like_any_others(fake_runs, tmp_path, figure):
    """A one-seed result kept each run's restart counts as if they were shared settings, so two of
    them differed there and pooling refused them (found in review, session 16)."""
    whole = result_of(figure, tmp_path, 0, 3)
    parts = []
    for seed in range(3):
        result_of(figure, tmp_path, seed, 1)
        parts.append(tmp_path / f"{figure}-{seed}-1" / f"{figure}.json")
    assert pool_files(figure, parts, tmp_path / "pooled") == whole


@pytest.mark.parametrize("figure", ["fig12", "fig13", "fig14", "fig16"])
def test_pooled_seeds_equal_one_run_over_all_of_them(fake_runs, tmp_path, figure):
    whole = result_of(figure, tmp_path, 0, 5)
    parts = [tmp_path / f"{figure}-0-2" / f"{figure}.json", tmp_path / f"{figure}-2-3" / f"{figure}.json"]
    result_of(figure, tmp_path, 0, 2)
    result_of(figure, tmp_path, 2, 3)
    pooled = pool_files(figure, parts, tmp_path / "pooled")
    assert pooled == whole
    assert pooled["seeds"] == [0, 1, 2, 3, 4]
    saved = json.loads((tmp_path / "pooled" / f"{figure}.json").read_text())
    assert saved["seeds"] == [0, 1, 2, 3, 4]
    assert any(p.suffix == ".png" and p.stat().st_size > 0 for p in (tmp_path / "pooled").iterdir())


def test_an_interval_is_recomputed_from_every_seed(fake_runs, tmp_path):
    a, b = result_of("fig14", tmp_path, 0, 2), result_of("fig14", tmp_path, 2, 1)
    pooled = pool_results([a, b])
    point = pooled["points"][0]["max_rho"]
    assert point["values"] == a["points"][0]["max_rho"]["values"] + b["points"][0]["max_rho"]["values"]
    assert point["mean"] == pytest.approx(sum(point["values"]) / 3)
    assert point["half"] > 0 and point["half"] != a["points"][0]["max_rho"]["half"]


def test_overlapping_seeds_are_refused(fake_runs, tmp_path):
    a, b = result_of("fig14", tmp_path, 0, 2), result_of("fig14", tmp_path, 1, 2)
    with pytest.raises(PoolError, match="seed 1 is in two results"):
        pool_results([a, b])


def test_different_settings_are_refused_with_the_field_named(fake_runs, tmp_path):
    a, b = result_of("fig16", tmp_path, 0, 1), result_of("fig16", tmp_path, 1, 1)
    b["lease"][1]["lease_s"] = 330.0
    with pytest.raises(PoolError, match=r"lease\[1\]\.lease_s: the results differ"):
        pool_results([a, b])
    c = result_of("fig16", tmp_path, 2, 1)
    c["quick"] = False
    with pytest.raises(PoolError, match="quick"):
        pool_results([a, c])


def test_figures_whose_plots_need_more_than_the_json_are_refused(tmp_path):
    with pytest.raises(PoolError, match="'fig9' cannot be pooled"):
        pool_results([{"figure": "fig9", "seeds": [0]}, {"figure": "fig9", "seeds": [1]}])
    with pytest.raises(PoolError, match="different figures"):
        pool_results([{"figure": "fig12", "seeds": [0]}, {"figure": "fig14", "seeds": [1]}])
    with pytest.raises(PoolError, match="at least two"):
        pool_results([{"figure": "fig12", "seeds": [0]}])


def test_the_cli_names_a_bad_file_and_writes_nothing(fake_runs, tmp_path, capsys):
    good = tmp_path / "fig14-0-1" / "fig14.json"
    result_of("fig14", tmp_path, 0, 1)
    broken = tmp_path / "broken.json"
    broken.write_text('{"figure": "fig14", "seeds": [1], "points": [')
    with pytest.raises(SystemExit, match=r"themis-sim pool: .*broken\.json: not a readable result"):
        main(["pool", "fig14", str(good), str(broken), "--out", str(tmp_path / "out")])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"figure": "fig16", "seeds": [1]}))
    with pytest.raises(SystemExit, match=r"other\.json: a result of 'fig16', not 'fig14'"):
        main(["pool", "fig14", str(good), str(other), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_the_cli_pools_and_says_what_it_wrote(fake_runs, tmp_path, capsys):
    result_of("fig16", tmp_path, 3, 2)
    result_of("fig16", tmp_path, 0, 1)
    code = main(["pool", "fig16", str(tmp_path / "fig16-3-2" / "fig16.json"), str(tmp_path / "fig16-0-1" / "fig16.json"),
                 "--out", str(tmp_path / "out")])
    assert code == 0
    assert "3 seeds (3, 4, 0) pooled from 2 results" in capsys.readouterr().err
    saved = json.loads((tmp_path / "out" / "fig16.json").read_text())
    assert saved["seeds"] == [3, 4, 0]
    assert (tmp_path / "out" / "fairness_knob.png").exists() and (tmp_path / "out" / "lease.png").exists()


def test_a_policy_or_point_in_one_result_only_is_refused_not_dropped(fake_runs, tmp_path):
    """Pooling kept only the keys every result holds, so a policy run in one part only (a smaller
    --policies) vanished from the pooled figure without a word."""
    a = result_of("fig16", tmp_path, 0, 1)
    b = result_of("fig16", tmp_path, 1, 1)
    del b["lease"]
    with pytest.raises(PoolError, match=r"lease: only in result 1 of 2"):
        pool_results([a, b])
    b = json.loads((tmp_path / "fig16-1-1" / "fig16.json").read_text())
    b["fairness_knob"][0]["max_rho"]["values"] = ["x"]
    with pytest.raises(PoolError, match=r"fairness_knob\[0\]\.max_rho: a value that is not a number \('x'\)"):
        pool_results([a, b])
