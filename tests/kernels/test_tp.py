"""Tensor parallelism as a transformation: N sharded copies of a stage, summing over gloo, act as the whole one.

The ranks here are threads of this process, each with its own gloo process group on loopback (a real all-reduce
over TCP); tests/agent/test_tp_runner.py runs them as the separate processes an agent launches."""

from __future__ import annotations

import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from stratamesh.agent.engine.tp_group import Collectives, store_for
from stratamesh.fleet.errors import CheckpointError, InvalidInput
from stratamesh.fleet.stages import MOE_MODEL_TYPES, StageSpec
from stratamesh.kernels.models.config import read_config
from stratamesh.kernels.models.decoder import StageModel, load_stage
from stratamesh.kernels.models.tp import apply_tp, check_tp, head_slice, load_tp_stage, shard_tensors
from tests.kernels.test_decoder import hf_greedy, hf_logits, prompt

NUM_LAYERS = 6
# float32 on CPU: sharded matmuls sum in a different order than whole ones; observed max |diff| about 6e-6
LOGITS_ATOL = 1e-4
NUM_NEW_TOKENS = 24
GQA = {"num_heads": 8, "num_kv_heads": 4}   # TP=4 needs KV heads divisible by 4


def sharded_ranks(model_dir, world_size: int, start: int = 0, end: int = NUM_LAYERS) -> list[StageModel]:
    """world_size ranks of stage [start, end), joined in one gloo group (threads of this process)."""
    spec = StageSpec("tiny", str(model_dir), start, end, NUM_LAYERS, tp_degree=world_size)
    master = store_for(0, world_size, 0)
    stores = [master] + [store_for(r, world_size, master.port) for r in range(1, world_size)]
    with ThreadPoolExecutor(world_size) as pool:   # joining a group blocks until every rank is in
        groups = list(pool.map(lambda r: Collectives(stores[r], r, world_size, "gloo"), range(world_size)))
    return [load_tp_stage(spec, r, groups[r].all_reduce) for r in range(world_size)]


def on_every_rank(ranks: list[StageModel], fn) -> list:
    """fn(rank's model, rank's state) on every rank at once, as the ranks of a group run: results in rank order."""
    with ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(fn, ranks, range(len(ranks))))


def sharded_logits(ranks: list[StageModel], caches: list, ids: torch.Tensor, start: int) -> list[torch.Tensor]:
    positions = torch.arange(start, start + ids.numel())

    def run(model: StageModel, rank: int) -> torch.Tensor:
        return model.logits(model.forward(ids, positions, caches[rank]))
    return on_every_rank(ranks, run)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral", "qwen2_moe",
                                  "qwen3_moe"])   # qwen2: biases split; qwen3, gemma3_text: q and k norms (and
# Gemma's sandwich norms) whole on every rank; phi3: each fused matrix split in each of the matrices it holds; the
# mixtures of experts: experts split by expert (each rank its run of 8 / N), Qwen2-MoE's shared expert and Qwen's
# dense layers as a dense MLP
@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_stage_matches_the_whole_model_and_transformers(tiny_model, arch, world_size):
    model_dir = tiny_model(arch, **GQA, **({"num_experts": 8} if arch in MOE_MODEL_TYPES else {}))
    ids = prompt(seed=11)
    whole = load_stage(StageSpec("tiny", str(model_dir), 0, NUM_LAYERS, NUM_LAYERS))
    expected = whole.logits(whole.forward(ids, torch.arange(ids.numel()), whole.new_cache()))
    ranks = sharded_ranks(model_dir, world_size)
    caches = [m.new_cache() for m in ranks]
    got = sharded_logits(ranks, caches, ids, 0)
    for logits in got:   # every rank ends with the whole hidden state, so the same logits
        torch.testing.assert_close(logits, expected, atol=LOGITS_ATOL, rtol=0)
        torch.testing.assert_close(logits, hf_logits(model_dir, ids), atol=LOGITS_ATOL, rtol=0)
    print(f"\n{arch} TP={world_size}: max |logits - unsharded| {(got[0] - expected).abs().max():.1e}, "
          f"max |logits - transformers| {(got[0] - hf_logits(model_dir, ids)).abs().max():.1e}")
    # each rank caches its own KV heads only
    kv_heads = read_config(model_dir).num_kv_heads // world_size
    assert all(m.num_kv_heads == kv_heads and m.new_paged_cache(2, 16).k[0].shape[2] == kv_heads for m in ranks)


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_greedy_decode_gives_the_tokens_of_generate(tiny_model, world_size):
    model_dir = tiny_model("llama", **GQA)
    ids = prompt(seed=12)
    ranks = sharded_ranks(model_dir, world_size)
    caches = [m.new_cache(chunk_tokens=16) for m in ranks]
    logits = sharded_logits(ranks, caches, ids, 0)[0]
    out = [int(logits[-1].argmax())]
    while len(out) < NUM_NEW_TOKENS:
        logits = sharded_logits(ranks, caches, torch.tensor([out[-1]]), ids.numel() + len(out) - 1)[0]
        out.append(int(logits[-1].argmax()))
    assert out == hf_greedy(model_dir, ids, NUM_NEW_TOKENS)


