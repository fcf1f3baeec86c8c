"""Tensor-parallel groups as the agent runs them: every rank holds the embedding and LM head whole, the layers run
at the slowest rank's FLOP/s and bandwidth, and rank 0 computes the LM head alone."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest

from stratamesh.fleet.errors import PlacementError
from stratamesh.partitioner.cost import TP_EFFICIENCY, StageTables, group_link, group_unit, single_unit
from stratamesh.partitioner.fleet_snapshot import Device, FleetSnapshot, Link
from stratamesh.fleet.boxes import Speed
from stratamesh.partitioner.plan import PlanRequest
from stratamesh.partitioner.planner import evaluate, plan_pipeline
from stratamesh.partitioner.profile import ModelProfile, profile_from_hf_config

GiB = 1 << 30
# The model: Llama-3-70B-like, 80 layers of hidden 8192, in bfloat16
LLAMA_70B = {"model_type": "llama", "num_hidden_layers": 80, "hidden_size": 8192, "intermediate_size": 28672,
             "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256, "torch_dtype": "bfloat16"}
SMALL = {"model_type": "llama", "num_hidden_layers": 6, "hidden_size": 512, "intermediate_size": 1024,
         "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000, "torch_dtype": "bfloat16"}


def _node(memory_bytes: int, speeds: list[tuple[float, float]], dtype: str = "bfloat16") -> FleetSnapshot:
    """GPUs g0.. of one node with NVLink-class links between them; speeds: (FLOP/s, bytes/s) of each."""
    gpus = tuple(Device(f"g{k}", memory_bytes, (Speed("torch-cuda", dtype, f, b),), "cloud", "dc", "box")
                 for k, (f, b) in enumerate(speeds))
    return FleetSnapshot(gpus, tuple(Link(a.id, b.id, 300e9, 5e-6) for a, b in itertools.combinations(gpus, 2)))


def _rank_memory(p: ModelProfile, request: PlanRequest, start: int, end: int, degree: int) -> int:
    """What each rank loads for [start, end): its share of the layers' weights and KV, the embedding and head whole."""
    shared = (sum(p.layer_params[start:end]) * p.bytes_per_param
              + request.concurrency * request.context_len * sum(p.layer_kv_bytes_per_token[start:end]))
    return math.ceil(shared / degree) + (start == 0) * p.embed_bytes + (end == p.num_layers) * p.head_bytes


# ------------------------------------------------------------------ memory: the example
def test_eight_18_gib_gpus_hold_a_70b_model_only_as_stages_whose_ranks_each_hold_the_embedding_and_head() -> None:
    """One TP-8 stage was planned at 1/8 of everything per rank, but each rank also loads the 2 GiB embedding
    and the 2 GiB head: it needs more than 18 GiB. Every stage planned now fits what its ranks load."""
    profile, request = profile_from_hf_config(LLAMA_70B), PlanRequest()
    fleet = _node(18 * GiB, [(3e14, 1.5e12)] * 8)
    whole_model = [(tuple(d.id for d in fleet.devices), 0, 80)]
    assert _rank_memory(profile, request, 0, 80, 8) > 18 * GiB
    assert (profile.total_bytes + request.concurrency * request.context_len
            * sum(profile.layer_kv_bytes_per_token)) / 8 <= 18 * GiB     # what the old model counted: it "fit"
    with pytest.raises(PlacementError, match=r"cannot hold layers \[0, 80\): needs [\d.]+ GB more memory"):
        evaluate(profile, fleet, request, whole_model)
    plan = plan_pipeline(profile, fleet, request)
    for stage in plan.pipelines[0].stages:
        load = _rank_memory(profile, request, stage.start_layer, stage.end_layer, stage.tp_degree)
        kv = request.concurrency * request.context_len * sum(
            profile.layer_kv_bytes_per_token[stage.start_layer:stage.end_layer])
        assert stage.memory_bytes == load <= 18 * GiB
        assert stage.headroom_bytes == 18 * GiB - load
        assert stage.kv_budget_bytes == math.ceil(kv / stage.tp_degree)
    assert sum(s.num_layers for s in plan.pipelines[0].stages) == 80


