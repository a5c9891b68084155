"""The digits example on Slurm (issue 6): a local fake-GPU Slurm cluster, then the example with
``--executor slurm`` against it, then the cluster stopped again.

    scripts/slurm-demo [--budget test] [any examples/digits_search.py option]

The cluster is ``tests/slurm_kit.py``'s: slurmctld and three slurmd's (n1..n3, four fake GPUs each,
one GRES type per index) on 127.0.0.1, in a fresh /tmp directory. The example is unchanged: it
reads the nodes with ``scontrol`` and submits its jobs with ``sbatch``; only ``SLURM_CONF`` points at
the local cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.slurm_kit import local_slurm  # noqa: E402


def main() -> int:
    began = time.monotonic()
    with local_slurm(nodes=3, gpus_per_node=4) as slurm:
        print(f"local Slurm up in {time.monotonic() - began:.1f} s: nodes {', '.join(slurm.nodes)} "
              f"(SLURM_CONF={slurm.conf_path})", flush=True)
        env = {**os.environ, **slurm.env, "PYTHONPATH": str(ROOT)}
        argv = [sys.executable, str(ROOT / "examples" / "digits_search.py"), "--executor", "slurm", *sys.argv[1:]]
        done = subprocess.run(argv, env=env, cwd=ROOT)
        jobs = slurm.run("squeue", "--noheader", "--states=all", "--format=%i %j %T %N %b", check=False).stdout
        print(f"\nSlurm's own record of the run ({len(jobs.splitlines())} jobs, squeue --states=all):")
        print("\n".join(jobs.splitlines()[:12]) + ("\n..." if len(jobs.splitlines()) > 12 else ""))
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
