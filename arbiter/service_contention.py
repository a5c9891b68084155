"""Network contention in the service (D35): who runs where, as the arbiter learns it from the agents.

The simulator knows every job's GPUs; the service knows only leases, which say which app holds a
GPU but not how the app splits its GPUs among its jobs (D3's split is the agent's). Two jobs of one
app on one machine each and one job over both machines hold the same leases and contend very
differently, so the arbiter cannot guess jobs from leases. The smallest honest source is the agent:
while a contention model runs, each agent sends its running jobs' GPU sets (``RunningJobs``)
whenever they change, and the arbiter keeps them, checked against the app's leases and cut to the
GPUs it still holds (a job on a lease that ran out is not a neighbour, as in the simulator).

A job's class is the class of the model the app is bound to (IssueToken ``--model``, the binding
D21's measured rank trusts) when it has one, else the class the agent names, else the job is left
out: a neighbour the table cannot price.

:class:`ServiceContention` is the service's ``arbiter.policies.base.ContentionView`` (what a
contention-aware policy asks; the simulator's ``ContentionTracker`` is the same view over its own
jobs) and what the offer's neighbourhood and the agents' ``Neighbourhood`` messages are made of. It
also keeps each job's measured ratio (its agent's profiler's) next to the table's, for MQTT and
Prometheus.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from arbiter.contention import (
    FLOOR,
    ClassMap,
    ContentionError,
    ContentionTable,
    Placed,
    job_ratios,
    load_classes,
    load_table,
    ratio_of,
)
from arbiter.contention_aware import harm_of, neighbourhood_of
from arbiter.rounds import RoundEngine
from protos.messages import Neighbour, RunningJob


class JobsRefused(ValueError):
    """An agent's job report that cannot be taken (a GPU it does not hold); the message says which."""


@dataclass(frozen=True)
class JobContention:
    """One job as published: where it runs, its class, the table's ratio (D35 against its
    neighbours now) and the ratio its agent measured (None: not measured)."""

    app: str
    job: str
    cls: str
    gpus: tuple[str, ...]
    machines: int
    expected: float
    measured: float | None


