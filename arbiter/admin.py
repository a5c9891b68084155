"""The admin API: the service's unary calls -- registration, reads, and the changes an admin makes.

Registration: an admin issues a registration token (``IssueToken``, optionally binding the app to a
model of the profile table, D21); the agent trades it once for its credential (``Register``). Reads:
an app reads its own state (``GetApp``), an admin everything (cluster, apps, leases, rounds).
Changes: settings, machines added or drained, apps removed, credentials revoked. Every change is
committed before it is acknowledged (fail closed): when the journal cannot be written the call is
refused with UNAVAILABLE and the cause, and memory is put back as it was.

Admin input is bounded before any work is done, so an absurd call is refused at once; together the
bounds bound the journal's rows per write (apps + leases).
"""

from __future__ import annotations

import hmac
import logging
import math
import re
from collections.abc import Callable
from dataclasses import asdict, replace
from types import MappingProxyType

import grpc

from arbiter.connection import StreamEnd, bearer, new_secret, quote
from arbiter.limits import TokenBucket
from arbiter.publisher import GpuLease, LeasesChanged, MachineAdded, MachineDrained, ServiceEvent, SettingsChanged
from arbiter.rounds import cut_reason
from arbiter.service_core import ServiceCore
from arbiter.settings import Settings
from arbiter.store import StoreError
from arbiter.streams import MAX_APPS
from protos import themis_pb2 as pb
from protos import wire

log = logging.getLogger("themis.arbiter")

APP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
RACK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.]{0,63}$")  # no '-': machines are named <rack>-m<n>
MAX_MACHINE_GPUS = 64  # GPUs in one added machine (a DGX has 8-16)
MAX_CLUSTER_GPUS = 4096  # GPUs in the whole cluster after AddMachine
MAX_ADDED_MACHINES = 256
MAX_OPEN_TOKENS = 16  # unused registration tokens per app
MAX_HISTORY = 10_000  # RoundHistory limit (the journal keeps that many rounds)
LEASE_RANGE_S = (1.0, 30 * 86400.0)
DEPARTED_SHOWN = 20  # apps that left, newest first, in ListApps (the journal keeps more)
NAME_MAX = 128  # machine names in DrainMachine; app names are checked by APP_NAME


