"""DeepShare's RL policy (seeds/002, section IV) as a policy of the simulator: ``deepshare-rl``
(RL-base) and ``deepshare-rl-hybrid`` (RL-Hybrid), by name in ``themis-sim run|compare|experiment``.

It lives here, not in ``arbiter.policies``, because running a trained model needs torch and
stable-baselines3 (the optional ``rl`` extra), which the arbiter's layer must not import; the
simulator registers it as it registers plugins (``simulator.plugins.load_from_env``), and importing
this module imports neither (the model is loaded when a policy is made).

Each round the policy decides in:

1. every job whose lease just ran out keeps its GPUs (DeepShare's RL runs a placed job until it
   ends or is preempted: no re-queueing every round, unlike its LAS and SRTF);
2. the waiting jobs form a queue in arrival order (a job back from preemption joins at the tail);
3. while some candidate fits somewhere, the decider sees the state (``simulator.rl_state``) and
   picks one action: a node list for one of the K candidates, which is placed at once, or nothing,
   which ends the round (an action that does not fit counts as nothing, as in DeepShare).
   RL-Hybrid, facing nothing, places the first candidate that fits spread over as many nodes as it
   can (DeepShare's safety rule, its LAS/SRTF placement). Where no job runs at all, RL-base does the
   same: DeepShare's empty cluster would idle for a round and ask again, but our simulator's clock
   moves only from event to event, and an empty cluster that waits has none left.

The decider is the trained model (``simulator.rl_model``: the action it deems likeliest among the
valid ones), the environment's hand-off in training (``simulator.rl_env``), or any function of a
:class:`~simulator.rl_state.Point` (e.g. :class:`RandomDecider`, the tests' baseline).

Contention must be on (``--contention``): the state and reward are contention ratios (D35).
"""

from __future__ import annotations

import importlib
import os
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import ClassVar

from arbiter.policies import Decision, Policy, RoundContext, register_policy
from protos.messages import BidTable
from simulator.rl_state import NOTHING, Candidate, Formulation, Job, Layout, Point, Snapshot, ewma_after, natural

#: The shipped trained policy (``python -m simulator.rl_train`` wrote it; data/rl/README.md).
MODEL = Path(__file__).resolve().parents[1] / "data" / "rl" / "deepshare-rl.zip"
#: A model file to use instead of the shipped one (a worker process inherits it).
MODEL_ENV = "THEMIS_DEEPSHARE_RL"
EXTRA = "rl"
NEEDS = ("torch", "stable_baselines3", "gymnasium")

Decide = Callable[[Point], int]


class RLUnavailable(ValueError):
    """The optional ``rl`` extra (torch, stable-baselines3, gymnasium) is not installed."""


def require_rl() -> None:
    """Refuse clearly when the ``rl`` extra is missing."""
    for module in NEEDS:
        try:
            importlib.import_module(module)
        except ImportError:
            raise RLUnavailable(f"DeepShare's RL policy needs the optional '{EXTRA}' extra ({module} is not "
                                f"installed): pip install 'themis-scheduler[{EXTRA}]'") from None


def model_path() -> Path:
    return Path(os.environ.get(MODEL_ENV) or MODEL)


