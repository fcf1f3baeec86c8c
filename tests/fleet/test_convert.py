"""The converter between protobuf and fleet types: every message round-trips, every bad field is named."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from stratamesh.fleet.errors import InvalidAssignment, InvalidInput
from stratamesh.fleet.boxes import Capabilities, GpuInfo, Peer, Registration, Speed, StageLoad, Telemetry
from stratamesh.fleet.control_messages import (Heartbeat, KvEventReport, LinkMeasurement, LinkReport, ProbeLinks,
                                               Release, RevokedSerials, RtcAnswer, RtcOffer, Shutdown, Welcome)
from stratamesh.fleet.kv import KvEvents, KvExportRequest, KvHeader, KvImportRequest, KvLayout, KvPiece
from stratamesh.fleet.sessions import (Hop, SamplingParams, SessionClose, SessionOpen, Speculation, StepBatch,
                                       StepChunk, TensorBlob, TokenEvent)
from stratamesh.fleet.stages import Assignment, StageSpec, StageStatus
from stratamesh.fleet.weights import WeightChunk, WeightFile, WeightManifest, WeightsProgress
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2 as pb

SPEC = StageSpec("m", "/models/m", 2, 4, 6)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
STAGE_MESSAGES = [
    SessionOpen("s1", "a1", (Hop("10.0.0.2:5000", "a2"), Hop("10.0.0.3:5000", "a3")), "10.0.0.1:1",
                SamplingParams(0.7, 40, 0.9, seed=11), TRACEPARENT, (5, 6, 7, 8), 3),
    SessionOpen("s1", "a1", (), "o:1", SamplingParams()),
    SessionOpen("s1", "a1", (Hop("10.0.0.2:5000", "a2", "bfloat16"), Hop("10.0.0.3:5000", "a3", "float32")),
                "o:1", SamplingParams()),
    SessionOpen("s1", "a1", (Hop("10.0.0.2:5000", "a2", "float32", "int8"), Hop("10.0.0.3:5000", "a3", "float32")),
                "o:1", SamplingParams()),
    SessionOpen("s1.1", "b1", (), "o:1", SamplingParams(), prompt_token_ids=(5, 6, 7), max_cached_tokens=2,
                resume_from="s1.0"),
    SessionOpen("s1.2", "b1", (), "o:1", SamplingParams(0.8, 0, 1.0, 5, min_p=0.05, presence_penalty=-0.5,
                                                        frequency_penalty=1.25, repetition_penalty=1.1,
                                                        logit_bias=((3, -100.0), (17, 2.5)), min_tokens=4,
                                                        stop_token_ids=(0, 2)),
                prompt_token_ids=(5, 6, 7, 8), output_start=3),
    SessionOpen("s1", "a1", (Hop("10.0.0.2:5000", "a2", agent_id="cloud-1"),
                             Hop("192.168.1.3:5000", "a3", agent_id="edge-2", nat="203.0.113.9")), "o:1",
                SamplingParams(), feed=Hop("192.168.1.2:5000", "a1", agent_id="edge-1", nat="203.0.113.9"),
                max_new_tokens=8),
    SessionOpen("s1", "a1", (), "o:1", SamplingParams(), prompt_token_ids=(5, 6), feed=Hop("10.0.0.1:5000", "a1"),
                speculation=Speculation("ngram", 4, 2, 3), revision="0f3a9c21be77"),
    StepChunk("s1", 0, 0, token_ids=(1, 2, 3), sample=False),
    StepChunk("s1", 4, 9, (7, 8, 9), True, num_draft=2),
    StepChunk("s1", 0, 0, (1, 2, 3), True, TRACE_ID, sent_unix_ns=1_700_000_000_123_456_789),
    StepBatch((StepChunk("s1", 3, 17, (4, 5), sample=True, trace_id=TRACE_ID), StepChunk("s2", 0, 0, (9,))),
              TensorBlob("float32", (3, 4), bytes(48)), sent_unix_ns=1_700_000_000_000_000_001),
    StepBatch((StepChunk("s1", 3, 17, (4,)),), TensorBlob("int8", (1, 4), bytes(4), "int8",
                                                          TensorBlob("float32", (1,), bytes(4)))),
    SessionClose("s1"),
]


@pytest.mark.parametrize("message", STAGE_MESSAGES, ids=lambda m: type(m).__name__)
def test_stage_messages_round_trip(message) -> None:
    wire = convert.stage_message_to_pb(message).SerializeToString()
    assert convert.stage_message_from_pb(pb.StageMessage.FromString(wire)) == message
    addressed = pb.StageMessage.FromString(convert.stage_message_to_pb(message, "a7").SerializeToString())
    assert addressed.to == "a7" and convert.stage_message_from_pb(addressed) == message


def test_a_stage_spec_round_trips_with_its_runtime_and_refuses_one_it_does_not_know() -> None:
    spec = StageSpec("m", "/models/m", 2, 4, 6, runtime="onnxruntime")
    assert convert.stage_spec_from_pb(convert.stage_spec_to_pb(spec)) == spec
    int8 = StageSpec("m", "/models/m", 2, 4, 6, quantize="int8")
    assert convert.stage_spec_from_pb(convert.stage_spec_to_pb(int8)) == int8
    reserved = StageSpec("m", "/models/m", 2, 4, 6, kv_cache_bytes=3 << 30, revision="0f3a9c21be77")
    assert convert.stage_spec_from_pb(convert.stage_spec_to_pb(reserved)) == reserved
    for bad in ("r 1", "x" * 65, "../etc"):
        with pytest.raises(InvalidInput, match="revision"):
            convert.stage_spec_from_pb(pb.StageSpec(model_id="m", model_path="/p", start_layer=0, end_layer=1,
                                                    num_layers=1, revision=bad))
    with pytest.raises(InvalidInput, match="kv_cache_bytes must be in"):
        convert.stage_spec_from_pb(pb.StageSpec(model_id="m", model_path="/p", start_layer=0, end_layer=1,
                                                num_layers=1, kv_cache_bytes=-1))
    with pytest.raises(InvalidInput, match="quantize 'int3'"):
        convert.stage_spec_from_pb(pb.StageSpec(model_id="m", model_path="/p", start_layer=0, end_layer=1,
                                                num_layers=1, quantize="int3"))
    assert convert.stage_spec_from_pb(pb.StageSpec(model_id="m", model_path="/p", start_layer=0, end_layer=1,
                                                   num_layers=1)).runtime == "torch"     # unsaid: torch
    with pytest.raises(InvalidInput, match="runtime 'tvm'"):
        convert.stage_spec_from_pb(pb.StageSpec(model_id="m", model_path="/p", start_layer=0, end_layer=1,
                                                num_layers=1, runtime="tvm"))


def test_capabilities_with_a_bad_speed_or_tier_are_rejected() -> None:
    for caps in (Capabilities("b", "c", 1, 1, 1, speeds=(Speed("torch-cpu", "float32", 0.0, 1e9),)),
                 Capabilities("b", "c", 1, 1, 1, tier="orbit"), Capabilities("b", "c", 1, 1, 1, dtype="int4"),
                 Capabilities("b", "c", 1, 1, 1, runtime="tensorrt")):
        with pytest.raises(InvalidInput):
            convert.capabilities_from_pb(convert.capabilities_to_pb(caps))


def test_control_messages_round_trip() -> None:
    caps = Capabilities("box", "cpu", 8, 16 << 30, 12 << 30, (GpuInfo(0, "H100", 80 << 30, 70 << 30, "u"),),
                        ("torch-cpu", "torch-cuda"), (Speed("torch-cuda", "bfloat16", 6e14, 2.5e12, 3e-5, 1e-5, 4e14, 1e12),),
                        site="eu-west", tier="cloud", dtype="float16", cpu_bf16=True, num_threads=6,
                        runtime="onnxruntime")
    reg = Registration("agent1", "box", "127.0.0.1:5000", caps, (Assignment("p-0", SPEC),), "m1",
                       metrics_address="127.0.0.1:9100")
    assert convert.registration_from_pb(convert.registration_to_pb(reg).register) == reg
    auto = Registration("agent1", "box", "127.0.0.1:5000", replace(caps, runtime="auto"))   # the planner picks
    assert convert.registration_from_pb(convert.registration_to_pb(auto).register) == auto
    assert caps.usable_mem_bytes == 70 << 30
    status = StageStatus("p-0", "ready", param_bytes=123)
    assert convert.stage_status_from_pb(convert.stage_status_to_pb(status).stage_status) == status
    events = [TokenEvent("s", 4, 99), TokenEvent("s", -1, opened=True, cached_tokens=32),
              TokenEvent("s", -1, preempted=True), TokenEvent("s", -1, error="boom", error_stage="a"),
              TokenEvent("s", 5, 7, sent_unix_ns=123)]
    wire = convert.token_batch_to_pb(events).SerializeToString()
    assert [convert.token_event_from_pb(e) for e in pb.TokenBatch.FromString(wire).events] == events


def test_what_the_coordinator_sends_an_agent_becomes_its_control_stream_message() -> None:
    peers = (Peer("a2", "127.0.0.1:5002"), Peer("a3", "127.0.0.1:5003"))
    wire = [convert.control_message_to_pb(m) for m in (Assignment("p-0", SPEC), Release("p-1"), Shutdown("drained"),
                                                      ProbeLinks(peers))]
    assert [m.WhichOneof("kind") for m in wire] == ["assign", "release", "shutdown", "probe_links"]
    assert convert.assignment_from_pb(wire[0].assign) == Assignment("p-0", SPEC)
    assert (wire[1].release.assignment_id, wire[2].shutdown.reason) == ("p-1", "drained")
    assert tuple(convert.probe_links_from_pb(wire[3].probe_links)) == peers
    with pytest.raises(TypeError, match="not a control message"):
        convert.control_message_to_pb(SessionClose("s"))


def test_an_embedding_event_round_trips_as_a_raw_float32_vector() -> None:
    vector = (0.5, -0.25, 1.0 / 3.0, 1e-30, 0.0)
    as_float32 = tuple(float(x) for x in np.asarray(vector, dtype=np.float32))
    event = TokenEvent("s", 0, embedding=vector, sent_unix_ns=9)
    msg = pb.TokenBatch.FromString(convert.token_batch_to_pb([event]).SerializeToString()).events[0]
    assert (msg.embedding.dtype, list(msg.embedding.shape), len(msg.embedding.data)) == ("float32", [5], 20)
    back = convert.token_event_from_pb(msg)
    assert back.token_id == -1 and back.sent_unix_ns == 9
    assert back.embedding == as_float32 and back.embedding[2] != vector[2]   # what a float32 tensor holds
    assert not convert.token_batch_to_pb([TokenEvent("s", 1, 3)]).events[0].HasField("embedding")


NOT_A_VECTOR = "token_event.embedding must be a raw float32 vector"


@pytest.mark.parametrize("tensor, match", [
    (pb.Tensor(dtype="float16", shape=[2], data=bytes(4)), NOT_A_VECTOR),
    (pb.Tensor(dtype="float32", shape=[2], data=bytes(8), codec="int8"), NOT_A_VECTOR),
    (pb.Tensor(dtype="float32", shape=[2, 2], data=bytes(16)), NOT_A_VECTOR),
    (pb.Tensor(dtype="float32", shape=[0]), NOT_A_VECTOR),
    (pb.Tensor(dtype="float32", shape=[3], data=bytes(8)), "token_event.embedding.data holds 8 bytes"),
], ids=["dtype", "codec", "shape", "empty", "short"])
def test_a_malformed_embedding_is_rejected_by_name(tensor: pb.Tensor, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        convert.token_event_from_pb(pb.TokenEvent(session_id="s", embedding=tensor))


@pytest.mark.parametrize("gpu", [
    GpuInfo(0, "NVIDIA H100", 80 << 30, 70 << 30, "GPU-a", "9.0", 37.0, 41.0, 123.5, 700.0),
    GpuInfo(1, "NVIDIA L4", 24 << 30, 20 << 30, "GPU-b", "8.9", 0.0, 0.0, 0.0, 0.0),   # zero is not unknown
    GpuInfo(2, "Jetson", 8 << 30, 4 << 30),                                              # NVML said nothing more
    GpuInfo(3, "A10", 24 << 30, 1 << 30, "GPU-c", "8.6", utilization_pct=5.0, power_limit_w=150.0),
], ids=["every-field", "zeros", "bare", "some"])
def test_gpu_info_round_trips_with_and_without_readings(gpu: GpuInfo) -> None:
    caps = Capabilities("box", "cpu", 8, 16 << 30, 12 << 30, (gpu,))
    wire = convert.capabilities_to_pb(caps).SerializeToString()
    assert convert.capabilities_from_pb(pb.Capabilities.FromString(wire)).gpus == (gpu,)


def test_an_unknown_gpu_reading_is_unset_on_the_wire() -> None:
    msg = convert.gpu_to_pb(GpuInfo(0, "L4", 1, 1, power_w=0.0))
    assert [f.name for f, _ in msg.ListFields()] == ["name", "mem_total_bytes", "mem_free_bytes", "power_w"]


@pytest.mark.parametrize("message, field", [
    (pb.StageMessage(), "no kind"),
    (pb.StageMessage(chunk=pb.StepChunk(session_id="s", token_ids=[1], start_pos=-1)), "start_pos"),
    (pb.StageMessage(chunk=pb.StepChunk(session_id="s")), "token_ids is empty"),
    (pb.StageMessage(chunk=pb.StepChunk(token_ids=[1])), "session_id"),
    (pb.StageMessage(chunk=pb.StepChunk(session_id="a b", token_ids=[1])), "session_id"),
    (pb.StageMessage(chunk=pb.StepChunk(session_id="s" * 129, token_ids=[1])), "session_id"),
    (pb.StageMessage(close=pb.SessionClose(session_id="s\x00")), "session_id"),
    (pb.StageMessage(batch=pb.StepBatch(chunks=[pb.StepChunk(session_id="s", token_ids=[1])],
                                        hidden=pb.Tensor(dtype="float32", shape=[-1, 4]))), "negative"),
    (pb.StageMessage(batch=pb.StepBatch(chunks=[pb.StepChunk(session_id="s", token_ids=[1, 2])],
                                        hidden=pb.Tensor(dtype="float32", shape=[3, 4]))), r"\[2, hidden\]"),
    (pb.StageMessage(batch=pb.StepBatch()), "chunks is empty"),
    (pb.StageMessage(batch=pb.StepBatch(chunks=[pb.StepChunk(session_id="s", token_ids=[1])])), "hidden"),
    (pb.StageMessage(open=pb.SessionOpen(session_id="s", origin="o:1", prompt_token_ids=[1],
                                         max_cached_tokens=2)), "max_cached_tokens"),
    (pb.StageMessage(open=pb.SessionOpen(session_id="s", route=["a:1"], origin="o:1")), "route"),
    (pb.StageMessage(open=pb.SessionOpen(session_id="s", route=["a:1"], route_assignments=["x"],
                                         route_dtypes=["float64"], origin="o:1")), "route_dtypes"),
    (pb.StageMessage(open=pb.SessionOpen(session_id="s", route=["a:1"], route_assignments=["x"],
                                         route_dtypes=["float32", "float32"], origin="o:1")), "route_dtypes"),
    (pb.StageMessage(open=pb.SessionOpen(session_id="s", route=["a:1"], route_assignments=["x"],
                                         route_codecs=["zstd"], origin="o:1")), "route_codecs"),
    (pb.StageMessage(open=pb.SessionOpen(session_id="s", route=["a:1"], route_assignments=["x"],
                                         route_codecs=["int8", "int8"], origin="o:1")), "route_codecs"),
    (pb.StageMessage(open=pb.SessionOpen(session_id="s", route=["a:1"], route_assignments=["x"],
                                         route_nats=["1.2.3.4", ""], origin="o:1")), "route_nats"),
    (pb.StageMessage(open=pb.SessionOpen(session_id="s", route=["a:1"], route_assignments=["x"],
                                         route_agents=["not an id"], origin="o:1")), "name"),
    (pb.StageMessage(open=pb.SessionOpen(session_id="s", origin="o:1",
                                         sampling=pb.SamplingParams(temperature=-1))), "temperature"),
    (pb.StageMessage(open=pb.SessionOpen(session_id="s", origin="o:1",
                                         sampling=pb.SamplingParams(top_p=1.5))), "top_p"),
    (pb.StageMessage(open=pb.SessionOpen(session_id="s", origin="o:1", sampling=pb.SamplingParams(
        logit_bias=[pb.LogitBias(token_id=3, bias=1e9)]))), "logit_bias"),
    (pb.StageMessage(open=pb.SessionOpen(session_id="s", origin="o:1",
                                         sampling=pb.SamplingParams(min_p=2))), "min_p"),
    (pb.StageMessage(chunk=pb.StepChunk(session_id="s", token_ids=[1, 2], sample=True, num_draft=2)), "num_draft"),
    (pb.StageMessage(chunk=pb.StepChunk(session_id="s", token_ids=[1, 2], num_draft=1)), "num_draft"),
    (pb.StageMessage(open=pb.SessionOpen(session_id="s", origin="o:1", speculation=pb.Speculation(
        method="eagle", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=1))), "method"),
    (pb.StageMessage(open=pb.SessionOpen(session_id="s", origin="o:1", speculation=pb.Speculation(
        method="ngram", num_speculative_tokens=0, prompt_lookup_min=1, prompt_lookup_max=1))), "num_speculative"),
    (pb.StageMessage(open=pb.SessionOpen(session_id="s", origin="o:1", sampling=pb.SamplingParams(
        temperature=0.7, repetition_penalty=1.2), speculation=pb.Speculation(
        method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=1))),
     "logits alone"),
])
def test_bad_stage_messages_name_the_field(message: pb.StageMessage, field: str) -> None:
    with pytest.raises(InvalidInput, match=field):
        convert.stage_message_from_pb(message)


@pytest.mark.parametrize("register, field", [
    (pb.Register(stage_address="h:1"), "agent_id"),
    (pb.Register(agent_id="a", stage_address="nohost"), "stage_address"),
    (pb.Register(agent_id="a", stage_address="h:70000"), "stage_address"),
    (pb.Register(agent_id="a", stage_address="h:1", held=[pb.Assignment(
        assignment_id="x", stage=pb.StageSpec(start_layer=3, end_layer=2, num_layers=4))]), "layer range"),
    (pb.Register(agent_id="a", stage_address="h:1", held=[pb.Assignment(
        assignment_id="x", stage=pb.StageSpec(start_layer=0, end_layer=2, num_layers=4, device="tpu:0"))]),
     "device"),
    (pb.Register(agent_id="a", stage_address="h:1", held=[pb.Assignment(
        assignment_id="x", stage=pb.StageSpec(start_layer=0, end_layer=2, num_layers=4, dtype="float64"))]),
     "dtype"),
])
def test_bad_registrations_name_the_field(register: pb.Register, field: str) -> None:
    with pytest.raises(InvalidInput, match=field):
        convert.registration_from_pb(register)


def test_telemetry_links_and_probe_round_trip() -> None:
    telemetry = Telemetry(1_700_000_000.5, queue_depth=3, tokens_per_s=812.5,
                          stages=(StageLoad("p-0", 2, 1, 40, 512, 96, 64),
                                  StageLoad("p-1", 0, 0, 0, 8, expert_tokens=(12, 0, 30, 6), expert_imbalance=2.5)),
                          gpus=(GpuInfo(0, "L4", 24 << 30, 20 << 30, "GPU-b", "8.9", 55.0, 61.0, 40.0, 72.0),),
                          serving_cpu_per_token_s=1.3e-4, resting="", limits_near=0.85)
    wire = convert.heartbeat_to_pb(7, 2, telemetry).SerializeToString()
    heartbeat = pb.AgentMessage.FromString(wire).heartbeat
    assert heartbeat.seq == 7 and convert.telemetry_from_pb(heartbeat.telemetry) == telemetry
    assert telemetry.stages[0].kv_usage == 40 / 512 and telemetry.stages[1].kv_usage == 0.0
    links = [LinkMeasurement("b", 0.00031, 6.2e8), LinkMeasurement("c", error="UNAVAILABLE: refused")]
    assert convert.link_report_from_pb(convert.link_report_to_pb(links).links) == links
    peers = [Peer("b", "10.0.0.2:5000"), Peer("c", "box-c:5001")]
    assert convert.probe_links_from_pb(convert.probe_links_to_pb(peers).probe_links) == peers


@pytest.mark.parametrize("stage", [
    pb.StageLoad(assignment_id="p", kv_blocks_used=9, kv_blocks_total=8),
    pb.StageLoad(assignment_id="p", num_running=-1),
    pb.StageLoad(assignment_id="p", prefix_query_tokens=4, prefix_hit_tokens=5),
    pb.StageLoad(assignment_id="p", expert_tokens=[3, -1]),
    pb.StageLoad(assignment_id="p", expert_tokens=[1] * 1025),
    pb.StageLoad(assignment_id="p", expert_imbalance=float("nan")),
], ids=["more-used-than-held", "negative", "more-hits-than-queries", "negative-expert", "too-many-experts",
        "imbalance-nan"])
def test_inconsistent_telemetry_is_rejected(stage) -> None:
    with pytest.raises(InvalidInput, match="telemetry.stages"):
        convert.telemetry_from_pb(pb.Telemetry(stages=[stage]))


@pytest.mark.parametrize("value", [-1e-4, float("nan"), float("inf")])
def test_a_serving_cpu_figure_or_limits_nearness_that_is_no_fraction_is_rejected(value: float) -> None:
    with pytest.raises(InvalidInput, match="serving_cpu_per_token_s"):
        convert.telemetry_from_pb(pb.Telemetry(serving_cpu_per_token_s=value))
    with pytest.raises(InvalidInput, match="limits_near"):
        convert.telemetry_from_pb(pb.Telemetry(limits_near=value))


@pytest.mark.parametrize("link, match", [
    (pb.LinkMeasurement(peer_agent_id="", rtt_s=1e-3, bandwidth_bytes_per_s=1e9), "peer_agent_id"),
    (pb.LinkMeasurement(peer_agent_id="b", rtt_s=0.0, bandwidth_bytes_per_s=1e9), "positive"),
    (pb.LinkMeasurement(peer_agent_id="b", rtt_s=1e-3, bandwidth_bytes_per_s=float("nan")), "positive"),
])
def test_bad_link_measurements_are_rejected(link, match) -> None:
    with pytest.raises(InvalidInput, match=match):
        convert.link_report_from_pb(pb.LinkReport(links=[link]))


def test_kv_events_round_trip() -> None:
    reports = [KvEvents("p-0", 16, True, (b"\x01" * 16, b"\x02" * 16)), KvEvents("p-1", 32, False, (), (b"\x03" * 16,))]
    wire = pb.AgentMessage.FromString(convert.kv_events_to_pb(reports).SerializeToString())
    assert wire.WhichOneof("kind") == "kv_events" and convert.kv_events_from_pb(wire.kv_events) == reports


@pytest.mark.parametrize("report, match", [
    (pb.KvEvents(assignment_id="", block_size=16), "assignment_id"),
    (pb.KvEvents(assignment_id="p", block_size=0), "block_size"),
    (pb.KvEvents(assignment_id="p", block_size=16, stored=[b"short"]), "16 bytes"),
    (pb.KvEvents(assignment_id="p", block_size=16, evicted=[b"x" * 17]), "16 bytes"),
], ids=["no-assignment", "no-block-size", "short-hash", "long-hash"])
def test_bad_kv_events_are_rejected(report, match) -> None:
    with pytest.raises(InvalidInput, match=match):
        convert.kv_events_from_pb(pb.KvEventReport(stages=[report]))


def test_weights_progress_and_manifests_round_trip() -> None:
    progress = WeightsProgress("p-0", 300, 100, 500, 450, True, "10.0.0.2:7001", 2)
    wire = pb.AgentMessage.FromString(convert.weights_progress_to_pb(progress).SerializeToString())
    assert wire.WhichOneof("kind") == "weights_progress"
    assert convert.weights_progress_from_pb(wire.weights_progress) == progress
    manifest = WeightManifest("m", "ab" * 32, (WeightFile("config.json", 10), WeightFile("model.safetensors", 99)),
                              (WeightChunk("config.json", 0, 10, b"\x01" * 32),
                               WeightChunk("model.safetensors", 8, 91, b"\x02" * 32)), 80, ("10.0.0.2:7001",))
    assert convert.weight_manifest_from_pb(pb.WeightManifest.FromString(
        convert.weight_manifest_to_pb(manifest).SerializeToString())) == manifest
    model_id, revision, chunks = convert.weight_fetch_from_pb(convert.weight_fetch_to_pb("m", "ab" * 32,
                                                                                          manifest.chunks))
    assert (model_id, revision, chunks) == ("m", "ab" * 32, manifest.chunks)


@pytest.mark.parametrize("convert_from, message, match", [
    (convert.weights_progress_from_pb, pb.WeightsProgress(fetched_bytes=1, total_bytes=1), "assignment_id"),
    (convert.weights_progress_from_pb, pb.WeightsProgress(assignment_id="a", fetched_bytes=2, total_bytes=1),
     "more than"),
    (convert.weight_manifest_from_pb, pb.WeightManifest(model_id="m", revision="ab" * 32, sources=["nowhere"]),
     "sources"),
    (convert.weight_manifest_from_pb, pb.WeightManifest(model_id="m", revision="ab" * 32, chunks=[
        pb.WeightChunk(file="model.safetensors", offset=0, length=4, sha256=bytes(32))]), "outside"),
    (convert.weight_fetch_from_pb, pb.WeightFetch(model_id="m", revision="ab" * 32, chunks=[
        pb.WeightChunk(file="/etc/passwd", offset=0, length=4, sha256=bytes(32))]), "plain file name"),
    (convert.weight_fetch_from_pb, pb.WeightFetch(model_id="m", revision="../../etc"), "revision"),
    (convert.weight_manifest_request_from_pb, pb.WeightManifestRequest(), "model_id"),
], ids=["no-assignment", "over-total", "bad-source", "chunk-outside", "path", "revision", "no-model"])
def test_bad_weights_messages_are_rejected(convert_from, message, match) -> None:
    with pytest.raises(InvalidInput, match=match):
        convert_from(message)


@pytest.mark.parametrize("message, match", [
    (pb.StageMessage(chunk=pb.StepChunk(session_id="s", token_ids=[1], trace_id="XYZ")), "trace_id"),
    (pb.StageMessage(chunk=pb.StepChunk(session_id="s", token_ids=[1], sent_unix_ns=-5)), "sent_unix_ns"),
    (pb.StageMessage(open=pb.SessionOpen(session_id="s", origin="o:1", traceparent="00-abc")), "traceparent"),
])
def test_bad_trace_fields_are_rejected(message, match) -> None:
    with pytest.raises(InvalidInput, match=match):
        convert.stage_message_from_pb(message)


LAYOUT = KvLayout("m", 2, 4, "float32", 16, 2, 8)


def test_kv_migration_messages_round_trip() -> None:
    header = KvHeader(LAYOUT, "s.0", (5, 6, 7), 2, 2, TensorBlob("float32", (2, 2, 2, 2, 8), b""), 512, b"d" * 16)
    piece = KvPiece(512, b"\x01\x02", 99)
    assert convert.kv_chunk_from_pb(convert.kv_chunk_to_pb(header)) == header
    assert convert.kv_chunk_from_pb(convert.kv_chunk_to_pb(piece)) == piece
    export = KvExportRequest("s.0", "a1", LAYOUT)
    assert convert.kv_export_request_from_pb(convert.kv_export_request_to_pb(export)) == export
    pull = KvImportRequest("s.0", "b1", Hop("127.0.0.1:5001", "a1"))
    assert convert.kv_import_request_from_pb(convert.kv_import_request_to_pb(pull)) == pull
    assert LAYOUT.mismatch(LAYOUT) == ""


@pytest.mark.parametrize("chunk, field", [
    (pb.KvChunk(), "no kind"),
    (pb.KvChunk(piece=pb.KvPiece(offset=-1)), "offset"),
    (pb.KvChunk(header=pb.KvHeader(session_id="s", token_ids=[1, 2], prompt_len=3, digest=b"d" * 16,
                                   layout=convert.kv_layout_to_pb(LAYOUT))), "prompt_len"),
    (pb.KvChunk(header=pb.KvHeader(session_id="s", token_ids=[1, -2], prompt_len=1, digest=b"d" * 16,
                                   layout=convert.kv_layout_to_pb(LAYOUT))), "token_ids"),
    (pb.KvChunk(header=pb.KvHeader(session_id="s", token_ids=[1], prompt_len=1, digest=b"d",
                                   layout=convert.kv_layout_to_pb(LAYOUT))), "digest"),
    (pb.KvChunk(header=pb.KvHeader(session_id="s", token_ids=[1], prompt_len=1, digest=b"d" * 16,
                                   layout=pb.KvLayout(start_layer=3, end_layer=3, block_size=16))), "layers"),
])
def test_bad_kv_chunks_name_the_field(chunk: pb.KvChunk, field: str) -> None:
    with pytest.raises(InvalidInput, match=field):
        convert.kv_chunk_from_pb(chunk)


def test_rtc_signalling_round_trips_and_refuses_what_it_cannot_carry() -> None:
    offer = RtcOffer("c0ffee", "edge-1", "v=0\r\n", b"-----BEGIN CERTIFICATE-----")
    wire = convert.rtc_offer_to_pb(offer).SerializeToString()
    assert convert.rtc_offer_from_pb(pb.RtcOffer.FromString(wire)) == offer
    for answer in (RtcAnswer("c0ffee", "cloud-1", "v=0\r\n", b"pem"), RtcAnswer("c0ffee", "cloud-1", error="no")):
        wire = convert.rtc_answer_to_pb(answer).SerializeToString()
        assert convert.rtc_answer_from_pb(pb.RtcAnswer.FromString(wire)) == answer
    for bad, field in ((pb.RtcOffer(call_id="", peer_id="a", sdp="v"), "call_id"),
                       (pb.RtcOffer(call_id="c", peer_id="a b", sdp="v"), "name"),
                       (pb.RtcOffer(call_id="c", peer_id="a"), "sdp is empty"),
                       (pb.RtcOffer(call_id="c", peer_id="a", sdp="v" * 70000), "sdp is over")):
        with pytest.raises(InvalidInput, match=field):
            convert.rtc_offer_from_pb(bad)
    with pytest.raises(InvalidInput, match="neither sdp nor error"):
        convert.rtc_answer_from_pb(pb.RtcAnswer(call_id="c", peer_id="a"))


# ---------------------------------------------------------------- the control stream, both ways

CAPS = Capabilities("box", "cpu", 8, 16 << 30, 12 << 30, (GpuInfo(0, "L4", 24 << 30, 20 << 30, "GPU-b", "8.9"),),
                    ("torch-cpu", "torch-cuda"), (Speed("torch-cuda", "bfloat16", 1e14, 3e11, 2e-5, 1e-6),),
                    site="lab", tier="cloud", num_ranks=2, dtype="bfloat16", num_threads=4)
TELEMETRY = Telemetry(1_700_000_000.5, 3, 812.5, (StageLoad("p-0", 2, 1, 40, 512, 96, 64),),
                      (GpuInfo(0, "L4", 24 << 30, 20 << 30, utilization_pct=55.0),), 1.3e-4, "owner's hours")
OFFER = RtcOffer("c0ffee", "edge-1", "v=0\r\n", b"-----BEGIN CERTIFICATE-----")
AGENT_MESSAGES = [
    Registration("agent1", "box", "127.0.0.1:5000", CAPS, (Assignment("p-0", SPEC),), "m1", "127.0.0.1:9100"),
    Heartbeat(7, 2, TELEMETRY),
    Heartbeat(1),
    StageStatus("p-0", "loading"),
    StageStatus("p-0", "ready", param_bytes=123),
    StageStatus("p-0", "failed", "OSError: no such file"),
    StageStatus("p-0", "released"),
    LinkReport((LinkMeasurement("b", 0.00031, 6.2e8), LinkMeasurement("c", error="UNAVAILABLE: refused"))),
    LinkReport(()),
    KvEventReport((KvEvents("p-0", 16, True, (b"\x01" * 16,)), KvEvents("p-1", 32, False, (), (b"\x03" * 16,)))),
    WeightsProgress("p-0", 300, 100, 500, 450, True, "10.0.0.2:7001", 2),
    OFFER,
    RtcAnswer("c0ffee", "cloud-1", "v=0\r\n", b"pem"),
    RtcAnswer("c0ffee", "cloud-1", error="refused"),
]
COORDINATOR_MESSAGES = [
    Welcome("agent1", 0.5),
    Welcome("agent1", 2.0, "203.0.113.9"),
    Assignment("p-0", SPEC),
    Release("p-0"),
    ProbeLinks((Peer("b", "10.0.0.2:5000"), Peer("c", "box-c:5001"))),
    Shutdown("drained"),
    RevokedSerials(frozenset({"0a1b2c", "ff"})),
    RevokedSerials(frozenset()),
    OFFER,
    RtcAnswer("c0ffee", "cloud-1", error="no"),
]


def kinds_of(message_type) -> set[str]:
    """Every kind the proto's oneof holds."""
    return {f.name for f in message_type.DESCRIPTOR.oneofs_by_name["kind"].fields}


