"""Seeds and intervals (issue 13): the t interval, aggregation of run summaries, parallel runs."""

from __future__ import annotations

import math
import statistics

import pytest

from simulator.seeds import aggregate, fmt, interval, run_parallel, t95


def test_the_interval_is_the_student_t_one():
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    stat = interval(values)
    half = 2.776 * statistics.stdev(values) / math.sqrt(5)
    assert stat["mean"] == 3.0 and stat["half"] == pytest.approx(half)
    assert stat["ci95"] == pytest.approx([3.0 - half, 3.0 + half])
    assert stat["values"] == values
    assert t95(2) == 12.706 and t95(31) == 2.042
    # beyond the table: Student's t at 40, 99 and 999 degrees of freedom (1.96 was 3% narrow at 40)
    assert t95(41) == pytest.approx(2.0211, abs=2e-4) and t95(100) == pytest.approx(1.9842, abs=2e-4)
    assert t95(1000) == pytest.approx(1.9623, abs=2e-4) and t95(32) < t95(31)


def test_one_seed_has_no_interval_and_equal_values_a_zero_one():
    assert interval([2.5]) == {"mean": 2.5, "ci95": [2.5, 2.5], "half": 0.0, "values": [2.5]}
    assert interval([1.0, 1.0, 1.0])["half"] == 0.0
    assert fmt(interval([1.0, 3.0]), "{:.1f}") == "2.0±12.7"
    assert fmt(0.5, "{:.0%}") == "50%"


def test_aggregate_keeps_shared_fields_and_intervals_per_metric():
    runs = [{"policy": "themis", "seed": s, "cluster": "c", "max_rho": 1.0 + s, "gpu_time": 10.0, "apps": [1]}
            for s in range(3)]
    agg = aggregate(runs)
    assert agg["policy"] == "themis" and agg["cluster"] == "c" and agg["seeds"] == [0, 1, 2]
    assert agg["max_rho"]["values"] == [1.0, 2.0, 3.0] and agg["gpu_time"]["half"] == 0.0
    assert "apps" not in agg


def _square(x: int) -> int:
    return x * x


def test_parallel_runs_come_back_in_submission_order():
    seen = []
    assert run_parallel(_square, [{"x": k} for k in range(7)], workers=2, progress=seen.append) == [
        k * k for k in range(7)]
    assert seen == list(range(1, 8))


def _wait_for_flag(flag: str) -> str:
    import time
    from pathlib import Path

    deadline = time.monotonic() + 120
    while not Path(flag).exists():
        if time.monotonic() > deadline:
            raise TimeoutError("progress was not reported until this run ended")
        time.sleep(0.01)
    return "slow"


def _at_once() -> str:
    return "fast"


def test_progress_counts_a_run_as_soon_as_it_ends_whatever_its_place(tmp_path):
    """A long first run must not hold back the count of later ones (a 4x Themis run is 10 minutes)."""
    flag = tmp_path / "flag"

    def progress(done: int) -> None:
        flag.touch()  # the first run waits for this: it can only end after a later run was counted

    out = run_parallel(_dispatch, [{"kind": "slow", "flag": str(flag)}, {"kind": "fast", "flag": ""}],
                       workers=2, progress=progress)
    assert out == ["slow", "fast"]  # still in submission order


def _dispatch(kind: str, flag: str) -> str:
    return _wait_for_flag(flag) if kind == "slow" else _at_once()


def _fail_or_mark(k: int, folder: str) -> int:
    import time
    from pathlib import Path

    if k == 0:
        raise RuntimeError("run 0 failed")
    time.sleep(1.0)
    Path(folder, str(k)).touch()
    return k


def test_a_failed_run_ends_the_batch_without_running_the_rest(tmp_path):
    with pytest.raises(RuntimeError, match="run 0 failed"):
        run_parallel(_fail_or_mark, [{"k": k, "folder": str(tmp_path)} for k in range(20)], workers=2)
    assert len(list(tmp_path.iterdir())) < 19  # the queued runs were cancelled, not run
