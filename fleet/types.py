"""The vocabulary agents, coordinator and partitioner share: frozen values, no I/O."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from stratamesh.fleet.errors import CheckpointError, InvalidInput
from stratamesh.fleet.states import RouterMode, Runtime, StageState
from stratamesh.fleet.weights import WeightsProgress

DTYPES = ("float32", "float16", "bfloat16")
RUNTIMES = (Runtime.TORCH, Runtime.ONNXRUNTIME)   # what computes a stage's layers (on its device)
AUTO_RUNTIME = Runtime.AUTO           # an agent's runtime when the planner picks one of RUNTIMES per stage
AGENT_RUNTIMES = tuple(Runtime)       # what an agent's operator may choose (--runtime)
# How the coordinator's router picks one of a model's ready replicas for a request (coordinator.control.routes).
ROUTER_MODES = tuple(RouterMode)
DEFAULT_ROUTER_MODE = RouterMode.KV
MAX_REPLICAS = 64               # pipelines one model may run side by side
QUANTIZATIONS = ("int8",)             # weight-only quantization of a stage (kernels.ops.quant); "" is none
ORT_DTYPES = ("float32",)             # what ONNX Runtime stages compute in (its CPU kernels, here)
MAX_TP_DEGREE = 8               # ranks of one tensor-parallel group, at most
MAX_KV_BLOCK_SIZE = 1024        # tokens of one KV block, at most
MAX_KV_CACHE_BYTES = 1 << 46    # a stage's KV cache per rank, at most (64 TiB: no box holds more)
# Hugging Face base-model classes: no LM head, so served as embedding models (last token, L2-normalized)
EMBEDDING_ARCHITECTURES = ("LlamaModel", "Qwen2Model", "MistralModel")


HOP_CODECS = ("", *DTYPES, "int8")


def wire_dtype(sender: str, receiver: str) -> str:
    """The dtype activations travel in from a stage computing in sender to one computing in receiver: the
    receiver's, so it converts nothing, except that a float32 receiver gets the sender's narrower dtype (the
    upcast it does then is exact, and the link carries half the bytes). "" (unknown) on either side: sender's."""
    if not receiver or not sender or receiver == "float32":
        return sender or receiver or "float32"
    return receiver


def model_task(config: Mapping[str, Any]) -> str:
    """"embed" for a config.json dict whose architectures[0] is a base model without an LM head, else "generate"."""
    architectures = config.get("architectures")
    first = architectures[0] if isinstance(architectures, list) and architectures else None
    return "embed" if first in EMBEDDING_ARCHITECTURES else "generate"