@pytest.mark.parametrize("message", AGENT_MESSAGES, ids=lambda m: type(m).__name__)
def test_every_agent_message_round_trips(message) -> None:
    wire = convert.agent_message_to_pb(message).SerializeToString()
    assert convert.agent_message_from_pb(pb.AgentMessage.FromString(wire)) == message


@pytest.mark.parametrize("message", COORDINATOR_MESSAGES, ids=lambda m: type(m).__name__)
def test_every_coordinator_message_round_trips(message) -> None:
    wire = convert.coordinator_message_to_pb(message).SerializeToString()
    assert convert.coordinator_message_from_pb(pb.CoordinatorMessage.FromString(wire)) == message


def test_the_round_trips_cover_every_kind_of_either_stream() -> None:
    assert {convert.agent_message_to_pb(m).WhichOneof("kind") for m in AGENT_MESSAGES} == kinds_of(pb.AgentMessage)
    assert ({convert.coordinator_message_to_pb(m).WhichOneof("kind") for m in COORDINATOR_MESSAGES}
            == kinds_of(pb.CoordinatorMessage))


def test_what_is_no_control_message_is_not_converted() -> None:
    with pytest.raises(TypeError, match="not an agent message"):
        convert.agent_message_to_pb(SessionClose("s"))
    with pytest.raises(TypeError, match="not a coordinator message"):
        convert.coordinator_message_to_pb(StageStatus("p-0", "ready"))