@pytest.mark.parametrize("tied", [False, True])
def test_a_group_holding_the_whole_model_holds_a_tied_embedding_once_per_rank(tied: bool) -> None:
    profile = profile_from_hf_config({**SMALL, "tie_word_embeddings": tied})
    request = PlanRequest(context_len=256, concurrency=2)
    head = profile.head_bytes - (profile.embed_bytes if tied else 0)
    need = _rank_memory(profile, request, 0, 6, 4) - profile.head_bytes + head
    fleet = _node(need, [(1e14, 1e12)] * 4)
    (stage,) = evaluate(profile, fleet, request, [(("g0", "g1", "g2", "g3"), 0, 6)]).stages
    assert (stage.memory_bytes, stage.headroom_bytes) == (need, 0)
    with pytest.raises(PlacementError, match="needs 1 B more memory"):
        evaluate(profile, _node(need - 1, [(1e14, 1e12)] * 4), request, [(("g0", "g1", "g2", "g3"), 0, 6)])


# ------------------------------------------------------------------ speed: the slowest rank, the head on rank 0
@pytest.mark.parametrize("speeds, flops, bandwidth", [
    ([(1e14, 1e12), (1e14, 1e12)], 1e14, 1e12),
    ([(1e14, 2e11), (5e13, 1e12)], 5e13, 2e11),         # one rank the fewest FLOP/s, the other the least bandwidth
    ([(5e13, 1e12), (1e14, 2e11)], 5e13, 2e11),
    ([(1e14, 1e12), (9e13, 8e11), (2e14, 3e11), (1e14, 1e12)], 9e13, 3e11),
])
def test_a_group_runs_at_its_slowest_ranks_flops_and_its_slowest_ranks_bandwidth(
        speeds: list[tuple[float, float]], flops: float, bandwidth: float) -> None:
    profile, request = profile_from_hf_config(SMALL), PlanRequest()
    fleet = _node(GiB, speeds)
    members = tuple(single_unit(d, profile) for d in fleet.devices)
    unit = group_unit(members, group_link(fleet, fleet.devices), profile, request)
    degree = len(speeds)
    assert (unit.speed.flops, unit.speed.mem_bandwidth) == pytest.approx(
        (degree * TP_EFFICIENCY * flops, degree * TP_EFFICIENCY * bandwidth), rel=1e-12)
    assert unit.head_speed == fleet.devices[0].speeds[0] and unit.memory_bytes == GiB


def _roofline(read_bytes: float, flops: float, speed: tuple[float, float]) -> float:
    return max(read_bytes / speed[1], flops / speed[0])


@pytest.mark.parametrize("rank0, rank1", [((1e14, 1e12), (1e14, 1e12)), ((2e13, 1e11), (1e14, 1e12)),
                                          ((1e14, 1e12), (2e13, 1e11))])
@pytest.mark.parametrize("start, end", [(0, 6), (2, 6), (0, 3)])
def test_rank_0_computes_the_whole_lm_head_alone(rank0: tuple[float, float], rank1: tuple[float, float],
                                                 start: int, end: int) -> None:
    """A group's step: its layers at the group's speed, then (last stage) the head at rank 0's own speed."""
    profile, request = profile_from_hf_config(SMALL), PlanRequest(context_len=512, concurrency=8)
    fleet = _node(GiB, [rank0, rank1, (1e14, 1e12)])
    stages = evaluate(profile, fleet, request, _tiling(start, end)).stages
    group = next(s for s in stages if s.devices == ("g0", "g1"))
    tokens, context, p = request.concurrency, request.context_len / 2, profile
    layers = range(group.start_layer, group.end_layer)
    read = sum(p.layer_param_bytes(i) + tokens * context * p.layer_kv_bytes_per_token[i] for i in layers)
    flops = tokens * sum(p.layer_flops_per_token[i] + context * p.layer_attn_flops_per_ctx[i] for i in layers)
    group_speed = tuple(2 * TP_EFFICIENCY * min(r[k] for r in (rank0, rank1)) for k in (0, 1))
    head = _roofline(p.head_bytes, tokens * p.head_flops_per_token, rank0) if group.end_layer == 6 else 0.0
    payload = tokens * p.hidden_size * 2                                    # bf16 activations, all-reduced
    allreduce = 2 * (payload / 300e9 + 5e-6)              # twice per layer; a ring of two: one transfer, one trip
    expected = _roofline(read, flops, group_speed) + head + len(layers) * allreduce
    assert group.compute_s == pytest.approx(expected, rel=1e-9)


