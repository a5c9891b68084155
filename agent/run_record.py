"""A search run's record in its workdir (issue 11, item 2): JSONL as it goes, a plot at the end.

Why. rho over time was only in ``AppRunner.summary()``, which the user had to dump and tabulate,
and nothing of it survived a crash. Each run now appends to ``<run folder>/record.jsonl`` one JSON
object per line, flushed at once:

* ``{"t", "what": "rho", "rho", "gpus"}``: the app's rho with the GPUs it holds (``null``: none held,
  rho infinite), every ``rho_every_s``;
* ``{"t", "what": "grant" | "revoke" | "release", "gpus", "held"}``: GPU ids, and the GPUs held after;
* ``{"t", "what": "trial", "job", "iteration", "loss", "params"}``: a trial's result when the tuner
  stops it (pruned, rung reached, done), and ``"what": "failed"`` when the runner gives up on it;
* ``{"t", "what": "start_up", "job", "seconds"}``: launch to first report of a run (item 5);
* ``{"t", "what": "done" | "stopped", ...}`` at the end.

At the end of the run :func:`plot` draws ``<run folder>/rho_gpus.png``: rho and GPUs held over time.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["RECORD", "PLOT", "RunRecord", "plot"]

RECORD = "record.jsonl"
PLOT = "rho_gpus.png"


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunRecord:
    """Appends records to ``folder/record.jsonl`` (one ``write`` per line, O_APPEND)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self.path = self.folder / RECORD

    def write(self, t: float, what: str, **fields: Any) -> None:
        line = json.dumps({"t": round(t, 3), "what": what, **{k: _plain(v) for k, v in fields.items()}},
                          default=str, allow_nan=False)
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


def plot(path: str | os.PathLike[str], app: str, rho: Sequence[tuple[float, float]],
         held: Sequence[tuple[float, int]], start: float, end: float) -> Path:
    """rho (finite values; gaps where none was held) and GPUs held over time, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), tight_layout=True)
    ax_rho, ax_gpus = fig.subplots(2, 1, sharex=True)
    xs = [t - start for t, _ in rho]
    ys = [r if math.isfinite(r) else float("nan") for _, r in rho]
    ax_rho.plot(xs, ys, color="tab:red", marker=".", linewidth=1)
    ax_rho.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    ax_rho.set_ylabel("rho (1 = fair share)")
    ax_rho.set_title(f"{app}: finish-time fairness and GPUs held")
    steps = [(0.0, 0)] + [(t - start, n) for t, n in held] + [(end - start, held[-1][1] if held else 0)]
    ax_gpus.step([t for t, _ in steps], [n for _, n in steps], where="post", color="tab:blue")
    ax_gpus.set_ylabel("GPUs held")
    ax_gpus.set_xlabel("seconds since the start")
    out = Path(path)
    fig.savefig(out, dpi=100)
    return out
