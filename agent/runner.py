"""The app runner: one tuner, its agent and its jobs, glued together (issue 5; paper Figure 7's AM).

:class:`AppRunner` owns a :class:`~agent.tuner.TunerAdapter` (what should run, what
the reports mean), an :class:`~agent.client.AgentClient` (the app's stream to the arbiter: rho
reports, bids, grants, revocations) and a :class:`~agent.launcher.Launcher` (the job processes),
plus optionally a :class:`~agent.profiler.Profiler`. Its loop, every ``tick_s`` or as soon as a
grant, revocation or report arrives:

1. **Reports** (from the launcher's pipes, or the job metrics topic when jobs publish to MQTT) go
   to the profiler, then to ``adapter.observe`` with the iteration time made *serial* (D2 inverted:
   ``measured * min(|G|, demand) / S(G)``, S from the profiler's learned slowdown, else the
   adapter's own); the jobs ``observe`` returns are stopped (SIGTERM: checkpoint and exit).
   An adapter whose ``observe`` takes ``gpus=`` (the Optuna adapter) normalises itself and gets the
   measured time with the job's GPUs.
2. **Placement**: ``adapter.assign(held GPUs)`` (D3's split), then kept stable: a running job whose
   GPU count did not change keeps its GPUs, the others take theirs from what is free, on as few
   machines as possible. A running job that is no longer assigned, or whose GPU set changes (lost
   lease, new split), is stopped and later restarted from its checkpoint on its new GPUs (D11). A
   job is started only once the GPUs it gets are no longer used by a process that is stopping.
3. **Demand**: ``client.set_demand(adapter.demand_now())`` whenever it changes (D6), and GPUs beyond
   the demand that no job uses are released at once (a rung finished, trials ended).
4. **End**: when the adapter is finished and no job runs, ``client.done()``.
5. **Contention** (D35, only while the arbiter models it): the running jobs' GPUs and each job's
   contention ratio as the profiler measures it go to the arbiter (``client.report_jobs``), which
   tells other apps' offers who runs where and publishes the ratios.

A job that fails (non-zero exit it was not asked for, or a clean exit without progress) is restarted
from its checkpoint up to ``max_failures`` times, then given up: ``adapter.fail(job)`` when the
adapter has it (Optuna; successive halving, which never keeps it for a next rung; curve stopping),
else it is reported at its target iteration with an infinite loss, so a rung never waits for it.
When ``max_failed_runs`` runs in a row fail and no job reports in between (a script that crashes
on start, a checkpoint refused), the search stops with :class:`SearchFailed`, which carries the
first failure's log tail (issue 11: fail fast, with the reason). A launch the executor could not
make (``LaunchError``: sbatch refused, the controller is down) is not the job's failure: it is
tried again with a growing pause (up to 30 s).

The runner records what a summary needs: the rho the agent reported in each round it was asked
(``rho``) and, every ``rho_every_s``, rho with the GPUs it holds then (``rho_now``; null in the
summary is infinity: no GPUs), GPUs held and demand over time, every report, every run (``launcher.history``), grants
and revocations. :meth:`AppRunner.summary` puts them together.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from agent.agent import Agent
from agent.client import AgentClient, HeldGpu, NoCredential, issue_token, register_or_stop
from agent.console import SearchProgress, show_progress_lines
from agent.credential import keep_credential, read_credential
from agent.executors import LaunchError
from agent.fairness import finish_time_fairness
from agent.launcher import JobExit, Launcher, training_command
from agent.placement import Position, slowdown_of
from agent.profiler import Profiler, parse_metrics
from agent.run_record import PLOT, RunRecord, history, plot
from agent.search_run import SearchRun
from agent.termination import ConvergenceRule, LossWatch
from protos.messages import RunningJob

if TYPE_CHECKING:
    from agent.trial import TrialSpec
    from agent.tuner import TunerAdapter
    from arbiter.events import EventBus

__all__ = ["AppRunner", "JobReport", "SearchFailed"]

log = logging.getLogger("themis.runner")

PREEMPTED = ("GPUs lost", "GPU set changed", "not assigned")  # stop reasons that are not the tuner's


@dataclass(frozen=True)
class JobReport:
    """One report as the runner took it."""

    t: float
    job_id: str
    iteration: float
    loss: float | None
    iter_time_s: float  # measured, on ``gpus`` GPUs
    serial_s: float  # what the adapter was told
    gpus: int
    extra: Mapping[str, Any] = field(default_factory=dict)


class SearchFailed(RuntimeError):
    """The search's runs keep failing (issue 11: a crashing script made all 60 launches and the
    search "finished" with no result). Carries the first failure of the streak: its job, why, and
    the tail of its log, which is usually the traceback the user needs."""

    def __init__(self, app: str, runs: int, job: str, why: str, log_path: Path, log_tail: str,
                 limit: int | None = None) -> None:
        self.app, self.runs, self.job, self.why, self.log_path, self.log_tail = app, runs, job, why, log_path, log_tail
        tail = "\n".join("    " + line for line in log_tail.splitlines()) or "    (empty)"
        # several runs can fail in one tick, so the streak may pass the limit by the time it is judged
        bound = f" (the limit, max_failed_runs, is {limit})" if limit is not None and limit != runs else ""
        super().__init__(f"{app}: stopping the search: its last {runs} runs failed{bound} with no job reporting in "
                         f"between; the first: job {job} ({why}); the end of {log_path}:\n{tail}")


def _log_tail(path: Path, lines: int = 20, limit: int = 8192) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


def _takes_gpus(fn: Callable) -> bool:
    try:
        return "gpus" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class AppRunner:
    """Runs one app's search on what the arbiter grants; see the module docstring."""

    def __init__(
        self,
        adapter: TunerAdapter,
        client: AgentClient,
        launcher: Launcher,
        *,
        profiler: Profiler | None = None,
        bus: EventBus | None = None,
        tick_s: float = 0.1,
        grace_s: float | None = None,
        max_failures: int = 3,
        max_failed_runs: int | None = 5,
        report_wait_s: float | None = None,
        rho_every_s: float = 1.0,
        quiet: bool = False,
        record: bool = True,
        clock: Callable[[], float] = time.time,
        convergence: ConvergenceRule | None = None,
    ) -> None:
        if launcher.report == "mqtt" and bus is None:
            raise ValueError("jobs that publish to MQTT need the runner to follow the bus: pass bus=")
        self.adapter, self.client, self.launcher = adapter, client, launcher
        self.profiler, self.bus = profiler, bus
        self.tick_s, self.max_failures, self.clock = tick_s, max_failures, clock
        if max_failed_runs is not None and max_failed_runs < 1:
            raise ValueError(f"max_failed_runs must be >= 1 or None, got {max_failed_runs!r}")
        self.max_failed_runs = max_failed_runs
        self.rho_every_s = rho_every_s
        self.quiet, self.record = quiet, record
        self._record: RunRecord | None = None
        self._bar: SearchProgress | None = None
        self._params: dict[str, dict[str, Any]] = {}  # job -> its hyperparameters, from its last start
        self._result_said: dict[str, str | None] = {}  # jobs whose current run had its result said: its outcome
        self._results: dict[str, tuple[float, float]] = {}  # job -> (iteration, loss) of its latest result
        self.lease_s: float | None = None  # the longest lease seen in a grant (what start-up is compared with)
        self.start_ups: list[tuple[str, float]] = []  # (job, launch to first report in s)
        self._warned_start_up = False
        self.grace_s = launcher.grace_s if grace_s is None else grace_s
        # a job that exits by itself is not restarted before its last report can have arrived
        self.report_wait_s = (2.0 if launcher.report == "mqtt" else 0.0) if report_wait_s is None else report_wait_s
        self.app = client.app
        self._own_bus: EventBus | None = None
        self.search_run: SearchRun | None = None  # set by create()

        self.rho: list[tuple[float, float]] = []  # (time, rho the agent reported to the arbiter)
        self.rho_now: list[tuple[float, float]] = []  # (time, rho with the GPUs held then), every rho_every_s
        self.held_history: list[tuple[float, int]] = []
        self.demand_history: list[tuple[float, int]] = []
        self.reports: list[JobReport] = []
        self.events: list[dict[str, Any]] = []  # grants, revocations, starts, stops, exits, releases, done
        self.failures: Counter[str] = Counter()
        self._launch_errors: Counter[str] = Counter()  # consecutive LaunchErrors (engine down): backoff
        self.failed: set[str] = set()
        self._failed_streak: list[tuple[str, str, str]] = []  # (job, why, log tail): failures since the last report
        self.rejected = 0  # reports that were not usable
        self.started_at: float | None = None
        self.finished_at: float | None = None

        self._wake = asyncio.Event()
        self._following = asyncio.Event()
        self._inbox: list[tuple[str, Any]] = []
        self._progress: dict[str, float] = {}  # job -> highest iteration reported
        self._hold: dict[str, float] = {}  # job -> monotonic time before which it is not restarted
        self._stopped_for: dict[str, str] = {}  # job -> why its last run was stopped
        self._told_jobs: tuple | None = None  # (jobs and their GPUs, ratios) last reported (D35)
        self._resuming: dict[str, tuple[str | None, float]] = {}  # job -> (why it was stopped, start iteration), till it reports
        self._heard: Counter[str] = Counter()  # job -> usable reports the runner took in (any channel)
        self._heard_at_start: dict[str, int] = {}  # job -> _heard when its current run started
        self._verdicts: dict[str, tuple[float, JobExit]] = {}  # clean exits waiting for late MQTT reports
        self.resumes: list[dict[str, Any]] = []  # resumed runs: job, iteration of the checkpoint, why stopped
        self._demand: int | None = None
        self._done = False
        self._observe_gpus = _takes_gpus(adapter.observe)
        self._runnable_gpus = _takes_gpus(adapter.runnable)
        self._profile_ok = True
        self._context: tuple[float, int] | None = None  # (N_avg, cluster size) of the last rho request
        self._next_rho = 0.0
        #: D34: the app's convergence rule over its jobs' loss reports; a job it fires for is ended
        self.watch = LossWatch(convergence) if convergence is not None else None
        self._said_converged: set[str] = set()

        previous_grant, previous_revoke = client.on_grant, client.on_revoke

        def on_grant(got: dict[str, HeldGpu]) -> None:
            left = max((h.expires_at - time.time() for h in got.values()), default=0.0)
            if left > 0:
                self.lease_s = max(self.lease_s or 0.0, left)
            self._note("grant", gpus=sorted(got))
            if previous_grant is not None:
                previous_grant(got)

        def on_revoke(gpus: list[str], reason: str) -> None:
            self._note("revoke", gpus=sorted(gpus), reason=reason)
            if previous_revoke is not None:
                previous_revoke(gpus, reason)

        client.on_grant, client.on_revoke = on_grant, on_revoke
        report = client.agent.report

        def reporting(request):
            self._context = (request.n_avg, request.cluster_size)
            answer = report(request)
            self.rho.append((self.clock(), float(answer.rho)))
            return answer

        client.agent.report = reporting  # type: ignore[method-assign]

    # -- building one ------------------------------------------------------------------------------

    @classmethod
    async def create(
        cls,
        adapter: TunerAdapter,
        argv: Callable[[TrialSpec], Sequence[str]] | Sequence[str],
        *,
        app: str,
        arbiter: str,
        workdir: str,
        credential: str | None = None,
        token: str | None = None,
        credential_file: str | os.PathLike[str] | None = None,
        cluster: str = "local",
        mqtt: str | None = None,
        report: str | None = None,
        profiler: Profiler | None = None,
        grace_s: float = 10.0,
        env: Mapping[str, str] | None = None,
        tls_ca: bytes | None = None,
        executor: Any = None,
        resume: bool = False,
        take_over: bool = False,
        **kwargs: Any,
    ) -> AppRunner:
        """Everything from names. The app's credential: ``credential``, else the one kept in
        ``credential_file``, else one got by registering with ``token`` (admin-issued, good once;
        written to ``credential_file``, mode 0600, when given). With ``mqtt``, makes (and later
        stops) the bus that carries job metrics. ``cluster`` is the arbiter's cluster name (the
        metrics topics' second level); ``executor`` runs the jobs (``agent.executors``: a name or an
        instance; default local processes); other keyword arguments go to :class:`AppRunner`.

        Every call starts a new run of the search in ``workdir`` (``agent.search_run``: a run id, the
        jobs' folders under ``<workdir>/<run id>``), so no job finds a checkpoint of an earlier run.
        ``resume=True`` goes on with the run recorded in ``workdir`` instead (its jobs resume from
        their checkpoints), and an adapter with a ``resume()`` method is asked to take up the trials
        that run left (its journal replayed; Optuna: the study's RUNNING trials; give the study its
        storage); ``agent.search_run.RunFinished`` when that run finished.
        ``take_over=True`` replaces an agent of the same app that is connected now (else the arbiter
        refuses this one with ALREADY_EXISTS and the runner stops)."""
        if not callable(argv):
            training_command(argv)  # a bad command is refused before a run begins
        search = SearchRun.begin(workdir, resume=resume)  # RunFinished: that run is over, nothing to resume
        search.attach(adapter)  # its run id and journal; on resume, the tuner takes up where the run stopped
        path = Path(credential_file) if credential_file is not None else None
        if credential is None and path is not None:
            credential = read_credential(path)
        if credential is None:
            if token is None:
                kept = f" (none kept in {path})" if path is not None else ""
                raise NoCredential("no_credential", f"{app!r} has no credential{kept} and no registration token "
                                                    "was given", f"ask an admin for a registration token "
                                                    f"(themis-arbiter issue-token {app}) and pass it as token=")
            credential = await register_or_stop(arbiter, app, token, tls_ca=tls_ca)  # AgentStopped: one line
            if path is not None:
                keep_credential(path, credential)
        bus = None
        if mqtt:
            from arbiter.events import make_bus

            bus = make_bus(mqtt, client_id=f"themis-agent-{app}-{id(adapter):x}")
            await bus.start()
        try:
            client = AgentClient(Agent(adapter, name=app), app, arbiter, credential, tls_ca=tls_ca,
                                 take_over=take_over, credential_file=path)
            launcher = Launcher(app, argv, workdir, cluster=cluster, mqtt=mqtt, report=report, bus=bus,
                                grace_s=grace_s, env=env, executor=executor, run_id=search.run_id)
            runner = cls(adapter, client, launcher, profiler=profiler, bus=bus, **kwargs)
        except BaseException:
            if bus is not None:  # a bad argument must not leave the broker connection open
                await bus.stop()
            raise
        runner.search_run = search
        runner._own_bus = bus  # started here, stopped when the run ends
        return runner

    @staticmethod
    async def token(arbiter: str, app: str, admin_token: str, *, tls_ca: bytes | None = None) -> str:
        """An admin's registration token for ``app`` (what ``themis-arbiter issue-token`` prints).
        Raises :class:`protos.exits.Stopped` (one line: unreachable, the admin token refused, ...)."""
        from protos.exits import rpc_stopped

        try:
            return await issue_token(arbiter, app, admin_token, tls_ca=tls_ca)
        except grpc.aio.AioRpcError as exc:
            raise rpc_stopped(exc, arbiter, what="admin token (IssueToken)", tls=tls_ca is not None,
                              refused_fix="give the arbiter's admin token (serve --admin-token, THEMIS_ADMIN_TOKEN, "
                                          "or the file <db>.admin-token next to its journal)") from None

    # -- the loop ----------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self._done

    def _where_it_stands(self) -> str:
        """What a timed-out run was doing: GPUs held, each job's engine state and age, runs ended."""
        now = self.launcher.clock()
        jobs = ", ".join(f"{job} {run.state} {now - run.started_at:.0f} s on {','.join(run.gpus)}"
                         for job, run in sorted(self.launcher.live().items())) or "none"
        return (f"holds {len(self.client.held)} GPUs; jobs: {jobs}; {len(self.launcher.history)} runs ended, "
                f"{len(self.reports)} reports")

    async def run(self, timeout: float | None = None) -> AppRunner:
        """Connect, run the search to its end (or ``timeout`` s: TimeoutError), stop every job."""
        if not getattr(self.adapter, "start_time", 0.0):
            self.adapter.start_time = self.clock()
        self.started_at = self.clock()
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.record:
            self._record = RunRecord(self.launcher.run_dir)
        if not self.quiet:
            show_progress_lines()
            total = self.adapter.trials_planned() if hasattr(self.adapter, "trials_planned") else None
            self._bar = SearchProgress(self.app, total if isinstance(total, int) else None)
            self._update_bar()
        log.info("%s: run %s in %s", self.app, self.launcher.run_id or "-", self.launcher.run_dir)
        # an earlier agent's jobs would hold GPUs the arbiter re-leases (waits for them to checkpoint)
        await asyncio.to_thread(self.launcher.cancel_leftovers)
        client_task = asyncio.create_task(self.client.run(), name=f"themis-agent-{self.app}")
        follow = asyncio.create_task(self._follow()) if self.launcher.report == "mqtt" else None
        try:
            if follow is not None:
                await asyncio.wait_for(self._following.wait(), 10.0)
            while not self._done:
                if client_task.done():
                    client_task.result()  # raises what ended it (e.g. a refused credential)
                    raise RuntimeError(f"the agent of {self.app} stopped before the app finished")
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"{self.app} did not finish within {timeout} s ({self._where_it_stands()})")
                try:
                    self.step()
                except SearchFailed:
                    # issue 36: a search that failed is over; the app leaves the arbiter (its leases
                    # end, it no longer counts in anyone's N_avg) instead of staying with its demand
                    self.client.done()
                    raise
                if self._done:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.tick_s)
                self._wake.clear()
        finally:
            try:
                polled = await self.launcher.shutdown(self.grace_s)
                self._take_last_reports(polled.metrics)
                for exited in polled.exited:
                    self._note("exit", job=exited.job_id, returncode=exited.returncode, reason=exited.reason,
                               killed=exited.killed, resumed=exited.resumed, first_iteration=exited.first_iteration,
                               last_iteration=exited.last_iteration)
            finally:
                await self._close_agent(client_task, follow)
                self._close_records()
        return self

    def _take_last_reports(self, metrics: Sequence[tuple[str, Any]]) -> None:
        """Reports the jobs made while the run shut them down: each stopped job finishes its iteration,
        reports it and saves it in its checkpoint. The tuner gets them, so it agrees with the
        checkpoints (a resumed Optuna study goes on where its trials' jobs do)."""
        for job, payload in metrics:
            try:
                self._ingest(job, payload)
            except Exception as exc:  # the run is ending already: never hide why it ended
                log.warning("%s: could not take the last report of %s: %s", self.app, job, exc)

    def _close_records(self) -> None:
        """The end of the run's record and its plot; the progress task leaves the display."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._record is None:
            return
        self._record.write(self.clock(), "done" if self._done else "stopped", best=self._best_text())
        try:
            kept = history(self._record.folder)  # every session of the run: a resumed one's too
            rho, held, start = kept if kept is not None else (self.rho_now, self.held_history,
                                                                self.started_at or self.clock())
            out = plot(self._record.folder / PLOT, self.app, rho, held, start, self.clock())
            log.info("%s: rho and GPUs over time in %s", self.app, out)
        except Exception as exc:  # a record must never fail the search
            log.warning("%s: could not draw %s: %s", self.app, PLOT, exc)

    async def _close_agent(self, client_task: asyncio.Task, follow: asyncio.Task | None) -> None:
        """Whatever happened to the jobs, the agent's stream, its tasks and its bus are closed."""
        if not self.client.finished:
            self.client.stop()
        with contextlib.suppress(asyncio.TimeoutError, Exception):
            await asyncio.wait_for(client_task, 5.0)
        if not client_task.done():
            client_task.cancel()
        await asyncio.wait([client_task])  # its stream and channel closed before the run returns
        if follow is not None:
            follow.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await follow
        if self._own_bus is not None:
            await self._own_bus.stop()

    async def _follow(self) -> None:
        """Reports jobs publish on MQTT (``report="mqtt"``)."""
        from arbiter.events import job_metrics_pattern

        assert self.bus is not None
        async with self.bus.subscribe(job_metrics_pattern(self.launcher.cluster, self.app)) as sub:
            self._following.set()
            async for event in sub:
                parts = event.topic.split("/")
                if len(parts) >= 3 and parts[-1] == "metrics" and parts[-3] == "jobs":
                    self._inbox.append((parts[-2], event.payload))
                    self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def step(self) -> None:
        """One pass of the loop (see the module docstring); never blocks."""
        polled = self.launcher.poll()
        batch, self._inbox = polled.metrics + self._inbox, []
        to_stop: list[str] = []
        for job, payload in batch:
            for j in self._ingest(job, payload):
                if j not in to_stop:
                    to_stop.append(j)
        for exited in polled.exited:
            self._on_exit(exited)
        self._judge_quiet_exits()
        self._check_failing()
        self._take_start_ups()
        for job in to_stop:
            run = self.launcher.run_of(job)
            if run is None or not run.active:
                continue
            target = getattr(run.spec, "target_iteration", None)
            # a job that reached its target exits by itself: no SIGTERM into its checkpoint and exit
            at_target = target is not None and run.last_iteration is not None and run.last_iteration >= target
            why = "converged" if self.watch is not None and job in self.watch.converged_at else "tuner"
            self.launcher.stop(job, self.grace_s, reason=why, signal_now=not at_target)
            self._note("stop", job=job, reason=why)
            self._stopped_for[job] = why
        if self.adapter.finished():
            self._update_demand(0)
            if not self.launcher.live():
                self._finish()
            return
        # While the stream is down, or silent before the client finds it broken, nobody would tell
        # us a lease ran out: stop counting on GPUs whose lease ends within a grace period (they
        # may already be someone else's). Past its end a lease runs on until the round decides
        # (D13) only while the arbiter is heard from, a heartbeat interval plus the grace.
        connected = self.client.hears_arbiter(self.client.heartbeat_s + self.grace_s)
        wall = time.time()
        held = {g: h.position for g, h in self.client.held.items()
                if connected or h.expires_at - self.grace_s > wall}
        desired = self._placement(held)
        for job, run in self.launcher.live().items():
            if run.state == "stopping" and not run.signalled and set(run.gpus) - set(held):
                self.launcher.stop(job, self.grace_s, reason="GPUs lost")  # was leaving by itself: hurry it
                continue
            if not run.active:
                continue
            want = desired.get(job)
            if want is None or set(want) != set(run.gpus):
                lost = set(run.gpus) - set(held)
                reason = "GPUs lost" if lost else ("not assigned" if want is None else "GPU set changed")
                self.launcher.stop(job, self.grace_s, reason=reason)
                self._note("stop", job=job, reason=reason)
                self._stopped_for[job] = reason
        busy = self.launcher.gpus_in_use()
        now = time.monotonic()
        specs: dict[str, TrialSpec] | None = None
        for job, gpus in desired.items():
            if self.launcher.is_live(job) or job in self.failed or self._hold.get(job, 0.0) > now:
                continue
            if set(gpus) & busy:
                continue  # the GPUs' previous job is still checkpointing
            if specs is None:
                specs = {t.job_id: t for t in self._runnable(len(held))}
            spec = specs.get(job)
            if spec is None:
                continue
            try:
                run = self.launcher.start(spec, gpus, [held[g] for g in gpus])
            except LaunchError as exc:  # the engine's trouble, not the job's: try again later, uncounted
                self._launch_errors[job] += 1
                wait = min(30.0, 0.5 * 2 ** min(self._launch_errors[job], 6))
                log.error("%s: cannot launch %s (trying again in %.0f s): %s", self.app, job, wait, exc)
                self._hold[job] = now + wait
                continue
            except (OSError, ValueError, RuntimeError) as exc:
                log.error("%s: cannot start %s: %s", self.app, job, exc)
                self._fail(job, f"cannot start: {exc}")
                continue
            self._launch_errors.pop(job, None)
            self._heard_at_start[job] = self._heard[job]
            self._params[job] = dict(spec.params)
            self._result_said.pop(job, None)
            busy |= set(gpus)
            after = self._stopped_for.pop(job, None)
            if run.resumed:
                self._resuming[job] = (after, spec.start_iteration)
            self._note("start", job=job, gpus=list(gpus), resumed=run.resumed, start_iteration=spec.start_iteration,
                       target_iteration=spec.target_iteration, after=after)
        self._check_failing()
        if getattr(self.client, "contention", None) is not None:  # D35: the arbiter models contention
            self._tell_jobs()
        demand = self.adapter.demand_now()
        self._update_demand(demand)
        self._sample_rho(held)
        if len(held) > demand:
            used = {g for gpus in desired.values() for g in gpus} | busy
            spare = sorted(g for g in held if g not in used)[: len(held) - demand]
            if spare:
                self.client.release(spare)
                self._note("release", gpus=spare)

    def _tell_jobs(self) -> None:
        """D35, while the arbiter models contention: the running jobs' GPUs and the contention ratio
        the profiler measured for each, sent when where they run changes or a ratio moves by a percent."""
        jobs = []
        for job, run in sorted(self.launcher.live().items()):
            if run.active and run.gpus:
                measured = self.profiler.contention_ratio(job) if self.profiler is not None else None
                jobs.append(RunningJob(job, frozenset(run.gpus), ratio=0.0 if measured is None else min(1.0, measured)))
        where, ratios = tuple((j.job, j.gpus) for j in jobs), [j.ratio for j in jobs]
        told = self._told_jobs
        if told is None or where != told[0] or any(abs(a - b) > 0.01 for a, b in zip(ratios, told[1])):
            self._told_jobs = (where, ratios)
            self.client.report_jobs(jobs)

    # -- placement ---------------------------------------------------------------------------------

    def _runnable(self, gpus: int) -> list[TrialSpec]:
        return self.adapter.runnable(gpus=gpus) if self._runnable_gpus else self.adapter.runnable()  # type: ignore[call-arg]

    def _placement(self, held: Mapping[str, Position]) -> dict[str, tuple[str, ...]]:
        """The adapter's assignment, remapped so running jobs keep their GPUs where they can."""
        if not held:
            return {}
        wanted = {j: g for j, g in self.adapter.assign(held).items() if j not in self.failed}
        live = {j: r.gpus for j, r in self.launcher.live().items() if r.active}
        out: dict[str, tuple[str, ...]] = {}
        for job, gpus in wanted.items():
            cur = live.get(job)
            if cur is not None and len(cur) == len(gpus) and set(cur) <= set(held):
                out[job] = cur
        used = {g for gpus in out.values() for g in gpus}
        moved = []
        for job, gpus in wanted.items():  # the adapter's own choice where it is still free
            if job in out:
                continue
            if set(gpus) & used:
                moved.append(job)
            else:
                out[job] = tuple(gpus)
                used |= set(gpus)
        for job in moved:  # the rest: the same number of GPUs from what is left, well placed
            pick = _best_locality([g for g in sorted(held) if g not in used], held, len(wanted[job]))
            if pick is not None:
                out[job] = pick
                used |= set(pick)
        return out

    # -- reports -----------------------------------------------------------------------------------

    def serial_time(self, iter_time_s: float, gpus: Sequence[Position], demand: int) -> float:
        """D2 inverted: the one-GPU time per iteration of a job measured at ``iter_time_s`` on ``gpus``."""
        slowdown = self.profiler.slowdown if self.profiler is not None else self.adapter.placement_slowdown()
        return iter_time_s * min(len(gpus), demand) / slowdown_of(slowdown, gpus)

    def _ingest(self, job: str, payload: Any) -> list[str]:
        try:
            m = parse_metrics(payload)
        except ValueError as exc:
            self.rejected += 1
            log.warning("%s: ignoring a report of %s: %s", self.app, job, exc)
            return []
        self._heard[job] += 1
        extra = payload.get("extra") if isinstance(payload.get("extra"), dict) else {}
        serial = self.serial_time(m.iter_time_s, m.gpus, m.demand)
        self.reports.append(JobReport(self.clock(), job, m.iteration, m.loss, m.iter_time_s, serial, len(m.gpus), extra))
        self._progress[job] = max(self._progress.get(job, -1.0), m.iteration)
        self._failed_streak.clear()
        if job in self._resuming:  # the first report of a resumed run: it went on from its checkpoint
            after, start = self._resuming.pop(job)
            # a run whose checkpoint was at its target says that report again and trains nothing
            went_on_from = m.iteration if m.iteration <= start else m.iteration - 1
            if went_on_from >= 1:  # a checkpoint written before the first iteration holds no progress
                self.resumes.append({"job": job, "from_iteration": went_on_from, "after": after})
        if self.profiler is not None:
            self.profiler.observe(job, m.iter_time_s, m.gpus, m.demand)
            if self._profile_ok:
                try:
                    self.profiler.apply(self.adapter)
                except TypeError as exc:
                    self._profile_ok = False
                    log.warning("%s: the profiler cannot update this adapter: %s", self.app, exc)
        loss = m.loss if m.loss is not None else math.inf
        try:
            if self._observe_gpus:
                stops = list(self.adapter.observe(job, m.iteration, loss, m.iter_time_s, gpus=m.gpus))  # type: ignore[call-arg]
            else:
                stops = list(self.adapter.observe(job, m.iteration, loss, serial))
        except (KeyError, ValueError) as exc:
            self.rejected += 1
            log.warning("%s: the tuner refused a report of %s: %s", self.app, job, exc)
            stops = []
            if self.watch is None or job not in self.watch.converged_at:
                return []
        if self.watch is not None and job not in stops and self.watch.report(job, m.iteration, loss):
            stops += [j for j in self._converged(job, m.iteration, loss, m.gpus) if j not in stops]
        for j in stops:
            self._trial_result(j, (m.iteration, loss, extra) if j == job else None)
        return stops

    def _converged(self, job: str, iteration: float, loss: float, gpus: Sequence[Position]) -> list[str]:
        """D34: the job's losses stopped improving by the app's rule. The tuner is told the trial
        reached its target with this loss -- the rule's claim is that training on would not have
        improved it by more than ``min_delta`` -- so it ends as a finished trial (a rung decides on
        it as on any other); the job is stopped. Returns the jobs to stop."""
        run = self.launcher.run_of(job)
        target = getattr(run.spec, "target_iteration", None) if run is not None else None
        at = max(float(iteration), float(target or 0))
        first = self._note_converged(job, iteration, loss)
        try:
            if self._observe_gpus:
                stops = list(self.adapter.observe(job, at, loss, None, gpus=gpus))  # type: ignore[call-arg]
            else:
                stops = list(self.adapter.observe(job, at, loss, None))
        except (KeyError, ValueError) as exc:
            if first:
                log.warning("%s: the tuner refused the end of converged %s: %s", self.app, job, exc)
            stops = []
        return stops + ([job] if job not in stops else [])

    def _note_converged(self, job: str, iteration: float, loss: float) -> bool:
        """Say once that ``job`` converged (a later run of it is ended at its first report, quietly)."""
        if job in self._said_converged:
            return False
        self._said_converged.add(job)
        self._note("converged", job=job, iteration=iteration, loss=loss)
        log.info("%s: %s converged: loss %.4g at iteration %g, no better by the app's rule (%s); ended",
                 self.app, job, loss, iteration, self.watch.rule.spec() if self.watch else "")
        return True

    def _on_exit(self, exited: JobExit) -> None:
        job = exited.job_id
        self._note("exit", job=job, returncode=exited.returncode, reason=exited.reason, killed=exited.killed,
                   resumed=exited.resumed, first_iteration=exited.first_iteration, last_iteration=exited.last_iteration)
        if exited.requested:
            return
        if exited.clean and self._progressed(exited):
            self._hold[job] = time.monotonic() + self.report_wait_s
            return
        if exited.clean and self.launcher.report == "mqtt":
            # Its reports travel through the broker and may land after the exit: judge it when
            # report_wait_s has passed, and do not restart it meanwhile.
            deadline = time.monotonic() + self.report_wait_s
            self._verdicts[job] = (deadline, exited)
            self._hold[job] = deadline
            return
        why = f"exit code {exited.returncode}" if not exited.clean else "exited without reporting progress"
        log.warning("%s: job %s failed (%s); see %s", self.app, job, why, self.launcher.log_path(job))
        self._fail(job, why)

    def _progressed(self, exited: JobExit) -> bool:
        """Did this run report? The launcher counts what came through its pipe or metrics file; reports
        published on MQTT reach only the runner, so it counts those itself."""
        return exited.reports > 0 or self._heard[exited.job_id] > self._heard_at_start.get(exited.job_id, 0)

    def _judge_quiet_exits(self) -> None:
        """A clean exit with no report seen yet is a failure only once the reports' grace has passed."""
        now = time.monotonic()
        for job, (deadline, exited) in list(self._verdicts.items()):
            if self._progressed(exited):
                del self._verdicts[job]
            elif now >= deadline:
                del self._verdicts[job]
                log.warning("%s: job %s failed (exited without reporting progress); see %s", self.app, job,
                            self.launcher.log_path(job))
                self._fail(job, "exited without reporting progress")

    def _check_failing(self) -> None:
        """Issue 11's fail-fast bound: ``max_failed_runs`` failed runs in a row, nobody reporting."""
        if self.max_failed_runs is None or len(self._failed_streak) < self.max_failed_runs:
            return
        job, why, tail = self._failed_streak[0]
        raise SearchFailed(self.app, len(self._failed_streak), job, why, self.launcher.log_path(job), tail,
                           limit=self.max_failed_runs)

    def _fail(self, job: str, why: str) -> None:
        self.failures[job] += 1
        tail = _log_tail(self.launcher.log_path(job)) if not self._failed_streak else ""  # only the first's is shown
        self._failed_streak.append((job, why, tail))
        if self.failures[job] < self.max_failures:
            self._hold[job] = time.monotonic() + 0.5 * self.failures[job]
            return
        self.failed.add(job)
        self._note("give up", job=job, reason=why)
        if self._record is not None:
            self._record.write(self.clock(), "failed", job=job, reason=why)
        self._results.setdefault(job, (self._progress.get(job, 0.0), math.inf))
        self._update_bar()
        log.error("%s: giving up on job %s after %d failures", self.app, job, self.failures[job])
        try:
            if hasattr(self.adapter, "fail"):
                stops = self.adapter.fail(job) or []  # type: ignore[attr-defined]
            else:
                target = next((t.target_iteration for t in self._runnable(1) if t.job_id == job), None)
                at = max(self._progress.get(job, 0.0), float(target or 0), 1.0)
                stops = self.adapter.observe(job, at, math.inf)
            for j in stops:
                self.launcher.stop(j, self.grace_s, reason="tuner")
        except (KeyError, ValueError) as exc:
            log.warning("%s: could not tell the tuner that %s failed: %s", self.app, job, exc)

    # -- demand, end, records ----------------------------------------------------------------------

    def _sample_rho(self, held: Mapping[str, Position]) -> None:
        """rho with the GPUs held now (Eq. 1 with the N_avg and cluster size of the last round that
        asked), every ``rho_every_s``: the app's finish-time fairness over time, also between the
        rounds that ask it (a round asks only apps that want more GPUs, D6, and at a lease's expiry
        the app holds none of the GPUs being re-auctioned, so reported rhos are often infinite)."""
        now = time.monotonic()
        if self._context is None or now < self._next_rho:
            return
        self._next_rho = now + self.rho_every_s
        rho = self.rho_with_held(list(held.values()))
        if rho is None:
            return
        self.rho_now.append((self.clock(), rho))
        if self._record is not None:
            self._record.write(self.clock(), "rho", rho=rho, gpus=len(held))

    def _update_demand(self, demand: int) -> None:
        if demand != self._demand:
            self.client.set_demand(demand)
            self._demand = demand
            self.demand_history.append((self.clock(), demand))

    def _finish(self) -> None:
        self._done = True
        self.finished_at = self.clock()
        self.client.done()
        self._note("done")
        log.info("%s finished in %.1f s", self.app, self.finished_at - (self.started_at or self.finished_at))

    def _note(self, what: str, **fields: Any) -> None:
        self.events.append({"t": self.clock(), "what": what, **fields})
        if what in ("grant", "revoke", "release"):
            self.held_history.append((self.clock(), len(self.client.held)))
            self._say_gpus(what, fields["gpus"], fields.get("reason"))
        self._wake.set()

    # -- what the user sees (issue 11, item 2) -----------------------------------------------------

    def rho_with_held(self, positions: Sequence[Position] | None = None) -> float | None:
        """rho with the GPUs held now (``positions``, default: every GPU the client holds; Eq. 1
        with the last round's N_avg and cluster size); None before the first round asked or when it
        cannot be computed."""
        if self._context is None:
            return None
        if positions is None:
            positions = [h.position for h in self.client.held.values()]
        try:
            return float(finish_time_fairness(self.adapter, positions, now=self.clock(), n_avg=self._context[0],
                                              cluster_size=self._context[1],
                                              left=self.client.agent.time_left(positions)))
        except (ValueError, ZeroDivisionError):
            return None

    def _say_gpus(self, what: str, gpus: Sequence[str], reason: str | None) -> None:
        held = sorted(self.client.held)
        rho = self.rho_with_held()
        words = {"grant": "granted", "revoke": "lost", "release": "released"}[what]
        why = f" ({reason})" if reason else ""
        log.info("%s: %s %s%s; holds %d GPU%s%s; rho %s", self.app, words, ",".join(gpus), why, len(held),
                 "" if len(held) == 1 else "s", f" [{','.join(held)}]" if held else "",
                 "-" if rho is None else ("inf" if math.isinf(rho) else f"{rho:.2f}"))
        if self._record is not None:
            self._record.write(self.clock(), what, gpus=list(gpus), held=held, reason=reason, rho=rho)

    def _trial_result(self, job: str, report: tuple[float, float, Mapping[str, Any]] | None) -> None:
        """The tuner stopped ``job`` (pruned, rung reached, done) on ``report`` (else on its last one):
        one line, one record, once per run of the job (reports already in the pipe when the
        stop was decided come after it and are not results); recorded again when its outcome changes
        (a Hyperband trial paused at its rung, then pruned or completed when the rung ends)."""
        outcome = self.adapter.outcome(job) if hasattr(self.adapter, "outcome") else None
        if self.watch is not None and job in self.watch.converged_at and outcome in (None, "completed", "paused"):
            outcome = "converged"  # D34: ended by the app's convergence rule (a rung may still prune it)
        first = job not in self._result_said
        if not first and self._result_said[job] == outcome:
            return
        if report is None:
            last = next((r for r in reversed(self.reports) if r.job_id == job), None)
            if last is not None:
                report = (last.iteration, last.loss if last.loss is not None else math.inf, last.extra)
            else:  # its reports came before a resume: the tuner still has the last one
                known = self.adapter.last_result(job) if hasattr(self.adapter, "last_result") else None
                if known is None:
                    return
                report = (known[0], known[1], {})
        self._result_said[job] = outcome
        iteration, loss, extra = report
        self._results[job] = (iteration, loss)
        if first:
            log.info("%s: %s result: loss %.4g at iteration %g; best so far %s", self.app, job, loss, iteration,
                     self._best_text())
        if self._record is not None:
            self._record.write(self.clock(), "trial", job=job, iteration=iteration, loss=loss,
                               params=self._params.get(job), extra=dict(extra) or None, outcome=outcome)
        self._update_bar()

    def _best_text(self) -> str:
        best = self.adapter.best()
        return "-" if best is None else f"{best.job_id} loss {best.loss:.4g} at iteration {best.iteration:g}"

    def _update_bar(self) -> None:
        if self._bar is not None:
            decided = self.adapter.trials_decided() if hasattr(self.adapter, "trials_decided") else None
            self._bar.update(len(self._results) if decided is None else decided, f"best {self._best_text()}")

    def _count_start_ups(self, seconds: list[float]) -> None:
        """D30: the app's rho counts the start-up its jobs pay (the median so far): in T_id once
        per job start it pays even alone, in its time left once per phase still to start, and in
        every bid row that moves its jobs (D17)."""
        start_up = statistics.median(seconds)
        self.adapter.start_up_s = start_up
        self.client.agent.restart_s = start_up
        self.adapter.touch()

    def _take_start_ups(self) -> None:
        """Item 5: a job whose start-up (launch to first report) is over a tenth of the lease loses
        much of each lease to starting; warn once per app with what to change."""
        taken, self.launcher.start_ups = self.launcher.start_ups, []
        if taken:
            self._count_start_ups([seconds for _, seconds in self.start_ups + taken])
        for job, seconds in taken:
            self.start_ups.append((job, seconds))
            if self._record is not None:
                self._record.write(self.clock(), "start_up", job=job, seconds=round(seconds, 3))
            if self.lease_s and seconds > self.lease_s / 10 and not self._warned_start_up:
                self._warned_start_up = True
                log.warning("%s: job %s took %.1f s from launch to its first report, more than a tenth of the "
                            "%.0f s lease: a job that loses its GPUs pays this again on every restart. Use leases "
                            "of at least %.0f s (themis-arbiter serve --lease), or report sooner after start "
                            "(docs/agents.md, 'Choosing the lease')", self.app, job, seconds, self.lease_s,
                            10 * seconds)

    def summary(self) -> dict[str, Any]:
        """What happened, as plain data: completion, best result (with the extras of its report),
        rho and GPUs over time, runs, resumes and lease losses."""
        start = self.started_at or 0.0
        best = self.adapter.best()
        best_out = None
        if best is not None:
            match = [r for r in self.reports if r.job_id == best.job_id and r.iteration == best.iteration]
            best_out = {"job": best.job_id, "params": dict(best.params), "loss": best.loss,
                        "iteration": best.iteration, **(dict(match[-1].extra) if match else {})}
        history = self.launcher.history
        return {
            "app": self.app,
            "run": self.launcher.run_id,
            "run_dir": str(self.launcher.run_dir),
            "finished": self._done,
            "completion_s": None if self.finished_at is None else round(self.finished_at - start, 2),
            "best": best_out,
            "rho": [(round(t - start, 2), (None if math.isinf(r) else round(r, 4))) for t, r in self.rho_now],
            "rho_reported": [(round(t - start, 2), (None if math.isinf(r) else round(r, 4))) for t, r in self.rho],
            "gpus_held": [(round(t - start, 2), n) for t, n in self.held_history],
            "runs": len(history),
            "jobs": len(self.launcher.starts),
            "resumed_runs": sum(1 for e in history if e.resumed),
            "resumed_after_preemption": sum(1 for e in self.events if e["what"] == "start" and e["resumed"]
                                            and e["after"] in PREEMPTED),
            "resumes": self.resumes[:100],
            "lease_losses": sum(1 for e in self.events if e["what"] == "revoke"),
            "stopped_for_lost_gpus": sum(1 for e in self.events if e["what"] == "stop" and e["reason"] == "GPUs lost"),
            "killed_after_grace": sum(1 for e in history if e.killed),
            "reports": len(self.reports),
            "failed_jobs": sorted(self.failed),
            "converged_jobs": sorted(self.watch.converged_at) if self.watch is not None else [],
        }


def _best_locality(free: Sequence[str], held: Mapping[str, Position], k: int) -> tuple[str, ...] | None:
    """``k`` of ``free`` on one slot, else one machine, else one rack, else anywhere (fewest spread)."""
    if len(free) < k:
        return None
    for key in (lambda p: p, lambda p: p[:2], lambda p: p[:1]):
        groups: dict[Any, list[str]] = {}
        for g in free:
            groups.setdefault(key(held[g]), []).append(g)
        fits = [ids for ids in groups.values() if len(ids) >= k]
        if fits:
            return tuple(sorted(min(fits, key=len))[:k])
    return tuple(sorted(free, key=lambda g: held[g])[:k])
