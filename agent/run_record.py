"""A search run's record in its workdir (issue 11, item 2): JSONL as it goes, a plot at the end.

Why. rho over time was only in ``AppRunner.summary()``, which the user had to dump and tabulate,
and nothing of it survived a crash. Each run now appends to ``<run folder>/record.jsonl`` one JSON
object per line, flushed at once:

* ``{"t", "what": "rho", "rho", "gpus"}``: the app's rho with the GPUs it holds (``null``: none held,
  rho infinite), every ``rho_every_s``;
* ``{"t", "what": "grant" | "revoke" | "release", "gpus", "held"}``: GPU ids, and the GPUs held after;
* ``{"t", "what": "trial", "job", "iteration", "loss", "params", "outcome"}``: a trial's result when the
  tuner stops it, and again when its fate changes; ``outcome`` is the tuner's word for it
  (``TunerAdapter.outcome``: ``paused`` at a rung whose end decides it, ``pruned``, ``completed``,
  ``diverged``, ``failed``; null for an adapter that does not say), and ``"what": "failed"`` when the
  runner gives up on it;
* ``{"t", "what": "start_up", "job", "seconds"}``: launch to first report of a run (item 5);
* ``{"t", "what": "done" | "stopped", ...}`` at the end.

At the end of the run :func:`plot` draws ``<run folder>/rho_gpus.png``: rho and GPUs held over time.

Beside it, the tuner keeps its own journal (issue 36, item 3), ``<run folder>/tuner.jsonl``
(:class:`TunerJournal`): every report the tuner took and every job the runner gave up on, in order,
with each trial's hyperparameters on its first line. It is what a resumed run replays
(``AppRunner.create(resume=True)``), so the tuner takes up its brackets and curves where the
interrupted run left them; it is written whether or not ``record.jsonl`` is.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["JOURNAL", "PLOT", "RECORD", "RunRecord", "TunerJournal", "finished_at", "history", "plot"]

RECORD = "record.jsonl"
PLOT = "rho_gpus.png"
JOURNAL = "tuner.jsonl"


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
        _append(self.path, line)


def _append(path: Path, line: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())  # one write: a reader never sees half a line and another
    finally:
        os.close(fd)


def _last_line(path: Path, limit: int = 65536) -> dict[str, Any] | None:
    """The last whole JSON line of ``path`` (None: no file, empty, or not JSON)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            lines = f.read().splitlines()
    except OSError:
        return None
    for raw in reversed(lines):
        try:
            value = json.loads(raw)
        except ValueError:
            continue  # a line cut short (the process died while writing it)
        return value if isinstance(value, dict) else None
    return None


def finished_at(folder: str | os.PathLike[str]) -> float | None:
    """When the run in ``folder`` finished, from its ``record.jsonl``: the time of its closing
    ``"done"`` line; None when the run did not finish (its last line is ``"stopped"`` or anything
    else: it was interrupted) or kept no record."""
    last = _last_line(Path(folder) / RECORD)
    if last is not None and last.get("what") == "done" and isinstance(last.get("t"), (int, float)):
        return float(last["t"])
    return None


class TunerJournal:
    """What a tuner was told, one JSON object per line, appended as it goes (``tuner.jsonl``):
    ``{"what": "observe", "job", "iteration", "loss", "iter_time_s"}`` for every report it took
    (``loss`` null: infinite, a diverged trial) and ``{"what": "fail", "job"}`` for every job the
    runner gave up on; a job's first line also has its ``"params"``. A resumed run replays it
    (``hyperparam_adapters.base.JournaledTuner.resume``)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def write(self, what: str, job: str, **fields: Any) -> None:
        _append(self.path, json.dumps({"what": what, "job": job, **{k: _plain(v) for k, v in fields.items()}},
                                      default=str, allow_nan=False, sort_keys=True))

    def read(self) -> list[dict[str, Any]]:
        """Every line, in order ([] without a journal). A last line cut short is left out; a broken
        line anywhere else is an error (the journal is not what the tuner was told)."""
        try:
            raw = self.path.read_bytes().splitlines()
        except FileNotFoundError:
            return []
        out: list[dict[str, Any]] = []
        for n, text in enumerate(raw, 1):
            if not text.strip():
                continue
            try:
                line = json.loads(text)
                if not isinstance(line, dict) or not isinstance(line.get("job"), str):
                    raise ValueError("not a journal line")
            except ValueError as exc:
                if n == len(raw):
                    break  # cut short by a crash
                raise ValueError(f"{self.path}, line {n}: {exc}") from None
            out.append(line)
        return out

    def modified(self) -> float | None:
        try:
            return self.path.stat().st_mtime
        except FileNotFoundError:
            return None


def history(folder: str | os.PathLike[str]) -> tuple[list[tuple[float, float]], list[tuple[float, int]], float] | None:
    """rho over time, GPUs held over time and the first time, as ``record.jsonl`` in ``folder`` has
    them: every session of the run, a resumed one's earlier sessions too (the plot's data; a
    session's own lists would cover only what came after the resume). None without a record."""
    path = Path(folder) / RECORD
    if not path.exists():
        return None
    rho: list[tuple[float, float]] = []
    held: list[tuple[float, int]] = []
    first = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                entry = json.loads(line)
                t = float(entry["t"])
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line of a killed run
            first = t if first is None else min(first, t)
            what = entry.get("what")
            if what == "rho":
                value = entry.get("rho")
                rho.append((t, math.inf if value is None else float(value)))
            elif what in ("grant", "revoke", "release") and isinstance(entry.get("held"), list):
                held.append((t, len(entry["held"])))
            elif what in ("done", "stopped"):
                held.append((t, 0))  # a session that ended let its GPUs go
    return (rho, held, first) if first is not None else None


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
