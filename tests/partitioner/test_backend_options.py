"""A device that measured two backends for its dtype (torch and ONNX Runtime on one CPU) runs each stage on the one
predicted faster for it: the planner prices every layer range at the fastest of them, with each backend's own
overheads, and the plan says which it chose."""

from __future__ import annotations

import numpy as np
import pytest

from stratamesh.partitioner.cost import StageTables, group_unit, single_unit
from stratamesh.partitioner.fleet_snapshot import Device, FleetSnapshot, Link
from stratamesh.fleet.boxes import Speed
from stratamesh.partitioner.plan import PlanRequest
from stratamesh.partitioner.planner import evaluate, plan_pipeline
from stratamesh.partitioner.profile import profile_from_hf_config

GiB = 1 << 30
# benchmarks/ort_stage.py's model: 8 layers of hidden 512, float32
MODEL = profile_from_hf_config({"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 512,
                                "intermediate_size": 1376, "num_attention_heads": 8, "num_key_value_heads": 4,
                                "vocab_size": 1024, "torch_dtype": "float32"}, dtype="float32", name="m")
# What this 2-core VM's probe measured (agent.speed, decode rates): torch's products of one sequence read the weights
# at 17 GB/s, ONNX Runtime's at 36 GB/s; with eight sequences torch computes faster, and steps cost it less.
TORCH = Speed("torch-cpu", "float32", 37e9, 17e9)
ORT = Speed("onnxruntime-cpu", "float32", 25e9, 36e9, step_overhead_s=4.2e-4, layer_overhead_s=1.1e-4)


def _cpu(speeds: tuple[Speed, ...], device_id: str = "cpu", node: str = "") -> Device:
    return Device(device_id, 8 * GiB, speeds, node=node, step_overhead_s=2.2e-4, layer_overhead_s=1.0e-4)


def _backend(concurrency: int, speeds: tuple[Speed, ...] = (TORCH, ORT)) -> str:
    request = PlanRequest(concurrency=concurrency, context_len=256, tensor_parallel=False)
    (stage,) = plan_pipeline(MODEL, FleetSnapshot((_cpu(speeds),)), request).pipelines[0].stages
    return stage.backend


def test_the_faster_backend_for_the_workload_computes_the_stage() -> None:
    assert _backend(1) == "onnxruntime-cpu"      # one sequence: reading the weights is the step
    assert _backend(32) == "torch-cpu"           # 32: its products compute faster
    assert _backend(1, (ORT, TORCH)) == _backend(1)     # whatever order the device lists them in


def test_a_range_is_priced_at_its_fastest_backend_with_that_backends_own_overheads() -> None:
    request = PlanRequest(concurrency=4, context_len=256)
    tables, unit = StageTables(MODEL, request), single_unit(_cpu((TORCH, ORT)), MODEL)
    assert unit.speed == TORCH and [o.speed for o in unit.options] == [ORT]   # the most FLOP/s first
    (ort_unit,) = unit.options
    assert (unit.overhead_s, unit.layer_overhead_s) == (2.2e-4, 1.0e-4)       # the device's
    assert (ort_unit.overhead_s, ort_unit.layer_overhead_s) == (4.2e-4, 1.1e-4)   # its own
    torch_alone = single_unit(_cpu((TORCH,)), MODEL)
    ort_alone = single_unit(Device("cpu", 8 * GiB, (ORT,)), MODEL)
    expected = np.minimum(tables.times(torch_alone), tables.times(ort_alone))
    assert np.array_equal(tables.times(unit), expected)
    assert np.isfinite(expected[0, MODEL.num_layers])
    for a, b in ((0, 1), (0, MODEL.num_layers), (3, 5)):
        chosen = tables.best(unit, a, b)
        assert tables.time_of(unit, a, b) == pytest.approx(expected[a, b])
        assert tables.time_of(chosen, a, b) == tables.time_of(unit, a, b)
    # times_of, the heuristic's many-unit form, agrees
    assert tables.times_of([unit, torch_alone, ort_alone], 2, 6) == pytest.approx(
        [expected[2, 6], tables.times(torch_alone)[2, 6], tables.times(ort_alone)[2, 6]])
    # and so does the price of a given placement
    pipeline = evaluate(MODEL, FleetSnapshot((_cpu((TORCH, ORT)),)), request, [(("cpu",), 0, MODEL.num_layers)])
    assert pipeline.stages[0].compute_s == pytest.approx(expected[0, MODEL.num_layers])


def test_one_device_may_choose_differently_per_range() -> None:
    """A short range's step is mostly overhead, where torch costs less; a long one's is reading weights, where ONNX
    Runtime is faster."""
    request = PlanRequest(concurrency=1, context_len=256)
    tables = StageTables(MODEL, request)
    overheads = Speed("onnxruntime-cpu", "float32", 25e9, 36e9, step_overhead_s=2e-3, layer_overhead_s=1e-4)
    unit = single_unit(_cpu((TORCH, overheads)), MODEL)
    assert tables.best(unit, 0, 1).speed.backend == "torch-cpu"
    assert tables.best(unit, 0, MODEL.num_layers).speed.backend == "onnxruntime-cpu"


def test_tensor_parallel_ranks_compute_with_a_backend_that_shards() -> None:
    """ONNX Runtime stages run on one rank: a group of CPUs whose fastest backend it is computes in torch, and a
    group none of whose members measured torch is no group."""
    fast_ort = Speed("onnxruntime-cpu", "float32", 80e9, 36e9)
    both = tuple(_cpu((TORCH, fast_ort), f"c{k}", node="box") for k in range(2))
    link = Link("", "", 100e9, 1e-6)
    request = PlanRequest(concurrency=8, context_len=256)
    group = group_unit(tuple(single_unit(d, MODEL) for d in both), link, MODEL, request)
    assert group is not None and group.speed.backend == "torch-cpu" and group.options == ()
    ort_only = tuple(Device(f"o{k}", 8 * GiB, (fast_ort,), node="box") for k in range(2))
    assert group_unit(tuple(single_unit(d, MODEL) for d in ort_only), link, MODEL, request) is None
