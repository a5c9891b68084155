"""A simulated run's rounds, recorded for the dashboard (``themis-sim run --record-rounds``; off by
default and in every benchmark and experiment).

The recorder watches the simulation through its ``on_round`` hook and feeds the same views the live
arbiter shows (``arbiter.dashboard.feed.EngineFeed``) into a recording beside ``summary.json``
(``rounds.jsonl.gz``); ``themis-sim view OUT`` serves it with a time slider. It only reads: a
recorded run's summary is the unrecorded one's (``tests/test_dashboard.py`` checks it).

Agents in the simulator answer in-process, so the recorder also keeps what a round's result does not
carry: the waiting rho of each app that reported infinity (D13), recomputed from its agent at the
round's time with the agent's own code (a rank by measured slowdowns, D21, computes its own and is
not shown).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agent.agent import packed
from agent.fairness import waiting_rho
from arbiter.dashboard.feed import EngineFeed
from arbiter.dashboard.recording import RECORDING, RecordingWriter
from arbiter.rounds import RoundResult
from simulator.engine import Simulation

__all__ = ["RECORDING", "RoundRecorder"]


class RoundRecorder:
    """Records ``sim``'s rounds into ``path`` from now on; :meth:`close` after ``sim.run()``."""

    def __init__(self, sim: Simulation, path: str | Path, *, meta: Mapping[str, Any], settings: Mapping[str, Any]):
        self.sim = sim
        self.writer = RecordingWriter(path, meta)
        measured = sim.engine.rank == "measured"
        self.feed = EngineFeed(self.writer, sim.engine, model_of=self._model,
                               bound_model_of=self._model if measured else _none)
        self.feed.start(settings)
        sim.on_round = self.after_round

    def _model(self, app: str) -> str | None:
        run = self.sim.runs.get(app)
        return run.spec.model if run is not None else None

    def after_round(self, result: RoundResult) -> None:
        self.feed.after_round(result, rho_wait=self._waits(result))

    def _waits(self, result: RoundResult) -> dict[str, float]:
        if self.sim.engine.rank != "reported":
            return {}
        engine, out = self.sim.engine, {}
        for app, rho in result.rho.items():
            run = self.sim.runs.get(app)
            if not math.isinf(rho) or run is None or app not in engine.apps or run.app.demand_now() <= 0:
                continue
            out[app] = waiting_rho(run.app, now=result.now, n_avg=engine.n_avg(app, result.now),
                                   cluster_size=engine.cluster.size, time_left=run.agent.time_left, packed=packed)
        return out

    def close(self) -> None:
        """The state after the last round (the apps that finished since), then the file."""
        self.feed.sync(self.sim.now)
        self.writer.close()


def _none(_: str) -> None:
    return None
