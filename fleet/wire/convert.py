"""The one converter between protobuf messages and fleet types; servicers call only these."""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Iterable

from stratamesh.fleet.enrollment import EnrollReply, EnrollRequest
from stratamesh.fleet.errors import InvalidAssignment, InvalidInput
from stratamesh.fleet.pki import MAX_PEM_BYTES, check_name
from stratamesh.fleet.prefix import HASH_BYTES
from stratamesh.fleet.boxes import Capabilities, GpuInfo, Peer, Registration, Speed, StageLoad, Telemetry
from stratamesh.fleet.control_messages import (AgentMessage, ControlMessage, CoordinatorMessage, Heartbeat,
                                               KvEventReport, LinkMeasurement, LinkReport, ProbeLinks, Release,
                                               RevokedSerials, RtcAnswer, RtcOffer, Shutdown, Welcome)
from stratamesh.fleet.kv import KvEvents, KvExportRequest, KvHeader, KvImportRequest, KvImportSummary, KvLayout, KvPiece
from stratamesh.fleet.sessions import (HOP_CODECS, MAX_LOGPROBS, Hop, Logprobs, SamplingParams, SessionClose,
                                       SessionHold, SessionOpen, SessionRewind, Speculation, StageMessage, StepBatch,
                                       StepChunk, StepChunks, TensorBlob, TokenEvent)
from stratamesh.fleet.stages import (AGENT_RUNTIMES, DTYPES, MAX_KV_BLOCK_SIZE, MAX_TP_DEGREE, Assignment, StageSpec,
                                     StageStatus)
from stratamesh.fleet.tracing import Span
from stratamesh.fleet.weights import WeightChunk, WeightFile, WeightManifest, WeightsProgress
from stratamesh.fleet.wire import mesh_pb2 as pb


_TRACE_ID = re.compile(r"[0-9a-f]{32}")
_TRACEPARENT = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_SERIAL = re.compile(r"[0-9a-f]{1,40}")
_SESSION_ID = re.compile(r"[\x21-\x7e]{1,128}")
_TOKEN_ID = re.compile(r"[0-9a-f]{8}")


# GpuInfo readings NVML may not give: None on our side, an unset proto3 optional on the wire.
_GPU_READINGS = ("utilization_pct", "temperature_c", "power_w", "power_limit_w")

OVERHEAD_LIMIT_S = 1.0      # a measured step or layer overhead past this is a broken probe, not a speed
MAX_EXPERTS = 1024          # experts a stage's heartbeat counts tokens for (DeepSeek-V3 and Qwen3 have 256 or 128)
MAX_REASON = 500            # characters of an agent's reason kept (why it rests): enough to read, not a flood


def gpu_to_pb(gpu: GpuInfo) -> pb.GpuInfo:
    readings = {name: getattr(gpu, name) for name in _GPU_READINGS if getattr(gpu, name) is not None}
    return pb.GpuInfo(index=gpu.index, name=gpu.name, mem_total_bytes=gpu.mem_total_bytes,
                      mem_free_bytes=gpu.mem_free_bytes, uuid=gpu.uuid,
                      compute_capability=gpu.compute_capability, **readings)


def gpu_from_pb(msg: pb.GpuInfo) -> GpuInfo:
    readings = {name: getattr(msg, name) if msg.HasField(name) else None for name in _GPU_READINGS}
    return GpuInfo(msg.index, msg.name, msg.mem_total_bytes, msg.mem_free_bytes, msg.uuid,
                   msg.compute_capability, **readings)


def capabilities_to_pb(caps: Capabilities) -> pb.Capabilities:
    return pb.Capabilities(
        hostname=caps.hostname, cpu_model=caps.cpu_model, num_cpus=caps.num_cpus,
        ram_total_bytes=caps.ram_total_bytes, ram_available_bytes=caps.ram_available_bytes,
        gpus=[gpu_to_pb(g) for g in caps.gpus],
        backends=list(caps.backends), site=caps.site, tier=caps.tier, num_ranks=caps.num_ranks,
        dtype=caps.dtype, cpu_bf16=caps.cpu_bf16, num_threads=caps.num_threads, runtime=caps.runtime,
        speeds=[pb.Speed(backend=s.backend, dtype=s.dtype, flops=s.flops, mem_bandwidth=s.mem_bandwidth,
                         step_overhead_s=s.step_overhead_s or 0.0, layer_overhead_s=s.layer_overhead_s or 0.0,
                         decode_flops=s.decode_flops, decode_bandwidth=s.decode_bandwidth)
                for s in caps.speeds])


def capabilities_from_pb(msg: pb.Capabilities) -> Capabilities:
    if msg.num_cpus < 0 or msg.ram_total_bytes < 0 or msg.ram_available_bytes < 0:
        raise InvalidInput("capabilities: num_cpus and memory sizes must be >= 0")
    if any(not (s.flops > 0 and s.mem_bandwidth > 0) for s in msg.speeds):
        raise InvalidInput("capabilities: speeds must have positive flops and mem_bandwidth")
    if any(not (0 <= s.step_overhead_s < OVERHEAD_LIMIT_S and 0 <= s.layer_overhead_s < OVERHEAD_LIMIT_S)
           for s in msg.speeds):
        raise InvalidInput(f"capabilities: speed overheads must be in [0, {OVERHEAD_LIMIT_S:g}) s")
    if any(not (0 <= s.decode_flops < math.inf and 0 <= s.decode_bandwidth < math.inf) for s in msg.speeds):
        raise InvalidInput("capabilities: decode_flops and decode_bandwidth must be finite and >= 0")
    if msg.num_threads < 0:
        raise InvalidInput("capabilities: num_threads must be >= 0")
    if msg.tier not in ("", "edge", "cloud"):
        raise InvalidInput(f"capabilities: tier {msg.tier!r} is not edge or cloud")
    if not 0 <= msg.num_ranks <= MAX_TP_DEGREE:
        raise InvalidInput(f"capabilities: num_ranks must be in 0..{MAX_TP_DEGREE}, got {msg.num_ranks}")
    _require_dtype(msg.dtype, "capabilities.dtype")
    if msg.runtime and msg.runtime not in AGENT_RUNTIMES:
        raise InvalidInput(f"capabilities.runtime {msg.runtime!r} is not one of {AGENT_RUNTIMES}")
    gpus = tuple(gpu_from_pb(g) for g in msg.gpus)
    speeds = tuple(Speed(s.backend, s.dtype, s.flops, s.mem_bandwidth, s.step_overhead_s, s.layer_overhead_s,
                             s.decode_flops, s.decode_bandwidth) for s in msg.speeds)
    return Capabilities(msg.hostname, msg.cpu_model, msg.num_cpus, msg.ram_total_bytes,
                        msg.ram_available_bytes, gpus, tuple(msg.backends), speeds, msg.site, msg.tier or "edge",
                        msg.num_ranks or 1, msg.dtype, msg.cpu_bf16, msg.num_threads, msg.runtime)


