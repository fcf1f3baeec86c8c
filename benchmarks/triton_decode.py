"""Paged decode attention on one CUDA GPU: the Triton kernel against PagedBatch's torch path (gather + SDPA).

    python benchmarks/triton_decode.py [--iters 50] [--block-size 16]

Llama-3-8B-like heads (H=32, KV=8, D=128) in bf16, every sequence one decode token over a context of 1024
or 4096 keys in random non-contiguous blocks. Both paths read the same cache; GB/s counts the K and V
bytes each sequence must read (B * context * KV * D * 2 tensors * 2 bytes) over the time per call. The
torch column times PagedBatch.attend, which also writes each sequence's new K and V (B * 4 KiB: noise).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

import torch
from stratamesh.kernels.ops import triton_decode
from stratamesh.kernels.ops.paged_attention import PagedBatch, PagedKVCache, SeqSlice

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
BATCHES = (1, 8, 64)
CONTEXTS = (1024, 4096)


def cuda_ms(fn: Callable[[], object], iters: int) -> float:
    """Mean milliseconds per call of fn on the current stream, after a few warm-up calls."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def measure(batch: int, context: int, block_size: int, iters: int) -> dict[str, float]:
    """Times and the max |difference| of both paths on one random batch of decodes."""
    blocks_per_seq = -(-context // block_size)
    cache = PagedKVCache(1, batch * blocks_per_seq, block_size, NUM_KV_HEADS, HEAD_DIM, DTYPE, "cuda")
    cache.k[0].normal_()
    cache.v[0].normal_()
    order = torch.randperm(cache.num_blocks).view(batch, blocks_per_seq)
    seqs = [SeqSlice(i, 1, context - 1, order[i].tolist()) for i in range(batch)]
    paged = PagedBatch(cache, seqs)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    k_new, v_new = (torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(2))
    tables = order.to("cuda", torch.int32)
    context_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    scale = 1 / math.sqrt(HEAD_DIM)

    def torch_path() -> torch.Tensor:
        return paged.attend(0, q, k_new, v_new, paged.positions, None)

    def triton_path() -> torch.Tensor:
        return triton_decode.paged_decode(q, cache.k[0], cache.v[0], tables, context_lens, scale)

    diff = (torch_path().float() - triton_path().float()).abs().max().item()
    return {"torch_ms": cuda_ms(torch_path, iters), "triton_ms": cuda_ms(triton_path, iters), "diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/triton_decode.py needs a CUDA GPU; torch sees none here")
    if not triton_decode.available():
        sys.exit("benchmarks/triton_decode.py needs triton (pip install triton)")
    print(f"{torch.cuda.get_device_name()}, H={NUM_HEADS} KV={NUM_KV_HEADS} D={HEAD_DIM} bf16, "
          f"block_size {args.block_size}, mean of {args.iters} calls\n")
    print("| B | context | torch ms | torch GB/s | triton ms | triton GB/s | torch / triton | max abs diff |")
    print("|--:|--------:|---------:|-----------:|----------:|------------:|---------------:|-------------:|")
    for batch in BATCHES:
        for context in CONTEXTS:
            r = measure(batch, context, args.block_size, args.iters)
            kv_bytes = batch * context * NUM_KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize
            torch_gbps, triton_gbps = kv_bytes / r["torch_ms"] / 1e6, kv_bytes / r["triton_ms"] / 1e6
            print(f"| {batch} | {context} | {r['torch_ms']:.3f} | {torch_gbps:.0f} | {r['triton_ms']:.3f} | "
                  f"{triton_gbps:.0f} | {r['torch_ms'] / r['triton_ms']:.2f}x | {r['diff']:.1e} |")


if __name__ == "__main__":
    main()
