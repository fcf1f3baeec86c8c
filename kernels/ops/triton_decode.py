"""Paged decode attention as one Triton kernel: one query token per sequence over its blocks of a PagedKVCache.

One program per (sequence, kv head) serves the G = H / KV query heads that share that kv head. It walks the
sequence's visible positions in tiles of TILE_N tokens (a tile may span several cache blocks; each token's
slot is looked up in the block table), scores the G queries against the tile with one tl.dot (G padded to
16 rows), and folds the tile into float32 running max / sum / weighted-value accumulators (online softmax,
as in flash-decoding), so the context is read once and never materialised. With a sliding window the walk
starts at the window's first position: blocks wholly before it are never read.

When (sequences x kv heads) programs are too few to fill the GPU (small batches: 8 programs for one Llama-8B
sequence on a 132-SM H100), each sequence's positions are split into NUM_SPLITS contiguous chunks, one program
each, which write float32 partial (max, sum, weighted values); a second small kernel merges them (flash-decoding's
split-KV). The split count is chosen from the block table's width, known on the host, so no device sync.

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
SPLIT_WAVES = 2       # split the context until about this many programs per SM
tl = None             # triton.language, bound by _kernels() on the first call: the kernels' bodies read it


def available() -> bool:
    """True when paged_decode can run here: Triton is installed and there is a CUDA device or its interpreter."""
    return _has_triton() and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int | None = None,
                 num_splits: int | None = None) -> torch.Tensor:
    """softmax(scale * q k^T) v for q [B, H, D] at position context_lens[b] - 1 -> [B, H, D] in q's dtype.

    k_cache, v_cache [num_blocks, block_size, KV, D]; block_tables [B, max_blocks] (padded);
    context_lens [B]; window W: only keys at p - W + 1 .. p are seen. A sequence with no keys gets zeros.
    num_splits: chunks each sequence's keys are split into (None: enough to fill the GPU; 1 on CPU)."""
    if not _has_triton():
        raise RuntimeError("paged_decode needs triton, which is not installed")
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens, window)
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    tile = 64 if head_dim <= 128 else 32
    span = block_tables.shape[1] * block_size            # the most keys a sequence's table holds
    if window is not None:
        span = min(span, window)
    tiles = max(1, -(-span // tile))
    if num_splits is None:
        num_splits = _auto_splits(q.device, num_seqs * num_kv_heads)
    tiles_per_split = -(-tiles // max(1, min(num_splits, tiles)))
    num_splits = -(-tiles // tiles_per_split)             # no split starts past the table's end
    split = num_splits > 1
    if split:   # float32 partials per (sequence, head, split): running max, sum and weighted values
        part_m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out                  # unused
    kernel, combine = _kernels()
    kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_m, part_l, part_acc,
        scale * math.log2(math.e), 0 if window is None else window, tiles_per_split * tile, num_splits, num_heads,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        GROUP=group, GROUP_PAD=max(MIN_DOT_ROWS, 1 << (group - 1).bit_length()),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, TILE_N=tile,
        HAS_WINDOW=window is not None, SPLIT=split, num_warps=4)
    if split:
        combine[(num_seqs, num_heads)](
            part_m, part_l, part_acc, out, num_splits, num_heads, *out.stride(),
            SPLITS_PAD=1 << (num_splits - 1).bit_length(), HEAD_DIM=head_dim, num_warps=4)
    return out


def _auto_splits(device: torch.device, programs: int) -> int:
    """Splits per sequence so that about SPLIT_WAVES programs run per SM; 1 off CUDA (the interpreter)."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, -(-SPLIT_WAVES * sms // programs))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


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
def _kernels():
    """(_paged_decode_kernel, _combine_kernel) jitted, importing Triton (once) and binding the tl they read."""
    global tl
    import triton
    import triton.language

    tl = triton.language
    return triton.jit(_paged_decode_kernel), triton.jit(_combine_kernel)


def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, ctx_lens_ptr, out_ptr, part_m_ptr, part_l_ptr,
                         part_acc_ptr, qk_scale_log2, window, chunk, num_splits, num_heads,
                         stride_qb, stride_qh, stride_qd,
                         stride_kn, stride_ks, stride_kh, stride_kd,
                         stride_vn, stride_vs, stride_vh, stride_vd,
                         stride_tb, stride_tn, stride_ob, stride_oh, stride_od,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                         SPLIT: tl.constexpr):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx_len = tl.load(ctx_lens_ptr + seq).to(tl.int32)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(ctx_len - window, 0)      # the query sits at ctx_len - 1
    # this program's keys: [lo, hi), chunk (a whole number of tiles) from the first; the last split runs to the end
    lo = first + split * chunk
    hi = tl.where(split == num_splits - 1, ctx_len, tl.minimum(lo + chunk, ctx_len))

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
    for start in range(lo, hi, TILE_N):
        pos = start + tl.arange(0, TILE_N)                  # key positions of this tile
        visible = pos < hi
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

    if SPLIT:   # partials at [seq, head, split]; an empty chunk leaves (-inf, 0, 0)
        part = (seq * num_heads + heads) * num_splits + split               # [G_PAD]
        tl.store(part_m_ptr + part, m_i, mask=rows < GROUP)
        tl.store(part_l_ptr + part, l_i, mask=rows < GROUP)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=rows[:, None] < GROUP)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]    # no keys: zeros, not NaN
        out_offs = seq * stride_ob + heads[:, None] * stride_oh + dims[None, :] * stride_od
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=rows[:, None] < GROUP)


def _combine_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, num_splits, num_heads,
                    stride_ob, stride_oh, stride_od, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One (sequence, head): merge its num_splits partials, each scaled by exp2(its max - the overall max)."""
    seq, head = tl.program_id(0), tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    real = splits < num_splits
    part = (seq * num_heads + head) * num_splits + splits
    m = tl.load(part_m_ptr + part, mask=real, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=real, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=real[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)      # no keys at all: every weight exp2(-inf) = 0
    w = tl.exp2(m - m_max)                                    # empty splits: 0
    total = tl.sum(w * l, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims * stride_od, out.to(out_ptr.dtype.element_ty))
