"""Finished simulations kept in an experiment's output folder, so that more seeds cost only the new ones.

A full figure takes hours on two cores (docs/reproduction.md), and every published figure should
have at least five seeds (issue 13). Without a store, going from 3 seeds to 5, or resuming after an
interrupted run, means simulating everything again. With it, ``themis-sim experiment fig14 --seeds
5 --out X`` after ``--seeds 3 --out X`` simulates seeds 3 and 4 only and aggregates all five, and
an interrupted run started again simulates only what had not finished (``--fresh`` ignores the
store).

A run is kept under a key that names everything its outcome depends on: the ``simulate`` keyword
arguments (seed included), the contents of a trace or cluster file they name, and a fingerprint of
the code and data that simulate it -- every file of
the ``agent``, ``arbiter``, ``simulator`` and ``protos`` packages except the few that only run,
aggregate or draw simulations (``NOT_OUTCOME``: the command line, the experiments, the plots, the
seed aggregation), the Philly trace and the slowdown
tables, plus the plugins and profile tables named in the environment (``THEMIS_PLUGINS``,
``THEMIS_PROFILES``). Outcomes are deterministic given these (D16), so a kept run is exactly what a
new one would return; any change to the code gives new keys, and old runs are simply not found.
Plugin files are hashed by content; a plugin given as a module name, and plugins installed as
entry points, are not (only the name is): after editing one, run with ``--fresh``.
Each run is written by the process that simulated it as soon as it ends (a temporary file renamed
into place), so an interrupted experiment keeps what finished. A file that cannot be read is
reported, set aside with a ``.corrupt`` suffix and simulated again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console

#: where the simulator's runs say what they do (stderr; ``simulator.runs`` prints through it too)
console = Console(stderr=True)

__all__ = ["RunStore", "code_fingerprint"]

ROOT = Path(__file__).resolve().parent.parent
#: What a simulation's outcome depends on besides its arguments (folders: every file under them).
CODE_PATHS = ("agent", "arbiter", "simulator", "protos", "data/philly", "data/profiles")
#: Files under CODE_PATHS that only run, aggregate or draw the simulations: a change to them (a new
#: flag, a plot, an experiment's table) leaves every kept run valid. An experiment's run arguments
#: are part of each run's key, so editing them in ``experiments.py`` still gives new keys.
NOT_OUTCOME = frozenset({"simulator/__main__.py", "simulator/cli.py", "simulator/experiments.py",
                         "simulator/plots.py", "simulator/seeds.py", "simulator/blox_experiment.py"})
_SUFFIXES = (".py", ".toml", ".csv", ".json", ".proto")


@functools.cache
def _tree_digest(root: Path = ROOT) -> str:
    digest = hashlib.sha256()
    for top in CODE_PATHS:
        for path in sorted((root / top).rglob("*")):
            name = path.relative_to(root).as_posix()
            if (path.is_file() and path.suffix in _SUFFIXES and "__pycache__" not in path.parts
                    and name not in NOT_OUTCOME):
                digest.update(name.encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


def _named_files(env: str) -> list[str]:
    """The files an environment variable names (os.pathsep-separated; modules by name as they are)."""
    out = []
    for item in filter(None, os.environ.get(env, "").split(os.pathsep)):
        path = Path(item).expanduser()
        out.append(hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else item)
    return out


def code_fingerprint() -> str:
    """A digest of the code and data that simulate a run, and of the user's plugins and profiles."""
    digest = hashlib.sha256(_tree_digest().encode())
    for env in ("THEMIS_PLUGINS", "THEMIS_PROFILES"):
        digest.update(json.dumps([env, _named_files(env)]).encode())
    return digest.hexdigest()


class RunStore:
    """Run summaries by key in ``folder`` (one JSON file each). ``code`` defaults to
    :func:`code_fingerprint`; with ``reuse`` False nothing is read (every run is simulated again
    and kept anew). ``reused`` and ``simulated`` count what :func:`simulator.runs.run_seeds` took
    from the store and what it had to run."""

    def __init__(self, folder: Path, code: str | None = None, *, reuse: bool = True):
        self.folder = Path(folder)
        self.code = code if code is not None else code_fingerprint()
        self.reuse = reuse
        self.reused = 0
        self.simulated = 0

    def key(self, job: Mapping[str, Any]) -> str:
        """The file stem for a run: a digest of its arguments, the contents of the files they name
        (a trace, cluster or profile table given as a path, also as a workload knob such as
        ``trace=``), and the code fingerprint."""
        files = {}
        named = [(name, value) for name, value in job.items() if name != "workload_knobs"]
        named += [(f"workload_knobs.{k}", v) for k, v in (job.get("workload_knobs") or {}).items()]
        for name, value in named:
            if isinstance(value, str) and value and Path(value).is_file():
                files[name] = hashlib.sha256(Path(value).read_bytes()).hexdigest()
        text = json.dumps({"job": job, "files": files, "code": self.code}, sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def path(self, job: Mapping[str, Any]) -> Path:
        return self.folder / f"{self.key(job)}.json"

    def get(self, job: Mapping[str, Any]) -> dict[str, Any] | None:
        """The kept summary of ``job``, or None. An unreadable file (a crash while writing it, an
        edit) is renamed ``.corrupt``, reported on stderr, and the run counts as missing."""
        path = self.path(job)
        if not self.reuse or not path.exists():
            return None
        try:
            kept = json.loads(path.read_text())
            if not isinstance(kept, dict) or kept.get("job") != json.loads(json.dumps(job, default=repr)):
                raise ValueError("it holds another run's summary")
            return kept["summary"]
        except (OSError, ValueError, KeyError) as err:
            aside = path.with_suffix(".corrupt")
            path.replace(aside)
            console.print(f"[yellow]kept run {path} could not be read ({err}); moved to {aside.name}, "
                          "simulating it again[/]")
            return None

    def put(self, job: Mapping[str, Any], summary: Mapping[str, Any]) -> None:
        """Keep ``summary`` for ``job``: written to a temporary file, then renamed into place."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path(job)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"job": job, "summary": summary}, default=repr))
        tmp.replace(path)

    def keep(self, job: Mapping[str, Any], summary: Mapping[str, Any]) -> dict[str, Any]:
        """Keep a fresh ``summary`` and return it as it was kept (through JSON: tuples become
        lists), so fresh and kept runs aggregate alike."""
        kept = json.loads(json.dumps(summary, default=repr))
        self.put(job, kept)
        return kept

    def tally(self) -> str:
        """What the store gave and what had to run, for the command's last lines."""
        return f"{self.reused} runs taken from {self.folder}, {self.simulated} simulated"
