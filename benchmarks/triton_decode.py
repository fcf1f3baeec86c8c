"""Paged decode attention on one CUDA GPU: the Triton kernel against PagedBatch's torch path (gather + SDPA).

    python benchmarks/triton_decode.py [--calls 16] [--block-size 16]

Llama-3-8B-like heads (H=32, KV=8, D=128) in bf16, every sequence one decode token over a context of 1024
or 4096 keys in random non-contiguous blocks. Three paths read the same cache: torch (PagedBatch.attend with
the kernel switched off, so gather + SDPA; it also writes each sequence's new K and V, B * 4 KiB: noise),
the kernel with one program per (sequence, kv head) ("1 split"), and the kernel with its automatic split-KV
count ("auto"). GB/s counts the K and V bytes each sequence must read (B * context * KV * D * 2 tensors *
2 bytes) over the time per call; "% copy" is that over the device-to-device copy rate measured first.

Timing: each path's calls are captured in one CUDA graph (launch overhead out of the numbers) that cycles
through enough copies of the batch, on disjoint blocks, to span 256 MiB, so L2 (50 MiB on an H100) is not
what is measured; the median of triton.testing.do_bench over graph replays, divided by the calls per graph.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from collections.abc import Callable, Iterator

import torch
from stratamesh.kernels.ops import triton_decode
from stratamesh.kernels.ops.paged_attention import PagedBatch, PagedKVCache, SeqSlice

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
BATCHES = (1, 8, 64)
CONTEXTS = (1024, 4096)
ROTATE_BYTES = 256 << 20


@contextlib.contextmanager
def torch_only() -> Iterator[None]:
    """PagedBatch sees no Triton: its CUDA decode takes the gather + SDPA path."""
    saved = triton_decode.available
    triton_decode.available = lambda: False
    try:
        yield
    finally:
        triton_decode.available = saved


def graph_ms(calls: list[Callable[[], object]]) -> float:
    """Median milliseconds per call: all calls captured in one CUDA graph, replays timed with events."""
    import triton.testing

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls[:3] * 2:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
        torch.cuda.synchronize()
        run = graph.replay
    except RuntimeError as e:   # not capturable: time the launches themselves, overhead included
        print(f"(no CUDA graph, timed eagerly: {str(e).splitlines()[0]})", file=sys.stderr)
        torch.cuda.synchronize()

        def run() -> None:
            for fn in calls:
                fn()
    return triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median") / len(calls)


def copy_gbps() -> float:
    """Device-to-device copy of 1 GiB, bytes read plus written over the median time."""
    import triton.testing

    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() * src.element_size() / ms / 1e6


def measure(batch: int, context: int, block_size: int, min_calls: int) -> dict[str, float]:
    """Times of the three paths and the kernel's max |difference| from the torch path, on random batches."""
    kv_bytes = batch * context * NUM_KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize
    copies = max(1, -(-ROTATE_BYTES // kv_bytes))
    blocks_per_seq = -(-context // block_size)
    cache = PagedKVCache(1, copies * batch * blocks_per_seq, block_size, NUM_KV_HEADS, HEAD_DIM, DTYPE, "cuda")
    cache.k[0].normal_()
    cache.v[0].normal_()
    order = torch.randperm(cache.num_blocks).view(copies, batch, blocks_per_seq)
    scale = 1 / math.sqrt(HEAD_DIM)
    context_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    torch_calls, split1_calls, auto_calls = [], [], []
    for c in range(copies):
        paged = PagedBatch(cache, [SeqSlice(i, 1, context - 1, order[c, i].tolist()) for i in range(batch)])
        q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        k_new, v_new = (torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(2))
        tables = order[c].to("cuda", torch.int32)
        torch_calls.append(lambda p=paged, q=q, k=k_new, v=v_new: p.attend(0, q, k, v, p.positions, None))
        split1_calls.append(lambda q=q, t=tables: triton_decode.paged_decode(
            q, cache.k[0], cache.v[0], t, context_lens, scale, None, 1))
        auto_calls.append(lambda q=q, t=tables: triton_decode.paged_decode(
            q, cache.k[0], cache.v[0], t, context_lens, scale))
    calls = max(copies, min_calls)
    with torch_only():
        expected = torch_calls[0]().float()      # writes k_new, v_new first: the kernels then read them too
        torch_ms = graph_ms([torch_calls[i % copies] for i in range(calls)])
    diff = max((fn().float() - expected).abs().max().item() for fn in (split1_calls[0], auto_calls[0]))
    split1_ms = graph_ms([split1_calls[i % copies] for i in range(calls)])
    auto_ms = graph_ms([auto_calls[i % copies] for i in range(calls)])
    tiles = -(-context // 64)                    # as paged_decode counts them: 64-key tiles of the table's span
    per_split = -(-tiles // min(tiles, triton_decode._auto_splits(torch.device("cuda"), batch * NUM_KV_HEADS)))
    return {"torch_ms": torch_ms, "split1_ms": split1_ms, "auto_ms": auto_ms, "diff": diff,
            "kv_bytes": kv_bytes, "splits": -(-tiles // per_split)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=16, help="fewest calls per CUDA graph")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/triton_decode.py needs a CUDA GPU; torch sees none here")
    if not triton_decode.available():
        sys.exit("benchmarks/triton_decode.py needs triton (pip install triton)")
    copy = copy_gbps()
    print(f"{torch.cuda.get_device_name()}, H={NUM_HEADS} KV={NUM_KV_HEADS} D={HEAD_DIM} bf16, "
          f"block_size {args.block_size}; device-to-device copy {copy:.0f} GB/s (read + write)\n")
    print("| B | context | torch ms | torch GB/s | 1 split ms | 1 split GB/s | auto ms | auto GB/s | auto % copy "
          "| splits | torch / auto | max abs diff |")
    print("|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for batch in BATCHES:
        for context in CONTEXTS:
            r = measure(batch, context, args.block_size, args.calls)
            gbps = {k: r["kv_bytes"] / r[k] / 1e6 for k in ("torch_ms", "split1_ms", "auto_ms")}
            print(f"| {batch} | {context} | {r['torch_ms']:.4f} | {gbps['torch_ms']:.0f} | {r['split1_ms']:.4f} | "
                  f"{gbps['split1_ms']:.0f} | {r['auto_ms']:.4f} | {gbps['auto_ms']:.0f} | "
                  f"{100 * gbps['auto_ms'] / copy:.0f}% | {r['splits']} | {r['torch_ms'] / r['auto_ms']:.2f}x | "
                  f"{r['diff']:.1e} |", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
