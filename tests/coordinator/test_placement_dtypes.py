"""What the plan says is what runs: each agent's device and dtype, from the policy, and the KV cache the plan
reserved become its stage spec."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from stratamesh.coordinator.placement import (
    UNMEASURED, checkpoint_dtype, cpu_shares, fleet_of, onnx_servable, plan_stages, repair_stages, stage_device,
    stage_dtype,
)
from stratamesh.fleet.control_messages import LinkMeasurement
from stratamesh.fleet.errors import PlacementError
from stratamesh.fleet.boxes import Capabilities, GpuInfo, Speed
from stratamesh.partitioner.plan import PlannedStage

GiB = 1 << 30
CONFIG = {"model_type": "llama", "num_hidden_layers": 6, "hidden_size": 256, "intermediate_size": 512,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 2048,
          "torch_dtype": "bfloat16"}
CUDA = {dtype: Speed("torch-cuda", dtype, flops, 2e12)
        for dtype, flops in (("bfloat16", 4e14), ("float16", 4e14), ("float32", 5e13))}
CPU_FP32, CPU_BF16 = Speed("torch-cpu", "float32", 1e11, 1e10), Speed("torch-cpu", "bfloat16", 3e11, 1e10)


def gpu_box(host: str, capability: str, free_gib: tuple[int, ...] = (20,), ranks: int = 1, dtype: str = "",
            first_index: int = 0, speeds: tuple[Speed, ...] = (*CUDA.values(), CPU_FP32)) -> Capabilities:
    gpus = tuple(GpuInfo(first_index + k, "GPU", 24 * GiB, free * GiB, f"{host}-{k}", capability)
                 for k, free in enumerate(free_gib))
    return Capabilities(host, "EPYC", 32, 64 * GiB, 60 * GiB, gpus, ("torch-cpu", "torch-cuda"), speeds,
                        tier="cloud", num_ranks=ranks, dtype=dtype)


def cpu_box(host: str, cpu_bf16: bool = False, dtype: str = "",
            speeds: tuple[Speed, ...] = (CPU_FP32,)) -> Capabilities:
    return Capabilities(host, "Xeon", 16, 32 * GiB, 30 * GiB, speeds=speeds, dtype=dtype, cpu_bf16=cpu_bf16)


def specs_of(agents: dict[str, Capabilities], config: dict = CONFIG, num_stages: int = 3,
             links: list[LinkMeasurement] = ()) -> dict[str, tuple[str, str]]:
    """agent -> (device, dtype) of its stage."""
    _, specs = plan_stages("m", "/models/m", config, agents, num_stages, links)
    return {agent: (spec.device, spec.dtype) for agent, spec in specs}


# ------------------------------------------------------------------ the policy
@pytest.mark.parametrize("checkpoint, capability, cpu_bf16, override, expected", [
    ("bfloat16", "9.0", False, "", "bfloat16"),
    ("bfloat16", "8.0", False, "", "bfloat16"),      # Ampere: the first with bfloat16
    ("bfloat16", "7.5", False, "", "float16"),       # Turing: none
    ("bfloat16", "", False, "", "bfloat16"),         # unknown: assume it works
    ("float16", "7.5", False, "", "float16"),
    ("float32", "9.0", False, "", "float32"),        # a GPU computes in the checkpoint's dtype
    ("bfloat16", None, False, "", "float32"),        # a CPU in float32 ...
    ("bfloat16", None, True, "", "bfloat16"),        # ... unless it computes bfloat16 natively
    ("float16", None, True, "", "float32"),
    ("float32", None, True, "", "float32"),
    ("bfloat16", "9.0", False, "float32", "float32"),    # the operator's --dtype wins
    ("bfloat16", "7.5", False, "bfloat16", "bfloat16"),
    ("float32", None, False, "bfloat16", "bfloat16"),
    ("bfloat16", None, True, "float16", "float16"),
])
def test_the_dtype_a_device_computes_in(checkpoint: str, capability: str | None, cpu_bf16: bool, override: str,
                                        expected: str) -> None:
    caps = cpu_box("h", cpu_bf16, override)
    gpu = None if capability is None else GpuInfo(0, "GPU", GiB, GiB, "", capability)
    assert stage_dtype(checkpoint, caps, gpu) == expected


@pytest.mark.parametrize("config, expected", [
    ({"torch_dtype": "bfloat16"}, "bfloat16"),
    ({"dtype": "float16", "torch_dtype": "bfloat16"}, "float16"),    # transformers' newer name wins
    ({}, "float32"),
    ({"torch_dtype": "float64"}, "float32"),                          # nothing a stage computes in: float32
])
def test_the_checkpoints_dtype(config: dict, expected: str) -> None:
    assert checkpoint_dtype(config) == expected


# ------------------------------------------------------------------ the fleet
def test_each_gpu_rank_has_its_own_gpus_memory_dtype_and_cuda_speeds() -> None:
    fleet = fleet_of({"g": gpu_box("h", "8.9", (20, 16), ranks=2)}, checkpoint="bfloat16")
    assert [(d.id, d.memory_bytes, d.dtype, d.speed(d.dtype).backend) for d in fleet.devices] == [
        ("g#0", 20 * GiB, "bfloat16", "torch-cuda"), ("g#1", 16 * GiB, "bfloat16", "torch-cuda")]
    assert {s.backend for d in fleet.devices for s in d.speeds} == {"torch-cuda"}   # not the host's CPU speed


@pytest.mark.parametrize("caps", [
    cpu_box("h", speeds=()),
    gpu_box("h", "9.0", speeds=()),       # GPUs, but no speed measured: planned as a CPU too (RAM, not GPU memory)
])
def test_an_agent_that_measured_nothing_is_a_modest_float32_cpu(caps: Capabilities) -> None:
    (device,) = fleet_of({"a": caps}, checkpoint="bfloat16").devices
    assert (device.dtype, device.speeds, device.memory_bytes) == ("float32", (UNMEASURED,), caps.ram_available_bytes)


def test_a_device_without_a_speed_for_its_dtype_is_planned_at_its_backends_float32_speed(
        caplog: pytest.LogCaptureFixture) -> None:
    agents = {"old-cache": cpu_box("h1", cpu_bf16=True), "fp32-only": gpu_box("h2", "9.0", speeds=(CUDA["float32"],))}
    with caplog.at_level(logging.INFO, logger="stratamesh.coordinator.placement"):
        fleet = fleet_of(agents, checkpoint="bfloat16")
    assert fleet.device("old-cache").speed("bfloat16") == Speed("torch-cpu", "bfloat16", 1e11, 1e10)
    assert fleet.device("fp32-only").speed("bfloat16") == Speed("torch-cuda", "bfloat16", 5e13, 2e12)
    assert sum("planned at its float32 speed" in r.message for r in caplog.records) == 2


# ------------------------------------------------------------------ the plan becomes the specs
def test_a_mixed_plan_runs_bf16_on_ampere_fp16_on_turing_and_fp32_on_the_cpu() -> None:
    agents = {"h100": gpu_box("h1", "9.0"), "t4": gpu_box("h2", "7.5", first_index=1), "cpu": cpu_box("h3")}
    assert specs_of(agents) == {"h100": ("cuda:0", "bfloat16"), "t4": ("cuda:1", "float16"),
                                "cpu": ("cpu", "float32")}


def test_the_operators_dtype_wins() -> None:
    agents = {"h100": gpu_box("h1", "9.0", dtype="float32"), "t4": gpu_box("h2", "7.5"),
              "cpu": cpu_box("h3", dtype="bfloat16", speeds=(CPU_FP32, CPU_BF16))}
    assert specs_of(agents) == {"h100": ("cuda:0", "float32"), "t4": ("cuda:0", "float16"),
                                "cpu": ("cpu", "bfloat16")}


@pytest.mark.parametrize("cpu_bf16, checkpoint, expected", [
    (True, "bfloat16", "bfloat16"), (False, "bfloat16", "float32"), (True, "float32", "float32"),
])
def test_a_cpu_with_native_bf16_runs_a_bf16_checkpoint_in_bf16(cpu_bf16: bool, checkpoint: str,
                                                               expected: str) -> None:
    agents = {"cpu": cpu_box("h", cpu_bf16, speeds=(CPU_FP32, CPU_BF16))}
    config = {**CONFIG, "torch_dtype": checkpoint}
    assert specs_of(agents, config, num_stages=1) == {"cpu": ("cpu", expected)}


def test_the_mixed_plans_links_carry_activations_in_the_wire_dtype() -> None:
    """bf16 GPU -> fp32 CPU: bf16 on the wire (2 bytes), fp32 CPU -> fp32 CPU: 4 bytes."""
    agents = {"gpu": gpu_box("h1", "9.0"), "cpu1": cpu_box("h2"), "cpu2": cpu_box("h3")}
    links = [LinkMeasurement(b, 1e-3, 1e8, "", a, 1.0) for a, b in (("gpu", "cpu1"), ("gpu", "cpu2"), ("cpu1", "cpu2"))]
    plan, specs = plan_stages("m", "/models/m", CONFIG, agents, 3, links)
    dtypes = [spec.dtype for _, spec in specs]
    assert sorted(dtypes) == ["bfloat16", "float32", "float32"]
    used = set()
    for stage, dtype, after in zip(plan.pipelines[0].stages, dtypes, dtypes[1:]):
        wire_bytes = 4 if (dtype, after) == ("float32", "float32") else 2
        assert stage.send_s == pytest.approx(8 * CONFIG["hidden_size"] * wire_bytes / 1e8, rel=1e-9)
        used.add(wire_bytes)
    assert used == {2, 4}       # the plan has both kinds of hop (its two CPUs sit side by side)


def test_a_tp_group_runs_on_its_agents_consecutive_gpus_from_the_first() -> None:
    """Two stages on one 4-GPU agent: each a pair of consecutive ranks on consecutive GPUs (cuda:base+r), taken in
    pipeline order, as a stored placement is read back: keeping the plan keeps each stage's GPUs."""
    agents = {"g": gpu_box("h", "9.0", (3, 3, 3, 3), ranks=4, first_index=2)}
    config = {**CONFIG, "num_hidden_layers": 64, "hidden_size": 2048, "intermediate_size": 5632,
              "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000}
    plan, specs = plan_stages("m", "/models/m", config, agents, 2)
    assert [s.devices for s in plan.pipelines[0].stages] == [("g#0", "g#1"), ("g#2", "g#3")]
    assert [(spec.device, spec.tp_degree, spec.dtype) for _, spec in specs] == [
        ("cuda:2", 2, "bfloat16"), ("cuda:4", 2, "bfloat16")]
    previous = [(a, s.start_layer, s.end_layer, s.tp_degree) for a, s in specs]
    kept, again = plan_stages("m", "/models/m", config, agents, 2, previous=previous)
    assert kept.search == "kept" and again == specs
    assert kept.reason.startswith("2 stage(s): g#0+g#1 [0, 32), g#2+g#3 [32, 64)")


@pytest.mark.parametrize("devices, backend, indices, expected", [
    (("g",), "torch-cuda", (0,), "cuda:0"),
    (("g#1",), "torch-cuda", (0, 1), "cuda:1"),
    (("g#2", "g#3"), "torch-cuda", (4, 5, 6, 7), "cuda:6"),      # the GPU's own index, not the rank
    (("g#0", "g#1"), "torch-cpu", (0, 1), "cpu"),
    (("g#0", "g#1"), "torch-cuda", (0, 2), PlacementError),      # cuda:0 and cuda:1 are not its GPUs 0 and 2
])
def test_the_device_a_stage_runs_on(devices: tuple[str, ...], backend: str, indices: tuple[int, ...],
                                    expected: str | type) -> None:
    gpus = tuple(GpuInfo(i, "GPU", GiB, GiB, "", "9.0") for i in indices)
    caps = Capabilities("h", "EPYC", 8, GiB, GiB, gpus, num_ranks=len(gpus))
    stage = PlannedStage(devices, 0, 1, backend, "bfloat16", 0.0, 0.0, 0, 0, 0)
    if expected is PlacementError:
        with pytest.raises(PlacementError, match="consecutive GPUs"):
            stage_device(stage, "g", caps)
    else:
        assert stage_device(stage, "g", caps) == expected


def test_a_stored_mixed_placement_is_kept_and_repaired() -> None:
    agents = {"h100": gpu_box("h1", "9.0"), "t4": gpu_box("h2", "7.5"), "cpu": cpu_box("h3")}
    _, specs = plan_stages("m", "/models/m", CONFIG, agents, 3)
    previous = [(a, s.start_layer, s.end_layer, s.tp_degree) for a, s in specs]
    plan, again = plan_stages("m", "/models/m", CONFIG, agents, 3, previous=previous)
    assert plan.search == "kept" and again == specs
    spare = {"spare": gpu_box("h4", "8.6")}
    repaired = repair_stages("m", "/models/m", CONFIG, {a: c for a, c in agents.items() if a != "t4"} | spare,
                             previous)
    assert [a for a, _ in repaired] == [("spare" if a == "t4" else a) for a, _ in specs]
    kept = {a: spec for a, spec in repaired}
    assert all(kept[a] == spec for a, spec in specs if a != "t4")
    t4 = next(spec for a, spec in specs if a == "t4")
    assert (t4.device, t4.dtype) == ("cuda:0", "float16")
    assert (kept["spare"].device, kept["spare"].dtype) == ("cuda:0", "bfloat16")   # the spare's own, not the T4's
    assert (kept["spare"].start_layer, kept["spare"].end_layer) == (t4.start_layer, t4.end_layer)


def test_each_stage_spec_carries_the_kv_cache_its_plan_counted_on() -> None:
    """8 sequences of the context (2048 here) for each micro-batch of the plan, in the stage's dtype."""
    agents = {"cpu": cpu_box("h1"), "gpu": gpu_box("h2", "9.0"), "t4": gpu_box("h3", "7.5")}
    plan, specs = plan_stages("m", "/models/m", CONFIG, agents, 3)
    (pipeline,) = plan.pipelines
    assert pipeline.micro_batches > 1            # the reserve is counted once per micro-batch
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}
    kv_per_token_layer = 2 * 2 * 64              # K and V of 2 KV heads of 64
    for stage, (_, spec) in zip(pipeline.stages, specs, strict=True):
        per_sequence = 2048 * (spec.end_layer - spec.start_layer) * kv_per_token_layer * itemsize[spec.dtype]
        assert spec.kv_cache_bytes == pipeline.micro_batches * 8 * per_sequence
        assert spec.kv_cache_bytes == pipeline.micro_batches * stage.kv_budget_bytes <= stage.memory_bytes + \
            stage.headroom_bytes
    assert len({spec.dtype for _, spec in specs}) == 3      # each stage in its own dtype's bytes


