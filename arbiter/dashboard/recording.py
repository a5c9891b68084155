"""A run's rounds on disk: the feed calls written as gzipped JSON lines, read back into a
:class:`~arbiter.dashboard.memory.MemorySource` to show the finished run with a time slider.

The first line names the format and the run (``{"op": "recording", "version": 1, "meta": {...}}``);
each later line is one feed call: ``layout``, ``settings``, ``apply`` (the leases and apps that
changed), ``round`` (a :class:`~arbiter.dashboard.model.RoundView`) or ``event``. The views are
written by :func:`~arbiter.dashboard.model.to_json`, so the file reads like the API.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from arbiter.dashboard.memory import MemorySource
from arbiter.dashboard.model import (
    AppView,
    BadView,
    ClusterLayout,
    EventView,
    LeaseView,
    RoundView,
    from_json,
    to_json,
)

RECORDING = "rounds.jsonl.gz"  # written beside a run's summary.json
VERSION = 1


class RecordingError(ValueError):
    """A file that is not a recording this code can read; the message names the file and line."""


class RecordingWriter:
    """A feed that writes every call to ``path`` (gzip). ``meta`` describes the run (policy,
    workload, cluster, seed): it titles the page."""

    def __init__(self, path: str | Path, meta: Mapping[str, Any]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._out: TextIO = gzip.open(self.path, "wt", encoding="utf-8", compresslevel=6)
        self._line({"op": "recording", "version": VERSION, "meta": dict(meta)})
        self.rounds = 0

    def _line(self, record: Mapping[str, Any]) -> None:
        self._out.write(json.dumps(record, separators=(",", ":")))
        self._out.write("\n")

    def set_layout(self, layout: ClusterLayout) -> None:
        self._line({"op": "layout", "layout": to_json(layout)})

    def set_settings(self, settings: Mapping[str, Any]) -> None:
        self._line({"op": "settings", "settings": to_json(dict(settings))})

    def apply(self, now: float, leases: Mapping[str, LeaseView | None], apps: Mapping[str, AppView | None]) -> None:
        self._line({"op": "apply", "now": to_json(now), "leases": to_json(leases), "apps": to_json(apps)})

    def push_round(self, view: RoundView) -> None:
        self.rounds += 1
        self._line({"op": "round", "round": to_json(view)})

    def push_event(self, event: EventView) -> None:
        self._line({"op": "event", "event": to_json(event)})

    def close(self) -> None:
        self._out.close()


def read_meta(path: str | Path) -> dict[str, Any]:
    """The run a recording describes (its first line)."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return _header(path, f.readline())


def _header(path: str | Path, line: str) -> dict[str, Any]:
    try:
        head = json.loads(line)
    except json.JSONDecodeError:
        head = None
    if not isinstance(head, dict) or head.get("op") != "recording":
        raise RecordingError(f"{path}: not a recording of rounds (line 1 should name the format)")
    if head.get("version") != VERSION:
        raise RecordingError(f"{path}: recording version {head.get('version')!r}, this code reads {VERSION}")
    return dict(head.get("meta") or {})


def load_recording(path: str | Path) -> MemorySource:
    """A recorded run as a source with every round, event and point kept."""
    path = Path(path)
    if not path.is_file():
        raise RecordingError(f"{path}: no such file (record a run with --record-rounds)")
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            meta = _header(path, f.readline())
            source = MemorySource(title=str(meta.get("title") or path.parent.name), mode="recorded", meta=meta,
                                  rounds_kept=None, events_kept=None, history_kept=100_000)
            for number, line in enumerate(f, start=2):
                try:
                    _replay(source, json.loads(line))
                except (json.JSONDecodeError, BadView, KeyError, TypeError, ValueError) as exc:
                    raise RecordingError(f"{path}, line {number}: {exc}") from None
    except (OSError, EOFError) as exc:
        raise RecordingError(f"{path}: cannot read it: {exc}") from None
    return source


def _replay(source: MemorySource, record: dict[str, Any]) -> None:
    op = record.get("op")
    if op == "apply":
        leases = {g: None if v is None else from_json(LeaseView, v, f"lease {g}") for g, v in record["leases"].items()}
        apps = {a: None if v is None else from_json(AppView, v, f"app {a}") for a, v in record["apps"].items()}
        source.apply(from_json(float, record["now"], "now"), leases, apps)
    elif op == "round":
        source.push_round(from_json(RoundView, record["round"], "round"))
    elif op == "event":
        source.push_event(from_json(EventView, record["event"], "event"))
    elif op == "layout":
        source.set_layout(from_json(ClusterLayout, record["layout"], "layout"))
    elif op == "settings":
        source.set_settings(record["settings"])
    else:
        raise ValueError(f"unknown record {op!r}")
