"""Quantized weights in the planner: a device that measured them holds the layers' matrices, the LM head and the
embedding in a byte a parameter (int8) or 0.625 (int4, its scales counted) and computes at that format's speed; one
that did not holds the model as before; of the backends that measured a format, the fastest computes it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stratamesh.fleet.errors import PlacementError
from stratamesh.partitioner.fleet_snapshot import Device, FleetSnapshot
from stratamesh.fleet.boxes import Speed
from stratamesh.partitioner.plan import PlanRequest
from stratamesh.partitioner.planner import evaluate, plan_pipeline
from stratamesh.partitioner.profile import profile_from_hf_config

GiB = 1 << 30
MODEL = {"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 1024, "intermediate_size": 2816,
         "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000, "torch_dtype": "float32"}
REQUEST = PlanRequest(context_len=256, concurrency=4)
FLOAT32 = Speed("torch-cpu", "float32", 5e10, 2e10)
INT8 = Speed("torch-cpu", "int8", 6e10, 2e10)
INT4 = Speed("torch-cpu", "int4", 6e10, 2e10)


def cpu(name: str, memory: int, *speeds: Speed) -> Device:
    return Device(name, memory, speeds or (FLOAT32, INT8), dtype="float32")


def test_a_stage_of_int8_weights_holds_a_quarter_of_the_layer_bytes() -> None:
    profile = profile_from_hf_config(MODEL)
    fleet = FleetSnapshot((cpu("a", 64 * GiB),))
    [whole] = evaluate(profile, fleet, REQUEST, [(("a",), 0, 8)]).stages
    [int8] = evaluate(replace(profile, weights="int8"), fleet, REQUEST, [(("a",), 0, 8)]).stages
    assert (whole.weights, int8.weights) == ("", "int8") and int8.dtype == "float32"
    kv = whole.kv_budget_bytes
    assert int8.kv_budget_bytes == kv, "the KV cache stays in the stage's dtype"
    weights = sum(profile.layer_params) + profile.head_params + profile.embed_params
    assert whole.memory_bytes - int8.memory_bytes == pytest.approx(3 * weights, rel=1e-3)


def test_a_stage_of_int4_weights_holds_its_packed_bytes_and_scales() -> None:
    profile = profile_from_hf_config(MODEL)
    fleet = FleetSnapshot((cpu("a", 64 * GiB, FLOAT32, INT8, INT4),))
    [whole] = evaluate(profile, fleet, REQUEST, [(("a",), 0, 8)]).stages
    [int4] = evaluate(replace(profile, weights="int4"), fleet, REQUEST, [(("a",), 0, 8)]).stages
    assert int4.weights == "int4" and int4.kv_budget_bytes == whole.kv_budget_bytes
    weights = sum(profile.layer_params) + profile.head_params + profile.embed_params
    assert whole.memory_bytes - int4.memory_bytes == pytest.approx((4 - 0.625) * weights, rel=1e-3)


def test_of_the_backends_that_measured_int4_the_fastest_on_it_computes_it() -> None:
    profile = replace(profile_from_hf_config(MODEL), weights="int4")
    request = PlanRequest(context_len=16, concurrency=1)
    ort = Speed("onnxruntime-cpu", "int4", 6e10, 1.5e10)       # (placement.py prices a decode step's bandwidth)
    for torch_bandwidth, backend in ((1e10, "onnxruntime-cpu"), (2e10, "torch-cpu")):
        torch_int4 = replace(INT4, mem_bandwidth=torch_bandwidth)
        fleet = FleetSnapshot((cpu("a", 64 * GiB, FLOAT32, torch_int4, ort),))
        [stage] = plan_pipeline(profile, fleet, request).pipelines[0].stages
        assert (stage.weights, stage.backend) == ("int4", backend)


def test_int8_weights_make_a_memory_bound_step_faster_by_the_bytes_they_save() -> None:
    profile = profile_from_hf_config(MODEL)
    slow_flops = replace(INT8, flops=FLOAT32.flops)           # the same FLOP/s: only the bytes differ
    fleet = FleetSnapshot((cpu("a", 64 * GiB, FLOAT32, slow_flops),))
    request = PlanRequest(context_len=16, concurrency=1)     # one token: reading the weights is the step
    [whole] = evaluate(profile, fleet, request, [(("a",), 0, 8)]).stages
    [int8] = evaluate(replace(profile, weights="int8"), fleet, request, [(("a",), 0, 8)]).stages
    assert 3.0 < whole.compute_s / int8.compute_s < 4.0


def test_a_device_that_measured_no_int8_speed_holds_the_model_as_stored() -> None:
    profile = replace(profile_from_hf_config(MODEL), weights="int8")
    fleet = FleetSnapshot((cpu("a", 64 * GiB, FLOAT32), cpu("b", 64 * GiB)))
    a, b = evaluate(profile, fleet, REQUEST, [(("a",), 0, 4), (("b",), 4, 8)]).stages
    assert (a.weights, b.weights) == ("", "int8")


def test_a_model_too_big_in_float32_fits_in_int8() -> None:
    profile = profile_from_hf_config(MODEL)
    float_bytes = 4 * (sum(profile.layer_params) + profile.embed_params + profile.head_params)
    fleet = FleetSnapshot((cpu("a", float_bytes // 2),))
    with pytest.raises(PlacementError):
        plan_pipeline(profile, fleet, REQUEST)
    [stage] = plan_pipeline(replace(profile, weights="int8"), fleet, REQUEST).pipelines[0].stages
    assert stage.weights == "int8" and stage.memory_bytes <= float_bytes // 2


def test_a_tensor_parallel_group_holds_its_weights_unquantized() -> None:
    profile = replace(profile_from_hf_config(MODEL), weights="int8")
    speeds = (Speed("torch-cuda", "float32", 1e13, 1e12), Speed("torch-cuda", "int8", 2e13, 1e12))
    gpus = tuple(Device(f"g{i}", 64 * GiB, speeds, tier="cloud", node="n", dtype="float32") for i in range(2))
    [stage] = evaluate(profile, FleetSnapshot(gpus), REQUEST, [(("g0", "g1"), 0, 8)]).stages
    assert stage.tp_degree == 2 and stage.weights == ""
