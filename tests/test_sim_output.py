"""What themis-sim prints and draws for a person (issue 36 item 5): a compare table that fits 80
columns with no column twice, a verdict computed from the numbers, plots that say which seeds
they show, progress lines from ``run`` off a terminal, choices in --help, and the strategic
study's verdict per lie size."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.container import BarContainer
from rich.console import Console

import simulator.plots as plots
from simulator.cli import main, print_summary, summary_table, verdict
from simulator.seeds import interval
from simulator.strategic_run import print_strategic
from simulator.strategic_run import verdict as lie_verdict

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "examples" / "trace.csv"

# Per policy, three seeds' values of each metric; as in the demo, max rho, its value above the
# 10-minute floor and p99 are the same numbers in every seed.
DEMO = {
    "themis": dict(max_rho=[0.45, 0.60, 0.72], mean_rho=[0.30, 0.31, 0.35], jain_rho=[0.85, 0.80, 0.90],
                   max_rho_share=[2.5, 2.5, 2.6], share_rho_share_gt_1=[0.7, 0.8, 0.8], avg_jct=[14000, 15000, 15500],
                   gpu_time=[1.6e6, 1.9e6, 2.4e6], mean_placement_score=[0.94, 0.93, 0.95],
                   restarts_per_job=[11.0, 13.0, 14.7], wall_seconds=[20.0, 30.0, 35.0],
                   share_auction=[0.5, 0.6, 0.55], share_queue=[0.3, 0.3, 0.3]),
    "gandiva": dict(max_rho=[1.1, 1.2, 1.24], mean_rho=[0.40, 0.42, 0.44], jain_rho=[0.75, 0.74, 0.76],
                    max_rho_share=[10.0, 12.0, 14.8], share_rho_share_gt_1=[0.6, 0.7, 0.8],
                    avg_jct=[19000, 21000, 22000],
                    gpu_time=[2.2e6, 2.6e6, 2.9e6], mean_placement_score=[0.76, 0.77, 0.77],
                    restarts_per_job=[3.0, 3.6, 4.2], wall_seconds=[2.0, 2.0, 2.0]),
    "tiresias": dict(max_rho=[0.8, 1.1, 1.4], mean_rho=[0.35, 0.37, 0.39], jain_rho=[0.6, 0.63, 0.66],
                     max_rho_share=[2.2, 2.6, 2.9], share_rho_share_gt_1=[0.5, 0.7, 0.9], avg_jct=[14500, 15200, 16000],
                     gpu_time=[2.2e6, 2.5e6, 2.8e6], mean_placement_score=[0.75, 0.78, 0.82],
                     restarts_per_job=[8.0, 9.0, 10.3], wall_seconds=[2.0, 2.0, 3.0]),
    "slaq": dict(max_rho=[0.7, 0.87, 1.04], mean_rho=[0.40, 0.42, 0.44], jain_rho=[0.85, 0.89, 0.93],
                 max_rho_share=[8.0, 9.7, 11.3], share_rho_share_gt_1=[0.7, 0.8, 0.96], avg_jct=[24000, 28000, 32000],
                 gpu_time=[2.3e6, 2.6e6, 2.9e6], mean_placement_score=[0.78, 0.8, 0.81],
                 restarts_per_job=[8.0, 9.6, 11.2], wall_seconds=[2.0, 3.0, 4.0]),
}


def _rows(demo=DEMO, seeds=(0, 1, 2)):
    """Multi-seed rows as ``simulator.seeds.aggregate`` makes them (each metric an interval)."""
    rows = []
    for policy, metrics in demo.items():
        metrics = {"max_rho_floor": metrics["max_rho"], "p99_rho": metrics["max_rho"], **metrics}
        rows.append({"policy": policy, "seeds": list(seeds), **{k: interval(v) for k, v in metrics.items()}})
    return rows


def _printed(rows, width=80, json_name="comparison.json"):
    console = Console(width=width, record=True, color_system=None)
    print_summary(console, rows, "contended on testbed-64, seeds 0-2 (mean; under it ± 95% CI)", json_name)
    return console.export_text()


def _header(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("policy"))


@pytest.mark.parametrize("width", [80, 60])
def test_the_compare_table_fits_the_terminal_and_hides_no_number(width):
    text = _printed(_rows(), width)
    assert max(len(line) for line in text.splitlines()) <= width
    assert "…" not in text and "..." not in text  # no number cut into an ellipsis
    header = _header(text)
    for label in ("max rho", "mean", "Jain"):
        assert label in header
    themis = next(line for line in text.splitlines() if line.startswith("themis"))
    assert "0.59*" in themis  # the mean of max rho, and the best of its column
    # the columns left out for room are named, the last kept first out
    said = " ".join(text.split())
    assert f"left out to fit {width} columns" in said and "wall s" in said.split("left out to fit")[0]
    assert "every metric, with every seed's value, is in comparison.json" in said


def test_a_column_equal_to_another_in_every_row_and_seed_is_shown_once():
    text = _printed(_rows(), 200)
    header = _header(text)
    assert "max rho" in header and "p99" not in header and "Tid" not in header
    assert "max, Tid>=10m and p99 equal max rho in every row" in " ".join(text.split())
    assert "left out to fit" not in text  # room for everything else at 200 columns
    assert "by bids" in header and "wall s" in header


def test_a_column_that_differs_in_one_seed_stays():
    demo = {p: dict(m) for p, m in DEMO.items()}
    rows = _rows(demo)
    rows[1]["p99_rho"] = interval([1.1, 1.2, 1.23])  # gandiva's p99 below its max in one seed
    header = _header(_printed(rows, 200))
    assert "p99" in header and "Tid" not in header


def test_one_number_equal_to_another_is_not_a_duplicate():
    """A single run's 1.07 max rho and 1.07 p99 may be a coincidence: both stay (room permitting)."""
    run = {"policy": "themis", "max_rho": 1.07, "p99_rho": 1.07, "mean_rho": 0.68, "jain_rho": 0.87}
    text = _printed([run], 200, "summary.json")
    assert "p99" in _header(text) and "equal" not in text
    assert "*" not in text  # one row: nothing to be best against
    assert "every metric is in summary.json" in text


