"""The only part of the agent that touches the device: a stage's weights, its paged KV cache, the forward pass."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from stratamesh.agent.engine.scheduler import Batch
from stratamesh.agent.engine.tp_group import RankGroup
from stratamesh.fleet.types import SamplingParams, StageSpec
from stratamesh.kernels.models.config import read_config
from stratamesh.kernels.models.decoder import TORCH_DTYPES, StageModel, load_stage
from stratamesh.kernels.models.tp import apply_tp, check_tp, head_slice
from stratamesh.kernels.ops.paged_attention import PagedBatch, PagedKVCache, SeqSlice
from stratamesh.kernels.ops.sampler import sample

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One step's result: hidden rows in batch order for the next stage, or what the last stage made of the chunks
    that asked for it: sampled tokens, or (an embedding model) pooled vectors."""

    hidden: torch.Tensor | None = None       # [sum of chunk lengths, hidden_size]
    tokens: Mapping[str, int] | None = None  # session id -> sampled token id
    embeddings: Mapping[str, torch.Tensor] | None = None   # session id -> unit vector [hidden_size], float32


class StageRunner:
    """Runs batches of one stage, or of one rank of a tensor-parallel stage; call it from one thread at a time.

    Rank 0 of a group holds the other ranks (ranks) and hands each step and KV read or write to them."""

    def __init__(self, model: StageModel, num_blocks: int, rank: int = 0, ranks: RankGroup | None = None):
        self.model = model
        self.num_blocks = num_blocks
        self.cache = model.new_paged_cache(num_blocks, model.spec.kv_block_size)
        self.kv_heads = head_slice(model.config.num_kv_heads, rank, model.spec.tp_degree)
        self.ranks = ranks

    @classmethod
    def load(cls, spec: StageSpec, kv_cache_bytes: int,
             on_group_failure: Callable[[str], None] | None = None) -> StageRunner:
        """Loads the stage's own tensors and a KV cache of about kv_cache_bytes (per rank, for a TP stage, whose
        other ranks it launches; on_group_failure hears, from any thread, that the group went down)."""
        config = read_config(spec.model_path)
        check_tp(config, spec.tp_degree)
        num_blocks = max(2, PagedKVCache.blocks_for_bytes(
            kv_cache_bytes, spec.end_layer - spec.start_layer, spec.kv_block_size,
            config.num_kv_heads // spec.tp_degree, config.head_dim, TORCH_DTYPES[spec.dtype]))
        ranks = None
        if spec.tp_degree > 1:   # the other ranks load their shards while this one loads its own
            threads = max(1, torch.get_num_threads() // spec.tp_degree)
            ranks = RankGroup(spec, num_blocks, threads, on_group_failure)
        try:
            model = load_stage(spec, config)
            if ranks is not None:
                model = apply_tp(model, 0, spec.tp_degree, ranks.start().all_reduce)
        except BaseException:
            if ranks is not None:
                ranks.close()
            raise
        runner = cls(model, num_blocks, 0, ranks)
        log.info("stage [%d, %d) of %s on %d rank(s): %.1f MB of weights, %d KV blocks of %d tokens (%.1f MB) "
                 "per rank", spec.start_layer, spec.end_layer, spec.model_id, spec.tp_degree,
                 model.param_bytes / 1e6, num_blocks, spec.kv_block_size, runner.cache.nbytes / 1e6)
        return runner

    def close(self) -> None:
        """Stops the other ranks of a tensor-parallel stage; nothing to do for one process."""
        if self.ranks is not None:
            self.ranks.close()

    def forward(self, inputs: torch.Tensor, seqs: list[SeqSlice]) -> torch.Tensor:
        """The stage's layers over a step's chunks: hidden [N, hidden]; rank 0 of a group runs it on every rank."""
        attn = PagedBatch(self.cache, seqs)
        if self.ranks is None:
            return self.model.forward(inputs, attn.positions, attn)
        # a bad input found on rank 0 alone would leave the others waiting in an all-reduce: check it first
        self.model.check_inputs(inputs, attn.positions, attn)
        self.ranks.forward(inputs, tuple(seqs))
        try:
            return self.model.forward(inputs, attn.positions, attn)
        except Exception as exc:   # the ranks are out of step now
            raise self.ranks.fail(f"{type(exc).__name__}: {exc}") from exc

    def read_kv(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """K and V of a session's positions [0, num_tokens): [2, layers, num_tokens, kv heads, head dim], on the CPU
        (every head: the other ranks of a group send theirs)."""
        local = self._read_local_kv(block_table, num_tokens)
        if self.ranks is None:
            return local
        return torch.cat([local, *self.ranks.read_kv(tuple(block_table), num_tokens)], dim=3)

    def write_kv(self, block_table: list[int], kv: torch.Tensor) -> None:
        """Writes what read_kv() returned (from a stage of the same layout) into the blocks of block_table."""
        if self.ranks is not None:
            self.ranks.write_kv(tuple(block_table), kv)
        self._write_local_kv(block_table, kv[:, :, :, self.kv_heads])

    def _read_local_kv(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        cache = self.cache
        ids = torch.tensor(block_table[:-(-num_tokens // cache.block_size)], dtype=torch.long, device=cache.device)
        # each layer's blocks [blocks, block_size, H, D] -> token slots [blocks * block_size, H, D] -> the first n
        return torch.stack([torch.stack([layer[ids].flatten(0, 1)[:num_tokens] for layer in layers])
                            for layers in (cache.k, cache.v)]).cpu()

    def _write_local_kv(self, block_table: list[int], kv: torch.Tensor) -> None:
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
        if model.spec.is_first:
            inputs = torch.tensor([t for c in batch.chunks for t in c.item.token_ids[c.begin:c.end]])
        else:
            inputs = torch.cat(payloads)                           # [N, hidden]
        with torch.inference_mode():
            hidden = self.forward(inputs, seqs)
            if not model.spec.is_last:
                return StepOutput(hidden=hidden)
            rows = [s.q_start + s.q_len - 1 for s, c in zip(seqs, batch.chunks, strict=True) if c.sample]
            sampled = [c for c in batch.chunks if c.sample]
            if not model.config.has_lm_head:    # an embedding model: the prompt's last token, pooled
                vectors = model.pool(hidden[rows]) if rows else None   # [num sampled, hidden]
                return StepOutput(embeddings={c.session_id: vectors[i] for i, c in enumerate(sampled)})
            logits = model.logits(hidden[rows]) if rows else None  # [num sampled, vocab]
        tokens = {}
        for i, chunk in enumerate(sampled):
            position = chunk.start_pos + chunk.end - chunk.begin    # the position of the new token
            tokens[chunk.session_id] = sample(logits[i], sampling[chunk.session_id], position)
        return StepOutput(tokens=tokens)

