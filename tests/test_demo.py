"""The README's main job runs and every app finishes."""

from arbiter.demo import main


def test_demo_runs_rounds_and_finishes_every_app(capsys):
    assert main(["--apps", "5", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "round 1" in out and "leases expire" in out
    for k in range(5):
        assert f"app{k:02d} finishes" in out
