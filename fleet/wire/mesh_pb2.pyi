from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "codec", "scales")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    codec: str
    scales: Tensor
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., codec: _Optional[str] = ..., scales: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class GpuInfo(_message.Message):
    __slots__ = ("index", "name", "mem_total_bytes", "mem_free_bytes", "uuid", "compute_capability", "utilization_pct", "temperature_c", "power_w", "power_limit_w")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEM_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEM_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PCT_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    POWER_W_FIELD_NUMBER: _ClassVar[int]
    POWER_LIMIT_W_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    mem_total_bytes: int
    mem_free_bytes: int
    uuid: str
    compute_capability: str
    utilization_pct: float
    temperature_c: float
    power_w: float
    power_limit_w: float
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., mem_total_bytes: _Optional[int] = ..., mem_free_bytes: _Optional[int] = ..., uuid: _Optional[str] = ..., compute_capability: _Optional[str] = ..., utilization_pct: _Optional[float] = ..., temperature_c: _Optional[float] = ..., power_w: _Optional[float] = ..., power_limit_w: _Optional[float] = ...) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("hostname", "cpu_model", "num_cpus", "ram_total_bytes", "ram_available_bytes", "gpus", "backends", "speeds", "site", "tier", "num_ranks", "dtype", "cpu_bf16", "num_threads", "runtime")
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    CPU_MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_CPUS_FIELD_NUMBER: _ClassVar[int]
    RAM_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAM_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    SPEEDS_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CPU_BF16_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    cpu_model: str
    num_cpus: int
    ram_total_bytes: int
    ram_available_bytes: int
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    backends: _containers.RepeatedScalarFieldContainer[str]
    speeds: _containers.RepeatedCompositeFieldContainer[Speed]
    site: str
    tier: str
    num_ranks: int
    dtype: str
    cpu_bf16: bool
    num_threads: int
    runtime: str
    def __init__(self, hostname: _Optional[str] = ..., cpu_model: _Optional[str] = ..., num_cpus: _Optional[int] = ..., ram_total_bytes: _Optional[int] = ..., ram_available_bytes: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., backends: _Optional[_Iterable[str]] = ..., speeds: _Optional[_Iterable[_Union[Speed, _Mapping]]] = ..., site: _Optional[str] = ..., tier: _Optional[str] = ..., num_ranks: _Optional[int] = ..., dtype: _Optional[str] = ..., cpu_bf16: _Optional[bool] = ..., num_threads: _Optional[int] = ..., runtime: _Optional[str] = ...) -> None: ...

class Speed(_message.Message):
    __slots__ = ("backend", "dtype", "flops", "mem_bandwidth", "step_overhead_s", "layer_overhead_s", "decode_flops", "decode_bandwidth")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    FLOPS_FIELD_NUMBER: _ClassVar[int]
    MEM_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    STEP_OVERHEAD_S_FIELD_NUMBER: _ClassVar[int]
    LAYER_OVERHEAD_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_FLOPS_FIELD_NUMBER: _ClassVar[int]
    DECODE_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    backend: str
    dtype: str
    flops: float
    mem_bandwidth: float
    step_overhead_s: float
    layer_overhead_s: float
    decode_flops: float
    decode_bandwidth: float
    def __init__(self, backend: _Optional[str] = ..., dtype: _Optional[str] = ..., flops: _Optional[float] = ..., mem_bandwidth: _Optional[float] = ..., step_overhead_s: _Optional[float] = ..., layer_overhead_s: _Optional[float] = ..., decode_flops: _Optional[float] = ..., decode_bandwidth: _Optional[float] = ...) -> None: ...