def attention_windows(config: Mapping[str, Any], arch: str, num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(sliding window, layer types) of a config.json dict: Mistral windows every layer; Qwen2 only with
    use_sliding_window, from max_window_layers on (its layer_types name which); (None, ()) is full attention.
    CheckpointError where layer_types does not name every layer."""
    window = config.get("sliding_window")
    if arch == "llama" or window is None:
        return None, ()
    if arch == "mistral":
        return int(window), ()
    if not config.get("use_sliding_window", False):
        return None, ()
    layer_types = config.get("layer_types")
    if layer_types is None:
        first = int(config.get("max_window_layers", 28))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise CheckpointError(f"config.json layer_types has {len(layer_types)} entries for {num_layers} layers")
    return int(window), tuple(layer_types)


def windowed(config: Mapping[str, Any]) -> bool:
    """Whether any layer of a config.json dict attends over a sliding window (attention_windows)."""
    window, layer_types = attention_windows(config, str(config.get("model_type")),
                                            int(config.get("num_hidden_layers", 0)))
    return window is not None and (not layer_types or "sliding_attention" in layer_types)


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One NVIDIA GPU as the probe saw it; None where NVML could not say."""

    index: int
    name: str
    mem_total_bytes: int
    mem_free_bytes: int
    uuid: str = ""
    compute_capability: str = ""            # "9.0"
    utilization_pct: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None


@dataclass(frozen=True, slots=True)
class Speed:
    """What a box measured for one backend and dtype: a large matmul and a large copy, and what a decode step of
    this code costs beyond its FLOPs and bytes (the framework: Python, op dispatch, kernel launches). The planner
    prices a device by the same fields (placement.py derives them from what its box measured)."""

    backend: str              # "torch-cuda", "torch-cpu", "onnxruntime-cpu"
    dtype: str
    flops: float              # FLOP/s of a large matmul
    mem_bandwidth: float      # bytes/s of a large copy
    step_overhead_s: float | None = None     # per step, whatever its layers; None: not measured apart (the device's)
    layer_overhead_s: float | None = None    # per layer of a step; None: likewise
    decode_flops: float = 0.0        # FLOP/s of the layers of a decode step (small matmuls); 0: not measured
    decode_bandwidth: float = 0.0    # bytes/s a decode step of one sequence reads its weights at; 0: not measured


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What an agent's box offers, as it reports it on registration."""

    hostname: str
    cpu_model: str
    num_cpus: int
    ram_total_bytes: int
    ram_available_bytes: int
    gpus: tuple[GpuInfo, ...] = ()
    backends: tuple[str, ...] = ("torch-cpu",)
    speeds: tuple[Speed, ...] = ()
    site: str = ""              # where the box is (a building, a cloud region): the operator says
    tier: str = "edge"          # "edge" or "cloud"
    num_ranks: int = 1          # the most ranks a tensor-parallel stage here may have (its GPUs, or CPU ranks)
    dtype: str = ""             # the operator's choice for this agent's stages (--dtype); "" lets the planner pick
    cpu_bf16: bool = False      # the CPU computes bfloat16 natively (AMX or AVX512-BF16)
    num_threads: int = 0        # CPU threads this agent computes with (agents of one host share its num_cpus)
    runtime: str = ""           # the operator's choice of RUNTIMES for this agent's stages (--runtime): "" is torch;
                                # AUTO_RUNTIME lets the planner pick per stage, by the speeds measured of each

    @property
    def usable_mem_bytes(self) -> int:
        """Memory a stage may fill: free GPU memory if the box has GPUs, else available RAM."""
        if self.gpus:
            return sum(g.mem_free_bytes for g in self.gpus)
        return self.ram_available_bytes


@dataclass(frozen=True, slots=True)
class StageSpec:
    """A contiguous layer range [start_layer, end_layer) of one model, as one stage serves it."""

    model_id: str
    model_path: str
    start_layer: int
    end_layer: int
    num_layers: int
    dtype: str = "float32"
    device: str = "cpu"
    kv_block_size: int = 16
    tp_degree: int = 1          # ranks of the tensor-parallel group serving it; 1 = one process
    runtime: str = "torch"      # what computes its layers: "torch", or "onnxruntime" (kernels.models.onnx_stage)
    quantize: str = ""          # "int8": its projection matrices and LM head as int8 with per-row scales (torch or ORT)
    kv_cache_bytes: int = 0     # the KV cache its plan reserved for it, per rank; 0: the plan said nothing

    def __post_init__(self) -> None:
        if not 1 <= self.tp_degree <= MAX_TP_DEGREE:
            raise InvalidInput(f"stage tp_degree must be in 1..{MAX_TP_DEGREE}, got {self.tp_degree}")
        if not 1 <= self.kv_block_size <= MAX_KV_BLOCK_SIZE:
            raise InvalidInput(f"stage kv_block_size must be in 1..{MAX_KV_BLOCK_SIZE}, got {self.kv_block_size}")
        if not 0 <= self.start_layer < self.end_layer <= self.num_layers:
            raise InvalidInput(
                f"stage layer range [{self.start_layer}, {self.end_layer}) is not inside "
                f"[0, {self.num_layers})")
        if self.dtype not in DTYPES:
            raise InvalidInput(f"stage dtype {self.dtype!r} is not one of {DTYPES}")
        if not re.fullmatch(r"cpu|cuda(:\d{1,2})?", self.device):
            raise InvalidInput(f"stage device {self.device!r} is not cpu, cuda or cuda:N")
        if self.runtime not in RUNTIMES:
            raise InvalidInput(f"stage runtime {self.runtime!r} is not one of {RUNTIMES}")
        if self.quantize and self.quantize not in QUANTIZATIONS:
            raise InvalidInput(f"stage quantize {self.quantize!r} is not one of {QUANTIZATIONS} (or none)")
        if self.quantize and self.tp_degree > 1:
            raise InvalidInput("int8 weights are for single-process stages (tp_degree 1)")
        if not 0 <= self.kv_cache_bytes <= MAX_KV_CACHE_BYTES:
            raise InvalidInput(f"stage kv_cache_bytes must be in 0..{MAX_KV_CACHE_BYTES}, got {self.kv_cache_bytes}")

    @property
    def is_first(self) -> bool:
        return self.start_layer == 0

    @property
    def is_last(self) -> bool:
        return self.end_layer == self.num_layers


@dataclass(frozen=True, slots=True)
class Assignment:
    """An order to an agent: serve this stage under this id."""

    assignment_id: str
    stage: StageSpec


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the last stage picks a token; temperature 0 is greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidInput(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidInput(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidInput(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass(frozen=True, slots=True)
class TensorBlob:
    """A tensor as bytes: what the wire carries and kernels' codecs produce and consume."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes
    codec: str = "raw"
    scales: TensorBlob | None = field(default=None)


@dataclass(frozen=True, slots=True)
class Hop:
    """One stage of a route: where it listens, which assignment serves it there, the dtype it computes in
    (activations for it travel in that dtype; "" when unknown: the sender's own), and the codec of the link into it
    (HOP_CODECS: "" raw in that dtype; a dtype: raw in that one; "int8": int8 with per-token scales); the agent
    serving it ("" when unknown), and, when that agent sits behind NAT, the address its connections come from (a
    sender outside that NAT cannot dial it, and reaches it over WebRTC instead: fleet/wire/rtc.py)."""

    address: str
    assignment_id: str
    dtype: str = ""
    codec: str = ""
    agent_id: str = ""
    nat: str = ""


@dataclass(frozen=True, slots=True)
class SessionOpen:
    """Opens a session on a stage; `route` holds the hops after the receiving stage."""

    session_id: str
    assignment_id: str
    route: tuple[Hop, ...]
    origin: str
    sampling: SamplingParams
    traceparent: str = ""       # W3C trace context of the request; "" when it is not traced
    prompt_token_ids: tuple[int, ...] = ()
    max_cached_tokens: int = 0   # the fewest prompt tokens any stage so far holds in its prefix cache
    resume_from: str = ""        # a moving session: stages that hold it under this id keep its KV
    # The decode loop: the last stage feeds each sampled token to this first stage (None: to nobody) until
    # max_new_tokens are sampled (0: no limit) or one of stop_token_ids is.
    feed: Hop | None = None
    max_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def forwarded(self, cached_tokens: int) -> SessionOpen:
        """The open as the next hop must receive it, carrying this stage's cached-token count."""
        head, *rest = self.route
        return replace(self, assignment_id=head.assignment_id, route=tuple(rest),
                       max_cached_tokens=min(cached_tokens, self.max_cached_tokens))


@dataclass(frozen=True, slots=True)
class StepChunk:
    """One step of a session: its token ids at positions start_pos.. (every stage gets them)."""

    session_id: str
    step: int
    start_pos: int
    token_ids: tuple[int, ...] = ()
    sample: bool = False
    trace_id: str = ""          # 32 hex digits; "" when the request is not traced
    sent_unix_ns: int = 0       # when the origin sent it (0 on chunks inside a StepBatch)


@dataclass(frozen=True, slots=True)
class StepBatch:
    """A stage's step for the next one: chunks, and their hidden states as rows in chunk order."""

    chunks: tuple[StepChunk, ...]
    hidden: TensorBlob
    sent_unix_ns: int = 0       # when the sending stage finished computing it


@dataclass(frozen=True, slots=True)
class StepChunks:
    """The next decode step of several sessions, token ids only, fed by the last stage to the first in one message."""

    chunks: tuple[StepChunk, ...]


@dataclass(frozen=True, slots=True)
class SessionClose:
    session_id: str


@dataclass(frozen=True, slots=True)
class SessionHold:
    """Stops a session's decode loop after the token the pipeline is on (to move it while it is quiet)."""

    session_id: str


@dataclass(frozen=True, slots=True)
class KvLayout:
    """The shape of a stage's KV cache: a session's KV moves only between stages of equal layout."""

    model_id: str
    start_layer: int
    end_layer: int
    dtype: str
    block_size: int
    num_kv_heads: int
    head_dim: int

    def mismatch(self, other: KvLayout) -> str:
        """What differs from other ("block_size 4 here, 8 there; ..."); "" when nothing does."""
        mine, theirs = self._parts(), other._parts()
        return "; ".join(f"{name} {mine[name]} here, {theirs[name]} there" for name in mine
                         if mine[name] != theirs[name])

    def _parts(self) -> dict[str, str]:
        return {"model": repr(self.model_id), "layers": f"[{self.start_layer}, {self.end_layer})",
                "dtype": self.dtype, "block_size": str(self.block_size), "kv_heads": str(self.num_kv_heads),
                "head_dim": str(self.head_dim)}


@dataclass(frozen=True, slots=True)
class KvHeader:
    """The first message of a session's export: its state, and what the data pieces after it must be."""

    layout: KvLayout
    session_id: str
    token_ids: tuple[int, ...]  # every token id the session has, prompt first
    prompt_len: int
    num_computed: int           # positions with KV: the data holds exactly these
    kv: TensorBlob              # dtype and shape of the data ([2, layers, num_computed, kv heads, head dim]), no bytes
    num_bytes: int
    digest: bytes               # BLAKE2b (16 bytes) of the data


@dataclass(frozen=True, slots=True)
class KvPiece:
    """data[offset:offset + len(data)] of an export, with its CRC-32."""

    offset: int
    data: bytes
    crc32: int


@dataclass(frozen=True, slots=True)
class KvExportRequest:
    session_id: str
    assignment_id: str          # the exporting stage
    layout: KvLayout            # the importing stage's: the export is refused unless it is the exporter's
    wait_for_prefill: bool = False  # export once the session's prompt is computed there, not at once


@dataclass(frozen=True, slots=True)
class KvImportRequest:
    session_id: str
    assignment_id: str          # the importing stage
    source: Hop                 # the stage that holds the session now
    wait_for_prefill: bool = False  # ... or will, once it has computed the session's prompt


@dataclass(frozen=True, slots=True)
class KvImportSummary:
    num_tokens: int
    num_bytes: int
    num_pieces: int


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """What the last stage returns to the origin: a sampled token (or an embedding model's pooled vector), or the
    error that ended the session."""

    session_id: str
    step: int
    token_id: int = -1
    error: str = ""
    error_stage: str = ""
    opened: bool = False        # the answer to an open: every stage opened the session ...
    cached_tokens: int = 0      # ... and holds this many leading prompt tokens in its cache
    preempted: bool = False     # a stage ran out of KV blocks: the origin replays the session
    sent_unix_ns: int = 0       # when the last stage finished the step that produced it
    unreachable: str = ""       # with error: the address of the hop a stage lost (the origin replays)
    embedding: tuple[float, ...] = ()   # instead of a token (embedding models): the prompt's normalized vector
    held: bool = False          # the last token before a hold: the session is quiet on every stage now


STAGE_STATES = tuple(StageState)


@dataclass(frozen=True, slots=True)
class Registration:
    """An agent's first message on its control stream."""

    agent_id: str
    name: str
    stage_address: str
    capabilities: Capabilities
    held: tuple[Assignment, ...] = ()
    mesh: str = "default"
    metrics_address: str = ""   # host:port of the agent's Prometheus /metrics; "" if it serves none


@dataclass(frozen=True, slots=True)
class StageStatus:
    """An agent's report on one assignment: one of STAGE_STATES (less "assigned")."""

    assignment_id: str
    state: str
    error: str = ""
    param_bytes: int = 0


@dataclass(frozen=True, slots=True)
class StageLoad:
    """How busy one stage of an agent is."""

    assignment_id: str
    num_running: int            # sessions holding KV blocks
    num_waiting: int            # sessions with chunks queued
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_query_tokens: int = 0    # prompt tokens looked up in the prefix cache since the stage loaded
    prefix_hit_tokens: int = 0      # ... and found there

    @property
    def kv_usage(self) -> float:
        """Fraction of the stage's KV blocks in use (0 with no blocks)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True, slots=True)
class KvEvents:
    """What a stage's prefix cache gained (stored) and lost (evicted) since its last report, as block hashes
    (fleet.prefix); cleared: forget what it said before, stored is all it holds. The router's index feeds on them."""

    assignment_id: str
    block_size: int
    cleared: bool
    stored: tuple[bytes, ...]
    evicted: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class Telemetry:
    """What an agent reports with each heartbeat."""

    unix_s: float
    queue_depth: int = 0        # messages and chunks waiting for a step, all stages
    tokens_per_s: float = 0.0   # tokens its stages computed per second since the last heartbeat
    stages: tuple[StageLoad, ...] = ()
    gpus: tuple[GpuInfo, ...] = ()
    # CPU seconds the agent spends per token of a step beyond its layers: the serving path (messages in and out,
    # scheduling), measured over the last window of enough tokens; 0 until then
    serving_cpu_per_token_s: float = 0.0
    resting: str = ""           # why the owner's limits rest this agent (agent/owner_limits.py); "" = it serves


@dataclass(frozen=True, slots=True)
class Peer:
    """Another agent whose link this agent should measure."""

    agent_id: str
    address: str                # its Stage and Link services


@dataclass(frozen=True, slots=True)
class Release:
    """The coordinator to an agent: drop this stage and every session on it."""

    assignment_id: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    """The coordinator to an agent: exit (cleanly; a drained agent gets this)."""

    reason: str


@dataclass(frozen=True, slots=True)
class ProbeLinks:
    """The coordinator to an agent: measure your links to these peers and report them."""

    peers: tuple[Peer, ...]


@dataclass(frozen=True, slots=True)
class RtcOffer:
    """A WebRTC offer on its way through the coordinator: from the caller, peer_id names the callee; to the callee,
    the coordinator has set it to the caller (whose control stream it came on, so nobody can offer as another).
    cert_pem: the caller's mesh certificate, which is also its DTLS certificate (b"" in an insecure mesh)."""

    call_id: str
    peer_id: str
    sdp: str
    cert_pem: bytes = b""


@dataclass(frozen=True, slots=True)
class RtcAnswer:
    """The callee's answer to an RtcOffer (peer_id: the callee, as the coordinator relays it), or why it refused."""

    call_id: str
    peer_id: str
    sdp: str = ""
    cert_pem: bytes = b""
    error: str = ""


@dataclass(frozen=True, slots=True)
class LinkMeasurement:
    """A measured link from the reporting agent to a peer; error instead of figures when it failed."""

    peer_agent_id: str
    rtt_s: float = 0.0
    bandwidth_bytes_per_s: float = 0.0
    error: str = ""


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """An agent to the coordinator: it is alive, serves num_sessions sessions, and took this telemetry (or none)."""

    seq: int
    num_sessions: int = 0
    telemetry: Telemetry | None = None


@dataclass(frozen=True, slots=True)
class LinkReport:
    """An agent to the coordinator: its links to the peers a ProbeLinks named, as measured."""

    links: tuple[LinkMeasurement, ...]


@dataclass(frozen=True, slots=True)
class KvEventReport:
    """An agent to the coordinator: its stages' prefix-cache changes, one KvEvents per stage (or piece of one)."""

    reports: tuple[KvEvents, ...]


@dataclass(frozen=True, slots=True)
class Welcome:
    """The coordinator to an agent: registered as agent_id, heartbeat at this pace (sent again when the pace changes);
    nat: the address its connections come from when it is behind NAT ("": it is not)."""

    agent_id: str
    heartbeat_interval_s: float
    nat: str = ""


@dataclass(frozen=True, slots=True)
class RevokedSerials:
    """The coordinator to an agent: every certificate serial the mesh has revoked (the whole list, not a change)."""

    serials: frozenset[str]


# What the coordinator's domain code sends an agent over its control stream (the control service converts it).
ControlMessage = Assignment | Release | Shutdown | ProbeLinks
# Everything the coordinator sends an agent: the control service adds welcomes, revocations and relayed signalling.
CoordinatorMessage = Welcome | ControlMessage | RevokedSerials | RtcOffer | RtcAnswer
# Everything an agent sends the coordinator on its control stream, a Registration first.
AgentMessage = (Registration | Heartbeat | StageStatus | LinkReport | KvEventReport | WeightsProgress | RtcOffer
                | RtcAnswer)