def _require_dtype(dtype: str, where: str) -> None:
    """InvalidInput unless dtype is one a stage computes in, or "" (not said)."""
    if dtype and dtype not in DTYPES:
        raise InvalidInput(f"{where} {dtype!r} is not one of {DTYPES}")


def stage_spec_to_pb(spec: StageSpec) -> pb.StageSpec:
    return pb.StageSpec(model_id=spec.model_id, model_path=spec.model_path,
                        start_layer=spec.start_layer, end_layer=spec.end_layer,
                        num_layers=spec.num_layers, dtype=spec.dtype, device=spec.device,
                        kv_block_size=spec.kv_block_size, tp_degree=spec.tp_degree, runtime=spec.runtime,
                        quantize=spec.quantize, kv_cache_bytes=spec.kv_cache_bytes, revision=spec.revision)


def stage_spec_from_pb(msg: pb.StageSpec) -> StageSpec:
    """A stage's spec; StageSpec checks its layer range, dtype, device, block size, tensor-parallel degree,
    runtime, quantization and KV cache."""
    return StageSpec(msg.model_id, msg.model_path, msg.start_layer, msg.end_layer, msg.num_layers,
                     msg.dtype or "float32", msg.device or "cpu", msg.kv_block_size or 16, msg.tp_degree or 1,
                     msg.runtime or "torch", msg.quantize, msg.kv_cache_bytes, msg.revision)


def assignment_to_pb(assignment: Assignment) -> pb.Assignment:
    return pb.Assignment(assignment_id=assignment.assignment_id,
                         stage=stage_spec_to_pb(assignment.stage))


def assignment_from_pb(msg: pb.Assignment) -> Assignment:
    if not msg.assignment_id:
        raise InvalidInput("assignment.assignment_id is empty")
    return Assignment(msg.assignment_id, stage_spec_from_pb(msg.stage))


def sampling_to_pb(params: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                             seed=params.seed or 0, has_seed=params.seed is not None, min_p=params.min_p,
                             presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                             repetition_penalty=params.repetition_penalty,
                             logit_bias=[pb.LogitBias(token_id=t, bias=b) for t, b in params.logit_bias],
                             min_tokens=params.min_tokens, stop_token_ids=list(params.stop_token_ids),
                             logprobs=params.logprobs or 0, has_logprobs=params.logprobs is not None,
                             prompt_logprobs=params.prompt_logprobs or 0,
                             has_prompt_logprobs=params.prompt_logprobs is not None, grammar=params.grammar)


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p or 1.0,
                          seed=msg.seed if msg.has_seed else None, min_p=msg.min_p,
                          presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
                          repetition_penalty=msg.repetition_penalty or 1.0,
                          logit_bias=tuple((b.token_id, b.bias) for b in msg.logit_bias), min_tokens=msg.min_tokens,
                          stop_token_ids=tuple(msg.stop_token_ids),
                          logprobs=msg.logprobs if msg.has_logprobs else None,
                          prompt_logprobs=msg.prompt_logprobs if msg.has_prompt_logprobs else None,
                          grammar=msg.grammar)


def tensor_to_pb(blob: TensorBlob) -> pb.Tensor:
    msg = pb.Tensor(dtype=blob.dtype, shape=list(blob.shape), data=blob.data, codec=blob.codec)
    if blob.scales is not None:
        msg.scales.CopyFrom(tensor_to_pb(blob.scales))
    return msg


def tensor_from_pb(msg: pb.Tensor) -> TensorBlob:
    if any(d < 0 for d in msg.shape):
        raise InvalidInput(f"tensor.shape has a negative dimension: {list(msg.shape)}")
    scales = tensor_from_pb(msg.scales) if msg.HasField("scales") else None
    return TensorBlob(msg.dtype, tuple(msg.shape), msg.data, msg.codec or "raw", scales)


def stage_message_to_pb(message: StageMessage, to: str = "") -> pb.StageMessage:
    """The wire form of a data-plane message; to: the assignment it is for ("": its session's stage there)."""
    msg = _stage_message_to_pb(message)
    if to:
        msg.to = to
    return msg


def _stage_message_to_pb(message: StageMessage) -> pb.StageMessage:
    match message:
        case SessionOpen():
            return pb.StageMessage(open=pb.SessionOpen(
                session_id=message.session_id, assignment_id=message.assignment_id,
                route=[h.address for h in message.route],
                route_assignments=[h.assignment_id for h in message.route],
                route_dtypes=[h.dtype for h in message.route],
                route_codecs=_if_any([h.codec for h in message.route]),
                route_agents=_if_any([h.agent_id for h in message.route]),
                route_nats=_if_any([h.nat for h in message.route]),
                feed_agent=message.feed.agent_id if message.feed else "",
                feed_nat=message.feed.nat if message.feed else "",
                origin=message.origin, sampling=sampling_to_pb(message.sampling),
                traceparent=message.traceparent, prompt_token_ids=list(message.prompt_token_ids),
                max_cached_tokens=message.max_cached_tokens, resume_from=message.resume_from,
                feed_address=message.feed.address if message.feed else "",
                feed_assignment=message.feed.assignment_id if message.feed else "",
                max_new_tokens=message.max_new_tokens, stop_token_ids=list(message.stop_token_ids),
                output_start=message.output_start, speculation=_speculation_to_pb(message.speculation),
                revision=message.revision, follow_runs=message.follow_runs))
        case StepChunk():
            return pb.StageMessage(chunk=_chunk_to_pb(message))
        case StepChunks():
            return pb.StageMessage(chunks=pb.StepChunks(chunks=[_chunk_to_pb(c) for c in message.chunks]))
        case StepBatch():
            return pb.StageMessage(batch=pb.StepBatch(chunks=[_chunk_to_pb(c) for c in message.chunks],
                                                      hidden=tensor_to_pb(message.hidden),
                                                      sent_unix_ns=message.sent_unix_ns))
        case SessionClose():
            return pb.StageMessage(close=pb.SessionClose(session_id=message.session_id))
        case SessionHold():
            return pb.StageMessage(hold=pb.SessionHold(session_id=message.session_id))
        case SessionRewind():
            return pb.StageMessage(rewind=pb.SessionRewind(session_id=message.session_id, position=message.position))
    raise TypeError(f"not a stage message: {type(message).__name__}")


