"""Fig. 16's sweeps (f and the lease length) meet at the defaults: that setting runs once, and both
sweeps share one pool of workers. The runs themselves are the simulator's (covered elsewhere);
here a Setup that records what it is asked to run stands in for the pool."""

from __future__ import annotations

from simulator.experiments import Setup, fig16


class Recording(Setup):
    def __init__(self, out):
        super().__init__(out, quick=False, seed=0, seeds=2, workers=1, policies=None)
        self.calls: list[list[dict]] = []

    def run(self, runs, label):
        self.calls.append(list(runs))
        return [{m: {"mean": 1.0 + k, "half": 0.1} for m in ("max_rho_floor", "p99_rho", "jain_rho", "gpu_time")}
                | {"setting": (r["fairness_knob"], r["lease"])} for k, r in enumerate(runs)]


def test_the_default_setting_is_run_once_and_both_sweeps_in_one_pool(tmp_path):
    setup = Recording(tmp_path)
    result = fig16(setup)
    assert len(setup.calls) == 1  # one pool for both sweeps
    settings = [(r["fairness_knob"], r["lease"]) for r in setup.calls[0]]
    assert len(settings) == len(set(settings)) == 7 + 5 - 1
    by_f = {r["setting"][0]: r for r in result["fairness_knob"]}
    by_lease = {r["setting"][1]: r for r in result["lease"]}
    assert sorted(by_f) == [0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.95] and all(r["setting"][1] == 600.0 for r in by_f.values())
    assert sorted(by_lease) == [150.0, 300.0, 600.0, 1200.0, 2400.0]
    assert all(r["setting"][0] == 0.8 for r in by_lease.values())
    assert by_lease[600.0] == by_f[0.8]  # the shared point is the same run in both sweeps
    assert (tmp_path / "fairness_knob.png").stat().st_size > 0 and (tmp_path / "lease.png").stat().st_size > 0
