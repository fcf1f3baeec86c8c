"""The only part of the agent that touches the device: a stage's weights, its paged KV cache, the forward pass."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from stratamesh.agent.engine.scheduler import Batch
from stratamesh.fleet.types import SamplingParams, StageSpec
from stratamesh.kernels.models.decoder import StageModel, load_stage
from stratamesh.kernels.ops.paged_attention import PagedBatch, SeqSlice
from stratamesh.kernels.ops.sampler import sample

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One step's result: hidden rows in batch order for the next stage, or the tokens the last stage sampled."""

    hidden: torch.Tensor | None = None       # [sum of chunk lengths, hidden_size]
    tokens: Mapping[str, int] | None = None  # session id -> sampled token id


class StageRunner:
    """Runs batches of one stage; call it from one thread at a time."""

    def __init__(self, model: StageModel, num_blocks: int):
        self.model = model
        self.num_blocks = num_blocks
        self.cache = model.new_paged_cache(num_blocks, model.spec.kv_block_size)

    @classmethod
    def load(cls, spec: StageSpec, kv_cache_bytes: int) -> StageRunner:
        """Loads the stage's own tensors and a KV cache of about kv_cache_bytes."""
        model = load_stage(spec)
        c = model.config
        layers = spec.end_layer - spec.start_layer
        bytes_per_block = 2 * layers * c.num_kv_heads * c.head_dim * model.dtype.itemsize * spec.kv_block_size
        num_blocks = max(2, kv_cache_bytes // bytes_per_block)
        log.info("stage [%d, %d) of %s: %.1f MB of weights, %d KV blocks of %d tokens (%.1f MB)",
                 spec.start_layer, spec.end_layer, spec.model_id, model.param_bytes / 1e6, num_blocks,
                 spec.kv_block_size, num_blocks * bytes_per_block / 1e6)
        return cls(model, num_blocks)

    def read_kv(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """K and V of a session's positions [0, num_tokens): [2, layers, num_tokens, kv heads, head dim], on the CPU."""
        cache = self.cache
        ids = torch.tensor(block_table[:-(-num_tokens // cache.block_size)], dtype=torch.long, device=cache.device)
        # each layer's blocks [blocks, block_size, H, D] -> token slots [blocks * block_size, H, D] -> the first n
        return torch.stack([torch.stack([layer[ids].flatten(0, 1)[:num_tokens] for layer in layers])
                            for layers in (cache.k, cache.v)]).cpu()

    def write_kv(self, block_table: list[int], kv: torch.Tensor) -> None:
        """Writes what read_kv() returned (from a stage of the same layout) into the blocks of block_table."""
        cache, num_tokens = self.cache, kv.shape[2]
        num_blocks = -(-num_tokens // cache.block_size)
        ids = torch.tensor(block_table[:num_blocks], dtype=torch.long, device=cache.device)
        padded = torch.zeros((2, kv.shape[1], num_blocks * cache.block_size, *kv.shape[3:]), dtype=cache.dtype)
        padded[:, :, :num_tokens] = kv
        padded = padded.to(cache.device).unflatten(2, (num_blocks, cache.block_size))  # [2, L, blocks, bs, H, D]
        for layer in range(cache.num_layers):
            cache.k[layer][ids] = padded[0, layer]
            cache.v[layer][ids] = padded[1, layer]

    def run(self, batch: Batch, payloads: list[torch.Tensor | None],
            sampling: Mapping[str, SamplingParams]) -> StepOutput:
        """One forward pass over every chunk of the batch; payloads[i] holds chunk i's input rows."""
        model, seqs, q_start = self.model, [], 0
        for chunk in batch.chunks:
            length = chunk.end - chunk.begin
            seqs.append(SeqSlice(q_start, length, chunk.start_pos, chunk.block_table))
            q_start += length
        attn = PagedBatch(self.cache, seqs)
        if model.spec.is_first:
            inputs = torch.tensor([t for c in batch.chunks for t in c.item.token_ids[c.begin:c.end]])
        else:
            inputs = torch.cat(payloads)                           # [N, hidden]
        with torch.inference_mode():
            hidden = model.forward(inputs, attn.positions, attn)
            if not model.spec.is_last:
                return StepOutput(hidden=hidden)
            rows = [s.q_start + s.q_len - 1 for s, c in zip(seqs, batch.chunks, strict=True) if c.sample]
            logits = model.logits(hidden[rows]) if rows else None  # [num sampled, vocab]
        tokens = {}
        sampled = [c for c in batch.chunks if c.sample]
        for i, chunk in enumerate(sampled):
            position = chunk.start_pos + chunk.end - chunk.begin    # the position of the new token
            tokens[chunk.session_id] = sample(logits[i], sampling[chunk.session_id], position)
        return StepOutput(tokens=tokens)