def stage_message_from_pb(msg: pb.StageMessage) -> StageMessage:
    """Parses and validates one data-plane message; raises InvalidInput naming the bad field."""
    kind = msg.WhichOneof("kind")
    if kind == "open":
        return _open_from_pb(msg.open)
    if kind == "chunk":
        return _chunk_from_pb(msg.chunk)
    if kind == "batch":
        return _batch_from_pb(msg.batch)
    if kind == "chunks":
        if not msg.chunks.chunks:
            raise InvalidInput("chunks.chunks is empty")
        return StepChunks(tuple(_chunk_from_pb(c) for c in msg.chunks.chunks))
    if kind == "close":
        _require_session_id(msg.close.session_id, "close")
        return SessionClose(msg.close.session_id)
    if kind == "hold":
        _require_session_id(msg.hold.session_id, "hold")
        return SessionHold(msg.hold.session_id)
    if kind == "rewind":
        _require_session_id(msg.rewind.session_id, "rewind")
        if msg.rewind.position <= 0:
            raise InvalidInput("rewind.position must be > 0")
        return SessionRewind(msg.rewind.session_id, msg.rewind.position)
    raise InvalidInput("stage message has no kind set")


def session_ids_of(msg: pb.StageMessage) -> list[str]:
    """The session ids a data-plane message names, read even from one that failed validation (its sessions end)."""
    kind = msg.WhichOneof("kind")
    if kind in ("batch", "chunks"):
        return [c.session_id for c in getattr(msg, kind).chunks]
    return [getattr(msg, kind).session_id] if kind else []


def _require_session_id(session_id: str, where: str) -> None:
    if not _SESSION_ID.fullmatch(session_id):
        raise InvalidInput(f"{where}.session_id must be 1..128 printable ASCII characters without spaces")


def _open_from_pb(msg: pb.SessionOpen) -> SessionOpen:
    _require_session_id(msg.session_id, "open")
    if len(msg.route) != len(msg.route_assignments):
        raise InvalidInput("open.route and open.route_assignments differ in length")
    if msg.route_dtypes and len(msg.route_dtypes) != len(msg.route):
        raise InvalidInput("open.route_dtypes must be empty or as long as open.route")
    for dtype in msg.route_dtypes:
        _require_dtype(dtype, "open.route_dtypes[]")
    if msg.route_codecs and len(msg.route_codecs) != len(msg.route):
        raise InvalidInput("open.route_codecs must be empty or as long as open.route")
    if bad := [c for c in msg.route_codecs if c not in HOP_CODECS]:
        raise InvalidInput(f"open.route_codecs[] {bad[0]!r} is not one of {HOP_CODECS}")
    for name in ("route_agents", "route_nats"):
        if getattr(msg, name) and len(getattr(msg, name)) != len(msg.route):
            raise InvalidInput(f"open.{name} must be empty or as long as open.route")
    for agent_id in (*msg.route_agents, msg.feed_agent):
        if agent_id:
            check_name(agent_id)
    if not msg.origin:
        raise InvalidInput("open.origin is empty")
    if msg.max_cached_tokens < 0 or msg.max_cached_tokens > len(msg.prompt_token_ids):
        raise InvalidInput("open.max_cached_tokens must lie in [0, len(prompt_token_ids)]")
    if msg.traceparent and not _TRACEPARENT.fullmatch(msg.traceparent):
        raise InvalidInput("open.traceparent is not a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>)")
    if msg.resume_from:
        _require_session_id(msg.resume_from, "open.resume_from")
    empty = [""] * len(msg.route)
    route = tuple(Hop(*hop) for hop in zip(msg.route, msg.route_assignments, msg.route_dtypes or empty,
                                          msg.route_codecs or empty, msg.route_agents or empty,
                                          msg.route_nats or empty, strict=True))
    speculation = _speculation_from_pb(msg.speculation) if msg.HasField("speculation") else None
    return SessionOpen(msg.session_id, msg.assignment_id, route, msg.origin, sampling_from_pb(msg.sampling),
                       msg.traceparent, tuple(msg.prompt_token_ids), msg.max_cached_tokens, msg.resume_from,
                       _feed_from_pb(msg), msg.max_new_tokens, tuple(msg.stop_token_ids), msg.output_start,
                       speculation, msg.revision, msg.follow_runs and speculation is not None)


def _speculation_to_pb(speculation: Speculation | None) -> pb.Speculation | None:
    if speculation is None:
        return None
    return pb.Speculation(method=speculation.method, num_speculative_tokens=speculation.num_speculative_tokens,
                          prompt_lookup_min=speculation.prompt_lookup_min,
                          prompt_lookup_max=speculation.prompt_lookup_max, model=speculation.model)


def _speculation_from_pb(msg: pb.Speculation) -> Speculation:
    """InvalidInput (from Speculation's checks) names what is wrong."""
    return Speculation(msg.method, msg.num_speculative_tokens, msg.prompt_lookup_min, msg.prompt_lookup_max,
                       msg.model)


def _if_any(values: list[str]) -> list[str]:
    """values, or none at all when every one is "" (the message stays as it was before the field)."""
    return values if any(values) else []


def _feed_from_pb(msg: pb.SessionOpen) -> Hop | None:
    """The first stage a last stage feeds tokens to, with the open's limits checked; None without one."""
    if msg.max_new_tokens < 0 or any(t < 0 for t in msg.stop_token_ids):
        raise InvalidInput("open.max_new_tokens and open.stop_token_ids must be >= 0")
    if not msg.feed_address:
        return None
    _require_address(msg.feed_address, "open.feed_address")
    return Hop(msg.feed_address, msg.feed_assignment, agent_id=msg.feed_agent, nat=msg.feed_nat)


def _chunk_to_pb(chunk: StepChunk) -> pb.StepChunk:
    return pb.StepChunk(session_id=chunk.session_id, step=chunk.step, start_pos=chunk.start_pos,
                        token_ids=list(chunk.token_ids), sample=chunk.sample, trace_id=chunk.trace_id,
                        sent_unix_ns=chunk.sent_unix_ns, num_draft=chunk.num_draft, pending_from=chunk.pending_from)


def _chunk_from_pb(msg: pb.StepChunk) -> StepChunk:
    _require_session_id(msg.session_id, "chunk")
    if msg.start_pos < 0 or msg.step < 0:
        raise InvalidInput("chunk.start_pos and chunk.step must be >= 0")
    if not msg.token_ids:
        raise InvalidInput("chunk.token_ids is empty")
    if msg.trace_id and not _TRACE_ID.fullmatch(msg.trace_id):
        raise InvalidInput("chunk.trace_id must be 32 lowercase hex digits or empty")
    if msg.sent_unix_ns < 0:
        raise InvalidInput("chunk.sent_unix_ns must be >= 0")
    if not 0 <= msg.num_draft < len(msg.token_ids) or (msg.num_draft and not msg.sample):
        raise InvalidInput("chunk.num_draft must be in [0, len(token_ids)) and only on a chunk that samples")
    if not 0 <= msg.pending_from <= msg.start_pos or (msg.pending_from and not msg.sample):
        raise InvalidInput("chunk.pending_from must be in [0, start_pos] and only on a chunk that samples")
    return StepChunk(msg.session_id, msg.step, msg.start_pos, tuple(msg.token_ids), msg.sample,
                     msg.trace_id, msg.sent_unix_ns, msg.num_draft, msg.pending_from)


