"""The ``ray`` executor against the shared executor tests, in a network namespace of its own.

Ray binds to the machine's network address (it ignores ``--node-ip-address=127.0.0.1``), so its
tests run where loopback is the only interface: this test (root) makes a uniquely named network
namespace, brings ``lo`` up, runs ``tests/ray_shared_tests.py`` in it with ``THEMIS_IN_NETNS=1``, and
deletes the namespace whatever happens. Whatever the inner run left in the namespace is killed by
pid (``ip netns pids``): only processes this test started can be in it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def kill_what_is_left(ns: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in ip("netns", "pids", ns, check=False).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if not pids:
            return
        time.sleep(2.0)


def test_the_ray_executor_passes_the_shared_executor_tests_in_a_loopback_only_namespace(tmp_path):
    assert os.geteuid() == 0, "making a network namespace needs root"
    ns = f"themis-ray-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    timings = tmp_path / "timings.json"
    env = {**os.environ, "THEMIS_IN_NETNS": "1", "THEMIS_RAY_TIMINGS": str(timings), "PYTHONPATH": str(ROOT),
           "RAY_USAGE_STATS_ENABLED": "0"}
    ip("netns", "add", ns)
    try:
        ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        began = time.monotonic()
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "pytest", "-q", "-p",
                                 "no:cacheprovider", "tests/ray_shared_tests.py"],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)  # pytest tears its fixtures (the Ray cluster) down
            try:
                output, _ = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
            output += f"\n[timed out after {TIMEOUT_S} s]"
        took = time.monotonic() - began
    finally:
        kill_what_is_left(ns)
        ip("netns", "del", ns, check=False)
    measured = json.loads(timings.read_text()) if timings.exists() else {}
    print(f"inner run: {took:.1f} s; measured: {json.dumps(measured, sort_keys=True)}")
    tail = "\n".join(output.splitlines()[-60:])
    assert proc.returncode == 0, f"inner pytest exited {proc.returncode}:\n{tail}"
    assert ns not in ip("netns", "list").stdout
