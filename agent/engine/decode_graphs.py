"""A CUDA stage's decode steps as CUDA graphs, captured once per batch size and replayed, as vLLM does.

A decode step of a small model is a few hundred short kernels: launched one by one from Python, a batch-1 step is
bound by the launches, not by the GPU. Captured for each size in GRAPH_BATCH_SIZES (up to the stage's most sessions
a step), the step replays as one launch. A graph reads and writes static tensors, so each step copies its token ids
(or hidden rows), positions, KV slots, block tables and context lengths into them; a batch of B decodes replays the
smallest graph for at least B, and its padding rows write their KV into a scratch block that no session ever holds.
Attention is the Triton paged-decode kernel: no shape in it depends on the data. Prefills, steps that mix them in,
and tensor-parallel stages (their all-reduces would need every rank to replay in step) run eagerly.

Without capture (capture=False) the same static, padded step runs eagerly: that is how it is tested off CUDA, with
Triton's CPU interpreter."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from stratamesh.kernels.models.decoder import StageModel, run_through
from stratamesh.kernels.ops import triton_decode
from stratamesh.kernels.ops.paged_attention import PagedKVCache, SeqSlice

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def can_capture(model: StageModel, block_size: int) -> bool:
    """Whether a stage's decode steps can run as graphs here: a generating model on CUDA, one process, and head
    and block sizes the Triton kernel takes (which does not soft-cap scores); no mixture of experts (its experts
    run on the tokens routed to them: a step's shapes depend on its routing)."""
    c, spec = model.config, model.spec
    return (spec.device.startswith("cuda") and spec.tp_degree == 1 and c.has_lm_head and triton_decode.available()
            and c.moe is None
            and c.attn_logit_softcap is None and _pow2(c.head_dim) and 16 <= c.head_dim <= triton_decode.MAX_HEAD_DIM
            and _pow2(block_size))


class StaticDecode:
    """The Attention of a captured decode step: its KV slots, block tables and context lengths are static tensors."""

    def __init__(self, cache: PagedKVCache, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> None:
        self.cache, self.slots, self.tables, self.lens = cache, slots, tables, lens

    def check_positions(self, positions: torch.Tensor) -> None:
        """Nothing to check: the step copied its own positions in."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, window: int | None, softcap: float | None = None) -> torch.Tensor:
        """Writes k, v [B, KV, D] to the slots; q [B, H, D] attends over each row's context -> [B, H, D] (no
        soft-capped scores: can_capture() keeps such models off graphs)."""
        assert softcap is None, "the Triton decode kernel does not soft-cap scores"
        k_flat, v_flat = self.cache.flat(layer_idx)
        k_flat.index_copy_(0, self.slots, k if k.dtype == k_flat.dtype else k.to(k_flat.dtype))
        v_flat.index_copy_(0, self.slots, v if v.dtype == v_flat.dtype else v.to(v_flat.dtype))
        return triton_decode.paged_decode(q, self.cache.k[layer_idx], self.cache.v[layer_idx], self.tables,
                                          self.lens, q.shape[-1] ** -0.5, window)


class DecodeGraphs:
    """One graph per batch size for a stage's decode steps; run() takes a step of single-token chunks."""

    def __init__(self, model: StageModel, cache: PagedKVCache, scratch_block: int, max_batch: int,
                 capture: bool = True) -> None:
        self.model, self.cache, self.scratch_block = model, cache, scratch_block
        self.sizes = tuple(sorted({b for b in GRAPH_BATCH_SIZES if b < max_batch} | {max_batch}))
        top, dev, c = self.sizes[-1], cache.device, model.config
        self.width = math.ceil(c.max_position_embeddings / cache.block_size)     # block table columns
        self._inputs = (torch.zeros(top, dtype=torch.long, device=dev) if model.spec.is_first
                        else torch.zeros(top, c.hidden_size, dtype=model.dtype, device=dev))
        self._positions = torch.zeros(top, dtype=torch.long, device=dev)
        self._slots = torch.zeros(top, dtype=torch.long, device=dev)
        self._tables = torch.zeros(top, self.width, dtype=torch.long, device=dev)
        self._lens = torch.ones(top, dtype=torch.long, device=dev)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture()

    def fits(self, seqs: Sequence[SeqSlice]) -> bool:
        """Whether run() takes this step: single-token chunks, at most the largest size, tables within width."""
        return (len(seqs) <= self.sizes[-1] and all(s.q_len == 1 for s in seqs)
                and all(len(s.block_table) <= self.width for s in seqs))

    def run(self, seqs: Sequence[SeqSlice], inputs: torch.Tensor) -> torch.Tensor:
        """The step's output for its B rows: hidden [B, hidden], or on the last stage float32 logits [B, vocab].

        It is the graph's own output tensor: use it before the next step overwrites it."""
        size = next(b for b in self.sizes if b >= len(seqs))
        self._fill(seqs, inputs, size)
        captured = self._graphs.get(size)
        if captured is None:
            return self._step(size)[:len(seqs)]
        graph, out = captured
        graph.replay()
        return out[:len(seqs)]

    def _fill(self, seqs: Sequence[SeqSlice], inputs: torch.Tensor, size: int) -> None:
        """Copies the step into the static inputs; rows past its own are padding: position 0, one key, scratch KV.

        Of the block tables only the columns the step's longest table fills are written: the kernel reads a row's
        columns up to its context length only, so what an earlier step left further right is never read (a table of
        every column is max_position_embeddings / block_size wide: 8,192 for a 128k-token model)."""
        bs, pad, scratch = self.cache.block_size, size - len(seqs), self.scratch_block
        positions = [s.start_pos for s in seqs] + [0] * pad
        slots = [s.block_table[s.start_pos // bs] * bs + s.start_pos % bs for s in seqs] + [scratch * bs] * pad
        lens = [s.start_pos + 1 for s in seqs] + [1] * pad
        columns = max((len(s.block_table) for s in seqs), default=1)
        tables = [b for s in seqs for b in (*s.block_table, *[scratch] * (columns - len(s.block_table)))]
        tables += [scratch] * (columns * pad)
        host = torch.tensor([positions, slots, lens], dtype=torch.long)      # [3, size], one copy up
        for static, values in zip((self._positions, self._slots, self._lens), host, strict=True):
            static[:size].copy_(values, non_blocking=True)
        self._tables[:size, :columns].copy_(torch.tensor(tables, dtype=torch.long).view(size, columns),
                                            non_blocking=True)
        self._inputs[:len(seqs)].copy_(inputs, non_blocking=True)
        if pad:
            self._inputs[len(seqs):size].zero_()

    @torch.inference_mode()
    def _step(self, size: int) -> torch.Tensor:
        """The static step over the first size rows (what a graph captures)."""
        model = self.model
        attn = StaticDecode(self.cache, self._slots[:size], self._tables[:size], self._lens[:size])
        hidden = run_through(model.forward_layers(self._inputs[:size], self._positions[:size], attn, checked=True))
        return model.logits(hidden) if model.spec.is_last else hidden

    def _capture(self) -> None:
        """Captures every size, the largest first, in one memory pool (vLLM's order: the pool fits them all)."""
        pool = torch.cuda.graph_pool_handle()
        self._slots.fill_(self.scratch_block * self.cache.block_size)
        self._tables.fill_(self.scratch_block)
        for size in reversed(self.sizes):
            self._step(size)                 # warm-up outside the capture: Triton compiles, cuBLAS picks kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._step(size)
            self._graphs[size] = (graph, out)
        torch.cuda.synchronize()


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
