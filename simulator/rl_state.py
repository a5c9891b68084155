"""DeepShare's RL formulation (seeds/002, section IV) over the placements our simulator makes: the
state, the action and the reward, as pure functions of one decision point.

The environment (``simulator.rl_env``, training) and the policy (``simulator.rl_policy``, running a
trained model in the simulator) both build their views here, so a model sees at run time exactly
what it saw in training.

Taken from the paper (and its artifact, read for these facts):

- **state**: a tensor of shape [nodes, 2 x GPUs per node]. The left half is the placement: slot
  (n, g) holds the profile of the job on the g-th busy GPU of node n. The right half is the
  candidates: slot (m - 1, p - 1) holds a candidate job that could run on m nodes with p GPUs each
  (its demand is m x p, so the K candidates, which have different demands, never share a slot);
- **candidates**: the first job of each GPU demand from the head of the waiting queue, K of them;
- **action**: a list of nodes for one of the K candidates (the job gets demand / m GPUs on each of
  the m nodes), or nothing (end the round); node lists of 2^i nodes, i >= 1 (2 and 4 on DeepShare's
  4-node testbed: its seven lists, six pairs and all four) -- one node is not offered, as DeepShare
  offers it neither to its RL policy nor to its LAS and SRTF;
- **reward**: -w1 x mean over placed jobs of (1 - contention ratio) + w2 x EWMA of the cluster's
  GPU utilisation, w2 = 1 - w1 (Eq. 2; the artifact's EWMA has span 10 and the reward is 0 while
  no job is placed).

What differs, and why:

- a slot holds features, not one serial number: present, the contention class one-hot, the job's
  GPUs over the cluster's, the nodes it spans over all nodes, its contention ratio now (left) or the
  best ratio it would get on a valid node list of that shape (right), and whether such a list is
  free now (right). A multi-layer perceptron learns little from a class id read as a magnitude;
- the observation also carries, per action, whether it is valid now, the ratio the job would run
  at, the lowest ratio it would leave a neighbour and the mean ratio after it (the reward's
  contention term), and four numbers about the cluster (utilisation now and its EWMA, the share of
  GPUs free, the queue's length on a log scale: how much is left, which the critic needs). stable-baselines3's PPO has no action masks; with the validity in
  the observation it learns which lists fit, and with the ratios it need not learn the 36 x 36
  table from rewards within a 15-minute training on two cores;
- the EWMA is the plain recursive one (alpha = 2 / (span + 1), started at the first sample), its
  samples the utilisation after each round the policy decides in; within a round the reward counts
  the utilisation reached so far as the round's sample.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from arbiter.contention import FLOOR, ContentionTable, JobKind

#: Reward weight of the contention term; w2 = 1 - w1 (the paper's branch B, its headline figures).
W1 = 0.4
#: The EWMA's span for the utilisation term (DeepShare's artifact).
SPAN = 10
#: Candidates per decision: one per GPU demand (DeepShare's traces have 2, 4 and 8).
K = 3
NOTHING = 0  # the action that places nothing and ends the round
ACTION_FEATURES = 4  # valid, the job's ratio, the lowest ratio it leaves a neighbour, the mean ratio after
GLOBALS = 4  # utilisation now, its EWMA, the share of GPUs free, the queue's length (log scale)
QUEUE_SCALE = 1024  # a queue this long reads as 1: what is left to do is what the critic must see


class LayoutError(ValueError):
    """A cluster, table or model file the formulation cannot be built for; the message says which."""


def natural(text: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text))


@dataclass(frozen=True)
class Layout:
    """What fixes the shapes of the state and the action space: the cluster's nodes, their GPUs,
    the contention table's classes, K and the node counts a job may spread over. A trained model
    runs only where its layout is the same."""

    nodes: tuple[str, ...]
    gpus_per_node: int
    classes: tuple[str, ...]
    k: int = K
    spreads: tuple[int, ...] = (2, 4)

    def __post_init__(self) -> None:
        if not self.nodes or self.gpus_per_node < 1:
            raise LayoutError("a layout needs at least one node with at least one GPU")
        if len(self.nodes) > 8:
            raise LayoutError(f"DeepShare's action space lists node subsets; {len(self.nodes)} nodes are too many "
                              "(at most 8)")
        if not self.classes or self.k < 1:
            raise LayoutError("a layout needs contention classes and at least one candidate")
        if not self.subsets:
            raise LayoutError(f"no node list of {self.spreads} nodes fits {len(self.nodes)} nodes")

    @staticmethod
    def for_cluster(machines: Mapping[str, int], classes: Sequence[str], k: int = K) -> "Layout":
        """The layout of a cluster given as machine -> GPUs: node lists of 2, 4, 8, ... nodes."""
        nodes = tuple(sorted(machines, key=natural))
        spreads = tuple(m for m in (2, 4, 8) if m <= len(nodes))
        return Layout(nodes, max(machines.values(), default=0), tuple(classes), k, spreads)

    @cached_property
    def subsets(self) -> tuple[tuple[int, ...], ...]:
        """The node lists an action may name, by size then lexicographically."""
        n = len(self.nodes)
        return tuple(c for m in self.spreads if m <= n for c in itertools.combinations(range(n), m))

    @property
    def n_actions(self) -> int:
        return 1 + self.k * len(self.subsets)

    @property
    def channels(self) -> int:
        return len(self.classes) + 5

    @property
    def grid_shape(self) -> tuple[int, int, int]:
        return (self.channels, len(self.nodes), 2 * self.gpus_per_node)

    @property
    def obs_size(self) -> int:
        c, n, w = self.grid_shape
        return c * n * w + (self.n_actions - 1) * ACTION_FEATURES + GLOBALS

    @property
    def total_gpus(self) -> int:
        return len(self.nodes) * self.gpus_per_node

    def decode(self, action: int) -> tuple[int, tuple[int, ...]] | None:
        """(candidate index, node list) of an action; None for :data:`NOTHING`."""
        if not 0 <= action < self.n_actions:
            raise ValueError(f"action {action} is outside 0..{self.n_actions - 1}")
        if action == NOTHING:
            return None
        k, s = divmod(action - 1, len(self.subsets))
        return k, self.subsets[s]

    def encode(self, k: int, subset: int) -> int:
        return 1 + k * len(self.subsets) + subset

    def to_json(self) -> dict:
        return {"nodes": list(self.nodes), "gpus_per_node": self.gpus_per_node, "classes": list(self.classes),
                "k": self.k, "spreads": list(self.spreads)}

    @staticmethod
    def from_json(data: Mapping) -> "Layout":
        try:
            return Layout(tuple(data["nodes"]), int(data["gpus_per_node"]), tuple(data["classes"]), int(data["k"]),
                          tuple(int(m) for m in data["spreads"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise LayoutError(f"a model's layout is malformed: {exc}") from None

    def same_shape(self, other: "Layout") -> bool:
        """Whether a model trained on ``other`` can run here (node names may differ)."""
        return (len(self.nodes), self.gpus_per_node, self.classes, self.k, self.spreads) == \
            (len(other.nodes), other.gpus_per_node, other.classes, other.k, other.spreads)

    def describe(self) -> str:
        return (f"{len(self.nodes)} nodes x {self.gpus_per_node} GPUs, classes {', '.join(self.classes)}, "
                f"K = {self.k}, node lists of {'/'.join(map(str, self.spreads))}")


@dataclass(frozen=True)
class Job:
    """A job in the state: its app, contention class, GPUs per node (node index -> count)."""

    app: str
    cls: str
    per_node: tuple[tuple[int, int], ...]

    @property
    def gpus(self) -> int:
        return sum(n for _, n in self.per_node)

    @property
    def kind(self) -> JobKind:
        return JobKind(self.cls, self.gpus, len(self.per_node))

    @property
    def node_set(self) -> frozenset[int]:
        return frozenset(i for i, _ in self.per_node)


@dataclass(frozen=True)
class Candidate:
    """A waiting job the action may place: its app, class and GPU demand."""

    app: str
    cls: str
    demand: int


@dataclass(frozen=True)
class Snapshot:
    """The cluster at a decision point: the jobs placed (held or granted this round), the free GPUs
    per node, the K candidates (by demand) and the queue."""

    placed: Mapping[str, Job]
    free: tuple[int, ...]
    candidates: tuple[Candidate, ...]
    waiting: int
    ewma: float | None  # the utilisation EWMA committed at the end of the last round
    now: float = 0.0  # simulated seconds

    @staticmethod
    def of(layout: Layout, placed: Iterable[Job], free: Sequence[int], candidates: Iterable[Candidate],
           waiting: int, ewma: float | None, now: float = 0.0) -> "Snapshot":
        return Snapshot({j.app: j for j in placed}, tuple(free), tuple(sorted(candidates, key=lambda c: c.demand))
                        [:layout.k], waiting, ewma, now)


@dataclass(frozen=True)
class Point:
    """One decision point: the observation, which actions are valid, what the reward reads."""

    obs: np.ndarray
    valid: np.ndarray  # bool per action; NOTHING is valid while some job is placed
    contention: float  # mean over placed jobs of 1 - ratio (0 with none placed)
    util: float  # GPUs placed / all GPUs
    ewma: float  # the utilisation EWMA with ``util`` as this round's sample
    after: np.ndarray  # per action, the contention term once it is taken (an invalid one changes nothing)
    snapshot: Snapshot = field(repr=False)

    def reward(self, w1: float = W1) -> float:
        """Eq. 2: -w1 x mean(1 - ratio) + (1 - w1) x EWMA(utilisation)."""
        return -w1 * self.contention + (1.0 - w1) * self.ewma

    @property
    def now(self) -> float:
        return self.snapshot.now

    @property
    def placements(self) -> list[int]:
        """The valid actions that place a job."""
        return [int(a) for a in np.flatnonzero(self.valid) if a != NOTHING]


def ewma_after(ewma: float | None, sample: float, span: int = SPAN) -> float:
    alpha = 2.0 / (span + 1.0)
    return sample if ewma is None else (1.0 - alpha) * ewma + alpha * sample


class Formulation:
    """The state, valid actions and reward of a layout with a contention table (module docstring)."""

    def __init__(self, layout: Layout, table: ContentionTable, floor: float = FLOOR):
        missing = [c for c in layout.classes if c not in table.classes]
        if missing:
            raise LayoutError(f"the layout's classes {missing} are not in {table.source}")
        self.layout = layout
        self.table = table
        self.floor = floor
        self._cls = {c: i for i, c in enumerate(layout.classes)}

    # -- contention (D35 on node indices) ----------------------------------------------------------

    def pair(self, target: JobKind, neighbour: JobKind) -> float:
        return self.table.pair(target, neighbour)

    def ratios(self, placed: Mapping[str, Job]) -> dict[str, float]:
        """D35 for every placed job: 1 on one node, else the floored minimum pairwise ratio over the
        multi-node jobs sharing one of its nodes."""
        by_node: dict[int, list[Job]] = {}
        for job in placed.values():
            if len(job.per_node) > 1:
                for i in job.node_set:
                    by_node.setdefault(i, []).append(job)
        out = {}
        for app, job in placed.items():
            if len(job.per_node) < 2:
                out[app] = 1.0
                continue
            near = {o.app: o for i in job.node_set for o in by_node[i] if o.app != app}
            worst = min((self.pair(job.kind, o.kind) for o in near.values()), default=1.0)
            out[app] = max(self.floor, worst)
        return out

    # -- a decision point ----------------------------------------------------------------------------

    def fits(self, cand: Candidate, subset: Sequence[int], free: Sequence[int]) -> bool:
        m = len(subset)
        if cand.demand % m:
            return False
        per = cand.demand // m
        return per <= self.layout.gpus_per_node and all(free[i] >= per for i in subset)

    def job_on(self, cand: Candidate, subset: Sequence[int]) -> Job:
        per = cand.demand // len(subset)
        return Job(cand.app, cand.cls, tuple((i, per) for i in subset))

    def point(self, snap: Snapshot) -> Point:
        lay = self.layout
        n_nodes, width = len(lay.nodes), lay.gpus_per_node
        grid = np.zeros(lay.grid_shape, dtype=np.float32)
        ratios = self.ratios(snap.placed)
        fill = [0] * n_nodes
        for app in sorted(snap.placed):
            job = snap.placed[app]
            for i, count in job.per_node:
                for _ in range(count):
                    if fill[i] >= width:
                        break
                    self._slot(grid, i, fill[i], job.cls, job.gpus, len(job.per_node), ratios[app], 0.0)
                    fill[i] += 1
        n_sub = len(lay.subsets)
        feats = np.zeros((lay.k, n_sub, ACTION_FEATURES), dtype=np.float32)
        valid = np.zeros(lay.n_actions, dtype=bool)
        valid[NOTHING] = bool(snap.placed)  # an empty cluster cannot wait: no event would wake it
        contention = math.fsum(1.0 - r for r in ratios.values()) / len(ratios) if ratios else 0.0
        after = np.full(lay.n_actions, contention)
        for k, cand in enumerate(snap.candidates):
            best: dict[int, float] = {}
            for s, subset in enumerate(lay.subsets):
                if not self.fits(cand, subset, snap.free):
                    continue
                job = self.job_on(cand, subset)
                mine, worst, mean = self._after(job, snap.placed, ratios)
                feats[k, s] = (1.0, mine, worst, mean)
                valid[lay.encode(k, s)] = True
                after[lay.encode(k, s)] = 1.0 - mean
                best[len(subset)] = max(best.get(len(subset), 0.0), mine)
            for m in lay.spreads:
                if cand.demand % m or cand.demand // m > width or m > n_nodes:
                    continue
                self._slot(grid, m - 1, width + cand.demand // m - 1, cand.cls, cand.demand, m, best.get(m, 0.0),
                           1.0 if m in best else 0.0)
        busy = sum(j.gpus for j in snap.placed.values())
        util = busy / lay.total_gpus
        ewma = ewma_after(snap.ewma, util)
        glob = np.array([util, ewma, sum(snap.free) / lay.total_gpus, math.log1p(snap.waiting) / math.log1p(QUEUE_SCALE)],
                        dtype=np.float32)
        obs = np.concatenate([grid.ravel(), feats.ravel(), glob]).astype(np.float32)
        np.clip(obs, 0.0, 1.0, out=obs)
        return Point(obs, valid, contention, util, ewma, after, snap)

    def _slot(self, grid: np.ndarray, row: int, col: int, cls: str, gpus: int, nodes: int, ratio: float,
              free: float) -> None:
        lay = self.layout
        c = len(lay.classes)
        grid[0, row, col] = 1.0
        if cls in self._cls:
            grid[1 + self._cls[cls], row, col] = 1.0
        grid[c + 1, row, col] = gpus / lay.total_gpus
        grid[c + 2, row, col] = nodes / len(lay.nodes)
        grid[c + 3, row, col] = ratio
        grid[c + 4, row, col] = free

    def _after(self, job: Job, placed: Mapping[str, Job], ratios: Mapping[str, float]) -> tuple[float, float, float]:
        """Placing ``job`` among ``placed``: its ratio, the lowest ratio of a job it slows (1 if
        none) and the mean ratio of every placed job after. A neighbour's ratio can only fall to
        max(floor, min(its ratio, pair)) (D35's minimum)."""
        after = dict(ratios)
        mine = 1.0
        worst = 1.0
        if len(job.per_node) > 1:
            kind = job.kind
            seen = set()
            for other in placed.values():
                if len(other.per_node) < 2 or other.app in seen or not (other.node_set & job.node_set):
                    continue
                seen.add(other.app)
                mine = min(mine, self.pair(kind, other.kind))
                now = max(self.floor, min(ratios[other.app], self.pair(other.kind, kind)))
                after[other.app] = now
                worst = min(worst, now)
            mine = max(self.floor, mine)
        after[job.app] = mine
        return mine, worst, math.fsum(after.values()) / len(after)
