"""Measured speed of this box for the planner: FLOP/s of a large matmul and bytes/s of a large copy."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from stratamesh.fleet.types import SpeedInfo

MATMUL_SIZE = 1024        # fp32: 2 GFLOP a product; large enough for the BLAS to reach steady state
COPY_BYTES = 64 << 20     # larger than any last-level cache here


def measure_speeds(reps: int = 3) -> tuple[SpeedInfo, ...]:
    """float32 on the CPU, and float32 + bfloat16 on the first CUDA device if there is one (~0.3 s in all)."""
    speeds = [_measure("torch-cpu", "cpu", torch.float32, reps)]
    if torch.cuda.is_available():
        speeds += [_measure("torch-cuda", "cuda", dtype, reps) for dtype in (torch.float32, torch.bfloat16)]
    return tuple(speeds)


def _measure(backend: str, device: str, dtype: torch.dtype, reps: int) -> SpeedInfo:
    n = MATMUL_SIZE
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    src = torch.empty(COPY_BYTES // a.element_size(), device=device, dtype=dtype)
    dst = torch.empty_like(src)
    matmul_s = _best_time(lambda: torch.mm(a, b), device, reps)
    copy_s = _best_time(lambda: dst.copy_(src), device, reps)
    return SpeedInfo(backend, str(dtype).removeprefix("torch."), 2 * n ** 3 / matmul_s, 2 * COPY_BYTES / copy_s)


def _best_time(work: Callable[[], object], device: str, reps: int) -> float:
    """The fastest of reps runs after one warm-up, in seconds (the least disturbed by other processes)."""
    best = float("inf")
    for i in range(reps + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        work()
        if device == "cuda":
            torch.cuda.synchronize()
        if i:
            best = min(best, time.perf_counter() - start)
    return best
