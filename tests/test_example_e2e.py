"""The digits example end to end: its one command, a real arbiter, a real Mosquitto broker, real
training jobs (scikit-learn MLPs on the digits data), with the test budget (issue 5).

The broker is started privately on a free loopback port; a subscriber on ``themis/<cluster>/#``
records what reaches it. Run once with jobs reporting through the launcher's pipe (the launcher
republishes on the broker) and once with jobs publishing to the broker themselves.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import paho.mqtt.client as paho
import pytest
import sklearn  # noqa: F401  (the test extra installs it: the example trains scikit-learn models)

from agent.profiler import parse_metrics

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "digits_search.py"
APPS = ("digits-hyperband", "digits-curves")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    assert os.path.exists(MOSQUITTO), "these tests need Mosquitto (Debian's mosquitto package)"
    folder = tmp_path_factory.mktemp("mosquitto")
    port = free_port()
    conf = folder / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("mosquitto did not start")
            time.sleep(0.05)
    yield f"mqtt://127.0.0.1:{port}", port
    proc.terminate()
    proc.wait(10)


class Recorder:
    """Everything published under ``themis/<cluster>/#`` while it listens."""

    def __init__(self, port: int, pattern: str):
        self.messages: list[tuple[str, bytes]] = []
        self.ready = threading.Event()
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"e2e-{os.getpid()}-{time.time_ns()}")
        self.client.on_connect = lambda c, u, f, rc, p: c.subscribe(pattern, qos=1)
        self.client.on_subscribe = lambda *a: self.ready.set()
        self.client.on_message = lambda c, u, m: self.messages.append((m.topic, m.payload))
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        assert self.ready.wait(10), "could not subscribe to the broker"

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.mark.parametrize("report", ["pipe", "mqtt"])
def test_two_real_searches_share_an_arbiter_through_a_real_broker(broker, tmp_path, report):
    url, port = broker
    recorder = Recorder(port, "themis/digits-4/#")
    out = tmp_path / "summary.json"
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, str(EXAMPLE), "--budget", "test", "--mqtt", url, "--report", report, "--json", str(out),
             "--workdir", str(tmp_path / "work")],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
        time.sleep(0.3)  # the last messages
    finally:
        recorder.close()
    took = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "=== summary" in done.stdout and "best:" in done.stdout
    result = json.loads(out.read_text())
    apps = {a["app"]: a for a in result["apps"]}
    assert set(apps) == set(APPS)

    for name, app in apps.items():
        assert app["finished"] and app["completion_s"] > 0, name
        assert app["best"]["accuracy"] > 0.8, (name, app["best"])  # real training, held-out digits
        assert app["best"]["params"] and app["best"]["loss"] < 1.0
        assert not app["failed_jobs"] and app["killed_after_grace"] == 0
        assert app["rho"] and app["gpus_held"]
    # leases ran out (4 s leases) and were re-auctioned; jobs came back from their checkpoints
    assert result["rounds"]["expired"] + sum(a["lease_losses"] for a in apps.values()) >= 1
    resumes = [r for a in apps.values() for r in a["resumes"]]
    assert resumes and all(r["from_iteration"] >= 1 for r in resumes)

    # the broker saw the jobs' metrics, for every job, under the job metrics topic, and the arbiter's events
    metrics = {}
    for topic, payload in recorder.messages:
        parts = topic.split("/")
        if len(parts) == 7 and parts[2] == "apps" and parts[4] == "jobs" and parts[6] == "metrics":
            metrics.setdefault(parts[3], set()).add(parts[5])
            data = json.loads(payload)
            m = parse_metrics(data)
            assert m.loss is not None and 0 <= data["extra"]["accuracy"] <= 1 and len(m.gpus) == 1
    assert set(metrics) == set(APPS)
    assert len(metrics["digits-hyperband"]) == apps["digits-hyperband"]["jobs"]
    assert len(metrics["digits-curves"]) == apps["digits-curves"]["jobs"]
    topics = {t for t, _ in recorder.messages}
    assert "themis/digits-4/rounds" in topics and any(t.endswith("/grants") for t in topics)
    print(f"the test budget took {took:.0f} s")


