"""Weight-only quantization: a weight matrix stored in 8 or 4 bits with float scales, activations in floating point.

Two formats (StageSpec.quantize), each as it is stored in a stage's tensors (under the matrix's name, its scales
under name + SCALE_SUFFIX, as vLLM names them) and as the CPU kernels that run it take it:
- "int8": q [out, in] int8 in [-127, 127], one float32 scale per row: w ~= q * scale[:, None].
- "int4": groups of INT4_GROUP weights along a row, each with its own float32 scale and the zero point 8 (Q4_0's
  form): w ~= (q - 8) * scale, q in [0, 15]; stored packed [out, in / 2] uint8, two q a byte, the even element in
  the low nibble (ONNX Runtime's MatMulNBits layout), scales [out, in / INT4_GROUP].

The kernels were chosen by measuring each candidate's batch-1 product over a 200M model's matrices on the CPUs these
agents run on (benchmarks/edge_cpu.py measures them again): in torch, its own weight-only kernels
(_weight_int8pack_mm, _weight_int4pack_mm_for_cpu) with bfloat16 activations read the weights at the memory's
bandwidth, 3-4x (int8) and 4-8x (int4) faster than a float32 product, on AVX-512 and on AVX2 alike (their float32
activation paths, and dequantizing the weight for every product, are 5-10x slower than float32); in ONNX Runtime,
MatMulNBits (kernels.models.onnx_stage), faster still. A torch int4 matrix is repacked once, when its stage loads,
into the kernel's tiled layout (PackedInt4Weight). Off the CPU, and within exact_products(), a product dequantizes
the weight into the activations' dtype instead."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from stratamesh.fleet.errors import InvalidInput

SCALE_SUFFIX = "_scale"            # a quantized "x.weight" has its scales under "x.weight_scale" (as vLLM names them)
INT8_MAX = 127
INT4_GROUP = 32                    # weights per 4-bit scale (Q4_0's block; 128 reads 10% fewer bytes, loses more)
INT4_ZERO = 8                      # a 4-bit q's zero point: q - 8 in [-8, 7]
INT4_MAX = 7
TORCH_INT4_ROWS = 16               # the torch int4 kernel's tiles: a matrix it packs has a multiple of 16 rows


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """w ~= q * scale[:, None]: q [out, in] int8, scale [out] float32."""

    BITS: ClassVar[int] = 8
    q: torch.Tensor
    scale: torch.Tensor
    kernel_scale: torch.Tensor = field(init=False, repr=False)   # scale in bfloat16, as the CPU kernel takes it

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernel_scale", self.scale.to(torch.bfloat16))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.q.to(dtype) * self.scale.to(dtype)[:, None]

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized rows ids (an embedding's lookup)."""
        return self.q[ids].to(dtype) * self.scale[ids].to(dtype)[..., None]


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """w ~= (q - 8) * scale per group of INT4_GROUP along a row: packed [out, in / 2] uint8 (the even element of
    each pair in the low nibble), scale [out, in / group] float32."""

    BITS: ClassVar[int] = 4
    packed: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], 2 * self.packed.shape[1]

    @property
    def group(self) -> int:
        return self.shape[1] // self.scale.shape[1]

    def unpacked(self) -> torch.Tensor:
        """q [out, in] uint8 in [0, 15]."""
        return unpack_int4(self.packed)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return _dequantize4(self.packed, self.scale, dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized rows ids (an embedding's lookup)."""
        return _dequantize4(self.packed[ids], self.scale[ids], dtype)


@dataclass(frozen=True, slots=True)
class PackedInt4Weight:
    """An Int4Weight in the torch CPU kernel's layout: packed [out, in / 2] uint8 tiled as
    _convert_weight_to_int4pack_for_cpu lays it, scales_and_zeros [in / group, out, 2] bfloat16 (the kernel
    computes (q - 8) * scale + zero; zero is 0 here: the format is symmetric)."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], 2 * self.packed.shape[1]

    @classmethod
    def of(cls, w: Int4Weight) -> PackedInt4Weight:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.unpacked().to(torch.int32), 1)
        scales = w.scale.T.to(torch.bfloat16)
        return cls(packed, torch.stack([scales, torch.zeros_like(scales)], dim=-1).contiguous(), w.group)


QuantizedWeight = Int8Weight | Int4Weight | PackedInt4Weight


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 of w [out, in] (a row of zeros gets scale 1, so q is 0)."""
    w32 = w.float()
    scale = w32.abs().amax(dim=1) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w32 / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous())


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> Int4Weight:
    """Symmetric 4-bit of w [out, in] in groups of `group` along each row, each group's scale its largest |w| / 7
    (a group of zeros gets scale 1). InvalidInput unless in is a multiple of the group."""
    out_features, in_features = w.shape
    if in_features % group:
        raise InvalidInput(f"4-bit weights take rows of a multiple of {group} weights, not {in_features}")
    groups = w.float().reshape(out_features, in_features // group, group)
    scale = groups.abs().amax(dim=2) / INT4_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (torch.round(groups / scale[..., None]).clamp_(-INT4_ZERO, INT4_MAX) + INT4_ZERO).to(torch.uint8)
    return Int4Weight(pack_int4(q.reshape(out_features, in_features)), scale.contiguous())


def takes_int4(w: torch.Tensor | Sequence[int]) -> bool:
    """Whether a matrix [out, in] (or its shape) is stored in 4 bits: its rows a multiple of INT4_GROUP, and its rows
    as many as the torch CPU kernel's tiles take (every such matrix is repacked for it: for_cpu_kernel)."""
    shape = tuple(w.shape) if isinstance(w, torch.Tensor) else tuple(w)
    return len(shape) == 2 and shape[1] % INT4_GROUP == 0 and shape[0] % TORCH_INT4_ROWS == 0


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """4-bit values [..., n] (uint8 in [0, 15]) two a byte [..., n / 2], the even one in the low nibble."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4's inverse: [..., n / 2] uint8 -> the values [..., n]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _dequantize4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    q = unpack_int4(packed).to(dtype) - INT4_ZERO
    groups = q.reshape(*scale.shape, -1)
    return (groups * scale.to(dtype)[..., None]).reshape(q.shape)


def linear(x: torch.Tensor, w: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a float or quantized weight; x [..., in] -> [..., out] in x's dtype."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    if isinstance(w, PackedInt4Weight):
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, w.packed, w.group, w.scales_and_zeros)
        out = out.to(x.dtype).reshape(*x.shape[:-1], -1)
    elif isinstance(w, Int8Weight) and _uses_cpu_kernel(x):
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch.ops.aten._weight_int8pack_mm(flat, w.q, w.kernel_scale)
        out = out.to(x.dtype).reshape(*x.shape[:-1], -1)
    elif isinstance(w, Int8Weight):
        out = F.linear(x, w.q.to(x.dtype)) * w.scale.to(x.dtype)
    else:
        out = F.linear(x, w.dequantize(x.dtype))
    return out if bias is None else out + bias


def embedding(ids: torch.Tensor, w: torch.Tensor | Int8Weight | Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The rows ids of an embedding [vocab, hidden], float or quantized, in dtype."""
    return F.embedding(ids, w) if isinstance(w, torch.Tensor) else w.rows(ids, dtype)


def for_cpu_kernel(w: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
    """w as the torch CPU kernels take it: an Int4Weight repacked (PackedInt4Weight), anything else as it is."""
    return PackedInt4Weight.of(w) if isinstance(w, Int4Weight) else w


_EXACT: ContextVar[bool] = ContextVar("exact_int8_products", default=False)   # set within exact_products()


INT8_KERNEL_K = 16     # torch's CPU int8 kernel reads the inputs in blocks of 16: other widths crash it or read garbage


def _uses_cpu_kernel(x: torch.Tensor) -> bool:
    """Whether an int8 product with activations x runs in torch's CPU int8-weight kernel (inputs of a width it
    takes; a product of another width dequantizes)."""
    return x.device.type == "cpu" and x.shape[-1] % INT8_KERNEL_K == 0 and not _EXACT.get()


@contextmanager
def exact_products() -> Iterator[None]:
    """Within it, int8 products keep the activations' own dtype (the weight dequantized for each product) instead
    of the CPU kernel's bfloat16 activations: slower, for measuring what that kernel's rounding costs."""
    token = _EXACT.set(True)
    try:
        yield
    finally:
        _EXACT.reset(token)