class StageSpec(_message.Message):
    __slots__ = ("model_id", "model_path", "start_layer", "end_layer", "num_layers", "dtype", "device", "kv_block_size", "tp_degree", "runtime", "quantize", "kv_cache_bytes", "revision")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_DEGREE_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    QUANTIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_path: str
    start_layer: int
    end_layer: int
    num_layers: int
    dtype: str
    device: str
    kv_block_size: int
    tp_degree: int
    runtime: str
    quantize: str
    kv_cache_bytes: int
    revision: str
    def __init__(self, model_id: _Optional[str] = ..., model_path: _Optional[str] = ..., start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., num_layers: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., kv_block_size: _Optional[int] = ..., tp_degree: _Optional[int] = ..., runtime: _Optional[str] = ..., quantize: _Optional[str] = ..., kv_cache_bytes: _Optional[int] = ..., revision: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "has_seed", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "logprobs", "has_logprobs", "prompt_logprobs", "has_prompt_logprobs", "grammar")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    has_seed: bool
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.RepeatedCompositeFieldContainer[LogitBias]
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: int
    has_logprobs: bool
    prompt_logprobs: int
    has_prompt_logprobs: bool
    grammar: str
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., has_seed: _Optional[bool] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Iterable[_Union[LogitBias, _Mapping]]] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[int] = ..., has_logprobs: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ..., has_prompt_logprobs: _Optional[bool] = ..., grammar: _Optional[str] = ...) -> None: ...

