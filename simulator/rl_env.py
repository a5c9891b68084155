"""DeepShare's training environment (seeds/002, Algorithm 1) over our simulator: a ``gymnasium`` env
whose steps are the decisions of ``deepshare-rl`` inside a real :class:`~simulator.engine.Simulation`.

Each episode replays one DeepShare trace (by default one of its nine training episodes,
``data/deepshare/traces/train``, drawn by the env's seed) on DeepShare's setting: the
``deepshare-4x8`` cluster, 300-second leases (its rounds), no restart cost, the shipped contention
table (D35), optionally DeepShare's preemption at a ratio of 0.6. The simulation runs in a worker
thread with the policy's decider handing each decision point here and waiting for the action, so
the environment drives the same engine, agents, contention tracker and policy code that
``themis-sim`` runs; one thing runs at a time, and an episode is as deterministic as a simulation.

- observation and action: ``simulator.rl_state`` (placement half, candidate half, per-action
  features; a node list for one of K candidates, or nothing);
- reward of an action, ``reward="time"`` (the default): Eq. 2's two terms as a cost rate, summed
  over the simulated time until the next decision point: -(w1 x mean(1 - ratio) + w2 x (1 -
  utilisation)) x seconds / 300, the contention term as the action left it, the utilisation the
  GPU time the simulator actually ran (so a round's placements before the last cost nothing). The
  drain after the last decision (no job waits; what runs was placed) is not charged: it is out of
  the policy's hands, and as one lump at the episode's end it drowned every other reward. That is
  Eq. 2 shifted by its most, w2, and weighted by time. Why: Eq. 2 is positive, and DeepShare's traces are batches (every job at 0,
  the episode ends when the last does), so summed per decision or per round it pays a policy for
  lasting longer -- each "nothing" adds a step, each round of contention adds a round. Trained so
  (``reward="round"``: Eq. 2 read at the next decision point, after the round when the action ended
  it, as Algorithm 1 computes it after sleeping for T; 0 utilisation at the end), PPO learnt to say
  nothing, and its JCT was half again a random policy's (docs/contention.md). The EWMA, a per-round
  smoother, is not needed once the reward integrates over time;
- an episode ends when every job has finished (``terminated``); decision points with nothing to
  decide (no candidate fits) are skipped.

What differs from DeepShare's artifact: it placed one job per 300-second round in training and
looped until an invalid action at run time; here a round holds as many decisions as the policy
makes before it says nothing, in training and at run time alike, and an action that does not fit
ends the round like nothing (DeepShare's invalid action).
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from arbiter.cluster import load_cluster
from simulator.contention import ContentionModel
from simulator.engine import Simulation
from simulator.rl_model import spaces_of
from simulator.rl_policy import DeepShareRLPolicy
from simulator.rl_state import NOTHING, W1, Layout, Point, ewma_after
from simulator.workloads.deepshare import DATA, load_trace

TRAIN_TRACES = tuple(sorted((DATA / "traces" / "train").glob("*.json")))
HELD_OUT = DATA / "traces" / "real" / "trace0.json"
SETTING = {"cluster": "deepshare-4x8", "lease_s": 300.0, "restart_s": 0.0, "table": "deepshare"}
ROUND_S = SETTING["lease_s"]
REWARDS = ("time", "round")


class _Stop(BaseException):
    """Ends a simulation thread whose episode the env abandoned (not an Exception: nothing in the
    engine may swallow it)."""


class DeepShareEnv(gym.Env):
    """The environment (module docstring). ``traces``: the episodes' trace files; ``jobs``: each
    episode ``jobs`` consecutive jobs of its trace from an offset the env's seed draws (0: the whole
    trace; shorter episodes make more of them in the same time, the rounds' cost growing with the
    queue); ``w1``: the reward's contention weight; ``reward``: how Eq. 2 is paid (module
    docstring); ``preempt_at``: DeepShare's preemption ratio (None: off).
    ``reset(options={"trace": FILE, "offset": N})`` picks an episode."""

    metadata = {"render_modes": []}

    def __init__(self, traces: Sequence[str | Path] = TRAIN_TRACES, *, jobs: int = 0, w1: float = W1,
                 reward: str = "time", preempt_at: float | None = None, cluster: str = SETTING["cluster"],
                 table: str = SETTING["table"]):
        if not traces:
            raise ValueError("DeepShareEnv needs at least one trace file")
        if reward not in REWARDS:
            raise ValueError(f"unknown reward {reward!r}; choose from {', '.join(REWARDS)}")
        self.reward = reward
        if not 0.0 <= w1 <= 1.0:
            raise ValueError(f"w1 must be in [0, 1] (w2 = 1 - w1), got {w1}")
        self.traces = tuple(Path(t) for t in traces)
        self.jobs = jobs
        self.w1 = w1
        self.cluster = load_cluster(cluster)
        self.model = ContentionModel.load(table, preempt_at)
        machines: dict[str, int] = {}
        for gpu in self.cluster.gpus.values():
            machines[gpu.machine] = machines.get(gpu.machine, 0) + 1
        self.layout = Layout.for_cluster(machines, self.model.table.classes)
        self.observation_space, self.action_space = spaces_of(self.layout)
        self._to_env: queue.Queue = queue.Queue()
        self._to_sim: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._last: Point | None = None
        self._policy: DeepShareRLPolicy | None = None
        self._sim: Simulation | None = None
        self._mark = (0.0, 0.0)  # (simulated time, busy GPU-seconds) at the last decision point
        self.episode: dict[str, Any] = {}

    # -- the simulation's side (its thread) --------------------------------------------------------

    def _ask(self, point: Point) -> int:
        self._to_env.put(("point", point))
        action = self._to_sim.get()
        if action is _Stop:
            raise _Stop
        return action

    def _simulate(self, sim: Simulation) -> None:
        try:
            result = sim.run()
        except _Stop:
            return
        except BaseException as exc:  # handed to the env's thread, which raises it
            self._to_env.put(("error", exc))
            return
        self._to_env.put(("done", result))

    # -- gymnasium -----------------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._halt()
        options = options or {}
        trace = Path(options.get("trace") or self.traces[int(self.np_random.integers(len(self.traces)))])
        workload = load_trace(trace)
        offset = 0
        if 0 < self.jobs < len(workload.apps):
            offset = int(options.get("offset", self.np_random.integers(len(workload.apps) - self.jobs + 1)))
            workload = replace(workload, apps=workload.apps[offset:offset + self.jobs])
        policy = self._policy = DeepShareRLPolicy(decide=self._ask)
        sim = Simulation(self.cluster, workload, policy, lease_s=SETTING["lease_s"], restart_s=SETTING["restart_s"],
                         contention=self.model)
        self.episode = {"trace": trace.name, "offset": offset, "jobs": len(workload.apps), "steps": 0, "return": 0.0}
        self._thread = threading.Thread(target=self._simulate, args=(sim,), name="deepshare-env", daemon=True)
        self._thread.start()
        kind, payload = self._to_env.get()
        if kind != "point":
            self._raise(kind, payload)
            raise RuntimeError(f"trace {trace.name}: the episode ended before its first decision")
        self._last = payload
        self._sim = sim
        self._mark = (payload.now, self._busy(sim.runs.values()))
        return payload.obs, self._info(payload, self._mark[1])

    @staticmethod
    def _busy(runs) -> float:
        return math.fsum(r.busy_gpu_seconds for r in runs)

    def step(self, action):
        if self._thread is None or self._last is None:
            raise RuntimeError("call reset() before step()")
        last, action = self._last, int(action)
        taken = action if 0 <= action < len(last.valid) and last.valid[action] else NOTHING
        self._to_sim.put(action)
        kind, payload = self._to_env.get()  # the simulation thread waits again, or has ended
        self.episode["steps"] += 1
        if kind == "point":
            busy = self._busy(self._sim.runs.values())
            reward = self._reward(last, taken, payload, payload.now, busy)
            self._last = payload
            self.episode["return"] += reward
            return payload.obs, reward, False, False, self._info(payload, busy)
        self._raise(kind, payload)
        result = payload
        self._thread.join()
        self._thread = None
        reward = self._reward(last, taken, None, result.makespan, self._busy(result.apps)) if self.reward == "round" else 0.0
        self.episode["return"] += reward
        jct = [r.finished_at - r.spec.arrival_s for r in result.apps]
        self.episode.update(avg_jct_s=math.fsum(jct) / len(jct), makespan_s=result.makespan)
        obs = np.zeros(self.observation_space.shape, dtype=np.float32)
        return obs, reward, True, False, {**self._info(last, self._busy(result.apps)),
                                          "episode_summary": dict(self.episode)}

    def _reward(self, last: Point, taken: int, nxt: Point | None, now: float, busy: float) -> float:
        """The reward of ``taken`` at ``last``, read at ``nxt`` (None: the episode's end) at
        simulated time ``now`` with ``busy`` GPU-seconds run so far (module docstring)."""
        if self.reward == "round":
            return nxt.reward(self.w1) if nxt is not None else (1.0 - self.w1) * ewma_after(self._policy.ewma, 0.0)
        t0, busy0 = self._mark
        self._mark = (now, busy)
        dt = now - t0
        idle = dt - (busy - busy0) / self.layout.total_gpus
        return -(self.w1 * float(last.after[taken]) * dt + (1.0 - self.w1) * idle) / ROUND_S

    def _raise(self, kind: str, payload: Any) -> None:
        if kind == "error":
            self._thread = None
            raise payload

    @staticmethod
    def _info(point: Point, busy: float) -> dict[str, Any]:
        """What the step saw: valid actions, Eq. 2's terms, the simulated time and the busy
        GPU-seconds run so far (at the episode's end: the last decision point's, and the total)."""
        return {"valid": point.valid.copy(), "contention": point.contention, "util": point.util, "ewma": point.ewma,
                "now": point.now, "busy_gpu_s": busy}

    def action_masks(self) -> np.ndarray:
        """The valid actions now (before the first decision: NOTHING)."""
        if self._last is None:
            out = np.zeros(self.action_space.n, dtype=bool)
            out[NOTHING] = True
            return out
        return self._last.valid.copy()

    def _halt(self) -> None:
        """Abandon the episode under way, if any: its thread ends at its pending decision."""
        if self._thread is not None and self._thread.is_alive():
            self._to_sim.put(_Stop)
            self._thread.join()
        self._thread = None
        self._last = None
        while not self._to_env.empty():
            self._to_env.get_nowait()
        while not self._to_sim.empty():
            self._to_sim.get_nowait()

    def close(self) -> None:
        self._halt()
        super().close()
