"""The local fake-GPU Slurm cluster of ``tests/slurm_kit.py``: real slurmctld/slurmd daemons.

These pin down the Slurm behaviour the scheduler relies on: exact GPU placement through one GRES
type per GPU index, exclusive use of a typed GPU, and SIGTERM delivery to a batch script via
``scancel --signal=TERM --full``.
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.slurm_kit import LocalSlurm, local_slurm, slurm_fixture

slurm = slurm_fixture("module")


def _wait_file(path: Path, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return path.read_text()


def test_cluster_shape(slurm: LocalSlurm) -> None:
    out = slurm.run("sinfo", "-h", "-N", "-o", "%N %T %c %G").stdout.split("\n")
    rows = sorted(line.split() for line in out if line.strip())
    gres = "gpu:g0:1,gpu:g1:1,gpu:g2:1,gpu:g3:1"
    assert rows == [["n1", "idle", "8", gres], ["n2", "idle", "8", gres], ["n3", "idle", "8", gres]]
    assert slurm.startup_seconds is not None and slurm.startup_seconds < 10


def test_pinned_job_sees_exactly_its_gpus(slurm: LocalSlurm) -> None:
    script = "#!/bin/sh\necho node=$SLURMD_NODENAME\necho cuda=$CUDA_VISIBLE_DEVICES\necho job_gpus=$SLURM_JOB_GPUS\n"
    job = slurm.sbatch(script, "-w", "n2", f"--gres={slurm.gpu_gres([1, 3])}")
    info = slurm.wait_job(job)
    assert (info["JobState"], info["ExitCode"], info["NodeList"]) == ("COMPLETED", "0:0", "n2")
    lines = slurm.job_output(job).splitlines()
    assert lines == ["node=n2", "cuda=1,3", "job_gpus=1,3"]


def test_same_typed_gpu_is_never_shared(slurm: LocalSlurm) -> None:
    root = slurm.root
    holder_script = (
        "#!/bin/sh\n"
        f"touch {root}/held-$SLURM_JOB_ID\n"
        f"while [ ! -e {root}/release-$SLURM_JOB_ID ]; do sleep 0.1; done\n"
    )
    other_script = f"#!/bin/sh\ntouch {root}/ran-$SLURM_JOB_ID\nsleep 300\n"
    first = slurm.sbatch(holder_script, "-w", "n3", "--gres=gpu:g2:1")
    # Same node, different GPU: must run alongside ``first`` (so PENDING below is not a slow scheduler).
    neighbour = slurm.sbatch(other_script, "-w", "n3", "--gres=gpu:g1:1")
    second = slurm.sbatch(f"#!/bin/sh\ntouch {root}/ran-$SLURM_JOB_ID\n", "-w", "n3", "--gres=gpu:g2:1")
    try:
        slurm.wait_job(first, {"RUNNING"})
        slurm.wait_job(neighbour, {"RUNNING"})
        _wait_file(root / f"held-{first}")
        time.sleep(2.5)  # a couple more scheduler passes
        info = slurm.job_info(second)
        assert (info["JobState"], info["Reason"]) == ("PENDING", "Resources")
        assert slurm.job_state(first) == "RUNNING"
        assert not (root / f"ran-{second}").exists()

        (root / f"release-{first}").touch()
        done = slurm.wait_job(first)
        assert done["JobState"] == "COMPLETED"
        after = slurm.wait_job(second)
        assert (after["JobState"], after["NodeList"]) == ("COMPLETED", "n3")
        assert (root / f"ran-{second}").exists()
        assert after["StartTime"] >= done["EndTime"]  # ISO timestamps compare as strings
    finally:
        slurm.run("scancel", str(first), str(neighbour), str(second), check=False)


def test_scancel_full_term_reaches_batch_script(slurm: LocalSlurm) -> None:
    root = slurm.root
    script = (
        "#!/bin/bash\n"
        f"trap 'echo TERM > {root}/term-$SLURM_JOB_ID; exit 0' TERM\n"
        f"touch {root}/ready-$SLURM_JOB_ID\n"
        "sleep 300 &\n"
        "wait\n"
    )
    job = slurm.sbatch(script, "-w", "n1")
    slurm.wait_job(job, {"RUNNING"})
    _wait_file(root / f"ready-{job}")  # the trap is installed
    assert not (root / f"term-{job}").exists()
    slurm.run("scancel", "--signal=TERM", "--full", str(job))
    assert _wait_file(root / f"term-{job}", timeout=15) == "TERM\n"
    info = slurm.wait_job(job, timeout=15)
    # The trap exits 0, so the job ends on its own terms; a plain scancel would report CANCELLED.
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0")


def test_exit_code_is_reported(slurm: LocalSlurm) -> None:
    job = slurm.sbatch("#!/bin/sh\nexit 3\n", "-w", "n1")
    info = slurm.wait_job(job)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "3:0")
    squeue = slurm.run("squeue", "-h", "-t", "all", "-j", str(job), "-O", "State:12,exit_code:8").stdout.split()
    assert squeue == ["FAILED", "768"]  # squeue shows the raw wait status (3 << 8)
    sacct = slurm.run("sacct", "--completion", "-n", "-j", str(job), "-o", "State,ExitCode").stdout.split()
    assert sacct == ["FAILED", "3:0"]


def test_kits_run_one_after_another_and_clean_up(slurm: LocalSlurm) -> None:
    # Two more clusters, one after the other, while the module's cluster keeps running.
    for _ in range(2):
        with local_slurm(nodes=1, gpus_per_node=1) as small:
            assert small.conf_path != slurm.conf_path and small.ctld_port != slurm.ctld_port
            job = small.sbatch("#!/bin/sh\nexec sleep 300\n", "--gres=gpu:g0:1")
            small.wait_job(job, {"RUNNING"})
            marker = f"SLURM_CONF={small.conf_path}".encode()
            deadline = time.monotonic() + 10
            while not _processes_with(marker):
                assert time.monotonic() < deadline, "job process never showed up"
                time.sleep(0.05)
        assert _processes_with(marker) == []  # stop() left no job process behind
    assert slurm.run("scontrol", "ping").returncode == 0


def _processes_with(marker: bytes) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found