def _tiling(start: int, end: int) -> list[tuple[tuple[str, ...], int, int]]:
    """The group g0+g1 on [start, end), a third GPU (g2, alone) on what is left of [0, 6)."""
    return [(("g2",), 0, start)] * (start > 0) + [(("g0", "g1"), start, end)] + [(("g2",), end, 6)] * (end < 6)


def test_one_device_prices_its_head_in_one_roofline_with_its_layers() -> None:
    """A single device keeps the single roofline over layers and head together (the head overlaps nothing else
    there either, but the planner's brute-force reference and every expectation before groups were priced apart
    use it)."""
    profile, request = profile_from_hf_config(SMALL), PlanRequest(context_len=512, concurrency=8)
    device = Device("d", GiB, (Speed("torch-cuda", "bfloat16", 2e13, 1e11),))
    tables, unit = StageTables(profile, request), single_unit(device, profile)
    tokens, context, p = request.concurrency, request.context_len / 2, profile
    read = sum(p.layer_param_bytes(i) + tokens * context * p.layer_kv_bytes_per_token[i] for i in range(6))
    flops = tokens * sum(p.layer_flops_per_token[i] + context * p.layer_attn_flops_per_ctx[i] for i in range(6))
    together = _roofline(read + p.head_bytes, flops + tokens * p.head_flops_per_token, (2e13, 1e11))
    assert tables.time_of(unit, 0, 6) == pytest.approx(together, rel=1e-12)
    assert tables.times(unit)[0, 6] == tables.time_of(unit, 0, 6)
    assert tables.times_of([unit], 0, 6)[0] == pytest.approx(together, rel=1e-12)


@pytest.mark.parametrize("speeds", [
    (Speed("torch-cuda", "bfloat16", 1e14, 1e12), Speed("torch-cuda", "float16", 1e14, 1e12)),
    (Speed("torch-cuda", "bfloat16", 1e14, 1e12), Speed("onnxruntime-cuda", "bfloat16", 1e14, 1e12)),
])
def test_a_group_computes_on_one_backend_in_one_dtype(speeds: tuple[Speed, Speed]) -> None:
    profile, request = profile_from_hf_config(SMALL), PlanRequest()
    devices = tuple(Device(f"g{k}", GiB, (s,), node="box", dtype=s.dtype) for k, s in enumerate(speeds))
    fleet = FleetSnapshot(devices)
    members = tuple(single_unit(d, profile) for d in devices)
    assert all(members) and group_unit(members, group_link(fleet, devices), profile, request) is None
    with pytest.raises(PlacementError, match="cannot serve .* mixes backends or dtypes"):
        evaluate(profile, fleet, request, [(("g0", "g1"), 0, 6)])


# ------------------------------------------------------------------ a mixture of experts
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
                 "torch_dtype": "bfloat16"}


def test_a_mixture_of_experts_that_fits_only_with_its_experts_split_is_placed_on_a_group_priced_by_its_active_ones(
        ) -> None:
    """Qwen3-30B-A3B's shape (about 61 GB in bfloat16) in one stage on two 40 GiB GPUs of a node: no GPU holds it, so
    the stage is a group of both, each rank holding half its experts; and its step is priced by the experts a step's
    tokens pick: at one token a step, as a model of about 3B parameters, far below a dense one as big."""
    profile = profile_from_hf_config(QWEN3_30B_A3B)
    request = PlanRequest(concurrency=1, context_len=4096, num_stages=1)
    fleet = _node(40 * GiB, [(3e14, 1.5e12)] * 2)
    assert profile.total_bytes > 40 * GiB
    plan = plan_pipeline(profile, fleet, request)
    (stage,) = plan.pipelines[0].stages
    assert (stage.tp_degree, stage.start_layer, stage.end_layer) == (2, 0, 48)
    assert stage.memory_bytes == _rank_memory(profile, request, 0, 48, 2) <= 40 * GiB
    tables = StageTables(profile, request)
    active = sum(profile.layer_read_params(1)) * profile.bytes_per_param
    assert active < 0.15 * sum(profile.layer_params) * profile.bytes_per_param        # about 3B of 30B read a token
    assert tables.read_params[0, 48] * profile.bytes_per_param == active
    dense = replace(profile, layer_expert_params=(), experts_per_layer=0, experts_per_token=0)
    assert evaluate(profile, fleet, request, [(("g0", "g1"), 0, 48)]).stages[0].compute_s < 0.5 * evaluate(
        dense, fleet, request, [(("g0", "g1"), 0, 48)]).stages[0].compute_s
