"""A dtype per device: each prices weights, KV and activations in the dtype it computes in."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stratamesh.fleet.errors import PlacementError
from stratamesh.partitioner.fleet_snapshot import Device, FleetSnapshot, Link
from stratamesh.fleet.boxes import Speed
from stratamesh.partitioner.plan import Plan, PlanRequest
from stratamesh.partitioner.planner import evaluate, plan_pipeline
from stratamesh.partitioner.profile import ModelProfile, profile_from_hf_config
from tests.partitioner.random_fleets import DTYPES, random_case

GiB = 1 << 30
SMALL = {"model_type": "llama", "num_hidden_layers": 6, "hidden_size": 512, "intermediate_size": 1024,
         "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000, "torch_dtype": "bfloat16"}


def _plan(profile: ModelProfile, fleet: FleetSnapshot, request: PlanRequest) -> Plan | str:
    try:
        return plan_pipeline(profile, fleet, request)
    except PlacementError as exc:
        return str(exc)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(30))
def test_devices_in_one_dtype_plan_as_the_model_stored_in_it(seed: int, dtype: str) -> None:
    """Devices that all say dtype plan exactly as devices that say nothing, for the model stored in dtype: what
    prices a stage is the dtype its device computes in, not the profile's."""
    case = random_case(seed, multi_gpu=seed % 2 == 1)
    says = FleetSnapshot(tuple(replace(d, dtype=dtype) for d in case.fleet.devices), case.fleet.links,
                         case.fleet.origin_site)
    mine = _plan(case.profile, says, case.request)
    stored = _plan(case.profile.at_dtype(dtype), case.fleet, case.request)
    assert (mine if isinstance(mine, str) else mine.to_json()) == (
        stored if isinstance(stored, str) else stored.to_json())


@pytest.mark.parametrize("first, second, wire_bytes", [
    ("bfloat16", "float32", 2),      # a float32 receiver gets the sender's narrower dtype ...
    ("float16", "float32", 2),
    ("float32", "bfloat16", 2),      # ... and any other receiver its own
    ("float32", "float16", 2),
    ("float16", "bfloat16", 2),
    ("float32", "float32", 4),
    ("bfloat16", "bfloat16", 2),
])
def test_activations_between_stages_cost_the_bytes_of_the_dtype_they_travel_in(first: str, second: str,
                                                                                wire_bytes: int) -> None:
    profile, request = profile_from_hf_config(SMALL), PlanRequest(context_len=256, concurrency=8)
    # slow enough devices that the link is a small share of a step: activations travel raw (wire_codec)
    devices = tuple(Device(i, 4 * GiB, (Speed("torch-cuda", dtype, 1e10, 1e10),), dtype=dtype)
                    for i, dtype in (("a", first), ("b", second)))
    fleet = FleetSnapshot(devices, (Link("a", "b", 1e9, 1e-3),))
    a, b = evaluate(profile, fleet, request, [(("a",), 0, 3), (("b",), 3, 6)]).stages
    assert a.send_s == pytest.approx(8 * 512 * wire_bytes / 1e9, rel=1e-12)
    assert (a.dtype, b.dtype, a.codec) == (first, second, "")


@pytest.mark.parametrize("dtype, bytes_per_value", [("float32", 4), ("bfloat16", 2), ("float16", 2)])
def test_a_stage_holds_weights_and_kv_in_its_devices_dtype(dtype: str, bytes_per_value: int) -> None:
    profile, request = profile_from_hf_config(SMALL), PlanRequest(context_len=256, concurrency=8)
    device = Device("d", 4 * GiB, (Speed("torch-cpu", dtype, 1e12, 1e11),), dtype=dtype)
    (stage,) = evaluate(profile, FleetSnapshot((device,)), request, [(("d",), 0, 6)]).stages
    kv_values = 8 * 256 * 6 * 2 * 4 * 64                # tokens x layers x (K, V) x KV heads x head dim
    params = sum(profile.layer_params) + profile.embed_params + profile.head_params
    assert stage.kv_budget_bytes == kv_values * bytes_per_value
    assert stage.memory_bytes == (params + kv_values) * bytes_per_value
    assert (stage.backend, stage.dtype) == ("torch-cpu", dtype)


def test_a_device_without_a_speed_for_its_dtype_is_not_used_and_the_error_says_which() -> None:
    profile = profile_from_hf_config(SMALL)
    bf16 = (Speed("torch-cuda", "bfloat16", 1e14, 1e12),)
    fleet = FleetSnapshot((Device("old", 4 * GiB, bf16, dtype="float16"), Device("cpu", 4 * GiB, bf16)))
    assert [s.devices for s in plan_pipeline(profile, fleet, PlanRequest()).pipelines[0].stages] == [("cpu",)]
    with pytest.raises(PlacementError, match="no device measured a speed for float16"):
        plan_pipeline(profile, fleet, PlanRequest(exclude=frozenset({"cpu"})))
    with pytest.raises(PlacementError, match="old cannot serve float16"):
        evaluate(profile, fleet, PlanRequest(), [(("old",), 0, 6)])


def test_a_bfloat16_gpu_beside_a_float32_cpu_takes_what_fits_in_each_dtype() -> None:
    """The CPU holds the model only in float32's doubled bytes if it has the room: the planner counts them."""
    profile, request = profile_from_hf_config(SMALL), PlanRequest(context_len=256, concurrency=8)
    gpu = Device("gpu", 4 * GiB, (Speed("torch-cuda", "bfloat16", 1e14, 1e12),), dtype="bfloat16")
    in_bf16 = evaluate(profile, FleetSnapshot((gpu,)), request, [(("gpu",), 0, 6)]).stages[0].memory_bytes
    for room, fits in ((2 * in_bf16 - 1, False), (2 * in_bf16, True)):
        cpu = Device("cpu", room, (Speed("torch-cpu", "float32", 1e12, 1e11),), dtype="float32")
        fleet = FleetSnapshot((gpu, cpu))
        if fits:
            assert evaluate(profile, fleet, request, [(("cpu",), 0, 6)]).stages[0].headroom_bytes == 0
        else:
            with pytest.raises(PlacementError, match="needs 1 B more memory"):
                evaluate(profile, fleet, request, [(("cpu",), 0, 6)])
