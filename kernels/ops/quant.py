"""Weight-only int8: a weight matrix as int8 rows times one float scale per row (per output channel).

A [out, in] matrix w is stored as q = round(w / scale) in [-127, 127] with scale = max |w[row]| / 127, a quarter
of float32's bytes (plus 4 bytes a row). Activations stay in floating point. On a CPU the product runs in
torch's int8-weight kernel (_weight_int8pack_mm) with bfloat16 activations where the CPU computes bfloat16
natively (2-4x faster than a float32 product here: benchmarks/int8_weights.py); elsewhere, and within
exact_products(), the weight is dequantized into the activations' dtype for each product."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cache

import torch
import torch.nn.functional as F

SCALE_SUFFIX = "_scale"            # a quantized "x.weight" has its scales under "x.weight_scale" (as vLLM names them)
INT8_MAX = 127


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """w ~= q * scale[:, None]: q [out, in] int8, scale [out] float32."""

    q: torch.Tensor
    scale: torch.Tensor
    kernel_scale: torch.Tensor = field(init=False, repr=False)   # scale in bfloat16, as the CPU kernel takes it

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernel_scale", self.scale.to(torch.bfloat16))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.q.to(dtype) * self.scale.to(dtype)[:, None]


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 of w [out, in] (a row of zeros gets scale 1, so q is 0)."""
    w32 = w.float()
    scale = w32.abs().amax(dim=1) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w32 / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous())


def linear(x: torch.Tensor, w: torch.Tensor | Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a float weight or an Int8Weight; x [..., in] -> [..., out] in x's dtype."""
    if not isinstance(w, Int8Weight):
        return F.linear(x, w, bias)
    if _uses_cpu_kernel(x):
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch.ops.aten._weight_int8pack_mm(flat, w.q, w.kernel_scale)
        out = out.to(x.dtype).reshape(*x.shape[:-1], -1)
    else:
        out = F.linear(x, w.q.to(x.dtype)) * w.scale.to(x.dtype)
    return out if bias is None else out + bias


_EXACT: ContextVar[bool] = ContextVar("exact_int8_products", default=False)   # set within exact_products()


def _uses_cpu_kernel(x: torch.Tensor) -> bool:
    """Whether an int8 product with activations x runs in torch's CPU int8-weight kernel."""
    return x.device.type == "cpu" and not _EXACT.get() and _cpu_int8_kernel()


@cache
def _cpu_int8_kernel() -> bool:
    """Whether torch has its int8-weight kernel and oneDNN computes bfloat16 natively on this CPU (AVX-512 BF16,
    AMX), where that kernel is fast."""
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        native = False
    return native and hasattr(torch.ops.aten, "_weight_int8pack_mm")


@contextmanager
def exact_products() -> Iterator[None]:
    """Within it, int8 products keep the activations' own dtype (the weight dequantized for each product) instead
    of the CPU kernel's bfloat16 activations: slower, for measuring what that kernel's rounding costs."""
    token = _EXACT.set(True)
    try:
        yield
    finally:
        _EXACT.reset(token)
