"""Network contention in the simulator (D35): every job's speed is its placement speed (Eq. 1, D1)
times its contention ratio, from the other jobs on its machines, by the rule of ``arbiter.contention``.

``themis-sim run|compare|experiment --contention FILE`` (a CSV of DeepShare's form, or
``deepshare`` for the shipped table) turns it on; without it nothing here runs and every outcome is
as before. With it:

- after every event the simulator hands the tracker the apps whose jobs it placed
  (:meth:`ContentionTracker.moved`); the tracker recomputes the ratio of each job on a machine whose
  jobs changed and sets ``JobRun.rate`` = ``JobRun.base_rate`` x ratio, so the next interval runs at
  the contended speed (the apps, their rho reports and bids do not know: "unaware");
- it accounts per app (:class:`ContentionAccount`) the time its jobs held GPUs, their GPU time and
  that GPU time weighted by the ratio, for ``mean_ratio`` and DeepShare's JCT (rounds scheduled);
- with ``preempt_at`` (DeepShare: 0.6) a job whose ratio falls to it or below loses its GPUs at
  once, as DeepShare's scheduler preempts it, and its app asks for none until one lease (DeepShare's
  round) has passed.

A contention-aware policy sees the tracker as ``Policy.contention`` (the
``arbiter.policies.base.ContentionView`` protocol): the ratio each app runs at and the one it would
run at on a given GPU set.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.contention_pricing import ContentionPricing
from arbiter.contention import (
    FLOOR,
    ClassMap,
    ContentionError,
    ContentionTable,
    Placed,
    load_classes,
    load_table,
    ratio_of,
)
from arbiter.contention_aware import harm_of, neighbourhood_of
from protos.messages import Neighbour

JobKey = tuple[str, str]  # (app, job)


@dataclass(frozen=True)
class ContentionModel:
    """A contention table, the classes of the models and how the simulator applies them (D35)."""

    table: ContentionTable
    classes: ClassMap
    floor: float = FLOOR
    preempt_at: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.floor <= 1:
            raise ContentionError(f"the contention floor must be in (0, 1], got {self.floor}")
        if self.preempt_at is not None and not 0 < self.preempt_at < 1:
            raise ContentionError(f"a preemption ratio must be in (0, 1), got {self.preempt_at}")

    @staticmethod
    def load(table: str | Path = "deepshare", preempt_at: float | None = None) -> "ContentionModel":
        return ContentionModel(load_table(table), load_classes(), preempt_at=preempt_at)

    def tracker(self, sim: Any) -> "ContentionTracker":
        """The tracker of one ``simulator.engine.Simulation`` (typed loosely: the engine imports this
        module, and a module pair that imports each other is refused, tests/test_layers.py)."""
        return ContentionTracker(self, sim)


@dataclass
class ContentionAccount:
    """What contention did to one app: the time any of its jobs held GPUs, its jobs' GPU time, that
    GPU time weighted by each job's ratio, and how often one of its jobs was preempted."""

    running_s: float = 0.0
    gpu_s: float = 0.0
    ratio_gpu_s: float = 0.0
    preempted: int = 0

    @property
    def mean_ratio(self) -> float:
        """The ratio its jobs ran at, averaged over the GPU time they held (1 if they held none)."""
        return self.ratio_gpu_s / self.gpu_s if self.gpu_s > 0 else 1.0