def test_the_example_runs_unchanged_on_a_local_slurm_from_its_one_command(tmp_path):
    """``scripts/slurm_demo.py`` (what ``scripts/slurm-demo`` runs): a local fake-GPU Slurm, the
    example with ``--executor slurm``: every job a Slurm job on the node and GPU index its lease names."""
    out, work = tmp_path / "summary.json", tmp_path / "work"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "slurm_demo.py"), "--budget", "test", "--json",
                           str(out), "--workdir", str(work)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["executor"] == "slurm" and result["report"] == "file"
    apps = {a["app"]: a for a in result["apps"]}
    assert set(apps) == set(APPS)
    for name, app in apps.items():
        assert app["finished"] and app["best"]["accuracy"] > 0.8 and not app["failed_jobs"], name
    assert [r for a in apps.values() for r in a["resumes"]]  # jobs came back from their checkpoints
    # Slurm's record: every job ran where its start line in the job log says the lease put it
    # <workdir>/<app>/<run>/<job>/output.log
    headers = [line for log in work.glob("*/*/*/output.log") for line in log.read_text().splitlines()
               if line.startswith("--- start")]
    assert headers and all("(slurm n" in h for h in headers)
    record = done.stdout.split("Slurm's own record of the run", 1)[1]
    assert "themis:digits-hyperband:" in record and "gres:gpu:g" in record


def test_the_optuna_example_runs_end_to_end_and_a_rerun_starts_a_new_run(tmp_path):
    """``examples/optuna_search.py`` at its test budget (issue 11, item 4): its own arbiter, a real
    Optuna study (HyperbandPruner, SQLite storage) whose trials are real training processes
    (``examples/train_breast_cancer.py``); run twice in one workdir, the second run's trials are new
    trials of the same study, each started from scratch."""
    work = tmp_path / "work"
    runs, printed = [], []
    for n, quiet in ((1, []), (2, ["--quiet"])):
        out = tmp_path / f"summary-{n}.json"
        done = subprocess.run([sys.executable, str(ROOT / "examples" / "optuna_search.py"), "--budget", "test",
                               "--workdir", str(work), "--json", str(out), *quiet],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "best: trial-" in done.stdout
        runs.append(json.loads(out.read_text()))
        printed.append(" ".join(done.stderr.split()))  # rich wraps lines to the terminal's width
    # observable by default (item 2): a line per grant and per trial result, with GPU ids and rho, and
    # the progress bar; --quiet prints none of it
    loud, quiet_run = printed
    assert "optuna-sgd: granted r0-m" in loud and "; rho " in loud and "holds " in loud
    assert "result: loss" in loud and "best so far trial-" in loud and "8/8 trials" in loud
    assert "granted" not in quiet_run and "result: loss" not in quiet_run
    first, second = runs
    assert first["finished"] and not first["failed_jobs"]
    assert set(first["best"]["params"]) == {"alpha", "eta0", "learning_rate"}
    assert first["best"]["accuracy"] > 0.9 and first["best"]["iteration"] <= 9  # at most max_resource epochs
    assert sum(first["trials"].values()) == 8 and first["trials"].get("PRUNED", 0) >= 1  # Hyperband pruned some
    assert sum(second["trials"].values()) == 16 and second["jobs"] == 8
    run_dirs = [p for p in work.iterdir() if p.is_dir()]
    assert len(run_dirs) == 2  # one folder per run: checkpoints never shared between runs
    second_jobs = {p.name for p in max(run_dirs, key=lambda p: p.name).iterdir() if p.is_dir()}
    assert second_jobs == {f"trial-{k}" for k in range(8, 16)}
    assert second["resumed_runs"] == second["resumed_after_preemption"]  # no trial resumed another's checkpoint
    # each run's record: JSONL written as it went, and the plot
    first_dir = min(run_dirs, key=lambda p: p.name)
    records = [json.loads(line) for line in (first_dir / "record.jsonl").read_text().splitlines()]
    kinds = {r["what"] for r in records}
    assert {"grant", "rho", "trial", "start_up", "done"} <= kinds
    trials = [r for r in records if r["what"] == "trial"]
    assert {r["job"] for r in trials} == {f"trial-{k}" for k in range(8)}
    assert all(set(r["params"]) == {"alpha", "eta0", "learning_rate"} and r["loss"] > 0 for r in trials)
    assert all(r["rho"] is None or r["rho"] > 0 for r in records if r["what"] == "rho")
    assert (first_dir / "rho_gpus.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
