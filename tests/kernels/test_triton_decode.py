"""The Triton paged-decode kernel against the slow reference and against PagedBatch.

Without CUDA the kernel runs in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set before Triton is
imported); with CUDA the same tests run natively, and the gpu-marked ones add half precision and large shapes."""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from stratamesh.kernels.ops import triton_decode
from stratamesh.kernels.ops.paged_attention import PagedBatch, PagedKVCache, SeqSlice
from stratamesh.kernels.ops.reference import paged_attention_reference
from stratamesh.kernels.ops.triton_decode import available, paged_decode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL_FP32 = 1e-5 if DEVICE == "cpu" else 1e-4   # float32 against float64; the GPU's exp2 is approximate
ATOL_HALF = 2e-2                                # fp16 / bf16 hold ~3 significant digits
HEAD_DIM = 16                                   # the smallest tl.dot allows: keeps the interpreter quick
NUM_BLOCKS = 64
CONTEXTS = [1, 5, 16, 37, 130]                  # one token, partial blocks, whole blocks, three 64-key tiles


def random_batch(context_lens: list[int], num_heads: int, num_kv_heads: int, block_size: int, head_dim: int,
                 num_blocks: int, seed: int, dtype: torch.dtype = torch.float32, device: str = DEVICE):
    """q [B, H, D], random k/v caches (every slot written, so a read past a context shows) and
    random non-contiguous block tables, padded with random block ids -> (q, k, v, tables, ctx)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    widths = [-(-n // block_size) for n in context_lens]
    tables = torch.randint(0, num_blocks, (len(context_lens), max(widths) + 1), generator=g)
    for row, width in zip(tables, widths):
        row[:width] = torch.tensor([free.pop() for _ in range(width)])
    q, k, v = (t.to(device, dtype) for t in (q, k, v))
    return q, k, v, tables.int().to(device), torch.tensor(context_lens, device=device)


def reference(q, k, v, tables, context_lens, window):
    """paged_attention_reference over each sequence's keys and values, read through its block table."""
    k, v, block_size = k.cpu().float(), v.cpu().float(), k.shape[1]
    seqs, keys, values = [], [], []
    for b, (table, n) in enumerate(zip(tables.tolist(), context_lens.tolist())):
        pos = torch.arange(n)
        blocks = torch.tensor(table)[pos // block_size]
        seqs.append(SeqSlice(b, 1, n - 1, table))
        keys.append(k[blocks, pos % block_size])                              # [n, KV, D]
        values.append(v[blocks, pos % block_size])
    return paged_attention_reference(q.cpu().float(), seqs, keys, values, window)


def decode(q, k, v, tables, context_lens, window, num_splits=None):
    return paged_decode(q, k, v, tables, context_lens, 1 / math.sqrt(q.shape[-1]), window, num_splits)


def test_available_here():
    assert available()


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(8, 2, HEAD_DIM), (4, 4, HEAD_DIM), (4, 1, 128)])
@pytest.mark.parametrize("window", [None, 5, 48])
@pytest.mark.parametrize("block_size", [4, 16])
def test_matches_the_reference(num_heads, num_kv_heads, head_dim, window, block_size):
    q, k, v, tables, ctx = random_batch(CONTEXTS, num_heads, num_kv_heads, block_size, head_dim,
                                        NUM_BLOCKS, seed=num_heads + block_size)
    out = decode(q, k, v, tables, ctx, window)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.cpu().double(), reference(q, k, v, tables, ctx, window), atol=ATOL_FP32, rtol=0)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(8, 2, HEAD_DIM), (4, 1, 128)])
@pytest.mark.parametrize("window", [None, 100])      # 136 keys of table: 3 tiles; a window of 100: 2 tiles
@pytest.mark.parametrize("num_splits", [2, 3, 50])
def test_split_contexts_match_the_reference(num_heads, num_kv_heads, head_dim, window, num_splits):
    """Split-KV: chunks of whole tiles, merged by the combine kernel; short sequences leave chunks empty."""
    q, k, v, tables, ctx = random_batch(CONTEXTS, num_heads, num_kv_heads, 4, head_dim, NUM_BLOCKS,
                                        seed=num_splits + head_dim)
    out = decode(q, k, v, tables, ctx, window, num_splits)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.cpu().double(), reference(q, k, v, tables, ctx, window), atol=ATOL_FP32, rtol=0)


def test_window_and_padding_change_the_output():
    """Guards the reference test: on these inputs the window matters and so do the slots past each context."""
    q, k, v, tables, ctx = random_batch(CONTEXTS, 8, 2, 4, HEAD_DIM, NUM_BLOCKS, seed=1)
    assert (reference(q, k, v, tables, ctx, None) - reference(q, k, v, tables, ctx, 5)).abs().max() > 1e-2
    longer = ctx + 3      # every table has room for 3 more keys: there are random keys in those slots
    assert (reference(q, k, v, tables, ctx, None) - reference(q, k, v, tables, longer, None)).abs().max() > 1e-2