class ServiceContention:
    """D35 over the jobs the agents report; see the module docstring."""

    def __init__(self, table: ContentionTable, name: str, engine: RoundEngine, models: Mapping[str, str],
                 classes: ClassMap | None = None, floor: float = FLOOR):
        self.table = table
        self.name = name  # as the operator gave it (--contention): what agents are told
        self.engine = engine
        self.models = models  # the service's live app -> bound model
        self.classes = classes if classes is not None else load_classes()
        self.floor = floor
        self._jobs: dict[str, tuple[RunningJob, ...]] = {}
        self._version = 0  # counts the reports taken, for the cache of who runs where
        self._cache: tuple | None = None

    @classmethod
    def load(cls, name_or_path: str, engine: RoundEngine, models: Mapping[str, str]) -> ServiceContention:
        """``deepshare`` (the shipped table) or a CSV file of its form; ContentionError if unusable."""
        return cls(load_table(name_or_path), name_or_path, engine, models)

    # -- what agents say ---------------------------------------------------------------------------

    def report(self, app: str, jobs: Iterable[RunningJob]) -> bool:
        """The app's jobs now (the whole list); whether anything a neighbour sees changed. A job on
        a GPU the app does not hold is refused whole (JobsRefused), the last list kept."""
        jobs = tuple(jobs)
        held = self._held(app)
        stray = sorted(g for j in jobs for g in j.gpus if g not in held)
        if stray:
            raise JobsRefused(f"{app!r} reports jobs on GPUs it does not hold: {', '.join(stray[:5])}")
        before = self._jobs.get(app, ())
        self._version += 1
        if jobs:
            self._jobs[app] = jobs
        else:
            self._jobs.pop(app, None)
        return [(j.job, j.gpus, j.cls) for j in before] != [(j.job, j.gpus, j.cls) for j in jobs]

    def forget(self, app: str) -> None:
        self._jobs.pop(app, None)
        self._version += 1

    # -- what is known ---------------------------------------------------------------------------

    def _class(self, app: str, named: str = "") -> str | None:
        model = self.models.get(app)
        if model:
            try:
                return self.classes.class_of(model, "", self.table)
            except ContentionError:
                pass  # a model of a user's table with no class entry: the agent's word, if any
        return named if named in self.table.classes else None

    def machine(self, gpu: str) -> str:
        return self.engine.cluster.position(gpu)[1]

    def _held(self, app: str) -> frozenset[str]:
        return self.engine.held(app) if app in self.engine.apps else frozenset()

    def _fresh(self) -> bool:
        """Whether the cache still holds: no report since, and the same held-GPU sets (the lease
        table hands out the same frozenset until an app's GPUs change) and models."""
        if self._cache is None or self._cache[0] != self._version:
            return False
        return all(self._held(a) is held and self.models.get(a) == model
                   for a, (held, model) in self._cache[1].items())

    def _placed(self) -> dict[tuple[str, str], tuple[Placed, tuple[str, ...]]]:
        """Every reported job with a class whose GPUs its app still all holds (a job on a lease that
        ran out as a round opened is not a neighbour, as in the simulator); kept while the reports,
        those apps' leases and their models stay as they are (a round asks once per bid row)."""
        if self._fresh():
            return self._cache[2]
        seen = {a: (self._held(a), self.models.get(a)) for a in self._jobs}
        out = {}
        for app, jobs in self._jobs.items():
            held = seen[app][0]
            for j in jobs:
                cls = self._class(app, j.cls)
                if cls is not None and j.gpus <= held:
                    gpus = tuple(sorted(j.gpus))
                    out[(app, j.job)] = (Placed.on(cls, map(self.machine, gpus)), gpus)
        self._cache = (self._version, seen, out, {}, {})
        return out

    def _ratios(self) -> dict[tuple[str, str], float]:
        """D35's ratio of every job of :meth:`_placed`, kept with it; call right after it."""
        kept, placed = self._cache[3], self._cache[2]
        if not kept and placed:
            kept.update(job_ratios(self.table, {k: p for k, (p, _) in placed.items()}, self.floor))
        return kept

    def _spread_on(self) -> dict[str, list[tuple[str, str]]]:
        """The spread jobs of :meth:`_placed` by machine, kept with it (the harm looks only there);
        call right after :meth:`_placed`."""
        index = self._cache[4]
        if not index:
            for key, (where, _) in sorted(self._cache[2].items()):
                if where.kind.spread:
                    for m in where.machines:
                        index.setdefault(m, []).append(key)
        return index

    def jobs(self) -> dict[str, tuple[JobContention, ...]]:
        """Every app's reported jobs as published (MQTT, Prometheus): the table's ratio against the
        neighbours now and the measured one."""
        placed, ratios = self._placed(), self._ratios()
        out: dict[str, tuple[JobContention, ...]] = {}
        for app, jobs in sorted(self._jobs.items()):
            mine = []
            for j in jobs:
                key = (app, j.job)
                if key in placed:
                    where, gpus = placed[key]
                    mine.append(JobContention(app, j.job, where.kind.cls, gpus, where.kind.machines, ratios[key],
                                              j.ratio if j.ratio > 0 else None))
            if mine:
                out[app] = tuple(mine)
        return out

    def around(self, app: str) -> dict[str, tuple[Neighbour, ...]]:
        """The neighbourhood of the machines where ``app`` holds GPUs (what its agent is told)."""
        return self.neighbourhood(app, {self.machine(g) for g in self._held(app)})

    # -- arbiter.policies.base.ContentionView ------------------------------------------------------

    def kind(self, app: str) -> str | None:
        """The app's class: its bound model's, else the one its agent named for its jobs."""
        return self._class(app, next((j.cls for j in self._jobs.get(app, ()) if j.cls), ""))

    def ratio(self, app: str) -> float:
        """The lowest table ratio among the app's reported jobs now (1 if none)."""
        return min((j.expected for j in self.jobs().get(app, ())), default=1.0)

    def neighbourhood(self, app: str, machines: Iterable[str]) -> dict[str, tuple[Neighbour, ...]]:
        """Per machine of ``machines`` (those with someone), the jobs of the other apps with a GPU
        there, as class, GPUs and machines spanned (D35, D36; no app names): an offer's neighbourhood."""
        others = (where for (owner, _), (where, _) in sorted(self._placed().items()) if owner != app)
        return neighbourhood_of(others, machines)

    def harm(self, app: str, gpus: Iterable[str]) -> float:
        """D36: what one job of ``app`` on ``gpus`` would leave of the other apps' running jobs'
        speed (1 for an app of no known class)."""
        cls = self.kind(app)
        if cls is None:
            return 1.0
        row = Placed.on(cls, map(self.machine, gpus))
        if not row.kind.spread:
            return 1.0
        placed = self._placed()
        index, ratios = self._spread_on(), self._ratios()
        near = {key for m in row.machines for key in index.get(m, ()) if key[0] != app}
        running = [(placed[key][0], ratios[key]) for key in sorted(near)]
        return harm_of(self.table, row, running, self.floor)

    def ratio_if(self, app: str, gpus: Iterable[str]) -> float:
        """The ratio one job of ``app`` would run at on ``gpus``, every other app's job where it is
        (1 for an app of no known class: nothing to price it by)."""
        cls = self.kind(app)
        if cls is None:
            return 1.0
        others = [where for (owner, _), (where, _) in self._placed().items() if owner != app]
        return ratio_of(self.table, Placed.on(cls, map(self.machine, gpus)), others, self.floor)