def test_a_middle_stage_sharded_chains_with_whole_stages(tiny_model):
    """Edge [0, 2) -> TP=2 [2, 5) -> edge [5, 6): the logits of the unsplit model."""
    model_dir = tiny_model("llama", **GQA)
    ids = prompt(seed=13)
    first, last = (load_stage(StageSpec("tiny", str(model_dir), s, e, NUM_LAYERS)) for s, e in ((0, 2), (5, 6)))
    middle = sharded_ranks(model_dir, 2, 2, 5)
    positions = torch.arange(ids.numel())
    hidden = first.forward(ids, positions, first.new_cache())
    caches = [m.new_cache() for m in middle]
    outs = on_every_rank(middle, lambda m, r: m.forward(hidden, positions, caches[r]))
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)   # the all-reduce leaves every rank the same
    logits = last.logits(last.forward(outs[0], positions, last.new_cache()))
    torch.testing.assert_close(logits, hf_logits(model_dir, ids), atol=LOGITS_ATOL, rtol=0)


def test_the_shards_put_together_are_the_whole_tensors(tiny_model):
    model_dir = tiny_model("qwen2", **GQA)
    config = read_config(model_dir)
    whole = load_stage(StageSpec("tiny", str(model_dir), 0, 2, NUM_LAYERS)).tensors
    shards = [shard_tensors(config, whole, r, 4) for r in range(4)]
    p = "model.layers.1."
    column = [p + "self_attn.q_proj.weight", p + "self_attn.k_proj.bias", p + "mlp.up_proj.weight"]
    row = [p + "self_attn.o_proj.weight", p + "mlp.down_proj.weight"]
    for name in column:
        assert torch.equal(torch.cat([s[name] for s in shards], dim=0), whole[name])
        assert shards[1][name].shape[0] == whole[name].shape[0] // 4
    for name in row:
        assert torch.equal(torch.cat([s[name] for s in shards], dim=1), whole[name])
    for name in (p + "input_layernorm.weight", "model.embed_tokens.weight"):
        assert all(s[name] is whole[name] for s in shards)   # replicated, not copied
    assert head_slice(config.num_kv_heads, 3, 4) == slice(3, 4)


@pytest.mark.parametrize("arch", ["qwen2", "phi3"])
def test_a_rank_reads_from_the_checkpoint_exactly_its_shards(tiny_model, arch):
    """What a served rank loads (its shards alone, read as slices of the checkpoint's tensors) is what sharding the
    whole stage in memory gives, for every tensor, biases, fused and replicated ones included."""
    model_dir = tiny_model(arch, **GQA)
    config = read_config(model_dir)
    whole = load_stage(StageSpec("tiny", str(model_dir), 0, NUM_LAYERS, NUM_LAYERS)).tensors
    spec = StageSpec("tiny", str(model_dir), 0, NUM_LAYERS, NUM_LAYERS, tp_degree=4)
    for rank in range(4):
        loaded = load_tp_stage(spec, rank, lambda t: t).tensors
        expected = shard_tensors(config, whole, rank, 4)
        assert loaded.keys() == expected.keys()
        for name, t in expected.items():
            assert torch.equal(loaded[name], t) and loaded[name].is_contiguous(), name
    q = "model.layers.0.self_attn." + ("qkv_proj.weight" if arch == "phi3" else "q_proj.weight")
    assert loaded[q].shape[0] == whole[q].shape[0] // 4


