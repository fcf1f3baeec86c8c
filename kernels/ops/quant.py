"""Weight-only int8: a weight matrix as int8 rows times one float scale per row (per output channel).

A [out, in] matrix w is stored as q = round(w / scale) in [-127, 127] with scale = max |w[row]| / 127, a quarter
of float32's bytes (plus 4 bytes a row). Activations stay in floating point. On a CPU the product runs in
torch's int8-weight kernel (_weight_int8pack_mm) with bfloat16 activations where the CPU computes bfloat16
natively (it reads the int8 weights once, 3-9x faster than a float32 matmul here); elsewhere the weight is
dequantized into the activations' dtype for each product (the memory is saved, not the time)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

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

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

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
    if x.device.type == "cpu" and _cpu_int8_kernel():
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch.ops.aten._weight_int8pack_mm(flat, w.q, w.kernel_scale)
        out = out.to(x.dtype).reshape(*x.shape[:-1], -1)
    else:
        out = F.linear(x, w.q.to(x.dtype)) * w.scale.to(x.dtype)
    return out if bias is None else out + bias


_KERNEL: list[bool] = []


def _cpu_int8_kernel() -> bool:
    """Whether torch has its int8-weight kernel and oneDNN computes bfloat16 natively on this CPU (AVX-512 BF16,
    AMX), where that kernel is fast; decided once per process."""
    if not _KERNEL:
        try:
            native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            native = False
        _KERNEL.append(native and hasattr(torch.ops.aten, "_weight_int8pack_mm"))
    return _KERNEL[0]


@contextmanager
def exact_products() -> Iterator[None]:
    """Within it, int8 products keep the activations' own dtype (the weight dequantized for each product) instead
    of the CPU kernel's bfloat16 activations: slower, for measuring what that kernel's rounding costs."""
    kernel = _cpu_int8_kernel()
    _KERNEL[0] = False
    try:
        yield
    finally:
        _KERNEL[0] = kernel