class ContentionTracker:
    """D35 applied to one simulation (module docstring)."""

    def __init__(self, model: ContentionModel, sim: Any):  # a simulator.engine.Simulation
        self.model = model
        self.sim = sim
        self.machine = {g: sim.cluster.position(g)[1] for g in sim.cluster.gpus}  # machine names are unique
        self.cls: dict[str, str] = {}
        for spec in sim.workload.apps:
            profile = sim.profiles[spec.model]
            try:
                self.cls[spec.app_id] = model.classes.class_of(spec.model, profile.category, model.table)
            except ContentionError as exc:
                raise ContentionError(f"workload {sim.workload.name!r}, app {spec.app_id!r}: {exc}") from None
        self._dirty: set[str] = set()
        self._where: dict[JobKey, tuple[tuple[str, ...], Placed]] = {}
        self._ratio: dict[JobKey, float] = {}
        self._since: dict[JobKey, float] = {}  # when the job's current (GPUs, ratio) began
        self._on_machine: dict[str, set[JobKey]] = {}  # multi-machine jobs only
        self._jobs_of: dict[str, set[JobKey]] = {}
        self._app_since: dict[str, float] = {}  # apps with a job placed: since when
        self.held_back: dict[str, float] = {}  # preempted apps -> when they may ask for GPUs again
        self._placed_at: dict[JobKey, float] = {}  # when the job was put on its current GPUs
        self._low: set[JobKey] = set()  # placed jobs at or below preempt_at
        sim.policy.contention = self  # what a contention-aware policy sees (ContentionView)

    # -- the simulator's side ------------------------------------------------------------------

    def moved(self, app: str) -> None:
        """The simulator placed (or finished) ``app``'s jobs: recompute around them at :meth:`apply`."""
        self._dirty.add(app)

    def next_wakeup(self) -> float | None:
        """When a preempted app may next ask for GPUs (an event the simulation must not skip)."""
        return min(self.held_back.values(), default=None)

    def apply(self) -> None:
        """Bring every job's rate up to date with the placements as they are now (D35)."""
        now = self.sim.now
        for app, until in sorted(self.held_back.items()):
            if until <= now:
                del self.held_back[app]
                run = self.sim.runs[app]
                if run.finished_at is None:
                    self.sim.engine.set_demand(app, run.app.demand_now(), now)
        while self._dirty:  # each pass after the first follows one preemption: at most one per job
            dirty, self._dirty = self._dirty, set()
            touched = self._replace(dirty, now)
            for app in dirty & set(self.held_back):
                if self.sim.runs[app].finished_at is None:  # its own re-placement asked again: not yet
                    self.sim.engine.set_demand(app, len(self.sim.engine.held(app)), now)
            self._rerate(touched, now)
            if self._low:
                # one at a time, the most recently placed first: a pair that hurts each other loses
                # the newcomer, and the other's ratio is looked at again without it
                self._preempt(max(self._low, key=lambda k: (self._placed_at[k], -self._ratio[k], k)), now)

    def _replace(self, apps: Iterable[str], now: float) -> set[JobKey]:
        """Update the index for ``apps``; the jobs whose ratio may have changed."""
        machines: set[str] = set()
        fresh: set[JobKey] = set()
        for app in sorted(apps):
            run = self.sim.runs[app]
            current = {} if run.finished_at is not None else {
                (app, jr.job_id): jr for jr in run.jobs.values() if jr.gpus}
            for key in self._jobs_of.get(app, set()) - set(current):
                machines |= self._remove(key, now)
            for key, jr in current.items():
                held = self._where.get(key)
                if held is not None and held[0] == jr.gpus:
                    continue
                if held is not None:
                    machines |= self._remove(key, now)
                where = Placed.on(self.cls[app], (self.machine[g] for g in jr.gpus))
                self._where[key] = (jr.gpus, where)
                self._ratio[key] = 1.0
                self._since[key] = now
                self._placed_at[key] = now
                if where.kind.spread:
                    for g in jr.gpus:
                        self._on_machine.setdefault(self.machine[g], set()).add(key)
                    machines |= {self.machine[g] for g in jr.gpus}
                fresh.add(key)
            self._jobs_of[app] = set(current)
            if current and app not in self._app_since:
                self._app_since[app] = now
            elif not current and app in self._app_since:
                self._account(app).running_s += now - self._app_since.pop(app)
        return fresh | {key for m in machines for key in self._on_machine.get(m, ())}

    def _remove(self, key: JobKey, now: float) -> set[str]:
        self._close(key, now)
        gpus, where = self._where.pop(key)
        del self._ratio[key], self._since[key], self._placed_at[key]
        self._low.discard(key)
        spots = set(where.machines) if where.kind.spread else set()
        for m in spots:
            self._on_machine[m].discard(key)
        return spots

    def _close(self, key: JobKey, now: float) -> None:
        """Account the job's interval since its (GPUs, ratio) last changed."""
        gpus, _ = self._where.get(key, ((), None))
        span = now - self._since[key]
        if span > 0:
            acc = self._account(key[0])
            acc.gpu_s += len(gpus) * span
            acc.ratio_gpu_s += len(gpus) * span * self._ratio[key]
        self._since[key] = now

    def _account(self, app: str) -> ContentionAccount:
        run = self.sim.runs[app]
        if run.contention is None:
            run.contention = ContentionAccount()
        return run.contention

    def _neighbours(self, key: JobKey) -> list[Placed]:
        near = {other for m in self._where[key][1].machines for other in self._on_machine.get(m, ())}
        near.discard(key)
        return [self._where[other][1] for other in near]

    def _rerate(self, keys: Iterable[JobKey], now: float) -> None:
        """Recompute the ratio and rate of ``keys`` (and which are at or below ``preempt_at``)."""
        for key in sorted(keys):
            if key not in self._where:
                continue
            where = self._where[key][1]
            ratio = ratio_of(self.model.table, where, self._neighbours(key), self.model.floor)
            jr = self._job(key)
            if ratio != self._ratio[key]:
                self._close(key, now)
                self._ratio[key] = ratio
            jr.ratio = ratio
            jr.rate = jr.base_rate * ratio
            if self.model.preempt_at is not None and ratio <= self.model.preempt_at:
                self._low.add(key)
            else:
                self._low.discard(key)

    def _job(self, key: JobKey) -> Any:  # its simulator.engine.JobRun
        return self.sim.runs[key[0]].jobs[key[1]]

    def _preempt(self, key: JobKey, now: float) -> None:
        """DeepShare's preemption: the job's GPUs go back now; its app asks for none for a lease."""
        app = key[0]
        if key not in self._where:
            return
        self._account(app).preempted += 1
        self.sim.engine.release(app, self._where[key][0], now)
        self.sim._place(app)
        self.sim.engine.set_demand(app, len(self.sim.engine.held(app)), now)
        self.held_back[app] = now + self.sim.engine.lease_s
        self._dirty.add(app)

    # -- what a policy may ask (arbiter.policies.base.ContentionView) ----------------------------

    def pricing(self, app: str) -> ContentionPricing:
        """D36: what the app's agent prices contention with: the table, its model's class, the floor."""
        return ContentionPricing(self.model.table, self.cls[app], self.model.floor)

    def kind(self, app: str) -> str | None:
        """The app's contention class (None for an app the workload does not have)."""
        return self.cls.get(app)

    def ratio(self, app: str) -> float:
        """The lowest ratio among the app's placed jobs now (1 if none is placed)."""
        return min((self._ratio[k] for k in self._jobs_of.get(app, ()) if k in self._ratio), default=1.0)

    def _running(self, app: str, machines: set[str] | None = None) -> list[tuple[JobKey, Placed]]:
        """Other apps' jobs whose GPUs their app still holds (a round's expired leases are not
        neighbours), on ``machines`` when given."""
        keys = self._where if machines is None else {
            k for m in machines for k in self._on_machine.get(m, ())} | {
            k for k, (_, p) in self._where.items() if not p.kind.spread and p.machines & machines}
        out = []
        for key in sorted(keys):
            owner = key[0]
            held, placed = self._where[key]
            if owner != app and set(held) <= self.sim.engine.held(owner):
                out.append((key, placed))
        return out

    def neighbourhood(self, app: str, machines: Iterable[str]) -> dict[str, tuple[Neighbour, ...]]:
        """D36: per machine of ``machines``, the other apps' running jobs there (class, GPUs, machines)."""
        wanted = set(machines)
        return neighbourhood_of((p for _, p in self._running(app, wanted)), wanted)

    def harm(self, app: str, gpus: Iterable[str]) -> float:
        """D36: what a job of ``app`` on ``gpus`` would leave of the other running jobs' speed."""
        row = Placed.on(self.cls[app], (self.machine[g] for g in gpus))
        if not row.kind.spread:
            return 1.0
        running = []
        for key in sorted({k for m in row.machines for k in self._on_machine.get(m, ())}):
            held, placed = self._where[key]
            if key[0] != app and set(held) <= self.sim.engine.held(key[0]):
                running.append((placed, self._ratio[key]))
        return harm_of(self.model.table, row, running, self.model.floor)

    def ratio_if(self, app: str, gpus: Iterable[str]) -> float:
        """The ratio one job of ``app`` would run at on ``gpus`` with every other app's jobs where
        they are now, counting only jobs whose GPUs their app still holds (a round's expired leases
        are not neighbours)."""
        where = Placed.on(self.cls[app], (self.machine[g] for g in gpus))
        others = []
        for (owner, _), (held, placed) in self._where.items():
            if owner != app and set(held) <= self.sim.engine.held(owner):
                others.append(placed)
        return ratio_of(self.model.table, where, others, self.model.floor)
