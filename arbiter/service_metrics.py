"""Prometheus metrics of the arbiter service. Each service has its own registry, so tests can run several.

What an operator asks first (issue 12, item 6): per app, its rho (on what it holds after the last
round), the GPUs it holds, the GPUs granted to it and its rejected messages; the process's CPU and
memory; whether the event broker is connected and how much waits for it; how long journal writes
take; how late the event loop runs. Per-app series are dropped when the app leaves, so their number
is bounded by the apps the arbiter runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server

from arbiter.rounds import RoundResult


class ServiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.round_latency = Histogram(
            "themis_round_latency_seconds", "Time from opening a round to its grants going out", registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30))
        self.rounds = Counter("themis_rounds", "Rounds run", registry=r)
        self.round_failures = Counter("themis_round_failures", "Rounds that failed with an internal error",
                                      registry=r)
        self.bidders = Gauge("themis_round_bidders", "Apps offered GPUs in the last round", registry=r)
        self.offered = Gauge("themis_round_offered_gpus", "Free GPUs offered in the last round", registry=r)
        self.idle = Gauge("themis_gpus_idle", "Free GPUs nobody got in the last round", registry=r)
        self.leases = Gauge("themis_leases", "GPUs under lease", registry=r)
        self.connected = Gauge("themis_connected_agents", "Agents with an open stream", registry=r)
        self.waiting = Gauge("themis_apps_waiting_admission", "Apps the admission policy had not let in as the "
                             "last round opened (D33)", registry=r)
        self.rejected = Counter("themis_rejected_messages", "Messages from agents that were rejected",
                                ["what"], registry=r)
        self.refused = Counter("themis_refused_streams", "Agent streams ended before their Welcome, by status "
                               "(UNAUTHENTICATED: unknown or revoked credential)", ["code"], registry=r)
        # per app
        self.app_rho = Gauge("themis_app_rho", "The app's rho on what it holds after the last round "
                             "(+Inf: holds nothing)", ["app"], registry=r)
        self.app_gpus = Gauge("themis_app_gpus_held", "GPUs the app holds", ["app"], registry=r)
        self.app_grants = Counter("themis_app_granted_gpus", "GPUs granted to the app", ["app"], registry=r)
        self.app_rejections = Counter("themis_app_rejected_messages", "The app's messages that were rejected",
                                      ["app"], registry=r)
        # per job, with a contention model on (D35, serve --contention)
        self.job_ratio = Gauge("themis_job_contention_ratio", "The job's contention ratio as its agent measured "
                               "it: its throughput over its profiled throughput (D35)", ["app", "job"], registry=r)
        self.job_expected = Gauge("themis_job_contention_expected", "The job's contention ratio by the table, "
                                  "against the neighbours its agents reported (D35)", ["app", "job"], registry=r)
        self._jobs: dict[str, set[str]] = {}
        # the process, the broker, the journal, the loop
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        self.broker_connected = Gauge("themis_broker_connected", "1 while the event bus is connected to its "
                                      "broker (always 1 for in-memory events)", registry=r)
        self.broker_queue = Gauge("themis_broker_queue", "Events waiting to be sent to the broker", registry=r)
        self.broker_dropped = Gauge("themis_broker_dropped_events", "Events dropped because the queue was full",
                                    registry=r)
        self.journal_latency = Histogram(
            "themis_journal_write_seconds", "Time to write the journal (one transaction)", registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5))
        self.journal_failures = Counter("themis_journal_failures", "Journal writes that failed", registry=r)
        self.loop_lag = Gauge("themis_loop_lag_seconds", "How late the event loop ran a 0.25 s timer, last check",
                              registry=r)
        self.serving = Gauge("themis_serving", "1 while health says SERVING", registry=r)

    def bind_bus(self, connected: Callable[[], bool], pending: Callable[[], int], dropped: Callable[[], int]) -> None:
        """Read the broker's state when scraped (the bus keeps it; nothing to update)."""
        self.broker_connected.set_function(lambda: 1.0 if connected() else 0.0)
        self.broker_queue.set_function(lambda: float(pending()))
        self.broker_dropped.set_function(lambda: float(dropped()))

    def observe_round(self, result: RoundResult, latency: float, *, leases: int, connected: int) -> None:
        self.rounds.inc()
        self.round_latency.observe(latency)
        self.bidders.set(len(result.bidders))
        self.offered.set(len(result.offered))
        self.idle.set(len(result.idle))
        self.leases.set(leases)
        self.connected.set(connected)
        self.waiting.set(len(result.waiting))

    def observe_apps(self, apps: Mapping[str, tuple[float, int]], result: RoundResult | None = None) -> None:
        """``apps``: app -> (rho after the round, GPUs held)."""
        for app, (rho, held) in apps.items():
            self.app_rho.labels(app=app).set(rho if not math.isnan(rho) else math.inf)
            self.app_gpus.labels(app=app).set(held)
        for grant in result.grants if result is not None else ():
            if grant.app in apps:  # an app that left as the round closed is forgotten, not re-created
                self.app_grants.labels(app=grant.app).inc(len(grant.gpus))

    def observe_jobs(self, app: str, jobs: Mapping[str, tuple[float, float | None]], gone=()) -> None:
        """``jobs``: job -> (the table's ratio, the measured one or None); ``gone``: jobs that ended."""
        for job in gone:
            self._forget_job(app, job)
        for job, (expected, measured) in jobs.items():
            self._jobs.setdefault(app, set()).add(job)
            self.job_expected.labels(app=app, job=job).set(expected)
            if measured is not None:
                self.job_ratio.labels(app=app, job=job).set(measured)

    def _forget_job(self, app: str, job: str) -> None:
        for metric in (self.job_ratio, self.job_expected):
            try:
                metric.remove(app, job)
            except KeyError:
                pass
        self._jobs.get(app, set()).discard(job)

    def forget_app(self, app: str) -> None:
        for metric in (self.app_rho, self.app_gpus, self.app_grants, self.app_rejections):
            try:
                metric.remove(app)
            except KeyError:
                pass
        for job in list(self._jobs.pop(app, ())):
            self._forget_job(app, job)

    def serve(self, port: int, addr: str = "127.0.0.1", tls: tuple | None = None):
        """Expose /metrics over HTTP, or HTTPS with ``tls`` = (certificate, key) files (a daemon
        thread); returns the server so it can be shut down."""
        certfile, keyfile = (str(tls[0]), str(tls[1])) if tls else (None, None)
        server, thread = start_http_server(port, addr=addr, registry=self.registry, certfile=certfile,
                                           keyfile=keyfile)
        return server, thread