def test_a_shard_of_a_tensor_whose_shape_the_config_does_not_imply_is_refused(tiny_model, tmp_path):
    model_dir = tiny_model("llama", **GQA)
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["intermediate_size"] *= 2        # the MLP's tensors are half as wide as this says
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"mlp\.(gate|up)_proj\.weight' has shape .* expected \d+ along "
                                              r"dimension 0"):
        load_tp_stage(StageSpec("tiny", str(bad), 0, 2, NUM_LAYERS, tp_degree=2), 0, lambda t: t)


@pytest.mark.parametrize("world_size, what", [(3, "attention heads"), (4, "KV heads")])
def test_a_group_that_cannot_split_the_heads_evenly_is_refused(tiny_model, world_size, what):
    config = read_config(tiny_model("llama"))   # 4 heads, 2 KV heads
    with pytest.raises(InvalidInput, match=what):
        check_tp(config, world_size)


def test_the_model_code_asks_no_rank(tiny_model):
    """Distribution is a transformation: an unsharded model sums nothing, a sharded one through the function
    it was given, and is otherwise the same object."""
    model = load_stage(StageSpec("tiny", str(tiny_model("llama")), 0, 2, NUM_LAYERS))
    calls = []
    lock = threading.Lock()

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        with lock:
            calls.append(tuple(t.shape))
        return t
    ids = prompt(seed=14, length=5)
    model.forward(ids, torch.arange(5), model.new_cache())
    assert apply_tp(model, 0, 1, all_reduce) is model
    model.forward(ids, torch.arange(5), model.new_cache())
    assert calls == [(5, 256)] * 4   # after attention and after the MLP, in each of 2 layers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_single_rank_nccl_group_on_a_gpu_matches_the_whole_model(tiny_model):
    """The NCCL path as far as one GPU allows: a group of one, its all-reduce through NCCL on the device."""
    model_dir = tiny_model("llama", **GQA)
    spec = StageSpec("tiny", str(model_dir), 0, NUM_LAYERS, NUM_LAYERS, device="cuda:0")
    ids = prompt(seed=15)
    whole = load_stage(spec)
    expected = whole.logits(whole.forward(ids, torch.arange(ids.numel()), whole.new_cache())).cpu()
    group = Collectives(store_for(0, 1, 0), 0, 1, "nccl")
    sharded = load_tp_stage(spec, 0, group.all_reduce)     # as a served rank loads (StageRunner, tp_worker)
    got = sharded.logits(sharded.forward(ids, torch.arange(ids.numel()), sharded.new_cache())).cpu()
    assert group.num_all_reduces == 2 * NUM_LAYERS
    torch.testing.assert_close(got, expected, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_an_expert_parallel_rank_reads_only_its_own_experts(tiny_model, arch):
    """Each of 2 ranks reads its run of the 8 experts of each sparse layer (and the router whole): no expert twice,
    none missing; 5 experts cannot be split by 2, and the group is refused saying so."""
    model_dir = tiny_model(arch, **GQA, num_experts=8)
    ranks = sharded_ranks(model_dir, 2)
    held = [{n for n in r.tensors if ".experts." in n} for r in ranks]
    assert not held[0] & held[1]
    whole = {n for n in load_stage(StageSpec("tiny", str(model_dir), 0, NUM_LAYERS, NUM_LAYERS)).tensors
             if ".experts." in n}
    assert held[0] | held[1] == whole
    assert {int(n.split(".experts.")[1].split(".")[0]) for n in held[1]} == {4, 5, 6, 7}
    assert all(r.tensors[next(n for n in r.tensors if n.endswith("gate.weight") and "shared" not in n)].shape[0] == 8
               for r in ranks)
    with pytest.raises(InvalidInput, match="cannot split 5 experts evenly"):
        check_tp(read_config(tiny_model(arch, **GQA, num_experts=5)), 2)