class RandomDecider:
    """Uniformly one of the valid placements (never nothing while one fits), from its own seed."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def __call__(self, point: Point) -> int:
        choices = point.placements
        return self.rng.choice(choices) if choices else NOTHING


class DeepShareRLPolicy(Policy):
    """RL-base: the decider's actions alone (module docstring)."""

    name = "deepshare-rl"
    hybrid: ClassVar[bool] = False

    def __init__(self, decide: Decide | None = None, model: str | Path | None = None):
        if decide is None:
            require_rl()
            from simulator.rl_model import TrainedModel

            decide = TrainedModel.load(model or model_path())
        self.decide = decide
        self.formulation: Formulation | None = None
        self._queue: dict[str, None] = {}  # waiting apps, head first
        self.ewma: float | None = None  # utilisation EWMA, committed at each round's end
        self.points = 0  # decisions asked

    def bidders(self, rho: Mapping[str, float], ctx: RoundContext) -> list[str]:
        return []  # no offers: it decides from the placement and the queue

    def _formulation(self, ctx: RoundContext) -> Formulation:
        if self.formulation is not None:
            return self.formulation
        from simulator.contention import ContentionTracker

        view = self.contention
        if not isinstance(view, ContentionTracker):
            raise ValueError(f"policy {self.name} needs the simulator's contention model: run with --contention "
                             "deepshare (its state and reward are contention ratios, D35)")
        machines: dict[str, int] = {}
        for gpu in set(ctx.free).union(*ctx.held.values()):
            m = ctx.position(gpu)[1]
            machines[m] = machines.get(m, 0) + 1
        layout = Layout.for_cluster(machines, view.model.table.classes)
        trained = getattr(self.decide, "layout", None)
        if isinstance(trained, Layout) and not trained.same_shape(layout):
            raise ValueError(f"policy {self.name}: the model was trained for {trained.describe()}; this cluster and "
                             f"table give {layout.describe()} (train one for it: python -m simulator.rl_train)")
        self.formulation = Formulation(layout, view.model.table, view.model.floor)
        return self.formulation

    def _job(self, app: str, gpus, ctx: RoundContext, node: Mapping[str, int]) -> Job:
        count: dict[int, int] = {}
        for g in gpus:
            i = node[ctx.position(g)[1]]
            count[i] = count.get(i, 0) + 1
        return Job(app, self.contention.kind(app) or "", tuple(sorted(count.items())))

    def allocate(self, ctx: RoundContext, bids: Mapping[str, BidTable]) -> Decision:
        form = self._formulation(ctx)
        lay = form.layout
        node = {m: i for i, m in enumerate(lay.nodes)}
        grants: dict[str, frozenset[str]] = {}
        for app, prev in sorted(ctx.previous.items()):
            if not ctx.held.get(app) and ctx.unmet.get(app, 0) >= len(prev) and prev <= ctx.free:
                grants[app] = prev
        taken = frozenset().union(*grants.values()) if grants else frozenset()
        free_gpus: list[list[str]] = [[] for _ in lay.nodes]
        for g in sorted(ctx.free - taken, key=natural):
            free_gpus[node[ctx.position(g)[1]]].append(g)
        placed = {app: self._job(app, gpus, ctx, node) for app, gpus in ctx.held.items() if gpus}
        placed.update((app, self._job(app, gpus, ctx, node)) for app, gpus in grants.items())
        waiting = {a for a, n in ctx.unmet.items() if n > 0 and a not in grants and not ctx.held.get(a)}
        for gone in set(self._queue) - waiting:
            del self._queue[gone]
        for app in sorted(waiting - set(self._queue), key=lambda a: (ctx.arrived.get(a, 0.0), natural(a))):
            self._queue[app] = None
        while True:
            cands: dict[int, Candidate] = {}
            for app in self._queue:
                demand = ctx.unmet[app]
                if demand not in cands:
                    cands[demand] = Candidate(app, self.contention.kind(app) or "", demand)
                    if len(cands) == lay.k:
                        break
            snap = Snapshot.of(lay, placed.values(), [len(f) for f in free_gpus], cands.values(), len(self._queue),
                               self.ewma, ctx.now)
            point = form.point(snap)
            if not point.placements:
                break
            self.points += 1
            action = int(self.decide(point))
            if not (0 <= action < lay.n_actions and point.valid[action]) or action == NOTHING:
                if not self.hybrid and point.valid[NOTHING]:
                    break
                action = self._greedy(point)
            k, subset = lay.decode(action)
            cand = snap.candidates[k]
            per = cand.demand // len(subset)
            gpus: list[str] = []
            for i in subset:
                gpus += free_gpus[i][:per]
                del free_gpus[i][:per]
            grants[cand.app] = frozenset(gpus)
            placed[cand.app] = form.job_on(cand, subset)
            del self._queue[cand.app]
        used = sum(j.gpus for j in placed.values())
        self.ewma = ewma_after(self.ewma, used / lay.total_gpus)
        return Decision(grants)

    def _greedy(self, point: Point) -> int:
        """RL-Hybrid's safety rule: the first candidate (by demand) that fits, over the most nodes."""
        lay = self.formulation.layout
        for k in range(len(point.snapshot.candidates)):
            for s in sorted(range(len(lay.subsets)), key=lambda s: (-len(lay.subsets[s]), s)):
                if point.valid[lay.encode(k, s)]:
                    return lay.encode(k, s)
        return NOTHING


class DeepShareRLHybridPolicy(DeepShareRLPolicy):
    """RL-Hybrid: the decider's actions, and DeepShare's greedy placement where it says nothing."""

    name = "deepshare-rl-hybrid"
    hybrid = True


def register() -> None:
    """Make both selectable by name (``simulator.plugins.load_from_env`` calls this)."""
    register_policy(DeepShareRLPolicy)
    register_policy(DeepShareRLHybridPolicy)
