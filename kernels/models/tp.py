"""Tensor parallelism as a transformation of a stage (gpt-fast's apply_tp): the model code never asks its rank.

Megatron's split of a Llama layer over N ranks: q, k, v and the MLP's gate and up are column-parallel (each rank
computes whole heads, KV heads and a slice of the intermediate units); o and down are row-parallel (each rank
multiplies its slice, and an all-reduce sums the partial outputs). So a layer costs two all-reduces of
[tokens, hidden], and each rank caches K and V of its own KV heads only. Norms, the embedding and the LM head
stay whole on every rank.

A mixture of experts' sparse layers are split by expert (expert parallelism): each rank holds E / N whole experts
(rank r the r-th run of them) and the router whole; every rank has every token's hidden state after attention's
all-reduce, routes them all, runs the tokens routed to its own experts, and the MLP's all-reduce sums the ranks'
partial outputs (the dispatch and the combine of an all-to-all, in one collective). A shared expert is split as a
dense MLP is."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch

from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels.models.checkpoint import Checkpoint, Slice
from stratamesh.kernels.models.config import ModelConfig, read_config
from stratamesh.kernels.models.decoder import TORCH_DTYPES, StageModel, checked_tensor_names

# The parameter name's tail after "model.layers.{i}." -> the dimension split across ranks, in units of what: a
# fused matrix (Phi-3's) is split in each of the matrices it holds, a rank taking its share of each
COLUMN = {"self_attn.q_proj": ("heads",), "self_attn.k_proj": ("kv_heads",), "self_attn.v_proj": ("kv_heads",),
          "mlp.gate_proj": ("mlp",), "mlp.up_proj": ("mlp",),
          "self_attn.qkv_proj": ("heads", "kv_heads", "kv_heads"), "mlp.gate_up_proj": ("mlp", "mlp"),
          "mlp.shared_expert.gate_proj": ("shared",), "mlp.shared_expert.up_proj": ("shared",)}
ROW = {"self_attn.o_proj.weight": ("heads",), "mlp.down_proj.weight": ("mlp",),
       "mlp.shared_expert.down_proj.weight": ("shared",)}
_EXPERT = re.compile(r"model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")


def check_tp(config: ModelConfig, world_size: int) -> None:
    """InvalidInput unless world_size ranks can each take whole heads, whole KV heads and an equal MLP slice (of a
    mixture of experts: whole experts, as many each, and an equal slice of its shared expert and dense layers)."""
    moe = config.moe
    dense = moe is None or not all(moe.sparse_layers)
    counts = [("attention heads", config.num_heads), ("KV heads", config.num_kv_heads)]
    counts += [("MLP units", config.intermediate_size)] if dense else []
    counts += [("experts", moe.num_experts), ("shared expert units", moe.shared_intermediate)] if moe else []
    for what, count in counts:
        if world_size < 1 or count % world_size:
            raise InvalidInput(f"a tensor-parallel group of {world_size} cannot split {count} {what} evenly")


def holds(config: ModelConfig, name: str, rank: int, world_size: int) -> bool:
    """Whether rank of a group of world_size holds the named tensor: every tensor, but of a sparse layer's experts
    only its own run of E / world_size."""
    match = _EXPERT.match(name)
    if match is None or config.moe is None:
        return True
    return int(match[1]) // (config.moe.num_experts // world_size) == rank


def shard_slices(config: ModelConfig, names: Iterable[str], rank: int, world_size: int) -> dict[str, Slice]:
    """The part of each named tensor that rank holds, of those split across ranks (the others it holds whole:
    norms, embedding, LM head, o_proj's bias, which is added once after the sum)."""
    check_tp(config, world_size)
    units = {"heads": config.num_heads * config.head_dim, "kv_heads": config.num_kv_heads * config.head_dim,
             "mlp": config.intermediate_size, "shared": config.moe.shared_intermediate if config.moe else 0}
    out = {}
    for name in names:
        tail = name.split(".", 3)[-1] if name.startswith("model.layers.") else ""
        column, row = COLUMN.get(tail.rsplit(".", 1)[0]), ROW.get(tail)
        if column is None and row is None:
            continue
        dim = 0 if column is not None else 1    # weight [out, in] or bias [out]: this rank's rows; else its columns
        ranges, offset = [], 0
        for unit in column or row:
            per_rank = units[unit] // world_size
            ranges.append((offset + rank * per_rank, per_rank))
            offset += units[unit]
        out[name] = Slice(dim, offset, tuple(ranges))
    return out


def shard_tensors(config: ModelConfig, tensors: dict[str, torch.Tensor], rank: int,
                  world_size: int) -> dict[str, torch.Tensor]:
    """Rank's shards of a stage's tensors (owned copies, so the whole tensors can be freed)."""
    slices = shard_slices(config, tensors, rank, world_size)
    return {name: t if name not in slices else _slice(t, slices[name]) for name, t in tensors.items()
            if holds(config, name, rank, world_size)}


def load_tp_stage(spec: StageSpec, rank: int, all_reduce: Callable[[torch.Tensor], torch.Tensor],
                  config: ModelConfig | None = None) -> StageModel:
    """Rank's part of a tensor-parallel stage (of spec.tp_degree ranks), on spec.device: each split tensor is read
    from the checkpoint as rank's shard alone, so a rank never holds the whole stage, in RAM or on its GPU;
    all_reduce sums a tensor over the ranks (it may be bound after the load, once the group is up)."""
    config = config or read_config(spec.model_path)
    names = [n for n in checked_tensor_names(spec, config) if holds(config, n, rank, spec.tp_degree)]
    tensors = Checkpoint(spec.model_path).load(names, TORCH_DTYPES[spec.dtype], spec.device,
                                               shard_slices(config, names, rank, spec.tp_degree))
    return StageModel(config, spec, tensors, spec.tp_degree, all_reduce)


def apply_tp(model: StageModel, rank: int, world_size: int,
             all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> StageModel:
    """Turns a whole stage in memory into rank's part of a tensor-parallel one; all_reduce sums a tensor over the
    ranks. (A served stage reads its shards alone: load_tp_stage.)"""
    c = model.config
    model.reshard(shard_tensors(c, model.tensors, rank, world_size), c.num_heads // world_size,
                  c.num_kv_heads // world_size, all_reduce)
    return model


def head_slice(num_kv_heads: int, rank: int, world_size: int) -> slice:
    """The KV heads rank holds, of a stage's num_kv_heads."""
    per_rank = num_kv_heads // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def _slice(t: torch.Tensor, part: Slice) -> torch.Tensor:
    assert t.shape[part.dim] == part.size, (tuple(t.shape), part)
    return part.of(t).clone() if len(part.ranges) == 1 else part.of(t)     # (several ranges: cat copied them)