class AdminApi:
    """The unary calls of the Arbiter service; see the module docstring."""

    def __init__(self, core: ServiceCore, admin_token: str):
        self.core = core
        self.admin_token = admin_token
        self._registers = TokenBucket(core.limits.registers, core.limits.per_s)
        self._removed: dict[str, float] = {}  # app -> when RemoveApp removed it (this run), for NOT_FOUND's reason

    # -- who may call ----------------------------------------------------------------------------

    def _is_admin(self, context) -> bool:
        token = bearer(context)
        return token is not None and hmac.compare_digest(token.encode(), self.admin_token.encode())

    async def _need_admin(self, context) -> None:
        if bearer(context) is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "the admin token is required")
        if not self._is_admin(context):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "this call needs the admin token")

    async def _need_app_name(self, app: str, context) -> None:
        if not APP_NAME.match(app):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"app name {quote([app])[2:-2]!r} must be 1-128 of A-Z a-z 0-9 . _ - "
                                "(starting with a letter or digit)")

    def _known(self, app: str) -> bool:
        return app in self.core.engine.apps or self.core.store.registered(app)

    def _unknown(self, app: str) -> str:
        """Why an admin call finds no app of that name: removed (by this arbiter's run), or never
        registered. A second RemoveApp used to say "never registered" of the app it had removed."""
        if app in self._removed:
            return f"app {app!r} was removed already, by RemoveApp at {self._removed[app]:.0f} (Unix time)"
        return f"unknown app {app!r} (never registered)"

    # -- committing an admin's change ------------------------------------------------------------

    async def _commit(self, context, what: str, *events: ServiceEvent, undo: Callable[[], None] | None = None,
                      wake: bool = False) -> None:
        """The commit step for a change an admin asked for, before answering: when the journal
        cannot be written the call is refused with UNAVAILABLE and the cause, and ``undo`` puts
        memory back as it was: nothing is acknowledged that a restart would not have."""
        try:
            self.core.commit(*events, wake=wake, strict=True)
        except Exception as exc:
            if undo is not None:
                undo()
            log.error("refused: the journal cannot be written", extra={"fields": {"call": what, "cause": str(exc)}})
            await context.abort(grpc.StatusCode.UNAVAILABLE, cut_reason(f"{what} was not done: {exc}"))

    async def _journal_works(self, context, what: str) -> None:
        """While the journal is failing, a mutating call is refused before it changes anything
        (after one more write, in case the journal has recovered)."""
        if "journal" in self.core.problems:
            await self._commit(context, what)

    # -- registration ----------------------------------------------------------------------------

    async def IssueToken(self, request: pb.IssueTokenRequest, context) -> pb.IssueTokenReply:
        core = self.core
        await self._need_admin(context)
        await self._need_app_name(request.app, context)
        if not self._known(request.app) and len(core.store.token_apps() | set(core.engine.apps)) >= MAX_APPS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the arbiter knows {MAX_APPS} apps already (the limit); remove one first")
        if core.store.open_tokens(request.app) >= MAX_OPEN_TOKENS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{request.app!r} has {MAX_OPEN_TOKENS} unused registration tokens (the limit); "
                                "use one or RevokeCredential")
        if request.model and request.model not in core.profiles:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"unknown model {quote([request.model])[2:-2]!r}; the profile table has "
                                f"{', '.join(sorted(core.profiles)) or 'none'} (serve --profiles FILE adds models)")
        await self._journal_works(context, "IssueToken")
        try:
            if request.model:  # before the token exists: a crash between the two leaves no token without it
                core.store.bind_model(request.app, request.model)
                core.models[request.app] = request.model
                if request.app in core.engine.apps:  # from the next round on (an open one keeps its own, D21)
                    core.engine.set_slowdown(request.app, core.slowdown_of(request.app))
                log.info("model bound", extra={"fields": {"app": request.app, "model": request.model}})
            token = new_secret("reg")
            core.store.add_token(token, request.app, "registration")
        except StoreError as exc:  # no token is handed out that the journal does not have
            core.journal_failed(exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, cut_reason(f"IssueToken was not done: {exc}"))
        return pb.IssueTokenReply(app=request.app, token=token)

    async def IssueViewerToken(self, request: pb.ViewerTokenRequest, context) -> pb.ViewerTokenReply:
        """A token that reads the dashboard off loopback and does nothing else; journaled (as a
        hash) before it is handed out."""
        from arbiter.dashboard.access import issue_viewer_token

        await self._need_admin(context)
        await self._journal_works(context, "IssueViewerToken")
        try:
            token = issue_viewer_token(self.core.store, request.name)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except StoreError as exc:
            self.core.journal_failed(exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, cut_reason(f"IssueViewerToken was not done: {exc}"))
        log.info("viewer token issued", extra={"fields": {"viewer": request.name}})
        return pb.ViewerTokenReply(name=request.name, token=token)

    async def RevokeViewerToken(self, request: pb.ViewerTokenRequest, context) -> pb.ViewerTokenReply:
        """Every viewer token of ``name`` stops working at once (refused in memory even when the
        journal cannot be written: then UNAVAILABLE says so)."""
        await self._need_admin(context)
        store = self.core.store
        if request.name not in store.viewers():
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no viewer token was issued to {quote([request.name])[2:-2]!r}")
        try:
            revoked = store.revoke_viewer(request.name)
        except StoreError as exc:
            self.core.journal_failed(exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, cut_reason(f"RevokeViewerToken: {exc}"))
        log.info("viewer token revoked", extra={"fields": {"viewer": request.name, "tokens": revoked}})
        return pb.ViewerTokenReply(name=request.name, revoked=revoked)

    async def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterReply:
        """A registration token buys the app's credential and revokes any older one: its stream,
        if open, ends. The admin token is not a registration token."""
        core = self.core
        token = bearer(context)
        if token is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a registration token is required")
        await self._need_app_name(request.app, context)
        if self._is_admin(context):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "the admin token is not a registration token: issue one with IssueToken")
        if not self._registers.take(request.app):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"more than {core.limits.registers} Registers for {request.app!r} in a burst (the "
                                f"limit; {core.limits.per_s:g} more a second)")
        owner = core.store.token_app(token, "registration")
        if owner is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "unknown or used registration token")
        if owner != request.app:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"this registration token is for {owner!r}, not {request.app!r}")
        credential = new_secret("app")
        try:
            exchanged = core.store.exchange_token(token, credential, request.app)
        except StoreError as exc:  # the token stays unused, and no credential is handed out
            core.journal_failed(exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, cut_reason(f"Register was not done: {exc}"))
        if not exchanged:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "unknown or used registration token")
        conn = core.conns.get(request.app)
        if conn is not None:
            conn.end(StreamEnd("revoked", f"{request.app!r} registered again: this stream's credential is revoked"))
        log.info("registered", extra={"fields": {"app": request.app}})
        return pb.RegisterReply(app=request.app, credential=credential)

    # -- reads -----------------------------------------------------------------------------------

    async def GetApp(self, request: pb.GetAppRequest, context) -> pb.AppState:
        token = bearer(context)
        if token is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a credential is required")
        if not self._is_admin(context):
            caller = self.core.store.token_app(token, "credential")
            if caller is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown credential")
            if caller != request.app:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{caller!r} cannot read {request.app!r}")
        elif not self._known(request.app):  # as RemoveApp and RevokeCredential say it
            await context.abort(grpc.StatusCode.NOT_FOUND, self._unknown(request.app))
        return self._app_state(request.app)

    def _app_state(self, app: str) -> pb.AppState:
        core = self.core
        state = core.engine.apps.get(app)
        now = core.clock()
        return pb.AppState(
            app=app,
            connected=app in core.conns,
            active=state is not None,
            arrived=state.arrived if state else 0.0,
            demand=(state.demand or 0) if state else 0,
            last_rho=core.last_rho.get(app, math.inf),
            n_avg=core.engine.n_avg(app, now) if state else 0.0,
            leases=[wire.lease_pb(x) for x in core.leases_of(app)],
            model=core.models.get(app, ""),
            idle=app in core.engine.idle,
        )

    def _cluster_state(self) -> pb.ClusterState:
        core = self.core
        cluster = core.engine.cluster
        return pb.ClusterState(
            cluster=cluster.name, size=cluster.size,
            gpus=wire.places({g: cluster.position(g) for g in cluster.gpu_ids}),
            free=sorted(core.free()), drained_machines=sorted(core.engine.drained),
            leases=[wire.lease_pb(x) for x in core.leases()],
            settings=core.settings_pb(), round_id=core.engine.round_id)

    async def GetClusterState(self, request, context) -> pb.ClusterState:
        await self._need_admin(context)
        return self._cluster_state()

    async def ListApps(self, request, context) -> pb.AppList:
        await self._need_admin(context)
        core = self.core
        departed = [pb.DepartedApp(**d) for d in core.store.departed(DEPARTED_SHOWN)]
        return pb.AppList(apps=[self._app_state(a) for a in sorted(set(core.engine.apps) | set(core.conns))],
                          departed=departed)

    async def ListLeases(self, request, context) -> pb.LeaseList:
        await self._need_admin(context)
        return pb.LeaseList(leases=[wire.lease_pb(x) for x in self.core.leases()])

    async def RoundHistory(self, request: pb.RoundHistoryRequest, context) -> pb.RoundList:
        await self._need_admin(context)
        if not 0 <= request.limit <= MAX_HISTORY:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"limit must be 0 (= 50) to {MAX_HISTORY} rounds, got {request.limit}")
        limit = request.limit or 50
        rounds = []
        for s in self.core.store.rounds(limit):
            rounds.append(pb.RoundSummary(
                round_id=s["round_id"], now=s["now"], offered=s["offered"], bidders=s["bidders"],
                rejected=s["rejected"], granted=s["granted"], idle=s["idle"], latency_s=s["latency_s"],
                rho={a: (math.inf if r is None else r) for a, r in s["rho"].items()},
                expired=s.get("expired", 0), moved=s.get("moved", 0), reports_s=s.get("reports_s", 0.0),
                bids_s=s.get("bids_s", 0.0), allocation_s=s.get("allocation_s", 0.0),
                seed=s.get("seed", ""), commitment=s.get("commitment", "")))
        return pb.RoundList(rounds=rounds)

    # -- changes ---------------------------------------------------------------------------------

    async def UpdateSettings(self, request: pb.SettingsUpdate, context) -> pb.Settings:
        await self._need_admin(context)
        core = self.core
        new = replace(core.settings)
        if request.HasField("policy"):
            new.policy = request.policy[:NAME_MAX]
        if request.HasField("fairness_knob"):
            new.fairness_knob = request.fairness_knob
        if request.HasField("lease_s"):
            low, high = LEASE_RANGE_S
            if not low <= request.lease_s <= high:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"lease_s must be {low:g} to {high:g} s, got {request.lease_s}")
            new.lease_s = request.lease_s
        if request.HasField("max_contenders"):
            new.max_contenders = request.max_contenders
        if request.HasField("rank"):
            new.rank = request.rank[:NAME_MAX]
        if request.HasField("reclaim"):
            new.reclaim = request.reclaim
        if request.HasField("min_bidders"):
            new.min_bidders = request.min_bidders
        try:
            new.check()
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        await core.engine_free()
        await self._journal_works(context, "UpdateSettings")
        old = core.settings
        self.apply_settings(new)
        await self._commit(context, "UpdateSettings",
                           SettingsChanged(now=core.clock(), settings=MappingProxyType(asdict(new))),
                           undo=lambda: self.apply_settings(old))
        log.info("settings", extra={"fields": asdict(new)})
        return core.settings_pb()

    def apply_settings(self, new: Settings) -> None:
        """Takes effect from the next round; leases already granted keep their expiry."""
        self.core.settings = new
        new.apply_to(self.core.engine)

    async def AddMachine(self, request: pb.AddMachineRequest, context) -> pb.ClusterState:
        """Bounded before anything is built (gpus = 2^31 - 1 once took the arbiter to 6 GB)."""
        await self._need_admin(context)
        core, engine = self.core, self.core.engine
        if request.machine:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "machine names are given by the arbiter (<rack>-m<number>); leave it empty")
        if not RACK_NAME.match(request.rack):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"rack name {quote([request.rack])[2:-2]!r} must be 1-64 of A-Z a-z 0-9 . _ "
                                "(no '-')")
        if not 1 <= request.gpus <= MAX_MACHINE_GPUS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"gpus must be 1 to {MAX_MACHINE_GPUS} per machine, got {request.gpus}")
        if not 0 <= request.slots <= request.gpus:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"slots must be 0 (= 1) to gpus ({request.gpus}), got {request.slots}")
        if engine.cluster.size + request.gpus > MAX_CLUSTER_GPUS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the cluster would have {engine.cluster.size + request.gpus} GPUs; "
                                f"the limit is {MAX_CLUSTER_GPUS}")
        if len(engine.added_machines) >= MAX_ADDED_MACHINES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{MAX_ADDED_MACHINES} machines were added already (the limit)")
        await core.engine_free()
        await self._journal_works(context, "AddMachine")
        now = core.clock()
        try:
            name = engine.add_machine(request.rack, request.gpus, request.slots or 1, now)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        gpus = tuple(engine.cluster.machines[name])
        await self._commit(context, "AddMachine",
                           LeasesChanged(now=now, cause="machine added", gpus=tuple(GpuLease(g) for g in gpus)),
                           MachineAdded(now=now, machine=name, rack=request.rack, gpus=gpus),
                           undo=lambda: engine.undo_add_machine(name), wake=True)
        log.info("machine added", extra={"fields": {"machine": name, "gpus": request.gpus}})
        return self._cluster_state()

    async def DrainMachine(self, request: pb.DrainMachineRequest, context) -> pb.ClusterState:
        await self._need_admin(context)
        core, engine = self.core, self.core.engine
        if not 0 < len(request.machine) <= NAME_MAX:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"machine name must be 1-{NAME_MAX} characters, got {len(request.machine)}")
        await core.engine_free()
        await self._journal_works(context, "DrainMachine")
        was_drained = request.machine in engine.drained
        try:
            if request.resume:
                engine.resume(request.machine, core.clock())
            else:
                engine.drain(request.machine)
        except KeyError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))

        def undo() -> None:
            (engine.drained.add if was_drained else engine.drained.discard)(request.machine)

        # a resumed machine's free GPUs are worth a round
        await self._commit(context, "DrainMachine",
                           MachineDrained(now=core.clock(), machine=request.machine, drained=not request.resume),
                           undo=undo, wake=request.resume)
        log.info("machine resumed" if request.resume else "machine drained",
                 extra={"fields": {"machine": request.machine}})
        return self._cluster_state()

    async def RemoveApp(self, request: pb.RemoveAppRequest, context) -> pb.AppState:
        """Any registered app, connected or not, done or not: its credentials and tokens are
        revoked, its stream ends with a Goodbye, its leases end (after the open round closes, if
        one is open)."""
        await self._need_admin(context)
        await self._need_app_name(request.app, context)
        core = self.core
        if not self._known(request.app):
            await context.abort(grpc.StatusCode.NOT_FOUND, self._unknown(request.app))
        await self._journal_works(context, "RemoveApp")
        try:
            core.store.revoke(request.app)  # fails closed: refused in memory even when not written
            core.store.unbind_model(request.app)
        except StoreError as exc:
            core.journal_failed(exc)
            conn = core.conns.get(request.app)
            if conn is not None:
                conn.end(StreamEnd("revoked", f"the credential of {request.app!r} was revoked by an admin"))
            await context.abort(grpc.StatusCode.UNAVAILABLE, cut_reason(f"RemoveApp was not done: {exc}"))
        core.models.pop(request.app, None)
        self._removed[request.app] = core.clock()
        while len(self._removed) > MAX_APPS:  # the oldest go first: a bound, not a record
            del self._removed[next(iter(self._removed))]
        end = StreamEnd("removed", f"{request.app!r} was removed by an admin: its leases ended")
        if request.app in core.engine.apps:
            core.remove_app(request.app, end)
        conn = core.conns.get(request.app)
        if conn is not None:
            conn.end(end)
        log.info("app removed", extra={"fields": {"app": request.app}})
        return self._app_state(request.app)

    async def RevokeCredential(self, request: pb.RevokeCredentialRequest, context) -> pb.AppState:
        """The app's credentials and unused registration tokens stop working and its stream ends;
        the app stays (its leases run out as usual) and may come back with a new token."""
        await self._need_admin(context)
        await self._need_app_name(request.app, context)
        core = self.core
        if not self._known(request.app):
            await context.abort(grpc.StatusCode.NOT_FOUND, self._unknown(request.app))
        failure = ""
        try:
            revoked = core.store.revoke(request.app)
        except StoreError as exc:  # refused in memory all the same (fail closed), and said so
            core.journal_failed(exc)
            revoked, failure = None, str(exc)
        conn = core.conns.get(request.app)
        if conn is not None:
            conn.end(StreamEnd("revoked", f"the credential of {request.app!r} was revoked by an admin"))
        if revoked is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, cut_reason(f"RevokeCredential: {failure}"))
        log.info("credential revoked", extra={"fields": {"app": request.app, "tokens": revoked}})
        return self._app_state(request.app)
