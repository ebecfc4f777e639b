from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PublishChunk(_message.Message):
    __slots__ = ("total_bytes", "offset", "data", "run")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    offset: int
    data: bytes
    run: str
    def __init__(self, total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., run: _Optional[str] = ...) -> None: ...

class PublishReply(_message.Message):
    __slots__ = ("info", "duplicate")
    INFO_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    info: VersionInfo
    duplicate: bool
    def __init__(self, info: _Optional[_Union[VersionInfo, _Mapping]] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class GetLatestRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VersionInfo(_message.Message):
    __slots__ = ("latest_version", "keyframe_version", "oldest_delta_base", "fmt", "keyframe_bytes", "delta_chain_bytes", "store_id")
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    KEYFRAME_VERSION_FIELD_NUMBER: _ClassVar[int]
    OLDEST_DELTA_BASE_FIELD_NUMBER: _ClassVar[int]
    FMT_FIELD_NUMBER: _ClassVar[int]
    KEYFRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELTA_CHAIN_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    latest_version: int
    keyframe_version: int
    oldest_delta_base: int
    fmt: str
    keyframe_bytes: int
    delta_chain_bytes: int
    store_id: str
    def __init__(self, latest_version: _Optional[int] = ..., keyframe_version: _Optional[int] = ..., oldest_delta_base: _Optional[int] = ..., fmt: _Optional[str] = ..., keyframe_bytes: _Optional[int] = ..., delta_chain_bytes: _Optional[int] = ..., store_id: _Optional[str] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("have_version", "resume_version", "resume_base_version", "resume_offset", "relay_id")
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESUME_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESUME_BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESUME_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RELAY_ID_FIELD_NUMBER: _ClassVar[int]
    have_version: int
    resume_version: int
    resume_base_version: int
    resume_offset: int
    relay_id: str
    def __init__(self, have_version: _Optional[int] = ..., resume_version: _Optional[int] = ..., resume_base_version: _Optional[int] = ..., resume_offset: _Optional[int] = ..., relay_id: _Optional[str] = ...) -> None: ...

class PullChunk(_message.Message):
    __slots__ = ("update_index", "update_count", "version", "base_version", "update_bytes", "offset", "data")
    UPDATE_INDEX_FIELD_NUMBER: _ClassVar[int]
    UPDATE_COUNT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    update_index: int
    update_count: int
    version: int
    base_version: int
    update_bytes: int
    offset: int
    data: bytes
    def __init__(self, update_index: _Optional[int] = ..., update_count: _Optional[int] = ..., version: _Optional[int] = ..., base_version: _Optional[int] = ..., update_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("after_version",)
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    after_version: int
    def __init__(self, after_version: _Optional[int] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("id", "text", "token_ids", "task", "metadata", "extra", "partial", "partial_version")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_VERSION_FIELD_NUMBER: _ClassVar[int]
    id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    task: str
    metadata: _containers.ScalarMap[str, str]
    extra: bytes
    partial: _containers.RepeatedCompositeFieldContainer[Sample]
    partial_version: int
    def __init__(self, id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., task: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., extra: _Optional[bytes] = ..., partial: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., partial_version: _Optional[int] = ...) -> None: ...

class EnqueuePromptsRequest(_message.Message):
    __slots__ = ("prompts",)
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ...) -> None: ...

class EnqueuePromptsReply(_message.Message):
    __slots__ = ("ids", "duplicates", "queue_depth")
    IDS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    duplicates: int
    queue_depth: int
    def __init__(self, ids: _Optional[_Iterable[str]] = ..., duplicates: _Optional[int] = ..., queue_depth: _Optional[int] = ...) -> None: ...

class LeasePromptsRequest(_message.Message):
    __slots__ = ("worker_id", "n", "deadline_s", "wait_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    n: int
    deadline_s: float
    wait_s: float
    def __init__(self, worker_id: _Optional[str] = ..., n: _Optional[int] = ..., deadline_s: _Optional[float] = ..., wait_s: _Optional[float] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "worker_id", "prompts", "deadline_unix_s", "latest_version", "staleness_floor")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FLOOR_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    worker_id: str
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    deadline_unix_s: float
    latest_version: int
    staleness_floor: int
    def __init__(self, lease_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., deadline_unix_s: _Optional[float] = ..., latest_version: _Optional[int] = ..., staleness_floor: _Optional[int] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "worker_id", "deadline_s", "partial")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    worker_id: str
    deadline_s: float
    partial: _containers.RepeatedCompositeFieldContainer[PartialRollouts]
    def __init__(self, lease_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., deadline_s: _Optional[float] = ..., partial: _Optional[_Iterable[_Union[PartialRollouts, _Mapping]]] = ...) -> None: ...

class CompleteLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "worker_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    worker_id: str
    def __init__(self, lease_id: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...

class CompleteLeaseReply(_message.Message):
    __slots__ = ("prompts_answered",)
    PROMPTS_ANSWERED_FIELD_NUMBER: _ClassVar[int]
    prompts_answered: int
    def __init__(self, prompts_answered: _Optional[int] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "worker_id", "prompt_ids", "partial")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    worker_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[str]
    partial: _containers.RepeatedCompositeFieldContainer[PartialRollouts]
    def __init__(self, lease_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[str]] = ..., partial: _Optional[_Iterable[_Union[PartialRollouts, _Mapping]]] = ...) -> None: ...

class PartialRollouts(_message.Message):
    __slots__ = ("prompt_id", "samples", "policy_version", "kept")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    policy_version: int
    kept: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_id: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., policy_version: _Optional[int] = ..., kept: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseLeaseReply(_message.Message):
    __slots__ = ("returned",)
    RETURNED_FIELD_NUMBER: _ClassVar[int]
    returned: int
    def __init__(self, returned: _Optional[int] = ...) -> None: ...

class Routes(_message.Message):
    __slots__ = ("ids", "layers", "top_k", "id_bytes")
    IDS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    ID_BYTES_FIELD_NUMBER: _ClassVar[int]
    ids: bytes
    layers: int
    top_k: int
    id_bytes: int
    def __init__(self, ids: _Optional[bytes] = ..., layers: _Optional[int] = ..., top_k: _Optional[int] = ..., id_bytes: _Optional[int] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("token_ids", "text", "reward", "logprobs", "logprobs_f32", "finish_reason", "metadata", "routes", "observed", "teacher_logprobs_f32", "teacher_topk_ids", "teacher_topk_logprobs_f32")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_F32_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_FIELD_NUMBER: _ClassVar[int]
    TEACHER_LOGPROBS_F32_FIELD_NUMBER: _ClassVar[int]
    TEACHER_TOPK_IDS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_TOPK_LOGPROBS_F32_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    reward: float
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    logprobs_f32: bytes
    finish_reason: str
    metadata: _containers.ScalarMap[str, str]
    routes: Routes
    observed: bytes
    teacher_logprobs_f32: bytes
    teacher_topk_ids: bytes
    teacher_topk_logprobs_f32: bytes
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., reward: _Optional[float] = ..., logprobs: _Optional[_Iterable[float]] = ..., logprobs_f32: _Optional[bytes] = ..., finish_reason: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., routes: _Optional[_Union[Routes, _Mapping]] = ..., observed: _Optional[bytes] = ..., teacher_logprobs_f32: _Optional[bytes] = ..., teacher_topk_ids: _Optional[bytes] = ..., teacher_topk_logprobs_f32: _Optional[bytes] = ...) -> None: ...

class RolloutGroup(_message.Message):
    __slots__ = ("prompt_id", "samples", "policy_version", "metadata", "prompt_routes", "failure", "baseline_reward")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ROUTES_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    BASELINE_REWARD_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    policy_version: int
    metadata: _containers.ScalarMap[str, str]
    prompt_routes: Routes
    failure: str
    baseline_reward: float
    def __init__(self, prompt_id: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., policy_version: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., prompt_routes: _Optional[_Union[Routes, _Mapping]] = ..., failure: _Optional[str] = ..., baseline_reward: _Optional[float] = ...) -> None: ...

class SubmitRolloutsRequest(_message.Message):
    __slots__ = ("lease_id", "worker_id", "group")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    worker_id: str
    group: RolloutGroup
    def __init__(self, lease_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., group: _Optional[_Union[RolloutGroup, _Mapping]] = ...) -> None: ...

class SubmitRolloutsReply(_message.Message):
    __slots__ = ("rollout_id", "duplicate", "lease_closed", "latest_version", "staleness_floor")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    LEASE_CLOSED_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FLOOR_FIELD_NUMBER: _ClassVar[int]
    rollout_id: int
    duplicate: bool
    lease_closed: bool
    latest_version: int
    staleness_floor: int
    def __init__(self, rollout_id: _Optional[int] = ..., duplicate: _Optional[bool] = ..., lease_closed: _Optional[bool] = ..., latest_version: _Optional[int] = ..., staleness_floor: _Optional[int] = ...) -> None: ...

class TakeRolloutsRequest(_message.Message):
    __slots__ = ("min_version", "max_groups", "wait_s", "ack_deadline_s", "requeue_unacked")
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    ACK_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    REQUEUE_UNACKED_FIELD_NUMBER: _ClassVar[int]
    min_version: int
    max_groups: int
    wait_s: float
    ack_deadline_s: float
    requeue_unacked: bool
    def __init__(self, min_version: _Optional[int] = ..., max_groups: _Optional[int] = ..., wait_s: _Optional[float] = ..., ack_deadline_s: _Optional[float] = ..., requeue_unacked: _Optional[bool] = ...) -> None: ...

class TakenRollout(_message.Message):
    __slots__ = ("rollout_id", "prompt", "group", "worker_id")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    rollout_id: int
    prompt: Prompt
    group: RolloutGroup
    worker_id: str
    def __init__(self, rollout_id: _Optional[int] = ..., prompt: _Optional[_Union[Prompt, _Mapping]] = ..., group: _Optional[_Union[RolloutGroup, _Mapping]] = ..., worker_id: _Optional[str] = ...) -> None: ...

class TakeRolloutsReply(_message.Message):
    __slots__ = ("take_id", "rollouts", "dropped_stale", "store_id")
    TAKE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    take_id: str
    rollouts: _containers.RepeatedCompositeFieldContainer[TakenRollout]
    dropped_stale: int
    store_id: str
    def __init__(self, take_id: _Optional[str] = ..., rollouts: _Optional[_Iterable[_Union[TakenRollout, _Mapping]]] = ..., dropped_stale: _Optional[int] = ..., store_id: _Optional[str] = ...) -> None: ...

class AckRolloutsRequest(_message.Message):
    __slots__ = ("take_id",)
    TAKE_ID_FIELD_NUMBER: _ClassVar[int]
    take_id: str
    def __init__(self, take_id: _Optional[str] = ...) -> None: ...

class AckRolloutsReply(_message.Message):
    __slots__ = ("acked",)
    ACKED_FIELD_NUMBER: _ClassVar[int]
    acked: int
    def __init__(self, acked: _Optional[int] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("name", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RegisterWorkerReply(_message.Message):
    __slots__ = ("worker_id", "heartbeat_interval_s", "max_request_bytes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    heartbeat_interval_s: float
    max_request_bytes: int
    def __init__(self, worker_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., max_request_bytes: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "version", "tokens_per_s", "kind", "leaving", "time")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    version: int
    tokens_per_s: float
    kind: str
    leaving: bool
    time: WorkerTime
    def __init__(self, worker_id: _Optional[str] = ..., version: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., kind: _Optional[str] = ..., leaving: _Optional[bool] = ..., time: _Optional[_Union[WorkerTime, _Mapping]] = ...) -> None: ...

class WorkerTime(_message.Message):
    __slots__ = ("total_s", "decoding_s", "waiting_prompts_s", "waiting_weights_s", "submitting_s", "scoring_s", "slot_s")
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    DECODING_S_FIELD_NUMBER: _ClassVar[int]
    WAITING_PROMPTS_S_FIELD_NUMBER: _ClassVar[int]
    WAITING_WEIGHTS_S_FIELD_NUMBER: _ClassVar[int]
    SUBMITTING_S_FIELD_NUMBER: _ClassVar[int]
    SCORING_S_FIELD_NUMBER: _ClassVar[int]
    SLOT_S_FIELD_NUMBER: _ClassVar[int]
    total_s: float
    decoding_s: float
    waiting_prompts_s: float
    waiting_weights_s: float
    submitting_s: float
    scoring_s: float
    slot_s: float
    def __init__(self, total_s: _Optional[float] = ..., decoding_s: _Optional[float] = ..., waiting_prompts_s: _Optional[float] = ..., waiting_weights_s: _Optional[float] = ..., submitting_s: _Optional[float] = ..., scoring_s: _Optional[float] = ..., slot_s: _Optional[float] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("latest_version", "staleness_floor")
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FLOOR_FIELD_NUMBER: _ClassVar[int]
    latest_version: int
    staleness_floor: int
    def __init__(self, latest_version: _Optional[int] = ..., staleness_floor: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "name", "version", "tokens_per_s", "seconds_since_heartbeat", "leases", "kind", "time")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    name: str
    version: int
    tokens_per_s: float
    seconds_since_heartbeat: float
    leases: int
    kind: str
    time: WorkerTime
    def __init__(self, worker_id: _Optional[str] = ..., name: _Optional[str] = ..., version: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., seconds_since_heartbeat: _Optional[float] = ..., leases: _Optional[int] = ..., kind: _Optional[str] = ..., time: _Optional[_Union[WorkerTime, _Mapping]] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("versions", "prompts_queued", "prompts_leased", "leases_active", "rollouts_ready", "rollouts_in_flight", "rollouts_accepted", "rollouts_duplicate", "rollouts_stale_dropped", "leases_expired", "bytes_served", "pulls_served", "workers_alive", "workers", "uptime_s", "errors", "prompts_resumed", "samples_resumed", "tokens_resumed", "streams_open", "takes_requeued", "pulls_busy", "workers_unlisted", "workers_known")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_QUEUED_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_LEASED_FIELD_NUMBER: _ClassVar[int]
    LEASES_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_READY_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_STALE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SERVED_FIELD_NUMBER: _ClassVar[int]
    PULLS_SERVED_FIELD_NUMBER: _ClassVar[int]
    WORKERS_ALIVE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_RESUMED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_RESUMED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_RESUMED_FIELD_NUMBER: _ClassVar[int]
    STREAMS_OPEN_FIELD_NUMBER: _ClassVar[int]
    TAKES_REQUEUED_FIELD_NUMBER: _ClassVar[int]
    PULLS_BUSY_FIELD_NUMBER: _ClassVar[int]
    WORKERS_UNLISTED_FIELD_NUMBER: _ClassVar[int]
    WORKERS_KNOWN_FIELD_NUMBER: _ClassVar[int]
    versions: VersionInfo
    prompts_queued: int
    prompts_leased: int
    leases_active: int
    rollouts_ready: int
    rollouts_in_flight: int
    rollouts_accepted: int
    rollouts_duplicate: int
    rollouts_stale_dropped: int
    leases_expired: int
    bytes_served: int
    pulls_served: int
    workers_alive: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStats]
    uptime_s: float
    errors: int
    prompts_resumed: int
    samples_resumed: int
    tokens_resumed: int
    streams_open: int
    takes_requeued: int
    pulls_busy: int
    workers_unlisted: int
    workers_known: int
    def __init__(self, versions: _Optional[_Union[VersionInfo, _Mapping]] = ..., prompts_queued: _Optional[int] = ..., prompts_leased: _Optional[int] = ..., leases_active: _Optional[int] = ..., rollouts_ready: _Optional[int] = ..., rollouts_in_flight: _Optional[int] = ..., rollouts_accepted: _Optional[int] = ..., rollouts_duplicate: _Optional[int] = ..., rollouts_stale_dropped: _Optional[int] = ..., leases_expired: _Optional[int] = ..., bytes_served: _Optional[int] = ..., pulls_served: _Optional[int] = ..., workers_alive: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStats, _Mapping]]] = ..., uptime_s: _Optional[float] = ..., errors: _Optional[int] = ..., prompts_resumed: _Optional[int] = ..., samples_resumed: _Optional[int] = ..., tokens_resumed: _Optional[int] = ..., streams_open: _Optional[int] = ..., takes_requeued: _Optional[int] = ..., pulls_busy: _Optional[int] = ..., workers_unlisted: _Optional[int] = ..., workers_known: _Optional[int] = ...) -> None: ...

class WalRecord(_message.Message):
    __slots__ = ("snapshot", "enqueue", "lease", "renew", "returned", "submit", "take", "ack", "requeue_take", "drop_stale")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    ENQUEUE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    RENEW_FIELD_NUMBER: _ClassVar[int]
    RETURNED_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    TAKE_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    REQUEUE_TAKE_FIELD_NUMBER: _ClassVar[int]
    DROP_STALE_FIELD_NUMBER: _ClassVar[int]
    snapshot: WalSnapshot
    enqueue: WalEnqueue
    lease: WalLease
    renew: WalRenew
    returned: WalReturn
    submit: WalSubmit
    take: WalTake
    ack: WalAck
    requeue_take: WalRequeueTake
    drop_stale: WalDropStale
    def __init__(self, snapshot: _Optional[_Union[WalSnapshot, _Mapping]] = ..., enqueue: _Optional[_Union[WalEnqueue, _Mapping]] = ..., lease: _Optional[_Union[WalLease, _Mapping]] = ..., renew: _Optional[_Union[WalRenew, _Mapping]] = ..., returned: _Optional[_Union[WalReturn, _Mapping]] = ..., submit: _Optional[_Union[WalSubmit, _Mapping]] = ..., take: _Optional[_Union[WalTake, _Mapping]] = ..., ack: _Optional[_Union[WalAck, _Mapping]] = ..., requeue_take: _Optional[_Union[WalRequeueTake, _Mapping]] = ..., drop_stale: _Optional[_Union[WalDropStale, _Mapping]] = ...) -> None: ...

class WalEnqueue(_message.Message):
    __slots__ = ("prompts",)
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ...) -> None: ...

class WalLease(_message.Message):
    __slots__ = ("lease_id", "worker_id", "prompt_ids", "deadline_unix_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    worker_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[str]
    deadline_unix_s: float
    def __init__(self, lease_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[str]] = ..., deadline_unix_s: _Optional[float] = ...) -> None: ...

class WalRenew(_message.Message):
    __slots__ = ("lease_id", "deadline_unix_s", "partial")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    deadline_unix_s: float
    partial: _containers.RepeatedCompositeFieldContainer[PartialRollouts]
    def __init__(self, lease_id: _Optional[str] = ..., deadline_unix_s: _Optional[float] = ..., partial: _Optional[_Iterable[_Union[PartialRollouts, _Mapping]]] = ...) -> None: ...

class WalReturn(_message.Message):
    __slots__ = ("lease_id", "prompt_ids", "expired", "partial")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[str]
    expired: bool
    partial: _containers.RepeatedCompositeFieldContainer[PartialRollouts]
    def __init__(self, lease_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[str]] = ..., expired: _Optional[bool] = ..., partial: _Optional[_Iterable[_Union[PartialRollouts, _Mapping]]] = ...) -> None: ...

class WalSubmit(_message.Message):
    __slots__ = ("lease_id", "rollout_id", "group", "fingerprint", "worker_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    rollout_id: int
    group: RolloutGroup
    fingerprint: bytes
    worker_id: str
    def __init__(self, lease_id: _Optional[str] = ..., rollout_id: _Optional[int] = ..., group: _Optional[_Union[RolloutGroup, _Mapping]] = ..., fingerprint: _Optional[bytes] = ..., worker_id: _Optional[str] = ...) -> None: ...

class WalTake(_message.Message):
    __slots__ = ("take_id", "rollout_ids", "deadline_unix_s")
    TAKE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_IDS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    take_id: str
    rollout_ids: _containers.RepeatedScalarFieldContainer[int]
    deadline_unix_s: float
    def __init__(self, take_id: _Optional[str] = ..., rollout_ids: _Optional[_Iterable[int]] = ..., deadline_unix_s: _Optional[float] = ...) -> None: ...

class WalAck(_message.Message):
    __slots__ = ("take_id",)
    TAKE_ID_FIELD_NUMBER: _ClassVar[int]
    take_id: str
    def __init__(self, take_id: _Optional[str] = ...) -> None: ...

class WalRequeueTake(_message.Message):
    __slots__ = ("take_id",)
    TAKE_ID_FIELD_NUMBER: _ClassVar[int]
    take_id: str
    def __init__(self, take_id: _Optional[str] = ...) -> None: ...

class WalDropStale(_message.Message):
    __slots__ = ("rollout_ids",)
    ROLLOUT_IDS_FIELD_NUMBER: _ClassVar[int]
    rollout_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rollout_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class WalLeaseState(_message.Message):
    __slots__ = ("lease_id", "worker_id", "prompt_ids", "deadline_unix_s", "answered", "fingerprints", "released", "expired", "open_prompts")
    class AnsweredEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class FingerprintsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINTS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    OPEN_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    worker_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[str]
    deadline_unix_s: float
    answered: _containers.ScalarMap[str, int]
    fingerprints: _containers.ScalarMap[str, bytes]
    released: _containers.RepeatedScalarFieldContainer[str]
    expired: bool
    open_prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    def __init__(self, lease_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[str]] = ..., deadline_unix_s: _Optional[float] = ..., answered: _Optional[_Mapping[str, int]] = ..., fingerprints: _Optional[_Mapping[str, bytes]] = ..., released: _Optional[_Iterable[str]] = ..., expired: _Optional[bool] = ..., open_prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ...) -> None: ...

class WalRollout(_message.Message):
    __slots__ = ("rollout_id", "prompt", "group", "worker_id")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    rollout_id: int
    prompt: Prompt
    group: RolloutGroup
    worker_id: str
    def __init__(self, rollout_id: _Optional[int] = ..., prompt: _Optional[_Union[Prompt, _Mapping]] = ..., group: _Optional[_Union[RolloutGroup, _Mapping]] = ..., worker_id: _Optional[str] = ...) -> None: ...

class WalSnapshot(_message.Message):
    __slots__ = ("continues", "queued", "leases", "rollouts", "takes", "acked_takes", "acked_take_groups", "next_rollout_id", "rollouts_accepted", "rollouts_duplicate", "rollouts_stale_dropped", "leases_expired", "prompts_resumed", "samples_resumed", "tokens_resumed", "takes_requeued")
    CONTINUES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    TAKES_FIELD_NUMBER: _ClassVar[int]
    ACKED_TAKES_FIELD_NUMBER: _ClassVar[int]
    ACKED_TAKE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_STALE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_RESUMED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_RESUMED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_RESUMED_FIELD_NUMBER: _ClassVar[int]
    TAKES_REQUEUED_FIELD_NUMBER: _ClassVar[int]
    continues: bool
    queued: _containers.RepeatedCompositeFieldContainer[Prompt]
    leases: _containers.RepeatedCompositeFieldContainer[WalLeaseState]
    rollouts: _containers.RepeatedCompositeFieldContainer[WalRollout]
    takes: _containers.RepeatedCompositeFieldContainer[WalTake]
    acked_takes: _containers.RepeatedScalarFieldContainer[str]
    acked_take_groups: _containers.RepeatedScalarFieldContainer[int]
    next_rollout_id: int
    rollouts_accepted: int
    rollouts_duplicate: int
    rollouts_stale_dropped: int
    leases_expired: int
    prompts_resumed: int
    samples_resumed: int
    tokens_resumed: int
    takes_requeued: int
    def __init__(self, continues: _Optional[bool] = ..., queued: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., leases: _Optional[_Iterable[_Union[WalLeaseState, _Mapping]]] = ..., rollouts: _Optional[_Iterable[_Union[WalRollout, _Mapping]]] = ..., takes: _Optional[_Iterable[_Union[WalTake, _Mapping]]] = ..., acked_takes: _Optional[_Iterable[str]] = ..., acked_take_groups: _Optional[_Iterable[int]] = ..., next_rollout_id: _Optional[int] = ..., rollouts_accepted: _Optional[int] = ..., rollouts_duplicate: _Optional[int] = ..., rollouts_stale_dropped: _Optional[int] = ..., leases_expired: _Optional[int] = ..., prompts_resumed: _Optional[int] = ..., samples_resumed: _Optional[int] = ..., tokens_resumed: _Optional[int] = ..., takes_requeued: _Optional[int] = ...) -> None: ...