def test_the_best_value_of_each_column_is_still_marked():
    console = Console(width=120, record=True, color_system=None)
    console.print(summary_table(_rows(), "t", width=120))
    lines = {line.split()[0]: line for line in console.export_text().splitlines() if line.split()
             and line.split()[0] in DEMO}
    assert "0.890*" in lines["slaq"]  # highest Jain
    assert "3.6*" in lines["gandiva"]  # fewest restarts
    assert "0.59*" in lines["themis"] and lines["themis"].count("*") == 6


def test_the_verdict_says_where_themis_wins_and_loses_from_the_numbers():
    said = verdict(_rows())
    assert said.startswith("Themis wins on max rho (0.59 vs slaq 0.87)")
    wins, losses = said.split("; loses on ")
    assert "GPU time (546 vs tiresias 694 GPU-h)" in wins and "JCT" in wins
    assert "Jain (0.850 vs slaq 0.890)" in losses and "restarts/job (12.9 vs gandiva 3.6)" in losses
    assert said.endswith("; 95% intervals apart only on restarts/job.")
    # other numbers, another verdict: restarts no longer lost
    demo = {p: dict(m) for p, m in DEMO.items()}
    demo["themis"]["restarts_per_job"] = [1.0, 1.0, 1.0]
    assert "restarts/job (1.0 vs gandiva 3.6)" in verdict(_rows(demo)).split("; loses on ")[0]


def test_without_themis_the_verdict_names_the_best_policy_per_metric():
    rows = [r for r in _rows() if r["policy"] != "themis"]
    said = verdict(rows)
    assert said.startswith("Best per metric: max rho slaq (0.87)")
    assert "restarts/job gandiva (3.6)" in said and "Themis" not in said
    assert verdict(rows[:1]) is None


