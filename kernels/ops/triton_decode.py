"""Paged decode attention as one Triton kernel: one query token per sequence over its blocks of a PagedKVCache.

One program per (sequence, kv head) serves the G = H / KV query heads that share that kv head. It walks the
sequence's visible positions in tiles of TILE_N tokens (a tile may span several cache blocks; each token's
slot is looked up in the block table), scores the G queries against the tile with one tl.dot (G padded to
16 rows), and folds the tile into float32 running max / sum / weighted-value accumulators (online softmax,
as in flash-decoding), so the context is read once and never materialised. With a sliding window the walk
starts at the window's first position: blocks wholly before it are never read.

Triton is optional and imported on the first call, never by importing this module: so TRITON_INTERPRET
(Triton's CPU interpreter, read when Triton is imported) can still be set by whoever calls first.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os

import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_DOT_ROWS = 16     # tl.dot needs every dimension >= 16
MAX_HEAD_DIM = 256
tl = None             # triton.language, bound by _kernel() on the first call: the kernel's body reads it


def available() -> bool:
    """True when paged_decode can run here: Triton is installed and there is a CUDA device or its interpreter."""
    return _has_triton() and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """softmax(scale * q k^T) v for q [B, H, D] at position context_lens[b] - 1 -> [B, H, D] in q's dtype.

    k_cache, v_cache [num_blocks, block_size, KV, D]; block_tables [B, max_blocks] (padded);
    context_lens [B]; window W: only keys at p - W + 1 .. p are seen. A sequence with no keys gets zeros."""
    if not _has_triton():
        raise RuntimeError("paged_decode needs triton, which is not installed")
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens, window)
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    _kernel()[(num_seqs, num_kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out,
        scale * math.log2(math.e), 0 if window is None else window,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        GROUP=group, GROUP_PAD=max(MIN_DOT_ROWS, 1 << (group - 1).bit_length()),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, TILE_N=64 if head_dim <= 128 else 32,
        HAS_WINDOW=window is not None, num_warps=4)
    return out


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, window: int | None) -> None:
    """ValueError unless the shapes, dtypes and sizes are ones the kernel handles."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"want q [B, H, D] and k_cache, v_cache [num_blocks, block_size, KV, D]; got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q has {num_heads} heads of {head_dim}, the cache {num_kv_heads} of {cache_head_dim}: "
                         f"head sizes must match and H be a multiple of KV")
    if not _is_pow2(head_dim) or not MIN_DOT_ROWS <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be a power of two in [{MIN_DOT_ROWS}, {MAX_HEAD_DIM}], got {head_dim}")
    if not _is_pow2(block_size):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if q.dtype not in DTYPES or k_cache.dtype not in DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"want float32, float16 or bfloat16 q and one such dtype for both caches; got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(f"want block_tables [{num_seqs}, max_blocks] and context_lens [{num_seqs}]; got "
                         f"{tuple(block_tables.shape)}, {tuple(context_lens.shape)}")
    if block_tables.dtype not in (torch.int32, torch.int64) or context_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError("block_tables and context_lens must be int32 or int64")
    if window is not None and window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    if len({t.device for t in (q, k_cache, v_cache, block_tables, context_lens)}) != 1:
        raise ValueError("q, the caches, block_tables and context_lens must be on one device")


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernel():
    """_paged_decode_kernel jitted, importing Triton (once) and binding the tl its body reads."""
    global tl
    import triton
    import triton.language

    tl = triton.language
    return triton.jit(_paged_decode_kernel)


def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, ctx_lens_ptr, out_ptr, qk_scale_log2, window,
                         stride_qb, stride_qh, stride_qd,
                         stride_kn, stride_ks, stride_kh, stride_kd,
                         stride_vn, stride_vs, stride_vh, stride_vd,
                         stride_tb, stride_tn, stride_ob, stride_oh, stride_od,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    seq, kv_head = tl.program_id(0), tl.program_id(1)
    ctx_len = tl.load(ctx_lens_ptr + seq).to(tl.int32)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(ctx_len - window, 0)      # the query sits at ctx_len - 1

    rows = tl.arange(0, GROUP_PAD)                   # query heads of this group, padded for tl.dot
    dims = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + rows
    q_offs = seq * stride_qb + heads[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_offs, mask=rows[:, None] < GROUP, other=0.0)   # q: [G_PAD, D]
    q = q.to(k_ptr.dtype.element_ty)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)   # running max of log2-scaled scores
    l_i = tl.zeros([GROUP_PAD], tl.float32)                 # running sum of exp2(score - m_i)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)       # running sum of weights * values
    table = tables_ptr + seq * stride_tb
    for start in range(first, ctx_len, TILE_N):
        pos = start + tl.arange(0, TILE_N)                  # key positions of this tile
        visible = pos < ctx_len
        block = tl.load(table + (pos // BLOCK_SIZE) * stride_tn, mask=visible, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        k = tl.load(k_ptr + block[:, None] * stride_kn + slot[:, None] * stride_ks
                    + kv_head * stride_kh + dims[None, :] * stride_kd,
                    mask=visible[:, None], other=0.0)       # k: [TILE_N, D]
        v = tl.load(v_ptr + block[:, None] * stride_vn + slot[:, None] * stride_vs
                    + kv_head * stride_vh + dims[None, :] * stride_vd,
                    mask=visible[:, None], other=0.0)       # v: [TILE_N, D]

        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale_log2   # [G_PAD, TILE_N]
        scores = tl.where(visible[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))     # finite: every tile has a visible key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]        # no keys: zeros, not NaN
    out_offs = seq * stride_ob + heads[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=rows[:, None] < GROUP)
