"""The arbiter as a gRPC service: the wall-clock shell around the round engine (paper 4.2, Fig. 7).

:class:`ArbiterService` composes the service's four jobs, each in its own module:

- the agents' streams (``arbiter.streams``): ``Connect``, every message on it, heartbeats;
- the round driver (``arbiter.round_driver``): D10 on the wall clock around ``arbiter.rounds``;
- the admin API (``arbiter.admin``): registration, reads, an admin's changes;
- publishing (``arbiter.publisher``): typed events and their sinks -- the agents' streams, MQTT,
  Prometheus and an in-memory event log a dashboard follows.

They share one state and one commit step (``arbiter.service_core``): every change is journaled,
then emitted once as events, then the round loop is woken. This class is that shared state, plus
the gRPC methods (each handed to its job) and the start and stop of the whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from arbiter.admin import AdminApi
from arbiter.connection import Connection, ParseGuard, StreamEnd, Unparsable, new_secret
from arbiter.events import EventBus
from arbiter.limits import Limits
from arbiter.publisher import ArbiterOnline, EventLog, LeasesChanged, MetricsSink, MqttSink
from arbiter.round_driver import RECLAIMED, RoundDriver, round_summary
from arbiter.rounds import RoundEngine, RoundResult
from arbiter.service_core import ServiceCore
from arbiter.service_metrics import ServiceMetrics
from arbiter.settings import Settings
from arbiter.store import Store
from arbiter.streams import MAX_BID_ROWS, AgentStreams
from protos import themis_pb2 as pb
from protos import themis_pb2_grpc as pb_grpc

__all__ = ["RECLAIMED", "MAX_BID_ROWS", "ArbiterService", "Connection", "ParseGuard", "Settings", "StreamEnd",
           "Unparsable", "new_secret"]

_summary = round_summary  # the round's journal and MQTT record, under the name tests know it by


class ArbiterService(ServiceCore, pb_grpc.ArbiterServicer):
    """The Arbiter gRPC service of one cluster; see the module docstring."""

    def __init__(
        self,
        engine: RoundEngine,
        store: Store,
        bus: EventBus,
        *,
        settings: Settings,
        admin_token: str,
        metrics: ServiceMetrics | None = None,
        clock: Callable[[], float] = time.time,
        profiles: Mapping[str, tuple[float, float, float, float]] | None = None,
        limits: Limits | None = None,
    ):
        super().__init__(engine, store, settings=settings, metrics=metrics, clock=clock, profiles=profiles,
                         limits=limits)
        self.bus = bus
        self.streams = AgentStreams(self)
        self.driver = RoundDriver(self)
        self.admin = AdminApi(self, admin_token)
        self.mqtt = MqttSink(bus, self.cluster, self._owns)
        self.events = EventLog()
        # the agents first: they hear of a grant before the broker and the metrics do, as before
        self.publisher.attach(self.streams, self.mqtt, MetricsSink(self.metrics), self.events)

    def _owns(self, kind: str, name: str) -> bool:
        return name in (self.engine.apps if kind == "apps" else self.engine.cluster.gpus)

    # -- running -----------------------------------------------------------------------------------

    async def run_rounds(self) -> None:
        await self.driver.run_rounds()

    async def run_round(self) -> RoundResult:
        return await self.driver.run_round()

    async def heartbeats(self) -> None:
        await self.streams.heartbeats()

    def stop(self) -> None:
        self.driver.stop()
        self.streams.end_all(StreamEnd("shutting_down", "the arbiter is shutting down; reconnect when it is back"))

    def republish_state(self) -> None:
        """Retained state for late subscribers: every GPU's lease and every app's leases."""
        now, gpus = self.clock(), self.engine.cluster.gpu_ids
        self.emit(ArbiterOnline(now=now),
                  LeasesChanged(now=now, cause="start", gpus=tuple(self.gpu_lease(g) for g in gpus),
                                apps=tuple(self.app_leases(a) for a in self.engine.apps)))

    async def sweep_retained(self, window_s: float = 2.0) -> list[str]:
        return await self.mqtt.sweep_retained(window_s)

    async def read_retained(self, window_s: float, on_retained: Callable[[str], Any] | None = None) -> set[str]:
        return await self.mqtt.read_retained(window_s, on_retained)

    def clear_unknown(self, topics) -> list[str]:
        return self.mqtt.clear_unknown(topics)

    def apply_settings(self, new: Settings) -> None:
        self.admin.apply_settings(new)

    # -- the Arbiter service, each call handed to its job ------------------------------------------

    async def Connect(self, request_iterator, context) -> None:
        await self.streams.Connect(request_iterator, context)

    async def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterReply:
        return await self.admin.Register(request, context)

    async def GetApp(self, request: pb.GetAppRequest, context) -> pb.AppState:
        return await self.admin.GetApp(request, context)

    async def IssueToken(self, request: pb.IssueTokenRequest, context) -> pb.IssueTokenReply:
        return await self.admin.IssueToken(request, context)

    async def GetClusterState(self, request, context) -> pb.ClusterState:
        return await self.admin.GetClusterState(request, context)

    async def ListApps(self, request, context) -> pb.AppList:
        return await self.admin.ListApps(request, context)

    async def ListLeases(self, request, context) -> pb.LeaseList:
        return await self.admin.ListLeases(request, context)

    async def RoundHistory(self, request: pb.RoundHistoryRequest, context) -> pb.RoundList:
        return await self.admin.RoundHistory(request, context)

    async def UpdateSettings(self, request: pb.SettingsUpdate, context) -> pb.Settings:
        return await self.admin.UpdateSettings(request, context)

    async def AddMachine(self, request: pb.AddMachineRequest, context) -> pb.ClusterState:
        return await self.admin.AddMachine(request, context)

    async def DrainMachine(self, request: pb.DrainMachineRequest, context) -> pb.ClusterState:
        return await self.admin.DrainMachine(request, context)

    async def RemoveApp(self, request: pb.RemoveAppRequest, context) -> pb.AppState:
        return await self.admin.RemoveApp(request, context)

    async def RevokeCredential(self, request: pb.RevokeCredentialRequest, context) -> pb.AppState:
        return await self.admin.RevokeCredential(request, context)

    async def IssueViewerToken(self, request: pb.ViewerTokenRequest, context) -> pb.ViewerTokenReply:
        return await self.admin.IssueViewerToken(request, context)

    async def RevokeViewerToken(self, request: pb.ViewerTokenRequest, context) -> pb.ViewerTokenReply:
        return await self.admin.RevokeViewerToken(request, context)
