from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GpuPlace(_message.Message):
    __slots__ = ("gpu", "rack", "machine", "slot")
    GPU_FIELD_NUMBER: _ClassVar[int]
    RACK_FIELD_NUMBER: _ClassVar[int]
    MACHINE_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    gpu: str
    rack: str
    machine: str
    slot: str
    def __init__(self, gpu: _Optional[str] = ..., rack: _Optional[str] = ..., machine: _Optional[str] = ..., slot: _Optional[str] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("gpu", "app", "granted_at", "expires_at", "round_id")
    GPU_FIELD_NUMBER: _ClassVar[int]
    APP_FIELD_NUMBER: _ClassVar[int]
    GRANTED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    gpu: str
    app: str
    granted_at: float
    expires_at: float
    round_id: int
    def __init__(self, gpu: _Optional[str] = ..., app: _Optional[str] = ..., granted_at: _Optional[float] = ..., expires_at: _Optional[float] = ..., round_id: _Optional[int] = ...) -> None: ...

class Settings(_message.Message):
    __slots__ = ("policy", "fairness_knob", "lease_s", "coalesce_s", "expiry_window_s", "report_timeout_s", "bid_timeout_s", "max_contenders", "rank", "reclaim", "min_bidders")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    FAIRNESS_KNOB_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    COALESCE_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRY_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    REPORT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    BID_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTENDERS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_FIELD_NUMBER: _ClassVar[int]
    MIN_BIDDERS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    fairness_knob: float
    lease_s: float
    coalesce_s: float
    expiry_window_s: float
    report_timeout_s: float
    bid_timeout_s: float
    max_contenders: int
    rank: str
    reclaim: bool
    min_bidders: int
    def __init__(self, policy: _Optional[str] = ..., fairness_knob: _Optional[float] = ..., lease_s: _Optional[float] = ..., coalesce_s: _Optional[float] = ..., expiry_window_s: _Optional[float] = ..., report_timeout_s: _Optional[float] = ..., bid_timeout_s: _Optional[float] = ..., max_contenders: _Optional[int] = ..., rank: _Optional[str] = ..., reclaim: _Optional[bool] = ..., min_bidders: _Optional[int] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("hello", "report", "bid", "release", "demand", "heartbeat", "done", "jobs")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    BID_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    DEMAND_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    report: RhoReport
    bid: Bid
    release: Release
    demand: DemandUpdate
    heartbeat: Heartbeat
    done: Done
    jobs: RunningJobs
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., report: _Optional[_Union[RhoReport, _Mapping]] = ..., bid: _Optional[_Union[Bid, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ..., demand: _Optional[_Union[DemandUpdate, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ..., jobs: _Optional[_Union[RunningJobs, _Mapping]] = ...) -> None: ...

class ArbiterMessage(_message.Message):
    __slots__ = ("welcome", "rho_request", "offer", "grant", "revocation", "rejection", "heartbeat", "goodbye", "neighbourhood")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    RHO_REQUEST_FIELD_NUMBER: _ClassVar[int]
    OFFER_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    REVOCATION_FIELD_NUMBER: _ClassVar[int]
    REJECTION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    GOODBYE_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURHOOD_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    rho_request: RhoRequest
    offer: Offer
    grant: Grant
    revocation: Revocation
    rejection: Rejection
    heartbeat: Heartbeat
    goodbye: Goodbye
    neighbourhood: Neighbourhood
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., rho_request: _Optional[_Union[RhoRequest, _Mapping]] = ..., offer: _Optional[_Union[Offer, _Mapping]] = ..., grant: _Optional[_Union[Grant, _Mapping]] = ..., revocation: _Optional[_Union[Revocation, _Mapping]] = ..., rejection: _Optional[_Union[Rejection, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., goodbye: _Optional[_Union[Goodbye, _Mapping]] = ..., neighbourhood: _Optional[_Union[Neighbourhood, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("app", "demand", "take_over")
    APP_FIELD_NUMBER: _ClassVar[int]
    DEMAND_FIELD_NUMBER: _ClassVar[int]
    TAKE_OVER_FIELD_NUMBER: _ClassVar[int]
    app: str
    demand: int
    take_over: bool
    def __init__(self, app: _Optional[str] = ..., demand: _Optional[int] = ..., take_over: _Optional[bool] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("app", "cluster", "leases", "settings", "now", "heartbeat_s", "places", "took_over")
    APP_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    PLACES_FIELD_NUMBER: _ClassVar[int]
    TOOK_OVER_FIELD_NUMBER: _ClassVar[int]
    app: str
    cluster: str
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    settings: Settings
    now: float
    heartbeat_s: float
    places: _containers.RepeatedCompositeFieldContainer[GpuPlace]
    took_over: bool
    def __init__(self, app: _Optional[str] = ..., cluster: _Optional[str] = ..., leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ..., settings: _Optional[_Union[Settings, _Mapping]] = ..., now: _Optional[float] = ..., heartbeat_s: _Optional[float] = ..., places: _Optional[_Iterable[_Union[GpuPlace, _Mapping]]] = ..., took_over: _Optional[bool] = ...) -> None: ...

class RhoRequest(_message.Message):
    __slots__ = ("round_id", "now", "n_avg", "cluster_size", "held", "extras", "deadline", "lottery_commitment", "neighbours")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    N_AVG_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_SIZE_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    LOTTERY_COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURS_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    now: float
    n_avg: float
    cluster_size: int
    held: _containers.RepeatedCompositeFieldContainer[GpuPlace]
    extras: _containers.RepeatedScalarFieldContainer[str]
    deadline: float
    lottery_commitment: str
    neighbours: _containers.RepeatedCompositeFieldContainer[Neighbour]
    def __init__(self, round_id: _Optional[int] = ..., now: _Optional[float] = ..., n_avg: _Optional[float] = ..., cluster_size: _Optional[int] = ..., held: _Optional[_Iterable[_Union[GpuPlace, _Mapping]]] = ..., extras: _Optional[_Iterable[str]] = ..., deadline: _Optional[float] = ..., lottery_commitment: _Optional[str] = ..., neighbours: _Optional[_Iterable[_Union[Neighbour, _Mapping]]] = ...) -> None: ...

class RhoReport(_message.Message):
    __slots__ = ("round_id", "app", "rho", "demand", "remaining_s", "slowdown", "loss_decrease", "rho_wait", "work")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    APP_FIELD_NUMBER: _ClassVar[int]
    RHO_FIELD_NUMBER: _ClassVar[int]
    DEMAND_FIELD_NUMBER: _ClassVar[int]
    REMAINING_S_FIELD_NUMBER: _ClassVar[int]
    SLOWDOWN_FIELD_NUMBER: _ClassVar[int]
    LOSS_DECREASE_FIELD_NUMBER: _ClassVar[int]
    RHO_WAIT_FIELD_NUMBER: _ClassVar[int]
    WORK_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    app: str
    rho: float
    demand: int
    remaining_s: float
    slowdown: _containers.RepeatedScalarFieldContainer[float]
    loss_decrease: float
    rho_wait: float
    work: WorkClaim
    def __init__(self, round_id: _Optional[int] = ..., app: _Optional[str] = ..., rho: _Optional[float] = ..., demand: _Optional[int] = ..., remaining_s: _Optional[float] = ..., slowdown: _Optional[_Iterable[float]] = ..., loss_decrease: _Optional[float] = ..., rho_wait: _Optional[float] = ..., work: _Optional[_Union[WorkClaim, _Mapping]] = ...) -> None: ...

class WorkClaim(_message.Message):
    __slots__ = ("work_gpu_s", "demand_max", "held", "share")
    WORK_GPU_S_FIELD_NUMBER: _ClassVar[int]
    DEMAND_MAX_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    work_gpu_s: float
    demand_max: int
    held: _containers.RepeatedCompositeFieldContainer[PhaseWork]
    share: _containers.RepeatedCompositeFieldContainer[PhaseWork]
    def __init__(self, work_gpu_s: _Optional[float] = ..., demand_max: _Optional[int] = ..., held: _Optional[_Iterable[_Union[PhaseWork, _Mapping]]] = ..., share: _Optional[_Iterable[_Union[PhaseWork, _Mapping]]] = ...) -> None: ...

class PhaseWork(_message.Message):
    __slots__ = ("seconds",)
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    seconds: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seconds: _Optional[_Iterable[float]] = ...) -> None: ...

class Offer(_message.Message):
    __slots__ = ("round_id", "gpus", "now", "n_avg", "cluster_size", "deadline", "held", "previous", "neighbours")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    N_AVG_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURS_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    gpus: _containers.RepeatedCompositeFieldContainer[GpuPlace]
    now: float
    n_avg: float
    cluster_size: int
    deadline: float
    held: _containers.RepeatedCompositeFieldContainer[GpuPlace]
    previous: _containers.RepeatedCompositeFieldContainer[GpuPlace]
    neighbours: _containers.RepeatedCompositeFieldContainer[Neighbour]
    def __init__(self, round_id: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuPlace, _Mapping]]] = ..., now: _Optional[float] = ..., n_avg: _Optional[float] = ..., cluster_size: _Optional[int] = ..., deadline: _Optional[float] = ..., held: _Optional[_Iterable[_Union[GpuPlace, _Mapping]]] = ..., previous: _Optional[_Iterable[_Union[GpuPlace, _Mapping]]] = ..., neighbours: _Optional[_Iterable[_Union[Neighbour, _Mapping]]] = ...) -> None: ...

class Neighbour(_message.Message):
    __slots__ = ("machine", "cls", "gpus", "machines")
    MACHINE_FIELD_NUMBER: _ClassVar[int]
    CLS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    MACHINES_FIELD_NUMBER: _ClassVar[int]
    machine: str
    cls: str
    gpus: int
    machines: int
    def __init__(self, machine: _Optional[str] = ..., cls: _Optional[str] = ..., gpus: _Optional[int] = ..., machines: _Optional[int] = ...) -> None: ...

class RunningJobs(_message.Message):
    __slots__ = ("app", "jobs")
    APP_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    app: str
    jobs: _containers.RepeatedCompositeFieldContainer[RunningJob]
    def __init__(self, app: _Optional[str] = ..., jobs: _Optional[_Iterable[_Union[RunningJob, _Mapping]]] = ...) -> None: ...

class RunningJob(_message.Message):
    __slots__ = ("job", "gpus", "cls", "ratio")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    CLS_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    job: str
    gpus: _containers.RepeatedScalarFieldContainer[str]
    cls: str
    ratio: float
    def __init__(self, job: _Optional[str] = ..., gpus: _Optional[_Iterable[str]] = ..., cls: _Optional[str] = ..., ratio: _Optional[float] = ...) -> None: ...

class Neighbourhood(_message.Message):
    __slots__ = ("table", "cls", "neighbours")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    CLS_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURS_FIELD_NUMBER: _ClassVar[int]
    table: str
    cls: str
    neighbours: _containers.RepeatedCompositeFieldContainer[Neighbour]
    def __init__(self, table: _Optional[str] = ..., cls: _Optional[str] = ..., neighbours: _Optional[_Iterable[_Union[Neighbour, _Mapping]]] = ...) -> None: ...

class Bid(_message.Message):
    __slots__ = ("round_id", "app", "rho_old", "rows")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    APP_FIELD_NUMBER: _ClassVar[int]
    RHO_OLD_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    app: str
    rho_old: float
    rows: _containers.RepeatedCompositeFieldContainer[BidRow]
    def __init__(self, round_id: _Optional[int] = ..., app: _Optional[str] = ..., rho_old: _Optional[float] = ..., rows: _Optional[_Iterable[_Union[BidRow, _Mapping]]] = ...) -> None: ...

class BidRow(_message.Message):
    __slots__ = ("gpus", "rho")
    GPUS_FIELD_NUMBER: _ClassVar[int]
    RHO_FIELD_NUMBER: _ClassVar[int]
    gpus: _containers.RepeatedScalarFieldContainer[str]
    rho: float
    def __init__(self, gpus: _Optional[_Iterable[str]] = ..., rho: _Optional[float] = ...) -> None: ...

class Grant(_message.Message):
    __slots__ = ("round_id", "gpus", "expires_at", "source")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    gpus: _containers.RepeatedCompositeFieldContainer[GpuPlace]
    expires_at: float
    source: str
    def __init__(self, round_id: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuPlace, _Mapping]]] = ..., expires_at: _Optional[float] = ..., source: _Optional[str] = ...) -> None: ...

class Revocation(_message.Message):
    __slots__ = ("gpus", "reason", "round_id")
    GPUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    gpus: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    round_id: int
    def __init__(self, gpus: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ..., round_id: _Optional[int] = ...) -> None: ...

class Rejection(_message.Message):
    __slots__ = ("code", "reason", "what", "round_id")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WHAT_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    code: int
    reason: str
    what: str
    round_id: int
    def __init__(self, code: _Optional[int] = ..., reason: _Optional[str] = ..., what: _Optional[str] = ..., round_id: _Optional[int] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("app", "gpus", "known_round")
    APP_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_ROUND_FIELD_NUMBER: _ClassVar[int]
    app: str
    gpus: _containers.RepeatedScalarFieldContainer[str]
    known_round: int
    def __init__(self, app: _Optional[str] = ..., gpus: _Optional[_Iterable[str]] = ..., known_round: _Optional[int] = ...) -> None: ...

class DemandUpdate(_message.Message):
    __slots__ = ("app", "demand")
    APP_FIELD_NUMBER: _ClassVar[int]
    DEMAND_FIELD_NUMBER: _ClassVar[int]
    app: str
    demand: int
    def __init__(self, app: _Optional[str] = ..., demand: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("now",)
    NOW_FIELD_NUMBER: _ClassVar[int]
    now: float
    def __init__(self, now: _Optional[float] = ...) -> None: ...

class Goodbye(_message.Message):
    __slots__ = ("why", "reason", "reconnect", "gpus")
    WHY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RECONNECT_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    why: str
    reason: str
    reconnect: bool
    gpus: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, why: _Optional[str] = ..., reason: _Optional[str] = ..., reconnect: _Optional[bool] = ..., gpus: _Optional[_Iterable[str]] = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("app",)
    APP_FIELD_NUMBER: _ClassVar[int]
    app: str
    def __init__(self, app: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("app",)
    APP_FIELD_NUMBER: _ClassVar[int]
    app: str
    def __init__(self, app: _Optional[str] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("app", "credential")
    APP_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    app: str
    credential: str
    def __init__(self, app: _Optional[str] = ..., credential: _Optional[str] = ...) -> None: ...

class GetAppRequest(_message.Message):
    __slots__ = ("app",)
    APP_FIELD_NUMBER: _ClassVar[int]
    app: str
    def __init__(self, app: _Optional[str] = ...) -> None: ...

class AppState(_message.Message):
    __slots__ = ("app", "connected", "active", "arrived", "demand", "last_rho", "n_avg", "leases", "model", "idle")
    APP_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_FIELD_NUMBER: _ClassVar[int]
    DEMAND_FIELD_NUMBER: _ClassVar[int]
    LAST_RHO_FIELD_NUMBER: _ClassVar[int]
    N_AVG_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    app: str
    connected: bool
    active: bool
    arrived: float
    demand: int
    last_rho: float
    n_avg: float
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    model: str
    idle: bool
    def __init__(self, app: _Optional[str] = ..., connected: _Optional[bool] = ..., active: _Optional[bool] = ..., arrived: _Optional[float] = ..., demand: _Optional[int] = ..., last_rho: _Optional[float] = ..., n_avg: _Optional[float] = ..., leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ..., model: _Optional[str] = ..., idle: _Optional[bool] = ...) -> None: ...

class IssueTokenRequest(_message.Message):
    __slots__ = ("app", "model")
    APP_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    app: str
    model: str
    def __init__(self, app: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class IssueTokenReply(_message.Message):
    __slots__ = ("app", "token")
    APP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    app: str
    token: str
    def __init__(self, app: _Optional[str] = ..., token: _Optional[str] = ...) -> None: ...

class ClusterStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterState(_message.Message):
    __slots__ = ("cluster", "size", "gpus", "free", "drained_machines", "leases", "settings", "round_id")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    DRAINED_MACHINES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    size: int
    gpus: _containers.RepeatedCompositeFieldContainer[GpuPlace]
    free: _containers.RepeatedScalarFieldContainer[str]
    drained_machines: _containers.RepeatedScalarFieldContainer[str]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    settings: Settings
    round_id: int
    def __init__(self, cluster: _Optional[str] = ..., size: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuPlace, _Mapping]]] = ..., free: _Optional[_Iterable[str]] = ..., drained_machines: _Optional[_Iterable[str]] = ..., leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ..., settings: _Optional[_Union[Settings, _Mapping]] = ..., round_id: _Optional[int] = ...) -> None: ...

class ListAppsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AppList(_message.Message):
    __slots__ = ("apps", "departed")
    APPS_FIELD_NUMBER: _ClassVar[int]
    DEPARTED_FIELD_NUMBER: _ClassVar[int]
    apps: _containers.RepeatedCompositeFieldContainer[AppState]
    departed: _containers.RepeatedCompositeFieldContainer[DepartedApp]
    def __init__(self, apps: _Optional[_Iterable[_Union[AppState, _Mapping]]] = ..., departed: _Optional[_Iterable[_Union[DepartedApp, _Mapping]]] = ...) -> None: ...

class DepartedApp(_message.Message):
    __slots__ = ("app", "arrived", "left", "why", "last_rho", "gpu_seconds")
    APP_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    LAST_RHO_FIELD_NUMBER: _ClassVar[int]
    GPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    app: str
    arrived: float
    left: float
    why: str
    last_rho: float
    gpu_seconds: float
    def __init__(self, app: _Optional[str] = ..., arrived: _Optional[float] = ..., left: _Optional[float] = ..., why: _Optional[str] = ..., last_rho: _Optional[float] = ..., gpu_seconds: _Optional[float] = ...) -> None: ...

class ListLeasesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaseList(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    def __init__(self, leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ...) -> None: ...

class RoundHistoryRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class RoundSummary(_message.Message):
    __slots__ = ("round_id", "now", "offered", "bidders", "rejected", "granted", "idle", "latency_s", "rho", "expired", "moved", "reports_s", "bids_s", "allocation_s", "seed", "commitment")
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class GrantedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RhoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    OFFERED_FIELD_NUMBER: _ClassVar[int]
    BIDDERS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    RHO_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    REPORTS_S_FIELD_NUMBER: _ClassVar[int]
    BIDS_S_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_S_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    now: float
    offered: int
    bidders: _containers.RepeatedScalarFieldContainer[str]
    rejected: _containers.ScalarMap[str, str]
    granted: _containers.ScalarMap[str, int]
    idle: int
    latency_s: float
    rho: _containers.ScalarMap[str, float]
    expired: int
    moved: int
    reports_s: float
    bids_s: float
    allocation_s: float
    seed: str
    commitment: str
    def __init__(self, round_id: _Optional[int] = ..., now: _Optional[float] = ..., offered: _Optional[int] = ..., bidders: _Optional[_Iterable[str]] = ..., rejected: _Optional[_Mapping[str, str]] = ..., granted: _Optional[_Mapping[str, int]] = ..., idle: _Optional[int] = ..., latency_s: _Optional[float] = ..., rho: _Optional[_Mapping[str, float]] = ..., expired: _Optional[int] = ..., moved: _Optional[int] = ..., reports_s: _Optional[float] = ..., bids_s: _Optional[float] = ..., allocation_s: _Optional[float] = ..., seed: _Optional[str] = ..., commitment: _Optional[str] = ...) -> None: ...

class RoundList(_message.Message):
    __slots__ = ("rounds",)
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    rounds: _containers.RepeatedCompositeFieldContainer[RoundSummary]
    def __init__(self, rounds: _Optional[_Iterable[_Union[RoundSummary, _Mapping]]] = ...) -> None: ...

class SettingsUpdate(_message.Message):
    __slots__ = ("policy", "fairness_knob", "lease_s", "max_contenders", "rank", "reclaim", "min_bidders")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    FAIRNESS_KNOB_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTENDERS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_FIELD_NUMBER: _ClassVar[int]
    MIN_BIDDERS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    fairness_knob: float
    lease_s: float
    max_contenders: int
    rank: str
    reclaim: bool
    min_bidders: int
    def __init__(self, policy: _Optional[str] = ..., fairness_knob: _Optional[float] = ..., lease_s: _Optional[float] = ..., max_contenders: _Optional[int] = ..., rank: _Optional[str] = ..., reclaim: _Optional[bool] = ..., min_bidders: _Optional[int] = ...) -> None: ...

class AddMachineRequest(_message.Message):
    __slots__ = ("rack", "machine", "gpus", "slots")
    RACK_FIELD_NUMBER: _ClassVar[int]
    MACHINE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    rack: str
    machine: str
    gpus: int
    slots: int
    def __init__(self, rack: _Optional[str] = ..., machine: _Optional[str] = ..., gpus: _Optional[int] = ..., slots: _Optional[int] = ...) -> None: ...

class DrainMachineRequest(_message.Message):
    __slots__ = ("machine", "resume")
    MACHINE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    machine: str
    resume: bool
    def __init__(self, machine: _Optional[str] = ..., resume: _Optional[bool] = ...) -> None: ...

class RemoveAppRequest(_message.Message):
    __slots__ = ("app",)
    APP_FIELD_NUMBER: _ClassVar[int]
    app: str
    def __init__(self, app: _Optional[str] = ...) -> None: ...

class ViewerTokenRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ViewerTokenReply(_message.Message):
    __slots__ = ("name", "token", "revoked")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    name: str
    token: str
    revoked: int
    def __init__(self, name: _Optional[str] = ..., token: _Optional[str] = ..., revoked: _Optional[int] = ...) -> None: ...

class RevokeCredentialRequest(_message.Message):
    __slots__ = ("app",)
    APP_FIELD_NUMBER: _ClassVar[int]
    app: str
    def __init__(self, app: _Optional[str] = ...) -> None: ...