def _batch_from_pb(msg: pb.StepBatch) -> StepBatch:
    chunks = tuple(_chunk_from_pb(c) for c in msg.chunks)
    if not chunks:
        raise InvalidInput("batch.chunks is empty")
    if not msg.HasField("hidden"):
        raise InvalidInput("batch.hidden is missing")
    hidden = tensor_from_pb(msg.hidden)
    num_rows = sum(len(c.token_ids) for c in chunks)
    if len(hidden.shape) != 2 or hidden.shape[0] != num_rows:
        raise InvalidInput(f"batch.hidden has shape {list(hidden.shape)}, expected [{num_rows}, hidden]")
    if msg.sent_unix_ns < 0:
        raise InvalidInput("batch.sent_unix_ns must be >= 0")
    return StepBatch(chunks, hidden, msg.sent_unix_ns)


def token_batch_to_pb(events: list[TokenEvent]) -> pb.TokenBatch:
    return pb.TokenBatch(events=[_token_event_to_pb(e) for e in events])


def _token_event_to_pb(e: TokenEvent) -> pb.TokenEvent:
    msg = pb.TokenEvent(session_id=e.session_id, step=e.step, token_id=e.token_id, error=e.error,
                        error_stage=e.error_stage, opened=e.opened, cached_tokens=e.cached_tokens,
                        preempted=e.preempted, sent_unix_ns=e.sent_unix_ns, unreachable=e.unreachable, held=e.held)
    if e.embedding:
        msg.embedding.CopyFrom(vector_to_pb(e.embedding))
    if e.logprobs is not None:
        msg.logprobs.CopyFrom(_logprobs_to_pb(e.logprobs))
    msg.prompt_logprobs.extend(_logprobs_to_pb(lp) for lp in e.prompt_logprobs)
    return msg


def _logprobs_to_pb(lp: Logprobs) -> pb.Logprobs:
    return pb.Logprobs(token_id=lp.token_id, logprob=lp.logprob, top_ids=[t for t, _ in lp.top],
                       top_logprobs=[v for _, v in lp.top])


def _logprobs_from_pb(msg: pb.Logprobs) -> Logprobs:
    if len(msg.top_ids) != len(msg.top_logprobs) or len(msg.top_ids) > MAX_LOGPROBS:
        raise InvalidInput(f"token_event.logprobs has {len(msg.top_ids)} top ids and {len(msg.top_logprobs)} "
                           f"log-probabilities (equal, at most {MAX_LOGPROBS})")
    return Logprobs(msg.token_id, msg.logprob, tuple(zip(msg.top_ids, msg.top_logprobs, strict=True)))


def token_event_from_pb(msg: pb.TokenEvent) -> TokenEvent:
    _require_session_id(msg.session_id, "token_event")
    if msg.cached_tokens < 0 or msg.sent_unix_ns < 0:
        raise InvalidInput("token_event.cached_tokens and token_event.sent_unix_ns must be >= 0")
    embedding = vector_from_pb(msg.embedding, "token_event.embedding") if msg.HasField("embedding") else ()
    return TokenEvent(msg.session_id, msg.step, msg.token_id, msg.error, msg.error_stage,
                      msg.opened, msg.cached_tokens, msg.preempted, msg.sent_unix_ns, msg.unreachable, embedding,
                      msg.held, _logprobs_from_pb(msg.logprobs) if msg.HasField("logprobs") else None,
                      tuple(_logprobs_from_pb(lp) for lp in msg.prompt_logprobs))


def vector_to_pb(vector: tuple[float, ...]) -> pb.Tensor:
    """A vector of floats as a raw float32 Tensor [n] (little-endian, as the activation codec writes it)."""
    return pb.Tensor(dtype="float32", shape=[len(vector)], data=struct.pack(f"<{len(vector)}f", *vector),
                     codec="raw")


def vector_from_pb(msg: pb.Tensor, where: str) -> tuple[float, ...]:
    """The floats of a raw float32 Tensor [n], n >= 1; InvalidInput naming where otherwise."""
    shape = list(msg.shape)
    if msg.dtype != "float32" or (msg.codec or "raw") != "raw" or len(shape) != 1 or shape[0] < 1:
        raise InvalidInput(f"{where} must be a raw float32 vector [n], got {msg.dtype} {msg.codec or 'raw'} {shape}")
    if len(msg.data) != 4 * shape[0]:
        raise InvalidInput(f"{where}.data holds {len(msg.data)} bytes, shape {shape} needs {4 * shape[0]}")
    return struct.unpack(f"<{shape[0]}f", msg.data)


def spans_to_pb(spans: list[Span]) -> pb.TraceSpans:
    return pb.TraceSpans(spans=[
        pb.SpanData(name=s.name, trace_id=s.trace_id, span_id=s.span_id, parent_span_id=s.parent_span_id,
                    start_unix_ns=s.start_unix_ns, end_unix_ns=s.end_unix_ns, attributes=dict(s.attributes))
        for s in spans])


def spans_from_pb(msg: pb.TraceSpans) -> list[Span]:
    return [Span(s.name, s.trace_id, s.span_id, s.parent_span_id, s.start_unix_ns, s.end_unix_ns,
                 dict(s.attributes)) for s in msg.spans]


# ---------------------------------------------------------------- control plane

_STATE_TO_PB = {"loading": pb.StageStatus.LOADING, "ready": pb.StageStatus.READY,
                "failed": pb.StageStatus.FAILED, "released": pb.StageStatus.RELEASED}
_STATE_FROM_PB = {v: k for k, v in _STATE_TO_PB.items()}


def registration_to_pb(reg: Registration) -> pb.AgentMessage:
    return pb.AgentMessage(register=pb.Register(
        agent_id=reg.agent_id, name=reg.name, stage_address=reg.stage_address,
        capabilities=capabilities_to_pb(reg.capabilities),
        held=[assignment_to_pb(a) for a in reg.held], mesh=reg.mesh, metrics_address=reg.metrics_address,
        software_version=reg.software_version, protocol_version=reg.protocol_version))