# ------------------------------------------------------------------ the runtime
def test_an_agent_told_to_run_onnxruntime_gets_an_onnxruntime_float32_cpu_stage() -> None:
    agents = {"t": cpu_box("h1", cpu_bf16=True, speeds=(CPU_FP32, CPU_BF16)),
              "o": replace(cpu_box("h2", cpu_bf16=True, speeds=(CPU_FP32, CPU_BF16)), runtime="onnxruntime"),
              "g": replace(gpu_box("h3", "9.0"), runtime="onnxruntime")}
    _, specs = plan_stages("m", "/models/m", CONFIG, agents, 3)
    runs = {agent: (spec.runtime, spec.device, spec.dtype) for agent, spec in specs}
    assert runs["t"] == ("torch", "cpu", "bfloat16")           # a bf16 checkpoint on a CPU with native bf16
    assert runs["o"] == ("onnxruntime", "cpu", "float32")      # ONNX Runtime stages compute in float32
    assert runs["g"] == ("onnxruntime", "cpu", "float32")      # ... on the CPU, even on a box with a GPU
    # priced at its host's torch speed where it measured none with ONNX Runtime, and its share of the host's cores
    (device,) = fleet_of({"g": agents["g"]}, checkpoint="bfloat16").devices
    assert device.speeds == (Speed("onnxruntime-cpu", "float32", CPU_FP32.flops, CPU_FP32.mem_bandwidth),)
    assert cpu_shares({"g": agents["g"]}) == {"g": (1.0, 1)}
    # ... and at torch's overheads
    timed = replace(cpu_box("h", speeds=(replace(CPU_FP32, step_overhead_s=2e-4, layer_overhead_s=1e-4),)),
                    runtime="onnxruntime")
    (device,) = fleet_of({"o": timed}).devices
    assert (device.step_overhead_s, device.layer_overhead_s) == (2e-4, 1e-4)


