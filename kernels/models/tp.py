"""Tensor parallelism as a transformation of a stage (gpt-fast's apply_tp): the model code never asks its rank.

Megatron's split of a Llama layer over N ranks: q, k, v and the MLP's gate and up are column-parallel (each rank
computes whole heads, KV heads and a slice of the intermediate units); o and down are row-parallel (each rank
multiplies its slice, and an all-reduce sums the partial outputs). So a layer costs two all-reduces of
[tokens, hidden], and each rank caches K and V of its own KV heads only. Norms, the embedding and the LM head
stay whole on every rank."""

from __future__ import annotations

from collections.abc import Callable

import torch

from stratamesh.fleet.errors import InvalidInput
from stratamesh.kernels.models.config import ModelConfig
from stratamesh.kernels.models.decoder import StageModel

# The parameter name's tail after "model.layers.{i}." -> the dimension split across ranks, and in units of what
COLUMN = {"self_attn.q_proj": "heads", "self_attn.k_proj": "kv_heads", "self_attn.v_proj": "kv_heads",
          "mlp.gate_proj": "mlp", "mlp.up_proj": "mlp"}
ROW = {"self_attn.o_proj.weight": "heads", "mlp.down_proj.weight": "mlp"}


def check_tp(config: ModelConfig, world_size: int) -> None:
    """InvalidInput unless world_size ranks can each take whole heads, whole KV heads and an equal MLP slice."""
    for what, count in (("attention heads", config.num_heads), ("KV heads", config.num_kv_heads),
                        ("MLP units", config.intermediate_size)):
        if world_size < 1 or count % world_size:
            raise InvalidInput(f"a tensor-parallel group of {world_size} cannot split {count} {what} evenly")


def shard_tensors(config: ModelConfig, tensors: dict[str, torch.Tensor], rank: int,
                  world_size: int) -> dict[str, torch.Tensor]:
    """Rank's shards of a stage's checkpoint tensors (owned copies, so the whole tensors can be freed)."""
    check_tp(config, world_size)
    units = {"heads": config.num_heads * config.head_dim, "kv_heads": config.num_kv_heads * config.head_dim,
             "mlp": config.intermediate_size}
    out = {}
    for name, t in tensors.items():
        tail = name.split(".", 3)[-1] if name.startswith("model.layers.") else ""
        column, row = COLUMN.get(tail.rsplit(".", 1)[0]), ROW.get(tail)
        if column is not None:      # weight [out, in] or bias [out]: this rank's rows
            out[name] = _slice(t, 0, units[column], rank, world_size)
        elif row is not None:       # weight [out, in]: this rank's columns
            out[name] = _slice(t, 1, units[row], rank, world_size)
        else:                       # norms, embedding, LM head, o_proj's bias (added once after the sum)
            out[name] = t
    return out


def apply_tp(model: StageModel, rank: int, world_size: int,
             all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> StageModel:
    """Turns a whole stage into rank's part of a tensor-parallel one; all_reduce sums a tensor over the ranks."""
    c = model.config
    model.reshard(shard_tensors(c, model.tensors, rank, world_size), c.num_heads // world_size,
                  c.num_kv_heads // world_size, all_reduce)
    return model


def head_slice(num_kv_heads: int, rank: int, world_size: int) -> slice:
    """The KV heads rank holds, of a stage's num_kv_heads."""
    per_rank = num_kv_heads // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def _slice(t: torch.Tensor, dim: int, size: int, rank: int, world_size: int) -> torch.Tensor:
    assert t.shape[dim] == size, (tuple(t.shape), dim, size)
    per_rank = size // world_size
    return t.narrow(dim, rank * per_rank, per_rank).clone()
