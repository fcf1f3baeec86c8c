"""A context whose KV is recomputed in one prefill, as a failover's new route recomputes it, continues as the decoded
one did: its logits stay within the margin the end-to-end tests keep between a greedy step's two best tokens
(stratamesh/bench/margins.py MIN_MARGIN), so those tests can ask for identical tokens after a failover."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from stratamesh.bench.margins import MIN_MARGIN
from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels.models.decoder import StageModel, load_stage
from stratamesh.kernels.ops.paged_attention import PagedBatch, PagedKVCache, SeqSlice

NUM_BLOCKS, BLOCK = 64, 16


def greedy_logits(stage: StageModel, prompts: torch.Tensor, num_tokens: int, recompute_at: int = 0) -> torch.Tensor:
    """Logits [num_tokens, B, vocab] of greedy decoding of B prompts [B, P] at once, decoding each step's tokens as
    one batch; after recompute_at tokens (0: never) the KV is dropped and each context is prefilled afresh."""
    contexts = [row.tolist() for row in prompts]
    tables = [list(range(i * NUM_BLOCKS // len(contexts), (i + 1) * NUM_BLOCKS // len(contexts)))
              for i in range(len(contexts))]
    cache, last = _prefill(stage, contexts, tables)
    out = []
    for step in range(num_tokens):
        logits = stage.logits(last)                                   # [B, vocab]
        out.append(logits)
        tokens = logits.argmax(-1)
        for context, token in zip(contexts, tokens.tolist(), strict=True):
            context.append(token)
        if step + 1 == recompute_at:
            cache, last = _prefill(stage, contexts, tables)
        else:
            seqs = [SeqSlice(i, 1, len(c) - 1, t) for i, (c, t) in enumerate(zip(contexts, tables, strict=True))]
            batch = PagedBatch(cache, seqs)
            last = stage.forward(tokens, batch.positions, batch)
    return torch.stack(out)


def _prefill(stage: StageModel, contexts: list[list[int]],
             tables: list[list[int]]) -> tuple[PagedKVCache, torch.Tensor]:
    """Every context prefilled in one batch into a fresh cache -> that cache, the hidden of each one's last token."""
    cache = stage.new_paged_cache(NUM_BLOCKS, BLOCK)
    seqs, row = [], 0
    for context, table in zip(contexts, tables, strict=True):
        seqs.append(SeqSlice(row, len(context), 0, table))
        row += len(context)
    batch = PagedBatch(cache, seqs)
    hidden = stage.forward(torch.tensor([t for c in contexts for t in c]), batch.positions, batch)
    return cache, hidden[[s.q_start + s.q_len - 1 for s in seqs]]


def test_a_recomputed_context_continues_within_the_end_to_end_tests_margin(tiny_model: Callable[..., Path]) -> None:
    model_dir = tiny_model(num_layers=6)
    stage = load_stage(StageSpec("m", str(model_dir), 0, 6, 6))
    prompts = torch.randint(3, 1024, (6, 20), generator=torch.Generator().manual_seed(1))
    decoded = greedy_logits(stage, prompts, 32)
    recomputed = greedy_logits(stage, prompts, 32, recompute_at=12)
    assert torch.equal(decoded[:12], recomputed[:12])                 # the same computation up to the recompute
    drift = (decoded[12:] - recomputed[12:]).abs().max()
    assert drift < MIN_MARGIN, f"logits drift {drift:.2e} after a recompute"