def test_int64_tables_and_strided_q():
    q, k, v, tables, ctx = random_batch([3, 70], 8, 2, 16, HEAD_DIM, NUM_BLOCKS, seed=2)
    wide_q = torch.cat([q, q], dim=-1)[..., :HEAD_DIM]      # a view with a row stride of 2 * D
    out = decode(wide_q, k, v, tables.long(), ctx.int(), None)
    torch.testing.assert_close(out.cpu().double(), reference(q, k, v, tables, ctx, None), atol=ATOL_FP32, rtol=0)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_an_empty_context_gives_zeros(num_splits):
    q, k, v, tables, ctx = random_batch([4, 90], 4, 4, 4, HEAD_DIM, NUM_BLOCKS, seed=3)
    out = decode(q, k, v, tables, torch.zeros_like(ctx), None, num_splits)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("window", [None, 7])
def test_agrees_with_paged_batch(window, monkeypatch):
    """The production torch path on a batch of decodes: PagedBatch writes the new k, v, then both attend.

    On CUDA PagedBatch would call this kernel itself: it is told Triton is unavailable, so it gathers + SDPA."""
    monkeypatch.setattr(triton_decode, "available", lambda: False)
    g = torch.Generator().manual_seed(4)
    num_heads, num_kv_heads, block_size = 8, 2, 4
    cache = PagedKVCache(2, NUM_BLOCKS, block_size, num_kv_heads, HEAD_DIM, device=DEVICE)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=g))
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    start_positions = [0, 11, 33, 4, 90, 63]
    seqs = [SeqSlice(i, 1, p, [free.pop() for _ in range(p // block_size + 1)])
            for i, p in enumerate(start_positions)]
    batch = PagedBatch(cache, seqs)
    q = torch.randn(len(seqs), num_heads, HEAD_DIM, generator=g).to(DEVICE)
    k, v = (torch.randn(len(seqs), num_kv_heads, HEAD_DIM, generator=g).to(DEVICE) for _ in range(2))
    expected = batch.attend(1, q, k, v, batch.positions, window)
    width = max(len(s.block_table) for s in seqs)
    tables = torch.tensor([list(s.block_table) + [0] * (width - len(s.block_table)) for s in seqs], device=DEVICE)
    ctx = torch.tensor([s.num_ctx for s in seqs], device=DEVICE)
    out = decode(q, cache.k[1], cache.v[1], tables, ctx, window)
    torch.testing.assert_close(out, expected, atol=ATOL_FP32, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton's interpreter runs bf16 tl.dot on the raw bits (triton-lang/triton#11584)")
    q, k, v, tables, ctx = random_batch(CONTEXTS, 8, 2, 4, HEAD_DIM, NUM_BLOCKS, seed=5, dtype=dtype)
    out = decode(q, k, v, tables, ctx, 48)
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().double(), reference(q, k, v, tables, ctx, 48), atol=ATOL_HALF, rtol=0)


@pytest.mark.parametrize("change, match", [
    (dict(head_dim=24), "head_dim must be a power of two"),
    (dict(block_size=6), "block_size must be a power of two"),
    (dict(num_heads=6, num_kv_heads=4), "multiple of KV"),
    (dict(window=0), "window must be at least 1"),
])
def test_bad_inputs_are_rejected(change, match):
    shape = dict(num_heads=4, num_kv_heads=2, block_size=4, head_dim=HEAD_DIM) | change
    window = shape.pop("window", None)
    q, k, v, tables, ctx = random_batch([3], **shape, num_blocks=4, seed=6)
    with pytest.raises(ValueError, match=match):
        paged_decode(q, k, v, tables, ctx, 1.0, window)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, ATOL_HALF),
                                         (torch.float16, ATOL_HALF)])
@pytest.mark.parametrize("window", [None, 256])
@pytest.mark.parametrize("num_seqs, num_splits", [(64, None), (64, 4), (3, None)])
def test_large_batch_on_gpu(dtype, atol, window, num_seqs, num_splits):
    """Llama-8B-like heads (H=32, KV=8, D=128), 16-slot blocks, sequences of up to 2000 keys; split or not
    (None: the automatic count, 1 for 64 sequences on an H100, many for 3)."""
    g = torch.Generator().manual_seed(7)
    context_lens = torch.randint(1, 2001, (num_seqs,), generator=g).tolist()
    num_blocks = sum(-(-n // 16) for n in context_lens) + 64
    q, k, v, tables, ctx = random_batch(context_lens, 32, 8, 16, 128, num_blocks, seed=8, dtype=dtype)
    out = decode(q, k, v, tables, ctx, window, num_splits)
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().double(), reference(q, k, v, tables, ctx, window), atol=atol, rtol=0)