# What the 2-core VM measured of torch and ONNX Runtime (agent.speed: decode rates beside the large matmul and copy)
TORCH_MEASURED = Speed("torch-cpu", "float32", 2e11, 4e10, 2.2e-4, 1.0e-4, 3.7e10, 1.7e10)
ORT_MEASURED = Speed("onnxruntime-cpu", "float32", 2e11, 4e10, 4.2e-4, 1.1e-4, 2.5e10, 3.6e10)
FP32_CONFIG = {**CONFIG, "torch_dtype": "float32"}


def test_an_auto_agent_offers_both_runtimes_at_their_decode_rates_with_their_own_overheads() -> None:
    auto = replace(cpu_box("h", speeds=(TORCH_MEASURED, ORT_MEASURED)), runtime="auto")
    (device,) = fleet_of({"a": auto}).devices
    assert device.speeds == (Speed("torch-cpu", "float32", 3.7e10, 1.7e10),
                             Speed("onnxruntime-cpu", "float32", 2.5e10, 3.6e10, 4.2e-4, 1.1e-4))
    assert (device.step_overhead_s, device.layer_overhead_s) == (2.2e-4, 1.0e-4)     # torch's
    # torch alone: an agent left at torch, a model whose layers do not export, a dtype ONNX Runtime does not compute
    plain = {"a": replace(auto, runtime="")}
    bf16 = {"a": replace(auto, cpu_bf16=True, speeds=(*auto.speeds, replace(TORCH_MEASURED, dtype="bfloat16")))}
    for fleet in (fleet_of(plain), fleet_of({"a": auto}, onnx=False), fleet_of(bf16, checkpoint="bfloat16")):
        assert {s.backend for s in fleet.devices[0].speeds} == {"torch-cpu"}


