"""Extending the simulator from outside the repository (issue 13 item 6): a policy, a workload and
a strategy in a file given with --plugin, or in an installed package's entry points, run by
themis-sim -- in worker processes too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from simulator.cli import main
from simulator.plugins import ENV

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "examples" / "trace.csv"

POLICY = textwrap.dedent('''
    """Shortest remaining GPU time first: remaining_s x demand, smallest served first."""
    import math

    from arbiter.policies import register_policy
    from arbiter.policies.greedy import GreedyPolicy, unless_nan
    from simulator.workloads import register
    from simulator.workloads.synthetic import synthetic


    @register_policy
    class ShortestRemainingGpuTime(GreedyPolicy):
        name = "{name}"
        report_extras = frozenset({{"remaining_s"}})

        def priority(self, app, ctx):
            report = ctx.reports.get(app)
            if report is None:
                return (math.inf,)
            return (unless_nan(float(report.remaining_s), math.inf) * max(1, ctx.unmet.get(app, 1)),)


    @register("{name}-load")
    def tiny(*, seed: int = 0, apps: int = 6):
        """A tiny synthetic workload from a plugin."""
        return synthetic(seed=seed, apps=apps, app_size=2, load=1.5, cluster_gpus=64, gpus=(1, 2),
                         job_duration_s=(300.0, 900.0))
''')


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.setenv(ENV, "")  # restored (unset) after the test, whatever load_plugins wrote


def test_a_policy_and_a_workload_in_a_file_run_through_compare_over_seeds(tmp_path):
    plugin = tmp_path / "srgt.py"
    plugin.write_text(POLICY.format(name="srgt"))
    out = tmp_path / "out"
    assert main(["compare", "--plugin", str(plugin), "--policies", "tiresias,srgt", "--cluster", "testbed-64",
                 "--workload", "srgt-load", "--workload-knob", "apps=5", "--seeds", "2", "--workers", "2",
                 "--out", str(out)]) == 0
    rows = json.loads((out / "comparison.json").read_text())
    assert [r["policy"] for r in rows] == ["tiresias", "srgt"]
    summary = json.loads((out / "srgt" / "seed1" / "summary.json").read_text())
    assert summary["policy"] == "srgt" and len(summary["apps"]) == 5  # the knob reached the workload
    assert str(plugin.resolve()) in os.environ[ENV]


def test_worker_processes_load_the_recorded_plugins(tmp_path):
    """A spawned worker imports nothing of its parent: THEMIS_PLUGINS is how it learns the names."""
    plugin = tmp_path / "late.py"
    plugin.write_text(POLICY.format(name="late"))
    code = ("from simulator.plugins import load_from_env; load_from_env(); "
            "from arbiter.policies import POLICIES; from simulator.workloads import load_workload; "
            "print('late' in POLICIES, len(load_workload('late-load').apps))")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, ENV: str(plugin)}, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "6"]


def test_entry_points_of_an_installed_package_are_found(tmp_path):
    site = tmp_path / "site"
    (site / "themis_ep_demo-0.1.dist-info").mkdir(parents=True)
    (site / "themis_ep_demo-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: themis-ep-demo\n"
                                                                     "Version: 0.1\n")
    (site / "themis_ep_demo-0.1.dist-info" / "entry_points.txt").write_text(
        "[themis.policies]\nepsrgt = themis_ep_demo:ShortestRemainingGpuTime\n")
    (site / "themis_ep_demo.py").write_text(POLICY.format(name="epsrgt"))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    done = subprocess.run([sys.executable, "-m", "simulator", "run", "--policy", "epsrgt", "--cluster", "testbed-64",
                           "--workload", str(TRACE), "--out", str(out)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "summary.json").read_text())["policy"] == "epsrgt"


def test_bad_plugins_and_knobs_are_refused_with_the_reason(tmp_path, capsys):
    with pytest.raises(SystemExit, match="no such file"):
        main(["run", "--plugin", str(tmp_path / "missing.py"), "--out", str(tmp_path)])
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('half-written plugin')\n")
    with pytest.raises(SystemExit, match="half-written plugin"):
        main(["run", "--plugin", str(broken), "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="cannot import"):
        main(["run", "--plugin", "no_such_module_here", "--out", str(tmp_path)])
    assert main(["run", "--workload", "synthetic", "--workload-knob", "colour=3", "--out", str(tmp_path)]) == 2
    assert "colour" in capsys.readouterr().err
    taken = tmp_path / "taken.py"
    taken.write_text(POLICY.format(name="themis"))
    with pytest.raises(SystemExit, match="taken"):
        main(["run", "--plugin", str(taken), "--out", str(tmp_path)])
