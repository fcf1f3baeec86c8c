"""A stage running a batch of sequences over a paged KV cache: same logits as one sequence at a time, same
greedy tokens as transformers."""

from __future__ import annotations

import pytest
import torch

from stratamesh.fleet.errors import InvalidInput
from stratamesh.kernels.models.decoder import StageModel
from stratamesh.kernels.ops.paged_attention import PagedBatch, SeqSlice
from stratamesh.kernels.tiny_model import TINY_ARCHS
from tests.kernels.test_decoder import LOGITS_ATOL, SPLIT, hf_greedy, load_stages, prompt, run_pipeline

BLOCK_SIZE = 4       # small, so every sequence spans many non-contiguous blocks
NUM_BLOCKS = 160
PREFILL_CHUNK = 24   # prompts longer than this are prefilled over two steps, beside other sequences' decodes


class PagedPipeline:
    """Stages with one paged cache each; a sequence gets the same random blocks in every stage."""

    def __init__(self, stages: list[StageModel], seed: int = 0) -> None:
        self.stages = stages
        self.caches = [s.new_paged_cache(NUM_BLOCKS, BLOCK_SIZE) for s in stages]
        self._free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()

    def allocate(self, num_tokens: int) -> list[int]:
        return [self._free.pop() for _ in range(-(-num_tokens // BLOCK_SIZE))]

    def step(self, chunks: list[tuple[list[int], int, torch.Tensor]]) -> torch.Tensor:
        """One batched pass over chunks (block_table, start_pos, token ids) -> logits [N, vocab]."""
        seqs, row = [], 0
        for table, start_pos, ids in chunks:
            seqs.append(SeqSlice(row, ids.numel(), start_pos, table))
            row += ids.numel()
        x = torch.cat([ids for _, _, ids in chunks])
        for stage, cache in zip(self.stages, self.caches):
            batch = PagedBatch(cache, seqs)
            x = stage.forward(x, batch.positions, batch)
        return self.stages[-1].logits(x)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_mixed_batch_matches_one_sequence_at_a_time(tiny_model, arch):
    stages = load_stages(tiny_model(arch), SPLIT)
    ids = {name: prompt(seed=10 + i, length=n) for i, (name, n) in enumerate(
        [("fresh", 20), ("mid_prefill", 25), ("decode", 37), ("long_decode", 50)])}
    alone = {name: run_pipeline(stages, [s.new_cache() for s in stages], t, 0) for name, t in ids.items()}
    pipe = PagedPipeline(stages, seed=1)
    tables = {name: pipe.allocate(t.numel()) for name, t in ids.items()}
    # step 1 writes the cached prefixes, step 2 mixes decodes, a fresh prefill and a prefill after a prefix
    first = {"mid_prefill": (0, 15), "decode": (0, 36), "long_decode": (0, 49)}
    second = {"decode": (36, 37), "fresh": (0, 20), "mid_prefill": (15, 25), "long_decode": (49, 50)}
    for step in (first, second):
        logits = pipe.step([(tables[n], a, ids[n][a:b]) for n, (a, b) in step.items()])
        row = 0
        for name, (a, b) in step.items():
            torch.testing.assert_close(logits[row:row + b - a], alone[name][a:b], atol=LOGITS_ATOL, rtol=0)
            row += b - a


def greedy_batch(pipe: PagedPipeline, prompts: list[torch.Tensor], num_new: int) -> list[list[int]]:
    """Continuous batching in miniature: chunked prefills beside decodes until each has num_new tokens."""
    tokens = [p.tolist() for p in prompts]
    cached = [0] * len(prompts)
    tables = [pipe.allocate(p.numel() + num_new) for p in prompts]
    while any(len(t) - p.numel() < num_new for t, p in zip(tokens, prompts)):
        live = [i for i, p in enumerate(prompts) if len(tokens[i]) - p.numel() < num_new]
        ends = {i: min(len(tokens[i]), cached[i] + PREFILL_CHUNK) for i in live}
        logits = pipe.step([(tables[i], cached[i], torch.tensor(tokens[i][cached[i]:ends[i]])) for i in live])
        row = 0
        for i in live:
            row += ends[i] - cached[i]
            cached[i] = ends[i]
            if ends[i] == len(tokens[i]):   # the chunk reached the end: its last row predicts the next token
                tokens[i].append(int(logits[row - 1].argmax()))
    return [t[p.numel():] for t, p in zip(tokens, prompts)]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_batched_greedy_decode_matches_generate(tiny_model, arch):
    """Prompts of 5..40 tokens; 40 + 16 passes the tiny Mistral's window of 32."""
    model_dir = tiny_model(arch)
    prompts = [prompt(seed=20 + n, length=n) for n in (5, 17, 33, 40)]
    ours = greedy_batch(PagedPipeline(load_stages(model_dir, SPLIT), seed=2), prompts, 16)
    assert ours == [hf_greedy(model_dir, p, 16) for p in prompts]


def test_positions_must_match_the_batch(tiny_model):
    (stage,) = load_stages(tiny_model("llama"), [(0, 2)])
    batch = PagedBatch(stage.new_paged_cache(8, BLOCK_SIZE), [SeqSlice(0, 2, 0, [3])])
    with pytest.raises(InvalidInput, match="disagree"):
        stage.forward(torch.tensor([5, 6]), torch.tensor([1, 2]), batch)
    assert stage.forward(torch.tensor([5, 6]), batch.positions, batch).shape == (2, stage.config.hidden_size)