@pytest.mark.parametrize("config, exports", [
    (FP32_CONFIG, True),
    ({**FP32_CONFIG, "model_type": "mistral", "sliding_window": 64}, False),      # windowed attention: not yet
    ({**FP32_CONFIG, "model_type": "qwen2", "sliding_window": 64, "use_sliding_window": False}, True),
    ({**FP32_CONFIG, "model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2},
     False),
    ({**FP32_CONFIG, "model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True,
      "layer_types": ["full_attention"] * 6}, True),
    ({**FP32_CONFIG, "model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True, "layer_types": []},
     False),      # a config no stage serves
])
def test_whether_onnx_runtime_stages_can_serve_a_model(config: dict, exports: bool) -> None:
    assert onnx_servable(config) is exports


def test_the_planner_picks_each_auto_agents_runtime_by_what_it_measured() -> None:
    """Three CPUs, each its own host: ONNX Runtime measured faster on one, slower on another, and a third left at
    torch. One mesh mixes both runtimes."""
    ort_faster = replace(ORT_MEASURED, step_overhead_s=1e-5, layer_overhead_s=1e-6, decode_flops=2e11,
                         decode_bandwidth=4e10)
    ort_slower = replace(ORT_MEASURED, step_overhead_s=5e-3, decode_flops=1e9)
    agents = {"ort": replace(cpu_box("h1", speeds=(TORCH_MEASURED, ort_faster)), runtime="auto"),
              "torch": replace(cpu_box("h2", speeds=(TORCH_MEASURED, ort_slower)), runtime="auto"),
              "plain": cpu_box("h3", speeds=(TORCH_MEASURED, ort_faster))}
    plan, specs = plan_stages("m", "/models/m", FP32_CONFIG, agents, 3)
    assert {agent: (spec.runtime, spec.dtype) for agent, spec in specs} == {
        "ort": ("onnxruntime", "float32"), "torch": ("torch", "float32"), "plain": ("torch", "float32")}
    backends = {s.devices[0]: s.backend for s in plan.pipelines[0].stages}
    assert backends == {"ort": "onnxruntime-cpu", "torch": "torch-cpu", "plain": "torch-cpu"}
    # a windowed model's stages stay in torch
    _, windowed = plan_stages("m", "/models/m", {**FP32_CONFIG, "model_type": "mistral", "sliding_window": 64},
                              agents, 3)
    assert {spec.runtime for _, spec in windowed} == {"torch"}


# ------------------------------------------------------------------ int8 weights
CPU_INT8 = Speed("torch-cpu", "int8", 1.5e11, 1e10)


def test_int8_weights_go_to_the_single_process_stages_that_measured_them_and_only_when_asked() -> None:
    fp32_config = {**CONFIG, "torch_dtype": "float32"}
    agents = {"int8": cpu_box("h1", speeds=(CPU_FP32, CPU_INT8)), "plain": cpu_box("h2"),
              "ort": replace(cpu_box("h3", speeds=(CPU_FP32, CPU_INT8)), runtime="onnxruntime"),
              "gpu": gpu_box("h4", "9.0", speeds=(*CUDA.values(), CPU_FP32, CPU_INT8))}
    _, specs = plan_stages("m", "/models/m", fp32_config, agents, 4, quantize="int8")
    # the ONNX Runtime agent's host measured torch's int8 alone: it is priced at that, and holds int8 in ORT
    assert {agent: (spec.runtime, spec.quantize) for agent, spec in specs} == {
        "int8": ("torch", "int8"), "plain": ("torch", ""), "ort": ("onnxruntime", "int8"), "gpu": ("torch", "")}
    _, unasked = plan_stages("m", "/models/m", fp32_config, agents, 4)
    assert all(spec.quantize == "" for _, spec in unasked), "never without the operator's choice"
    # a spare taking a drained stage holds int8 weights as the plan would have given it
    placement = [(a, s.start_layer, s.end_layer, s.tp_degree) for a, s in specs]
    spare = {"spare": cpu_box("h5", speeds=(CPU_FP32, CPU_INT8))}
    repaired = dict(repair_stages("m", "/models/m", fp32_config,
                                  {a: c for a, c in agents.items() if a != "plain"} | spare, placement,
                                  quantize="int8"))
    assert repaired["spare"].quantize == "int8" and repaired["int8"].quantize == "int8"


def test_an_auto_agent_holds_int8_weights_in_the_runtime_it_measured_faster_with_them() -> None:
    """ONNX Runtime measured slower than torch in float32 but faster with int8 weights (its integer products): the
    same agent computes in torch unless the operator asked for int8."""
    ort_int8 = replace(ORT_MEASURED, dtype="int8", step_overhead_s=1e-5, layer_overhead_s=1e-6, decode_flops=4e11,
                       decode_bandwidth=1e11)
    torch_int8 = replace(TORCH_MEASURED, dtype="int8", decode_flops=1e10, decode_bandwidth=1e10)
    ort_slower = replace(ORT_MEASURED, step_overhead_s=5e-3, decode_flops=1e9)
    agents = {"a": replace(cpu_box("h1", speeds=(TORCH_MEASURED, torch_int8, ort_slower, ort_int8)),
                           runtime="auto")}
    _, ((_, int8),) = plan_stages("m", "/models/m", FP32_CONFIG, agents, 1, quantize="int8")
    assert (int8.runtime, int8.quantize) == ("onnxruntime", "int8")
    _, ((_, full),) = plan_stages("m", "/models/m", FP32_CONFIG, agents, 1)
    assert (full.runtime, full.quantize) == ("torch", "")
