"""Tensor parallelism as a transformation of a stage (gpt-fast's apply_tp): the model code never asks its rank.

Megatron's split of a Llama layer over N ranks: q, k, v and the MLP's gate and up are column-parallel (each rank
computes whole heads, KV heads and a slice of the intermediate units); o and down are row-parallel (each rank
multiplies its slice, and an all-reduce sums the partial outputs). So a layer costs two all-reduces of
[tokens, hidden], and each rank caches K and V of its own KV heads only. Norms, the embedding and the LM head
stay whole on every rank."""

from __future__ import annotations

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
          "self_attn.qkv_proj": ("heads", "kv_heads", "kv_heads"), "mlp.gate_up_proj": ("mlp", "mlp")}
ROW = {"self_attn.o_proj.weight": ("heads",), "mlp.down_proj.weight": ("mlp",)}


def check_tp(config: ModelConfig, world_size: int) -> None:
    """InvalidInput unless world_size ranks can each take whole heads, whole KV heads and an equal MLP slice (and,
    for now, the model has no experts to split)."""
    if world_size > 1 and config.moe is not None:
        raise InvalidInput(f"a tensor-parallel group cannot serve {config.arch} yet: mixture-of-experts layers run in "
                           "single-process stages")
    for what, count in (("attention heads", config.num_heads), ("KV heads", config.num_kv_heads),
                        ("MLP units", config.intermediate_size)):
        if world_size < 1 or count % world_size:
            raise InvalidInput(f"a tensor-parallel group of {world_size} cannot split {count} {what} evenly")


def shard_slices(config: ModelConfig, names: Iterable[str], rank: int, world_size: int) -> dict[str, Slice]:
    """The part of each named tensor that rank holds, of those split across ranks (the others it holds whole:
    norms, embedding, LM head, o_proj's bias, which is added once after the sum)."""
    check_tp(config, world_size)
    units = {"heads": config.num_heads * config.head_dim, "kv_heads": config.num_kv_heads * config.head_dim,
             "mlp": config.intermediate_size}
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
    return {name: t if name not in slices else _slice(t, slices[name]) for name, t in tensors.items()}


def load_tp_stage(spec: StageSpec, rank: int, all_reduce: Callable[[torch.Tensor], torch.Tensor],
                  config: ModelConfig | None = None) -> StageModel:
    """Rank's part of a tensor-parallel stage (of spec.tp_degree ranks), on spec.device: each split tensor is read
    from the checkpoint as rank's shard alone, so a rank never holds the whole stage, in RAM or on its GPU;
    all_reduce sums a tensor over the ranks (it may be bound after the load, once the group is up)."""
    config = config or read_config(spec.model_path)
    names = checked_tensor_names(spec, config)
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
