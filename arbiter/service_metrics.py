"""Prometheus metrics of the arbiter service: round latency, bidders, idle GPUs, leases, rejected
messages, connected agents. Each service has its own registry, so tests can run several."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

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
        self.rejected = Counter("themis_rejected_messages", "Messages from agents that were rejected",
                                ["what"], registry=r)

    def observe_round(self, result: RoundResult, latency: float, *, leases: int, connected: int) -> None:
        self.rounds.inc()
        self.round_latency.observe(latency)
        self.bidders.set(len(result.bidders))
        self.offered.set(len(result.offered))
        self.idle.set(len(result.idle))
        self.leases.set(leases)
        self.connected.set(connected)

    def serve(self, port: int, addr: str = "127.0.0.1"):
        """Expose /metrics over HTTP (a daemon thread); returns the server so it can be shut down."""
        server, thread = start_http_server(port, addr=addr, registry=self.registry)
        return server, thread
