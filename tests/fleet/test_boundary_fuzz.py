"""Property fuzzing of what arrives from the network or a file: whatever the bytes, the parser answers with a
value or its named error (InvalidInput, CheckpointError, DecodeError), never anything else."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stratamesh.fleet.discovery import AGENT_SERVICE, COORDINATOR_SERVICE, ServiceRecord, parse_record
from stratamesh.fleet.errors import CheckpointError, InvalidInput
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.kernels.codec import decode
from stratamesh.kernels.models.config import parse_config
from stratamesh.partitioner.profile import profile_from_hf_config

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))

txt_values = st.one_of(st.none(), st.binary(max_size=300), st.sampled_from([b"", b"0", b"8000", b"70000", b"a0",
                                                                           b"x" * 80, "\u00e9".encode()]))
txt_keys = st.one_of(st.binary(min_size=0, max_size=20),
                     st.sampled_from([b"mesh", b"http", b"enroll", b"agent_id", b"grpc"]))


@SETTINGS
@given(type_=st.sampled_from([COORDINATOR_SERVICE, AGENT_SERVICE, "_http._tcp.local."]),
       instance=st.text(max_size=70), addresses=st.lists(st.text(max_size=40), max_size=3),
       port=st.one_of(st.none(), st.integers(-5, 70000)),
       txt=st.dictionaries(txt_keys, txt_values, max_size=40))
def test_zeroconf_records(type_: str, instance: str, addresses: list[str], port: int | None,
                          txt: dict[bytes, bytes | None]) -> None:
    try:
        record = parse_record(type_, f"{instance}.{type_}", addresses, port, txt)
    except InvalidInput:
        return
    assert isinstance(record, ServiceRecord) and 1 <= record.port <= 65535 and record.mesh
    for key in ("http", "enroll"):
        if key in record.properties:
            assert 1 <= int(record.properties[key]) <= 65535


def test_zeroconf_records_with_a_bad_port_or_id_are_refused() -> None:
    good = {b"mesh": b"m", b"http": b"8000", b"agent_id": b"edge-1"}
    assert parse_record(AGENT_SERVICE, f"a.{AGENT_SERVICE}", ["127.0.0.1"], 9, good).properties["http"] == "8000"
    for bad in ({b"http": b"0"}, {b"enroll": b"65536"}, {b"enroll": b"12a"}, {b"agent_id": b"a b"},
                {b"\xff": b"x"}, {b"k" * 200: b"v" * 100}, {f"k{i}".encode(): b"" for i in range(40)}):
        with pytest.raises(InvalidInput):
            parse_record(AGENT_SERVICE, f"a.{AGENT_SERVICE}", ["127.0.0.1"], 9, {**good, **bad})


VALID_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 100, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "hidden_act": "silu", "tie_word_embeddings": False, "eos_token_id": 2}
json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2 ** 40, 2 ** 40),
                                     st.floats(allow_nan=True), st.text(max_size=20)),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=3), max_leaves=6)


@SETTINGS
@given(changes=st.dictionaries(st.sampled_from(sorted(VALID_CONFIG) + ["rope_scaling", "head_dim", "sliding_window",
                                                                       "layer_types", "rope_parameters"]),
                               json_values, max_size=4),
       dropped=st.sets(st.sampled_from(sorted(VALID_CONFIG)), max_size=3))
def test_model_configs(changes: dict[str, Any], dropped: set[str]) -> None:
    raw = {k: v for k, v in {**VALID_CONFIG, **changes}.items() if k not in dropped}
    try:
        profile = profile_from_hf_config(raw)    # what the coordinator reads to place a model it is asked to deploy
        assert profile.num_layers >= 1
    except (CheckpointError, InvalidInput):
        pass
    try:
        config = parse_config(raw)               # what a stage reads to load its layers
    except (CheckpointError, InvalidInput):
        return
    assert config.num_layers >= 1 and config.hidden_size >= 1


@SETTINGS
@given(data=st.binary(max_size=2048))
def test_stage_messages_from_random_bytes(data: bytes) -> None:
    try:
        message = pb.StageMessage.FromString(data)
    except DecodeError:
        return
    try:
        parsed = convert.stage_message_from_pb(message)
    except InvalidInput:
        return
    if message.WhichOneof("kind") == "batch":
        try:
            decode(parsed.hidden)
        except InvalidInput:
            pass


tensor_fields = st.fixed_dictionaries({
    "dtype": st.sampled_from(["float32", "float16", "bfloat16", "int8", "float64", ""]),
    "shape": st.lists(st.integers(-3, 1 << 41), max_size=4),
    "data": st.binary(max_size=256),
    "codec": st.sampled_from(["raw", "int8", "", "zstd"])})


@SETTINGS
@given(fields=tensor_fields, scales=st.one_of(st.none(), tensor_fields))
def test_tensors(fields: dict[str, Any], scales: dict[str, Any] | None) -> None:
    msg = pb.Tensor(**fields)
    if scales is not None:
        msg.scales.CopyFrom(pb.Tensor(**scales))
    try:
        tensor = decode(convert.tensor_from_pb(msg))
    except InvalidInput:
        return
    assert list(tensor.shape) == list(msg.shape)