def registration_from_pb(msg: pb.Register) -> Registration:
    if not msg.agent_id or len(msg.agent_id) > 64:
        raise InvalidInput("register.agent_id must be 1..64 characters")
    _require_address(msg.stage_address, "register.stage_address")
    if msg.metrics_address:
        _require_address(msg.metrics_address, "register.metrics_address")
    return Registration(msg.agent_id, msg.name or msg.agent_id, msg.stage_address,
                        capabilities_from_pb(msg.capabilities),
                        tuple(assignment_from_pb(a) for a in msg.held), msg.mesh or "default",
                        msg.metrics_address, msg.software_version[:MAX_REASON], msg.protocol_version)


def _require_address(address: str, where: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInput(f"{where} {address!r} is not host:port")


def heartbeat_to_pb(seq: int, num_sessions: int, telemetry: Telemetry | None = None) -> pb.AgentMessage:
    message = pb.Heartbeat(seq=seq, num_sessions=num_sessions)
    if telemetry is not None:
        message.telemetry.CopyFrom(telemetry_to_pb(telemetry))
    return pb.AgentMessage(heartbeat=message)


def telemetry_to_pb(t: Telemetry) -> pb.Telemetry:
    return pb.Telemetry(
        unix_s=t.unix_s, queue_depth=t.queue_depth, tokens_per_s=t.tokens_per_s,
        stages=[pb.StageLoad(assignment_id=s.assignment_id, num_running=s.num_running, num_waiting=s.num_waiting,
                             kv_blocks_used=s.kv_blocks_used, kv_blocks_total=s.kv_blocks_total,
                             prefix_query_tokens=s.prefix_query_tokens, prefix_hit_tokens=s.prefix_hit_tokens,
                             decode_step_s=s.decode_step_s, decode_roofline=s.decode_roofline,
                             spec_draft_tokens=s.spec_draft_tokens, spec_accepted_tokens=s.spec_accepted_tokens,
                             expert_tokens=s.expert_tokens, expert_imbalance=s.expert_imbalance)
                for s in t.stages],
        gpus=[gpu_to_pb(g) for g in t.gpus], serving_cpu_per_token_s=t.serving_cpu_per_token_s, resting=t.resting,
        limits_near=t.limits_near)


def telemetry_from_pb(msg: pb.Telemetry) -> Telemetry:
    """A heartbeat's telemetry; InvalidInput for negative counts or more blocks used than held."""
    if msg.queue_depth < 0 or not msg.tokens_per_s >= 0 or not 0 <= msg.serving_cpu_per_token_s < math.inf \
            or not 0 <= msg.limits_near < math.inf:
        raise InvalidInput("telemetry.queue_depth, tokens_per_s, serving_cpu_per_token_s and limits_near must be "
                           ">= 0")
    stages = []
    for s in msg.stages:
        counts = (s.num_running, s.num_waiting, s.kv_blocks_used, s.kv_blocks_total, s.prefix_query_tokens,
                  s.prefix_hit_tokens)
        spec = (s.spec_draft_tokens, s.spec_accepted_tokens)
        if (min(counts + spec) < 0 or s.kv_blocks_used > s.kv_blocks_total
                or s.prefix_hit_tokens > s.prefix_query_tokens or s.spec_accepted_tokens > s.spec_draft_tokens):
            raise InvalidInput(f"telemetry.stages[{s.assignment_id!r}] has inconsistent counts {counts + spec}")
        if not (0 <= s.decode_step_s < math.inf and 0 <= s.decode_roofline < math.inf
                and 0 <= s.expert_imbalance < math.inf):
            raise InvalidInput(f"telemetry.stages[{s.assignment_id!r}]: decode_step_s, decode_roofline and "
                               "expert_imbalance must be finite and >= 0")
        if len(s.expert_tokens) > MAX_EXPERTS or min(s.expert_tokens, default=0) < 0:
            raise InvalidInput(f"telemetry.stages[{s.assignment_id!r}]: expert_tokens must be at most {MAX_EXPERTS} "
                               "counts >= 0")
        stages.append(StageLoad(s.assignment_id, *counts, s.decode_step_s, s.decode_roofline, *spec,
                                tuple(s.expert_tokens), s.expert_imbalance))
    return Telemetry(msg.unix_s, msg.queue_depth, msg.tokens_per_s, tuple(stages),
                     tuple(gpu_from_pb(g) for g in msg.gpus), msg.serving_cpu_per_token_s, msg.resting[:MAX_REASON],
                     msg.limits_near)


def link_report_to_pb(links: list[LinkMeasurement]) -> pb.AgentMessage:
    return pb.AgentMessage(links=pb.LinkReport(links=[
        pb.LinkMeasurement(peer_agent_id=m.peer_agent_id, rtt_s=m.rtt_s,
                           bandwidth_bytes_per_s=m.bandwidth_bytes_per_s, error=m.error) for m in links]))


def link_report_from_pb(msg: pb.LinkReport) -> list[LinkMeasurement]:
    """An agent's link measurements; InvalidInput for a missing peer or a figure that is not a positive number."""
    links = []
    for m in msg.links:
        if not m.peer_agent_id:
            raise InvalidInput("links[].peer_agent_id is empty")
        if not m.error and not (0 < m.rtt_s < 3600 and 0 < m.bandwidth_bytes_per_s < 1e15):
            raise InvalidInput(f"links[{m.peer_agent_id!r}]: rtt_s and bandwidth_bytes_per_s must be positive "
                               f"and finite, got {m.rtt_s}, {m.bandwidth_bytes_per_s}")
        links.append(LinkMeasurement(m.peer_agent_id, m.rtt_s, m.bandwidth_bytes_per_s, m.error))
    return links


def kv_events_to_pb(reports: Iterable[KvEvents]) -> pb.AgentMessage:
    return pb.AgentMessage(kv_events=pb.KvEventReport(stages=[
        pb.KvEvents(assignment_id=e.assignment_id, block_size=e.block_size, cleared=e.cleared, stored=e.stored,
                    evicted=e.evicted) for e in reports]))


def kv_events_from_pb(msg: pb.KvEventReport) -> list[KvEvents]:
    """The stages' prefix-cache changes; InvalidInput for a missing assignment, a bad block size or a hash that is
    not one."""
    reports = []
    for e in msg.stages:
        if not e.assignment_id:
            raise InvalidInput("kv_events.stages[].assignment_id is empty")
        if not 0 < e.block_size <= MAX_KV_BLOCK_SIZE:
            raise InvalidInput(f"kv_events[{e.assignment_id!r}]: block_size must be in 1..{MAX_KV_BLOCK_SIZE}")
        if any(len(h) != HASH_BYTES for h in (*e.stored, *e.evicted)):
            raise InvalidInput(f"kv_events[{e.assignment_id!r}]: block hashes are {HASH_BYTES} bytes")
        reports.append(KvEvents(e.assignment_id, e.block_size, e.cleared, tuple(e.stored), tuple(e.evicted)))
    return reports


def weights_progress_to_pb(progress: WeightsProgress) -> pb.AgentMessage:
    p = progress
    return pb.AgentMessage(weights_progress=pb.WeightsProgress(
        assignment_id=p.assignment_id, fetched_bytes=p.fetched_bytes, reused_bytes=p.reused_bytes,
        total_bytes=p.total_bytes, tensor_bytes=p.tensor_bytes, done=p.done, source=p.source,
        num_corrupt=p.num_corrupt))


def weights_progress_from_pb(msg: pb.WeightsProgress) -> WeightsProgress:
    if not msg.assignment_id:
        raise InvalidInput("weights_progress.assignment_id is empty")
    return WeightsProgress(msg.assignment_id, msg.fetched_bytes, msg.reused_bytes, msg.total_bytes,
                           msg.tensor_bytes, msg.done, msg.source[:MAX_REASON], msg.num_corrupt)


def weight_manifest_request_to_pb(model_id: str, tensor_names: Iterable[str],
                                  agent_id: str) -> pb.WeightManifestRequest:
    return pb.WeightManifestRequest(model_id=model_id, tensor_names=list(tensor_names), agent_id=agent_id)


def weight_manifest_request_from_pb(msg: pb.WeightManifestRequest) -> tuple[str, tuple[str, ...], str]:
    """(model id, tensor names, asking agent's id)."""
    if not msg.model_id:
        raise InvalidInput("weight_manifest_request.model_id is empty")
    return msg.model_id, tuple(msg.tensor_names), msg.agent_id


def _weight_chunk_to_pb(c: WeightChunk) -> pb.WeightChunk:
    return pb.WeightChunk(file=c.file, offset=c.offset, length=c.length, sha256=c.sha256)


def _weight_chunks_from_pb(chunks: Iterable[pb.WeightChunk]) -> tuple[WeightChunk, ...]:
    return tuple(WeightChunk(c.file, c.offset, c.length, c.sha256) for c in chunks)


def weight_manifest_to_pb(m: WeightManifest) -> pb.WeightManifest:
    return pb.WeightManifest(model_id=m.model_id, revision=m.revision,
                             files=[pb.WeightFile(name=f.name, size=f.size) for f in m.files],
                             chunks=[_weight_chunk_to_pb(c) for c in m.chunks], tensor_bytes=m.tensor_bytes,
                             sources=list(m.sources))


def weight_manifest_from_pb(msg: pb.WeightManifest) -> WeightManifest:
    for i, address in enumerate(msg.sources):
        _require_address(address, f"weight_manifest.sources[{i}]")
    return WeightManifest(msg.model_id, msg.revision, tuple(WeightFile(f.name, f.size) for f in msg.files),
                          _weight_chunks_from_pb(msg.chunks), msg.tensor_bytes, tuple(msg.sources))


def weight_fetch_to_pb(model_id: str, revision: str, chunks: Iterable[WeightChunk]) -> pb.WeightFetch:
    return pb.WeightFetch(model_id=model_id, revision=revision, chunks=[_weight_chunk_to_pb(c) for c in chunks])


def weight_fetch_from_pb(msg: pb.WeightFetch) -> tuple[str, str, tuple[WeightChunk, ...]]:
    """(model id, revision, the chunks asked for)."""
    if not msg.model_id:
        raise InvalidInput("weight_fetch.model_id is empty")
    if not re.fullmatch(r"[0-9a-f]{64}", msg.revision):   # it names a folder on the server: hex only
        raise InvalidInput("weight_fetch.revision is not a hex sha256")
    return msg.model_id, msg.revision, _weight_chunks_from_pb(msg.chunks)


def weight_data_to_pb(index: int, data: bytes | None) -> pb.WeightData:
    return pb.WeightData(index=index, data=data or b"", missing=data is None)


def probe_links_to_pb(peers: list[Peer]) -> pb.CoordinatorMessage:
    return pb.CoordinatorMessage(probe_links=pb.ProbeLinks(
        peers=[pb.Peer(agent_id=p.agent_id, address=p.address) for p in peers]))


def probe_links_from_pb(msg: pb.ProbeLinks) -> list[Peer]:
    for p in msg.peers:
        _require_address(p.address, f"probe_links.peers[{p.agent_id!r}].address")
    return [Peer(p.agent_id, p.address) for p in msg.peers]


def stage_status_to_pb(status: StageStatus) -> pb.AgentMessage:
    return pb.AgentMessage(stage_status=pb.StageStatus(
        assignment_id=status.assignment_id, state=_STATE_TO_PB[status.state],
        error=status.error, param_bytes=status.param_bytes))


def stage_status_from_pb(msg: pb.StageStatus) -> StageStatus:
    if msg.state not in _STATE_FROM_PB:
        raise InvalidInput(f"stage_status.state {msg.state} is not a known state")
    return StageStatus(msg.assignment_id, _STATE_FROM_PB[msg.state], msg.error, msg.param_bytes)


def welcome_to_pb(agent_id: str, heartbeat_interval_s: float, nat: str = "") -> pb.CoordinatorMessage:
    return pb.CoordinatorMessage(welcome=pb.Welcome(agent_id=agent_id,
                                                    heartbeat_interval_s=heartbeat_interval_s, nat=nat))


def assign_to_pb(assignment: Assignment) -> pb.CoordinatorMessage:
    return pb.CoordinatorMessage(assign=assignment_to_pb(assignment))


def release_to_pb(assignment_id: str) -> pb.CoordinatorMessage:
    return pb.CoordinatorMessage(release=pb.Release(assignment_id=assignment_id))


def control_message_to_pb(message: ControlMessage) -> pb.CoordinatorMessage:
    """What the coordinator's domain code sends an agent, as the control stream carries it."""
    match message:
        case Assignment():
            return assign_to_pb(message)
        case Release(assignment_id):
            return release_to_pb(assignment_id)
        case Shutdown(reason):
            return shutdown_to_pb(reason)
        case ProbeLinks(peers):
            return probe_links_to_pb(list(peers))
    raise TypeError(f"not a control message: {message!r}")


def coordinator_message_to_pb(message: CoordinatorMessage) -> pb.CoordinatorMessage:
    """Anything the coordinator sends an agent, as the control stream carries it."""
    match message:
        case Welcome(agent_id, heartbeat_interval_s, nat):
            return welcome_to_pb(agent_id, heartbeat_interval_s, nat)
        case RevokedSerials(serials):
            return revocations_to_pb(serials)
        case RtcOffer():
            return pb.CoordinatorMessage(rtc_offer=rtc_offer_to_pb(message))
        case RtcAnswer():
            return pb.CoordinatorMessage(rtc_answer=rtc_answer_to_pb(message))
        case Assignment() | Release() | Shutdown() | ProbeLinks():
            return control_message_to_pb(message)
    raise TypeError(f"not a coordinator message: {message!r}")


def coordinator_message_from_pb(msg: pb.CoordinatorMessage) -> CoordinatorMessage:
    """Parses and validates one message the coordinator sent an agent; raises InvalidInput naming the bad field
    (InvalidAssignment, naming the assignment too, for an assign)."""
    match msg.WhichOneof("kind"):
        case "welcome":
            return _welcome_from_pb(msg.welcome)
        case "assign":
            return _assign_from_pb(msg.assign)
        case "release":
            if not msg.release.assignment_id:
                raise InvalidInput("release.assignment_id is empty")
            return Release(msg.release.assignment_id)
        case "probe_links":
            return ProbeLinks(tuple(probe_links_from_pb(msg.probe_links)))
        case "shutdown":
            return Shutdown(msg.shutdown.reason)
        case "revocations":
            return RevokedSerials(revocations_from_pb(msg.revocations))
        case "rtc_offer":
            return rtc_offer_from_pb(msg.rtc_offer)
        case "rtc_answer":
            return rtc_answer_from_pb(msg.rtc_answer)
    raise InvalidInput("coordinator message has no kind set")


def _welcome_from_pb(msg: pb.Welcome) -> Welcome:
    if not 0 <= msg.heartbeat_interval_s < math.inf:
        raise InvalidInput(f"welcome.heartbeat_interval_s must be finite and >= 0, got {msg.heartbeat_interval_s}")
    return Welcome(msg.agent_id, msg.heartbeat_interval_s, msg.nat)


def _assign_from_pb(msg: pb.Assignment) -> Assignment:
    """The assignment; InvalidAssignment, which names it, when it fails validation (its agent reports it failed)."""
    try:
        return assignment_from_pb(msg)
    except InvalidInput as exc:
        raise InvalidAssignment(msg.assignment_id, str(exc)) from exc


def agent_message_to_pb(message: AgentMessage) -> pb.AgentMessage:
    """Anything an agent sends the coordinator, as the control stream carries it."""
    match message:
        case Registration():
            return registration_to_pb(message)
        case Heartbeat(seq, num_sessions, telemetry):
            return heartbeat_to_pb(seq, num_sessions, telemetry)
        case StageStatus():
            return stage_status_to_pb(message)
        case LinkReport(links):
            return link_report_to_pb(list(links))
        case KvEventReport(reports):
            return kv_events_to_pb(reports)
        case WeightsProgress():
            return weights_progress_to_pb(message)
        case RtcOffer():
            return pb.AgentMessage(rtc_offer=rtc_offer_to_pb(message))
        case RtcAnswer():
            return pb.AgentMessage(rtc_answer=rtc_answer_to_pb(message))
    raise TypeError(f"not an agent message: {message!r}")


def agent_message_from_pb(msg: pb.AgentMessage) -> AgentMessage:
    """Parses and validates one message an agent sent the coordinator; raises InvalidInput naming the bad field."""
    match msg.WhichOneof("kind"):
        case "register":
            return registration_from_pb(msg.register)
        case "heartbeat":
            telemetry = telemetry_from_pb(msg.heartbeat.telemetry) if msg.heartbeat.HasField("telemetry") else None
            return Heartbeat(msg.heartbeat.seq, msg.heartbeat.num_sessions, telemetry)
        case "stage_status":
            return stage_status_from_pb(msg.stage_status)
        case "links":
            return LinkReport(tuple(link_report_from_pb(msg.links)))
        case "kv_events":
            return KvEventReport(tuple(kv_events_from_pb(msg.kv_events)))
        case "weights_progress":
            return weights_progress_from_pb(msg.weights_progress)
        case "rtc_offer":
            return rtc_offer_from_pb(msg.rtc_offer)
        case "rtc_answer":
            return rtc_answer_from_pb(msg.rtc_answer)
    raise InvalidInput("agent message has no kind set")


def stage_info_to_pb(agent_id: str, assignments: list[Assignment], tensor_names: list[str],
                     param_bytes: int, num_sessions: int) -> pb.StageInfo:
    return pb.StageInfo(agent_id=agent_id, assignments=[assignment_to_pb(a) for a in assignments],
                        tensor_names=tensor_names, param_bytes=param_bytes, num_sessions=num_sessions)


# ---------------------------------------------------------------- KV migration
def kv_layout_to_pb(layout: KvLayout) -> pb.KvLayout:
    return pb.KvLayout(model_id=layout.model_id, start_layer=layout.start_layer, end_layer=layout.end_layer,
                       dtype=layout.dtype, block_size=layout.block_size, num_kv_heads=layout.num_kv_heads,
                       head_dim=layout.head_dim)


def kv_layout_from_pb(msg: pb.KvLayout, where: str) -> KvLayout:
    if not 0 <= msg.start_layer < msg.end_layer:
        raise InvalidInput(f"{where}.layout: layers [{msg.start_layer}, {msg.end_layer}) are not a layer range")
    if msg.block_size <= 0 or msg.num_kv_heads <= 0 or msg.head_dim <= 0:
        raise InvalidInput(f"{where}.layout: block_size, num_kv_heads and head_dim must be > 0")
    return KvLayout(msg.model_id, msg.start_layer, msg.end_layer, msg.dtype, msg.block_size, msg.num_kv_heads,
                    msg.head_dim)


def kv_export_request_to_pb(request: KvExportRequest) -> pb.KvExportRequest:
    return pb.KvExportRequest(session_id=request.session_id, assignment_id=request.assignment_id,
                              layout=kv_layout_to_pb(request.layout), wait_for_prefill=request.wait_for_prefill)


def kv_export_request_from_pb(msg: pb.KvExportRequest) -> KvExportRequest:
    _require_session_id(msg.session_id, "export")
    return KvExportRequest(msg.session_id, msg.assignment_id, kv_layout_from_pb(msg.layout, "export"),
                           msg.wait_for_prefill)


def kv_import_request_to_pb(request: KvImportRequest) -> pb.KvImportRequest:
    return pb.KvImportRequest(session_id=request.session_id, assignment_id=request.assignment_id,
                              source_address=request.source.address,
                              source_assignment_id=request.source.assignment_id,
                              wait_for_prefill=request.wait_for_prefill)


def kv_import_request_from_pb(msg: pb.KvImportRequest) -> KvImportRequest:
    _require_session_id(msg.session_id, "import")
    _require_address(msg.source_address, "import.source_address")
    return KvImportRequest(msg.session_id, msg.assignment_id, Hop(msg.source_address, msg.source_assignment_id),
                           msg.wait_for_prefill)


def kv_import_summary_to_pb(summary: KvImportSummary) -> pb.KvImportSummary:
    return pb.KvImportSummary(num_tokens=summary.num_tokens, num_bytes=summary.num_bytes,
                              num_pieces=summary.num_pieces)


def kv_import_summary_from_pb(msg: pb.KvImportSummary) -> KvImportSummary:
    return KvImportSummary(msg.num_tokens, msg.num_bytes, msg.num_pieces)


def kv_chunk_to_pb(chunk: KvHeader | KvPiece) -> pb.KvChunk:
    if isinstance(chunk, KvPiece):
        return pb.KvChunk(piece=pb.KvPiece(offset=chunk.offset, data=chunk.data, crc32=chunk.crc32))
    return pb.KvChunk(header=pb.KvHeader(
        layout=kv_layout_to_pb(chunk.layout), session_id=chunk.session_id, token_ids=list(chunk.token_ids),
        prompt_len=chunk.prompt_len, num_computed=chunk.num_computed, kv=tensor_to_pb(chunk.kv),
        num_bytes=chunk.num_bytes, digest=chunk.digest))


def kv_chunk_from_pb(msg: pb.KvChunk) -> KvHeader | KvPiece:
    """Parses one message of an export; raises InvalidInput naming the bad field."""
    kind = msg.WhichOneof("kind")
    if kind == "piece":
        if msg.piece.offset < 0:
            raise InvalidInput("kv piece.offset must be >= 0")
        return KvPiece(msg.piece.offset, msg.piece.data, msg.piece.crc32)
    if kind != "header":
        raise InvalidInput("kv chunk has no kind set")
    h = msg.header
    _require_session_id(h.session_id, "kv header")
    if any(t < 0 for t in h.token_ids):
        raise InvalidInput("kv header.token_ids must be >= 0")
    if not 0 < h.prompt_len <= len(h.token_ids) or not 0 <= h.num_computed <= len(h.token_ids):
        raise InvalidInput("kv header: prompt_len must lie in [1, len(token_ids)], num_computed in [0, len(token_ids)]")
    if h.num_bytes < 0 or len(h.digest) != 16:
        raise InvalidInput("kv header: num_bytes must be >= 0 and digest 16 bytes")
    return KvHeader(kv_layout_from_pb(h.layout, "kv header"), h.session_id, tuple(h.token_ids), h.prompt_len,
                    h.num_computed, tensor_from_pb(h.kv), h.num_bytes, h.digest)


def shutdown_to_pb(reason: str) -> pb.CoordinatorMessage:
    return pb.CoordinatorMessage(shutdown=pb.Shutdown(reason=reason))


def revocations_to_pb(serials: Iterable[str]) -> pb.CoordinatorMessage:
    return pb.CoordinatorMessage(revocations=pb.Revocations(serials=sorted(serials)))


def revocations_from_pb(msg: pb.Revocations) -> frozenset[str]:
    if any(not _SERIAL.fullmatch(s) for s in msg.serials):
        raise InvalidInput("revocations.serials must be hex certificate serials")
    return frozenset(msg.serials)


# ---------------------------------------------------------------- WebRTC signalling

def rtc_offer_to_pb(offer: RtcOffer) -> pb.RtcOffer:
    return pb.RtcOffer(call_id=offer.call_id, peer_id=offer.peer_id, sdp=offer.sdp, cert_pem=offer.cert_pem)


def rtc_offer_from_pb(msg: pb.RtcOffer) -> RtcOffer:
    _check_signal(msg.call_id, msg.peer_id, msg.sdp, msg.cert_pem, "rtc_offer")
    if not msg.sdp:
        raise InvalidInput("rtc_offer.sdp is empty")
    return RtcOffer(msg.call_id, msg.peer_id, msg.sdp, msg.cert_pem)


def rtc_answer_to_pb(answer: RtcAnswer) -> pb.RtcAnswer:
    return pb.RtcAnswer(call_id=answer.call_id, peer_id=answer.peer_id, sdp=answer.sdp, cert_pem=answer.cert_pem,
                        error=answer.error)


def rtc_answer_from_pb(msg: pb.RtcAnswer) -> RtcAnswer:
    _check_signal(msg.call_id, msg.peer_id, msg.sdp, msg.cert_pem, "rtc_answer")
    if not msg.sdp and not msg.error:
        raise InvalidInput("rtc_answer has neither sdp nor error")
    return RtcAnswer(msg.call_id, msg.peer_id, msg.sdp, msg.cert_pem, msg.error[:MAX_SIGNAL_ERROR])


# An SDP offer of one data channel is about 1 KB; this leaves room for many ICE candidates, not for abuse.
MAX_SDP_BYTES = 64 * 1024
MAX_SIGNAL_ERROR = 1024


def _check_signal(call_id: str, peer_id: str, sdp: str, cert_pem: bytes, where: str) -> None:
    if not _CALL_ID.fullmatch(call_id):
        raise InvalidInput(f"{where}.call_id must be 1..64 letters, digits, '-' or '_'")
    check_name(peer_id)
    if len(sdp) > MAX_SDP_BYTES:
        raise InvalidInput(f"{where}.sdp is over {MAX_SDP_BYTES} bytes")
    if len(cert_pem) > MAX_PEM_BYTES:
        raise InvalidInput(f"{where}.cert_pem is over {MAX_PEM_BYTES} bytes")


_CALL_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def enroll_request_to_pb(request: EnrollRequest) -> pb.EnrollRequest:
    return pb.EnrollRequest(mesh=request.mesh, token_id=request.token_id, agent_id=request.agent_id,
                            csr_pem=request.csr_pem, mac=request.mac)


def enroll_request_from_pb(msg: pb.EnrollRequest) -> EnrollRequest:
    check_name(msg.agent_id)
    if not _TOKEN_ID.fullmatch(msg.token_id):
        raise InvalidInput("enroll.token_id must be 8 hex digits")
    if not 0 < len(msg.csr_pem) <= MAX_PEM_BYTES or len(msg.mac) != 32:
        raise InvalidInput(f"enroll: csr_pem must be 1..{MAX_PEM_BYTES} bytes and mac 32 bytes")
    return EnrollRequest(msg.mesh, msg.token_id, msg.agent_id, msg.csr_pem, msg.mac)


def enroll_reply_to_pb(reply: EnrollReply) -> pb.EnrollReply:
    return pb.EnrollReply(cert_pem=reply.cert_pem, ca_pem=reply.ca_pem, mac=reply.mac)


def enroll_reply_from_pb(msg: pb.EnrollReply) -> EnrollReply:
    if not (0 < len(msg.cert_pem) <= MAX_PEM_BYTES and 0 < len(msg.ca_pem) <= MAX_PEM_BYTES
            and len(msg.mac) == 32):
        raise InvalidInput("enroll reply: cert_pem and ca_pem must be PEM and mac 32 bytes")
    return EnrollReply(msg.cert_pem, msg.ca_pem, msg.mac)