def test_compare_prints_an_80_column_table_and_ends_with_the_verdict(tmp_path):
    """As a person's terminal runs it: COLUMNS=80, stdout a pipe."""
    done = subprocess.run([sys.executable, "-m", "simulator", "compare", "--cluster", "testbed-64", "--workload",
                           str(TRACE), "--policies", "themis,fifo,drf", "--out", str(tmp_path)],
                          env={**os.environ, "COLUMNS": "80"}, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    lines = [line for line in out.splitlines() if line.strip()]
    assert max(len(line) for line in lines) <= 80 and "…" not in out
    assert _header(out).split()[:3] == ["policy", "max", "rho"]
    verdict_line = out[out.index("Themis "):]
    assert out.rstrip().endswith(verdict_line.rstrip()) and re.search(r"(wins|loses|ties) on", verdict_line)


def _drawn(monkeypatch, summaries, aggregated):
    """compare_plots' figures as (file name -> title, legend texts, bar groups), without PNGs."""
    seen = {}

    def keep(fig, path):
        ax = fig.axes[0]
        legend = ax.get_legend()
        seen[path.name] = (ax.get_title().replace("\n", " "), [t.get_text() for t in legend.get_texts()] if legend
                           else [], sum(isinstance(c, BarContainer) for c in ax.containers))
        plots.plt.close(fig)
        return path

    monkeypatch.setattr(plots, "_save", keep)
    plots.compare_plots(summaries, Path("unused"), aggregated=aggregated)
    return seen


def _first_seed(rows):
    return [{"policy": r["policy"], "workload": "contended", "cluster": "testbed-64", "seed": 0,
             "max_rho": r["max_rho"]["values"][0], "gpu_time": r["gpu_time"]["values"][0],
             "apps": [{"rho": r["max_rho"]["values"][0], "placement_score": 0.9}, {"rho": 0.2, "placement_score": 0.8}]}
            for r in rows]


def test_plots_say_which_seeds_they_show_and_draw_equal_metrics_once(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    rows = _rows()
    seen = _drawn(monkeypatch, _first_seed(rows), rows)
    title, legend, _ = seen["rho_cdf.png"]
    assert "seed 0" in title and "seeds 0-2" in title
    assert "themis: max 0.45 (seed 0)" in legend  # seed 0's max, not the table's mean 0.59
    title, legend, groups = seen["max_rho.png"]
    assert groups == 1 and legend == ["max rho = max rho (T_id >= 10 min) = p99 rho"]
    assert "seeds 0-2" in title and "seeds 0-2" in seen["gpu_time.png"][0]
    assert "seed 0" in seen["placement_cdf.png"][0]
    rows[2]["p99_rho"] = interval([0.8, 1.0, 1.4])  # tiresias's p99 below its max in one seed
    _, legend, groups = _drawn(monkeypatch, _first_seed(rows), rows)["max_rho.png"]
    assert groups == 2 and legend == ["max rho = max rho (T_id >= 10 min)", "p99 rho"]


def test_seeds_text():
    assert plots.seeds_text([4]) == "seed 4"
    assert plots.seeds_text([2, 0, 1]) == "seeds 0-2"
    assert plots.seeds_text([0, 2, 5]) == "seeds 0, 2, 5"


def test_run_prints_progress_lines_off_a_terminal(tmp_path, capsys):
    assert main(["run", "--cluster", "testbed-64", "--workload", str(TRACE), "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "themis on testbed-64: 5 apps to simulate; a line every 1 finished"
    found = (re.search(r": (\d+) of 5 apps done, [\d.]+ simulated hours", line) for line in err)
    done = [int(m.group(1)) for m in found if m]
    assert done == [1, 2, 3, 4, 5]


def test_run_keeps_its_live_bar_on_a_terminal(tmp_path, monkeypatch):
    import io

    import simulator.runs as runs

    screen = io.StringIO()
    monkeypatch.setattr(runs, "console", Console(file=screen, force_terminal=True, width=100))
    assert main(["run", "--cluster", "testbed-64", "--workload", str(TRACE), "--out", str(tmp_path)]) == 0
    assert "simulated hours" not in screen.getvalue() and "apps done" in screen.getvalue()


@pytest.mark.parametrize("argv, listed", [
    (["run"], ["tiresias", "gandiva", "drf", "testbed-64", "contended", "rent-or-buy"]),
    (["compare"], ["tiresias", "slaq"]),
    (["strategic"], ["overreport-spread", "withhold-bid", "measured"]),
    (["experiment"], ["fig9", "fig16"]),
    (["pool"], ["fig12", "fig16"]),
])
def test_help_lists_the_choices(argv, listed, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name in listed:
        assert name in out, name


def test_a_plugin_strategy_is_listed_and_accepted(tmp_path, capsys, monkeypatch):
    from simulator.plugins import ENV

    monkeypatch.setenv(ENV, "")
    plugin = tmp_path / "quiet.py"
    plugin.write_text("from simulator.strategic import BiddingStrategy, strategy\n\n\n"
                      "@strategy\nclass Quiet(BiddingStrategy):\n    name = 'quiet-plugin'\n")
    with pytest.raises(SystemExit):
        main(["strategic", "--plugin", str(plugin), "--help"])
    assert "quiet-plugin" in capsys.readouterr().out
    assert main(["strategic", "--plugin", str(plugin), "--strategy", "quiet-plugin", "--levels", "10", "--seeds", "1",
                 "--workers", "1", "--cluster", "testbed-64", "--workload", str(TRACE), "--liar", "speech",
                 "--out", str(tmp_path / "o")]) == 0
    with pytest.raises(SystemExit) as exit_:
        main(["strategic", "--strategy", "no-such-lie", "--out", str(tmp_path / "o")])
    assert exit_.value.code == 2 and "invalid choice: 'no-such-lie'" in capsys.readouterr().err


def _point(level, ratios, faster=None, slower=None):
    return {"level": level, "seeds": len(ratios), "liar_jct_vs_truthful": interval(ratios),
            "liar_faster_in": sum(r < 1 for r in ratios) if faster is None else faster,
            "liar_slower_in": sum(r > 1 for r in ratios) if slower is None else slower,
            "liar_jct_s": interval([3600.0 * r for r in ratios]), "liar_hidden_payment": interval([0.1] * len(ratios)),
            "others_jct_vs_truthful": interval([1.0] * len(ratios))}


def test_the_strategic_verdict_says_whether_lying_paid_with_its_interval():
    paid = lie_verdict(_point(50, [0.92, 0.94, 0.95, 0.93, 0.96]), "overreport-spread")
    assert paid.startswith("overreport-spread, X = 50%: lying paid: the liar finishes at 0.940 of its truthful time")
    assert "(95% CI 0.920-0.960), sooner in 5 of 5 seeds" in paid
    unclear = lie_verdict(_point(20, [0.90, 1.02, 0.97]), "noisy", liars=2)
    assert "lying did not clearly pay: the liars finish at 0.963 of their truthful time" in unclear
    assert "sooner in 2 of 3 seeds, later in 1" in unclear
    assert "lying did not pay" in lie_verdict(_point(100, [1.05, 1.1, 1.02]), "hide-rows")
    same = lie_verdict(_point(10, [1.0, 1.0]), "hide-rows")
    assert "lying did not pay" in same and "the same time in all 2 seeds" in same
    one = lie_verdict(_point(10, [0.9]), "hide-rows")
    assert "lying paid" in one and "one seed, no interval" in one


def test_the_strategic_study_prints_a_verdict_per_lie_size_in_80_columns():
    result = {"strategy": "overreport-spread", "policy": "themis", "rank": "reported", "liars": ["speech"],
              "cluster": "testbed-64", "workload": "contended", "seeds": [0, 1, 2],
              "points": [_point(0, [1.0, 1.0, 1.0]), _point(50, [0.92, 0.94, 0.95]), _point(100, [1.1, 1.2, 1.0])]}
    console = Console(width=80, record=True, color_system=None)
    print_strategic(result, console)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80 and "…" not in text
    said = " ".join(text.split())
    assert "X = 0%" not in said  # the truthful baseline has no verdict
    assert "overreport-spread, X = 50%: lying paid" in said and "overreport-spread, X = 100%: lying did not pay" in said