@pytest.mark.parametrize("message, field", [
    (pb.AgentMessage(), "agent message has no kind"),
    (pb.AgentMessage(register=pb.Register(stage_address="h:1")), "register.agent_id"),
    (pb.AgentMessage(register=pb.Register(agent_id="a", stage_address="h:1",
                                          capabilities=pb.Capabilities(tier="orbit"))), "capabilities: tier"),
    (pb.AgentMessage(heartbeat=pb.Heartbeat(seq=1, telemetry=pb.Telemetry(queue_depth=-1))),
     "telemetry.queue_depth"),
    (pb.AgentMessage(stage_status=pb.StageStatus(assignment_id="p")), "stage_status.state"),
    (pb.AgentMessage(links=pb.LinkReport(links=[pb.LinkMeasurement(rtt_s=1e-3, bandwidth_bytes_per_s=1e9)])),
     "peer_agent_id"),
    (pb.AgentMessage(kv_events=pb.KvEventReport(stages=[pb.KvEvents(assignment_id="p")])), "block_size"),
    (pb.AgentMessage(weights_progress=pb.WeightsProgress(total_bytes=1)), "weights_progress.assignment_id"),
    (pb.AgentMessage(rtc_offer=pb.RtcOffer(peer_id="a", sdp="v")), "rtc_offer.call_id"),
    (pb.AgentMessage(rtc_answer=pb.RtcAnswer(call_id="c", peer_id="a")), "rtc_answer has neither sdp nor error"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_a_bad_agent_message_names_its_field(message: pb.AgentMessage, field: str) -> None:
    with pytest.raises(InvalidInput, match=field):
        convert.agent_message_from_pb(message)


@pytest.mark.parametrize("message, field", [
    (pb.CoordinatorMessage(), "coordinator message has no kind"),
    (pb.CoordinatorMessage(welcome=pb.Welcome(agent_id="a", heartbeat_interval_s=-1)), "welcome.heartbeat_interval_s"),
    (pb.CoordinatorMessage(welcome=pb.Welcome(agent_id="a", heartbeat_interval_s=math.nan)),
     "welcome.heartbeat_interval_s"),
    (pb.CoordinatorMessage(release=pb.Release()), "release.assignment_id"),
    (pb.CoordinatorMessage(probe_links=pb.ProbeLinks(peers=[pb.Peer(agent_id="b", address="nohost")])),
     "probe_links.peers"),
    (pb.CoordinatorMessage(revocations=pb.Revocations(serials=["not-hex"])), "revocations.serials"),
    (pb.CoordinatorMessage(rtc_offer=pb.RtcOffer(call_id="c", peer_id="a")), "rtc_offer.sdp"),
    (pb.CoordinatorMessage(rtc_answer=pb.RtcAnswer(call_id="c c", peer_id="a", sdp="v")), "rtc_answer.call_id"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_a_bad_coordinator_message_names_its_field(message: pb.CoordinatorMessage, field: str) -> None:
    with pytest.raises(InvalidInput, match=field):
        convert.coordinator_message_from_pb(message)


@pytest.mark.parametrize("assign, assignment_id, field", [
    (pb.Assignment(stage=convert.stage_spec_to_pb(SPEC)), "", "assignment.assignment_id"),
    (pb.Assignment(assignment_id="p-0", stage=pb.StageSpec(start_layer=0, end_layer=2, num_layers=4,
                                                           dtype="float64")), "p-0", "dtype"),
    (pb.Assignment(assignment_id="p-1", stage=pb.StageSpec(start_layer=3, end_layer=2, num_layers=4)), "p-1",
     "layer range"),
], ids=["no-id", "dtype", "layers"])
def test_a_bad_assignment_names_its_field_and_which_assignment_it_is(assign: pb.Assignment, assignment_id: str,
                                                                     field: str) -> None:
    with pytest.raises(InvalidAssignment, match=field) as caught:
        convert.coordinator_message_from_pb(pb.CoordinatorMessage(assign=assign))
    assert caught.value.assignment_id == assignment_id