class LogitBias(_message.Message):
    __slots__ = ("token_id", "bias")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    bias: float
    def __init__(self, token_id: _Optional[int] = ..., bias: _Optional[float] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("agent_id", "name", "stage_address", "capabilities", "held", "mesh", "metrics_address", "software_version", "protocol_version")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STAGE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    name: str
    stage_address: str
    capabilities: Capabilities
    held: _containers.RepeatedCompositeFieldContainer[Assignment]
    mesh: str
    metrics_address: str
    software_version: str
    protocol_version: int
    def __init__(self, agent_id: _Optional[str] = ..., name: _Optional[str] = ..., stage_address: _Optional[str] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ..., held: _Optional[_Iterable[_Union[Assignment, _Mapping]]] = ..., mesh: _Optional[str] = ..., metrics_address: _Optional[str] = ..., software_version: _Optional[str] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("seq", "num_sessions", "telemetry")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_FIELD_NUMBER: _ClassVar[int]
    seq: int
    num_sessions: int
    telemetry: Telemetry
    def __init__(self, seq: _Optional[int] = ..., num_sessions: _Optional[int] = ..., telemetry: _Optional[_Union[Telemetry, _Mapping]] = ...) -> None: ...

class Telemetry(_message.Message):
    __slots__ = ("unix_s", "queue_depth", "tokens_per_s", "stages", "gpus", "serving_cpu_per_token_s", "resting", "limits_near")
    UNIX_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    SERVING_CPU_PER_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    RESTING_FIELD_NUMBER: _ClassVar[int]
    LIMITS_NEAR_FIELD_NUMBER: _ClassVar[int]
    unix_s: float
    queue_depth: int
    tokens_per_s: float
    stages: _containers.RepeatedCompositeFieldContainer[StageLoad]
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    serving_cpu_per_token_s: float
    resting: str
    limits_near: float
    def __init__(self, unix_s: _Optional[float] = ..., queue_depth: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., stages: _Optional[_Iterable[_Union[StageLoad, _Mapping]]] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., serving_cpu_per_token_s: _Optional[float] = ..., resting: _Optional[str] = ..., limits_near: _Optional[float] = ...) -> None: ...

class StageLoad(_message.Message):
    __slots__ = ("assignment_id", "num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total", "prefix_query_tokens", "prefix_hit_tokens", "decode_step_s", "decode_roofline", "spec_draft_tokens", "spec_accepted_tokens", "expert_tokens", "expert_imbalance")
    ASSIGNMENT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_ROOFLINE_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    assignment_id: str
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    decode_step_s: float
    decode_roofline: float
    spec_draft_tokens: int
    spec_accepted_tokens: int
    expert_tokens: _containers.RepeatedScalarFieldContainer[int]
    expert_imbalance: float
    def __init__(self, assignment_id: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., decode_step_s: _Optional[float] = ..., decode_roofline: _Optional[float] = ..., spec_draft_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., expert_tokens: _Optional[_Iterable[int]] = ..., expert_imbalance: _Optional[float] = ...) -> None: ...

class LinkMeasurement(_message.Message):
    __slots__ = ("peer_agent_id", "rtt_s", "bandwidth_bytes_per_s", "error")
    PEER_AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    peer_agent_id: str
    rtt_s: float
    bandwidth_bytes_per_s: float
    error: str
    def __init__(self, peer_agent_id: _Optional[str] = ..., rtt_s: _Optional[float] = ..., bandwidth_bytes_per_s: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class LinkReport(_message.Message):
    __slots__ = ("links",)
    LINKS_FIELD_NUMBER: _ClassVar[int]
    links: _containers.RepeatedCompositeFieldContainer[LinkMeasurement]
    def __init__(self, links: _Optional[_Iterable[_Union[LinkMeasurement, _Mapping]]] = ...) -> None: ...

class StageStatus(_message.Message):
    __slots__ = ("assignment_id", "state", "error", "param_bytes")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[StageStatus.State]
        LOADING: _ClassVar[StageStatus.State]
        READY: _ClassVar[StageStatus.State]
        FAILED: _ClassVar[StageStatus.State]
        RELEASED: _ClassVar[StageStatus.State]
    STATE_UNSPECIFIED: StageStatus.State
    LOADING: StageStatus.State
    READY: StageStatus.State
    FAILED: StageStatus.State
    RELEASED: StageStatus.State
    ASSIGNMENT_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PARAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    assignment_id: str
    state: StageStatus.State
    error: str
    param_bytes: int
    def __init__(self, assignment_id: _Optional[str] = ..., state: _Optional[_Union[StageStatus.State, str]] = ..., error: _Optional[str] = ..., param_bytes: _Optional[int] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("register", "heartbeat", "stage_status", "links", "kv_events", "weights_progress", "rtc_offer", "rtc_answer")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    STAGE_STATUS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RTC_OFFER_FIELD_NUMBER: _ClassVar[int]
    RTC_ANSWER_FIELD_NUMBER: _ClassVar[int]
    register: Register
    heartbeat: Heartbeat
    stage_status: StageStatus
    links: LinkReport
    kv_events: KvEventReport
    weights_progress: WeightsProgress
    rtc_offer: RtcOffer
    rtc_answer: RtcAnswer
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., stage_status: _Optional[_Union[StageStatus, _Mapping]] = ..., links: _Optional[_Union[LinkReport, _Mapping]] = ..., kv_events: _Optional[_Union[KvEventReport, _Mapping]] = ..., weights_progress: _Optional[_Union[WeightsProgress, _Mapping]] = ..., rtc_offer: _Optional[_Union[RtcOffer, _Mapping]] = ..., rtc_answer: _Optional[_Union[RtcAnswer, _Mapping]] = ...) -> None: ...

class WeightsProgress(_message.Message):
    __slots__ = ("assignment_id", "fetched_bytes", "reused_bytes", "total_bytes", "tensor_bytes", "done", "source", "num_corrupt")
    ASSIGNMENT_ID_FIELD_NUMBER: _ClassVar[int]
    FETCHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REUSED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    NUM_CORRUPT_FIELD_NUMBER: _ClassVar[int]
    assignment_id: str
    fetched_bytes: int
    reused_bytes: int
    total_bytes: int
    tensor_bytes: int
    done: bool
    source: str
    num_corrupt: int
    def __init__(self, assignment_id: _Optional[str] = ..., fetched_bytes: _Optional[int] = ..., reused_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., tensor_bytes: _Optional[int] = ..., done: _Optional[bool] = ..., source: _Optional[str] = ..., num_corrupt: _Optional[int] = ...) -> None: ...

class KvEvents(_message.Message):
    __slots__ = ("assignment_id", "block_size", "cleared", "stored", "evicted")
    ASSIGNMENT_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    assignment_id: str
    block_size: int
    cleared: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    evicted: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, assignment_id: _Optional[str] = ..., block_size: _Optional[int] = ..., cleared: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., evicted: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KvEventReport(_message.Message):
    __slots__ = ("stages",)
    STAGES_FIELD_NUMBER: _ClassVar[int]
    stages: _containers.RepeatedCompositeFieldContainer[KvEvents]
    def __init__(self, stages: _Optional[_Iterable[_Union[KvEvents, _Mapping]]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("agent_id", "heartbeat_interval_s", "nat")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    NAT_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    heartbeat_interval_s: float
    nat: str
    def __init__(self, agent_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., nat: _Optional[str] = ...) -> None: ...

class RtcOffer(_message.Message):
    __slots__ = ("call_id", "peer_id", "sdp", "cert_pem")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    SDP_FIELD_NUMBER: _ClassVar[int]
    CERT_PEM_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    peer_id: str
    sdp: str
    cert_pem: bytes
    def __init__(self, call_id: _Optional[str] = ..., peer_id: _Optional[str] = ..., sdp: _Optional[str] = ..., cert_pem: _Optional[bytes] = ...) -> None: ...

class RtcAnswer(_message.Message):
    __slots__ = ("call_id", "peer_id", "sdp", "cert_pem", "error")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    SDP_FIELD_NUMBER: _ClassVar[int]
    CERT_PEM_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    peer_id: str
    sdp: str
    cert_pem: bytes
    error: str
    def __init__(self, call_id: _Optional[str] = ..., peer_id: _Optional[str] = ..., sdp: _Optional[str] = ..., cert_pem: _Optional[bytes] = ..., error: _Optional[str] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("assignment_id", "stage")
    ASSIGNMENT_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    assignment_id: str
    stage: StageSpec
    def __init__(self, assignment_id: _Optional[str] = ..., stage: _Optional[_Union[StageSpec, _Mapping]] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("assignment_id",)
    ASSIGNMENT_ID_FIELD_NUMBER: _ClassVar[int]
    assignment_id: str
    def __init__(self, assignment_id: _Optional[str] = ...) -> None: ...

class Peer(_message.Message):
    __slots__ = ("agent_id", "address")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    address: str
    def __init__(self, agent_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class ProbeLinks(_message.Message):
    __slots__ = ("peers",)
    PEERS_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedCompositeFieldContainer[Peer]
    def __init__(self, peers: _Optional[_Iterable[_Union[Peer, _Mapping]]] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class CoordinatorMessage(_message.Message):
    __slots__ = ("welcome", "assign", "release", "probe_links", "shutdown", "revocations", "rtc_offer", "rtc_answer")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    PROBE_LINKS_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    REVOCATIONS_FIELD_NUMBER: _ClassVar[int]
    RTC_OFFER_FIELD_NUMBER: _ClassVar[int]
    RTC_ANSWER_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    assign: Assignment
    release: Release
    probe_links: ProbeLinks
    shutdown: Shutdown
    revocations: Revocations
    rtc_offer: RtcOffer
    rtc_answer: RtcAnswer
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., assign: _Optional[_Union[Assignment, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ..., probe_links: _Optional[_Union[ProbeLinks, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., revocations: _Optional[_Union[Revocations, _Mapping]] = ..., rtc_offer: _Optional[_Union[RtcOffer, _Mapping]] = ..., rtc_answer: _Optional[_Union[RtcAnswer, _Mapping]] = ...) -> None: ...

class Revocations(_message.Message):
    __slots__ = ("serials",)
    SERIALS_FIELD_NUMBER: _ClassVar[int]
    serials: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, serials: _Optional[_Iterable[str]] = ...) -> None: ...

class EnrollRequest(_message.Message):
    __slots__ = ("mesh", "token_id", "agent_id", "csr_pem", "mac")
    MESH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    mesh: str
    token_id: str
    agent_id: str
    csr_pem: bytes
    mac: bytes
    def __init__(self, mesh: _Optional[str] = ..., token_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., csr_pem: _Optional[bytes] = ..., mac: _Optional[bytes] = ...) -> None: ...

class EnrollReply(_message.Message):
    __slots__ = ("cert_pem", "ca_pem", "mac")
    CERT_PEM_FIELD_NUMBER: _ClassVar[int]
    CA_PEM_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    cert_pem: bytes
    ca_pem: bytes
    mac: bytes
    def __init__(self, cert_pem: _Optional[bytes] = ..., ca_pem: _Optional[bytes] = ..., mac: _Optional[bytes] = ...) -> None: ...

class WeightManifestRequest(_message.Message):
    __slots__ = ("model_id", "tensor_names", "agent_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NAMES_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tensor_names: _containers.RepeatedScalarFieldContainer[str]
    agent_id: str
    def __init__(self, model_id: _Optional[str] = ..., tensor_names: _Optional[_Iterable[str]] = ..., agent_id: _Optional[str] = ...) -> None: ...

class WeightFile(_message.Message):
    __slots__ = ("name", "size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("file", "offset", "length", "sha256")
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    file: str
    offset: int
    length: int
    sha256: bytes
    def __init__(self, file: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., sha256: _Optional[bytes] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("model_id", "revision", "files", "chunks", "tensor_bytes", "sources")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    revision: str
    files: _containers.RepeatedCompositeFieldContainer[WeightFile]
    chunks: _containers.RepeatedCompositeFieldContainer[WeightChunk]
    tensor_bytes: int
    sources: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_id: _Optional[str] = ..., revision: _Optional[str] = ..., files: _Optional[_Iterable[_Union[WeightFile, _Mapping]]] = ..., chunks: _Optional[_Iterable[_Union[WeightChunk, _Mapping]]] = ..., tensor_bytes: _Optional[int] = ..., sources: _Optional[_Iterable[str]] = ...) -> None: ...

class WeightFetch(_message.Message):
    __slots__ = ("model_id", "revision", "chunks")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    revision: str
    chunks: _containers.RepeatedCompositeFieldContainer[WeightChunk]
    def __init__(self, model_id: _Optional[str] = ..., revision: _Optional[str] = ..., chunks: _Optional[_Iterable[_Union[WeightChunk, _Mapping]]] = ...) -> None: ...

class WeightData(_message.Message):
    __slots__ = ("index", "data", "missing")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    index: int
    data: bytes
    missing: bool
    def __init__(self, index: _Optional[int] = ..., data: _Optional[bytes] = ..., missing: _Optional[bool] = ...) -> None: ...

class SessionOpen(_message.Message):
    __slots__ = ("session_id", "assignment_id", "route", "route_assignments", "origin", "sampling", "traceparent", "prompt_token_ids", "max_cached_tokens", "resume_from", "route_dtypes", "feed_address", "feed_assignment", "max_new_tokens", "stop_token_ids", "route_codecs", "route_agents", "route_nats", "feed_agent", "feed_nat", "output_start", "speculation", "revision", "follow_runs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    ROUTE_ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    ROUTE_DTYPES_FIELD_NUMBER: _ClassVar[int]
    FEED_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FEED_ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_CODECS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_AGENTS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_NATS_FIELD_NUMBER: _ClassVar[int]
    FEED_AGENT_FIELD_NUMBER: _ClassVar[int]
    FEED_NAT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_RUNS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    assignment_id: str
    route: _containers.RepeatedScalarFieldContainer[str]
    route_assignments: _containers.RepeatedScalarFieldContainer[str]
    origin: str
    sampling: SamplingParams
    traceparent: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_cached_tokens: int
    resume_from: str
    route_dtypes: _containers.RepeatedScalarFieldContainer[str]
    feed_address: str
    feed_assignment: str
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    route_codecs: _containers.RepeatedScalarFieldContainer[str]
    route_agents: _containers.RepeatedScalarFieldContainer[str]
    route_nats: _containers.RepeatedScalarFieldContainer[str]
    feed_agent: str
    feed_nat: str
    output_start: int
    speculation: Speculation
    revision: str
    follow_runs: bool
    def __init__(self, session_id: _Optional[str] = ..., assignment_id: _Optional[str] = ..., route: _Optional[_Iterable[str]] = ..., route_assignments: _Optional[_Iterable[str]] = ..., origin: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., traceparent: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_cached_tokens: _Optional[int] = ..., resume_from: _Optional[str] = ..., route_dtypes: _Optional[_Iterable[str]] = ..., feed_address: _Optional[str] = ..., feed_assignment: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., route_codecs: _Optional[_Iterable[str]] = ..., route_agents: _Optional[_Iterable[str]] = ..., route_nats: _Optional[_Iterable[str]] = ..., feed_agent: _Optional[str] = ..., feed_nat: _Optional[str] = ..., output_start: _Optional[int] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ..., revision: _Optional[str] = ..., follow_runs: _Optional[bool] = ...) -> None: ...

class Speculation(_message.Message):
    __slots__ = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_MIN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_MAX_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    model: str
    def __init__(self, method: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., prompt_lookup_min: _Optional[int] = ..., prompt_lookup_max: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class StepChunk(_message.Message):
    __slots__ = ("session_id", "step", "start_pos", "token_ids", "sample", "trace_id", "sent_unix_ns", "num_draft", "pending_from")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_FIELD_NUMBER: _ClassVar[int]
    PENDING_FROM_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step: int
    start_pos: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sample: bool
    trace_id: str
    sent_unix_ns: int
    num_draft: int
    pending_from: int
    def __init__(self, session_id: _Optional[str] = ..., step: _Optional[int] = ..., start_pos: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., sample: _Optional[bool] = ..., trace_id: _Optional[str] = ..., sent_unix_ns: _Optional[int] = ..., num_draft: _Optional[int] = ..., pending_from: _Optional[int] = ...) -> None: ...

class StepBatch(_message.Message):
    __slots__ = ("chunks", "hidden", "sent_unix_ns")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[StepChunk]
    hidden: Tensor
    sent_unix_ns: int
    def __init__(self, chunks: _Optional[_Iterable[_Union[StepChunk, _Mapping]]] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., sent_unix_ns: _Optional[int] = ...) -> None: ...

class StepChunks(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[StepChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[StepChunk, _Mapping]]] = ...) -> None: ...

class SessionClose(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionHold(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionRewind(_message.Message):
    __slots__ = ("session_id", "position")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    position: int
    def __init__(self, session_id: _Optional[str] = ..., position: _Optional[int] = ...) -> None: ...

class StageMessage(_message.Message):
    __slots__ = ("open", "chunk", "close", "batch", "chunks", "hold", "rewind", "to")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    REWIND_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    open: SessionOpen
    chunk: StepChunk
    close: SessionClose
    batch: StepBatch
    chunks: StepChunks
    hold: SessionHold
    rewind: SessionRewind
    to: str
    def __init__(self, open: _Optional[_Union[SessionOpen, _Mapping]] = ..., chunk: _Optional[_Union[StepChunk, _Mapping]] = ..., close: _Optional[_Union[SessionClose, _Mapping]] = ..., batch: _Optional[_Union[StepBatch, _Mapping]] = ..., chunks: _Optional[_Union[StepChunks, _Mapping]] = ..., hold: _Optional[_Union[SessionHold, _Mapping]] = ..., rewind: _Optional[_Union[SessionRewind, _Mapping]] = ..., to: _Optional[str] = ...) -> None: ...

class PushSummary(_message.Message):
    __slots__ = ("num_messages",)
    NUM_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    num_messages: int
    def __init__(self, num_messages: _Optional[int] = ...) -> None: ...

class StageInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageInfo(_message.Message):
    __slots__ = ("agent_id", "assignments", "tensor_names", "param_bytes", "num_sessions")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NAMES_FIELD_NUMBER: _ClassVar[int]
    PARAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    assignments: _containers.RepeatedCompositeFieldContainer[Assignment]
    tensor_names: _containers.RepeatedScalarFieldContainer[str]
    param_bytes: int
    num_sessions: int
    def __init__(self, agent_id: _Optional[str] = ..., assignments: _Optional[_Iterable[_Union[Assignment, _Mapping]]] = ..., tensor_names: _Optional[_Iterable[str]] = ..., param_bytes: _Optional[int] = ..., num_sessions: _Optional[int] = ...) -> None: ...

class TraceRequest(_message.Message):
    __slots__ = ("trace_id",)
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    trace_id: str
    def __init__(self, trace_id: _Optional[str] = ...) -> None: ...

class SpanData(_message.Message):
    __slots__ = ("name", "trace_id", "span_id", "parent_span_id", "start_unix_ns", "end_unix_ns", "attributes")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    START_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    END_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_unix_ns: int
    end_unix_ns: int
    attributes: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., trace_id: _Optional[str] = ..., span_id: _Optional[str] = ..., parent_span_id: _Optional[str] = ..., start_unix_ns: _Optional[int] = ..., end_unix_ns: _Optional[int] = ..., attributes: _Optional[_Mapping[str, str]] = ...) -> None: ...

class TraceSpans(_message.Message):
    __slots__ = ("spans",)
    SPANS_FIELD_NUMBER: _ClassVar[int]
    spans: _containers.RepeatedCompositeFieldContainer[SpanData]
    def __init__(self, spans: _Optional[_Iterable[_Union[SpanData, _Mapping]]] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("model_id", "start_layer", "end_layer", "dtype", "block_size", "num_kv_heads", "head_dim")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    start_layer: int
    end_layer: int
    dtype: str
    block_size: int
    num_kv_heads: int
    head_dim: int
    def __init__(self, model_id: _Optional[str] = ..., start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ...) -> None: ...

class KvExportRequest(_message.Message):
    __slots__ = ("session_id", "assignment_id", "layout", "wait_for_prefill")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_PREFILL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    assignment_id: str
    layout: KvLayout
    wait_for_prefill: bool
    def __init__(self, session_id: _Optional[str] = ..., assignment_id: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., wait_for_prefill: _Optional[bool] = ...) -> None: ...

class KvHeader(_message.Message):
    __slots__ = ("layout", "session_id", "token_ids", "prompt_len", "num_computed", "kv", "num_bytes", "digest")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    layout: KvLayout
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_len: int
    num_computed: int
    kv: Tensor
    num_bytes: int
    digest: bytes
    def __init__(self, layout: _Optional[_Union[KvLayout, _Mapping]] = ..., session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_len: _Optional[int] = ..., num_computed: _Optional[int] = ..., kv: _Optional[_Union[Tensor, _Mapping]] = ..., num_bytes: _Optional[int] = ..., digest: _Optional[bytes] = ...) -> None: ...

class KvPiece(_message.Message):
    __slots__ = ("offset", "data", "crc32")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    crc32: int
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("header", "piece")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    header: KvHeader
    piece: KvPiece
    def __init__(self, header: _Optional[_Union[KvHeader, _Mapping]] = ..., piece: _Optional[_Union[KvPiece, _Mapping]] = ...) -> None: ...

class KvImportRequest(_message.Message):
    __slots__ = ("session_id", "assignment_id", "source_address", "source_assignment_id", "wait_for_prefill")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ASSIGNMENT_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_PREFILL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    assignment_id: str
    source_address: str
    source_assignment_id: str
    wait_for_prefill: bool
    def __init__(self, session_id: _Optional[str] = ..., assignment_id: _Optional[str] = ..., source_address: _Optional[str] = ..., source_assignment_id: _Optional[str] = ..., wait_for_prefill: _Optional[bool] = ...) -> None: ...

class KvImportSummary(_message.Message):
    __slots__ = ("num_tokens", "num_bytes", "num_pieces")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_PIECES_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    num_bytes: int
    num_pieces: int
    def __init__(self, num_tokens: _Optional[int] = ..., num_bytes: _Optional[int] = ..., num_pieces: _Optional[int] = ...) -> None: ...

class EchoMessage(_message.Message):
    __slots__ = ("seq", "payload")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    seq: int
    payload: bytes
    def __init__(self, seq: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class BulkChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class BulkSummary(_message.Message):
    __slots__ = ("num_bytes", "timed_bytes", "timed_s")
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMED_S_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    timed_bytes: int
    timed_s: float
    def __init__(self, num_bytes: _Optional[int] = ..., timed_bytes: _Optional[int] = ..., timed_s: _Optional[float] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("session_id", "step", "token_id", "error", "error_stage", "opened", "cached_tokens", "preempted", "sent_unix_ns", "unreachable", "embedding", "held", "logprobs", "prompt_logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_STAGE_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step: int
    token_id: int
    error: str
    error_stage: str
    opened: bool
    cached_tokens: int
    preempted: bool
    sent_unix_ns: int
    unreachable: str
    embedding: Tensor
    held: bool
    logprobs: Logprobs
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[Logprobs]
    def __init__(self, session_id: _Optional[str] = ..., step: _Optional[int] = ..., token_id: _Optional[int] = ..., error: _Optional[str] = ..., error_stage: _Optional[str] = ..., opened: _Optional[bool] = ..., cached_tokens: _Optional[int] = ..., preempted: _Optional[bool] = ..., sent_unix_ns: _Optional[int] = ..., unreachable: _Optional[str] = ..., embedding: _Optional[_Union[Tensor, _Mapping]] = ..., held: _Optional[bool] = ..., logprobs: _Optional[_Union[Logprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[TokenEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[TokenEvent, _Mapping]]] = ...) -> None: ...

class DeliverSummary(_message.Message):
    __slots__ = ("num_events",)
    NUM_EVENTS_FIELD_NUMBER: _ClassVar[int]
    num_events: int
    def __init__(self, num_events: _Optional[int] = ...) -> None: ...
