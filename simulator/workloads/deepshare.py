"""DeepShare's job traces (seeds/002, section VI; ``data/deepshare/``): 256 distributed jobs queued at 0.

``--workload deepshare`` is DeepShare's evaluation trace ("real0", ``traces/real/trace0.json``);
``--workload deepshare:FILE`` any trace in its JSON form::

    {"<id>": {"model": "MoE", "gpu_demand": 8, "total_samples_to_train": 130785.648}, ...}

Each job becomes an app of one ``fixed`` job (a DeepShare job is one training run, not a search):

- app ``ds-<id>``, arriving at 0: DeepShare queues every job of a trace at once, so JCT counted
  from submission is the finish time;
- model: DeepShare's model name, with placement slowdowns S = 1 (``agent/profiles/deepshare.toml``,
  which the workload names for the simulator, ``Workload.profile_tables``), and its contention class
  the same name (D35);
- GPUs: ``gpu_demand``;
- work: the job's time alone at its *reference placement*, T = samples / isolated throughput of
  (model, GPUs, nodes) from ``data/deepshare/isolated_thp.csv``, as T iterations of one second at
  its whole demand (``iter_time_s`` = GPUs: one iteration is one GPU-second per GPU, Eq. 1 at S = 1).
  The reference placement is the one DeepShare's own LAS and SRTF try first: the job spread over as
  many of the cluster's 4 nodes as divide its demand (2 GPUs on 2 nodes, 4 on 4, 8 on 4). DeepShare
  measured no one-node throughput, and D1 cannot tell 2 nodes from 4, so every placement runs at
  that speed before contention (docs/contention.md, "what does not reproduce").

DeepShare sized the jobs to about an hour alone ("expected training time in an isolated cluster as
one hour"): at the reference placement they take 0.8-1.4 hours.

Knobs: ``path`` (a trace file), ``jobs`` (only the jobs with the ``jobs`` smallest ids, for a small
slice; 0 = all), ``nodes`` (the nodes of the reference placement's cluster, default 4).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping
from functools import cache
from pathlib import Path

from simulator.workload import AppSpec, JobSpec, Workload
from simulator.workloads import WorkloadError, register

DATA = Path(__file__).resolve().parents[2] / "data" / "deepshare"
DEFAULT_TRACE = DATA / "traces" / "real" / "trace0.json"
ISOLATED_THP = DATA / "isolated_thp.csv"
PROFILE_TABLE = str(Path(__file__).resolve().parents[2] / "agent" / "profiles" / "deepshare.toml")
DEFAULT_NODES = 4
FIELDS = ("model", "gpu_demand", "total_samples_to_train")


@cache
def isolated_throughputs(path: Path = ISOLATED_THP) -> Mapping[tuple[str, int, int], float]:
    """(model, GPUs, nodes) -> samples per second alone (DeepShare's ``isolated_thp.csv``)."""
    try:
        rows = list(csv.reader(path.read_text(encoding="utf-8-sig").splitlines()))
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read DeepShare's isolated throughputs: {exc.strerror}") from None
    out: dict[tuple[str, int, int], float] = {}
    for line, row in enumerate(rows[1:], start=2):
        try:
            model, gpus, nodes = row[0].split(",")
            out[(model.strip(), int(gpus), int(nodes))] = float(row[1])
        except (ValueError, IndexError):
            raise WorkloadError(f"{path}:{line}: expected \"<model>,<GPUs>,<nodes>\",<samples/s>, got {row}") from None
    return out


def reference_nodes(gpus: int, nodes: int = DEFAULT_NODES) -> int:
    """How many nodes DeepShare's LAS and SRTF spread a job over first: the most nodes, at least 2,
    of the cluster's that divide its demand evenly (1 when none does)."""
    return max((n for n in range(2, nodes + 1) if gpus % n == 0), default=1)


def job_seconds(model: str, gpus: int, samples: float, nodes: int = DEFAULT_NODES) -> float:
    """The job's time alone at its reference placement (module docstring)."""
    key = (model, gpus, reference_nodes(gpus, nodes))
    thp = isolated_throughputs().get(key)
    if thp is None:
        known = sorted({(m, g) for m, g, _ in isolated_throughputs()})
        raise WorkloadError(f"DeepShare measured no throughput for {model!r} on {gpus} GPUs over {key[2]} nodes; "
                            f"known (model, GPUs): {known}")
    return samples / thp


def _job(path: Path, job_id: str, entry: object, nodes: int) -> tuple[str, int, float]:
    where = f"{path}: job {job_id!r}"
    if not isinstance(entry, Mapping):
        raise WorkloadError(f"{where}: expected an object with {', '.join(FIELDS)}")
    missing = [f for f in FIELDS if f not in entry]
    if missing:
        raise WorkloadError(f"{where}: missing {', '.join(missing)}")
    model, gpus, samples = entry["model"], entry["gpu_demand"], entry["total_samples_to_train"]
    if not isinstance(model, str) or not model:
        raise WorkloadError(f"{where}: model must be a name, got {model!r}")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise WorkloadError(f"{where}: gpu_demand must be a whole number >= 1, got {gpus!r}")
    if isinstance(samples, bool) or not isinstance(samples, (int, float)) or not (samples > 0 and math.isfinite(samples)):
        raise WorkloadError(f"{where}: total_samples_to_train must be a number > 0, got {samples!r}")
    try:
        return model, gpus, job_seconds(model, gpus, float(samples), nodes)
    except WorkloadError as exc:
        raise WorkloadError(f"{where}: {exc}") from None


def load_trace(path: str | Path, *, jobs: int = 0, nodes: int = DEFAULT_NODES, seed: int = 0) -> Workload:
    """The workload of a DeepShare trace file (module docstring)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read DeepShare trace: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{path}:{exc.lineno}: not JSON: {exc.msg}") from None
    if not isinstance(data, Mapping) or not data:
        raise WorkloadError(f"{path}: a DeepShare trace is a non-empty object of jobs by id")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 0:
        raise WorkloadError(f"workload 'deepshare': jobs must be a whole number >= 0, got {jobs!r}")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise WorkloadError(f"workload 'deepshare': nodes must be a whole number >= 1, got {nodes!r}")
    ids = sorted(data, key=lambda i: (int(i) if i.isdigit() else math.inf, i))
    if jobs:
        ids = ids[:jobs]
    width = max(3, max(len(i) for i in ids))
    apps = []
    for job_id in ids:
        model, gpus, seconds = _job(path, job_id, data[job_id], nodes)
        app_id = f"ds-{job_id.zfill(width)}"
        apps.append(AppSpec(app_id, 0.0, model, "fixed", (JobSpec(f"{app_id}/j0", seconds, float(gpus), gpus),),
                            seed=seed))
    demand = sum(a.demand_max for a in apps)
    source = (f"DeepShare trace {path.name} ({len(apps)} of its {len(data)} jobs, {demand} GPUs demanded, all at t=0; "
              f"work at {nodes}-node spread throughputs)")
    return Workload("deepshare", tuple(apps), source, profile_tables=(PROFILE_TABLE,))


@register("deepshare")
def deepshare(*, seed: int = 0, path: str = str(DEFAULT_TRACE), jobs: int = 0, nodes: int = DEFAULT_NODES) -> Workload:
    """DeepShare's traces: 256 distributed jobs at t=0 (real0 by default; deepshare:FILE for another)."""
    return load_trace(path, jobs=jobs, nodes=nodes, seed=seed)
