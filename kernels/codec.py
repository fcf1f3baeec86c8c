"""Activation codecs: torch tensor <-> TensorBlob (raw float32/float16/bfloat16, or int8 with per-row scales)."""

from __future__ import annotations

import math

import torch

from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.sessions import TensorBlob
from stratamesh.fleet.stages import DTYPES

CODECS = ("raw", "int8")
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def encode(t: torch.Tensor, codec: str = "raw") -> TensorBlob:
    """A tensor as bytes; int8 quantizes each row (token) of the last dimension with its own absmax scale."""
    if t.dtype not in DTYPE_NAMES:
        raise InvalidInput(f"cannot encode dtype {t.dtype}; supported: {DTYPES}")
    if codec not in CODECS:
        raise InvalidInput(f"unknown codec {codec!r}; supported: {CODECS}")
    shape = tuple(t.shape)
    t = t.detach().to("cpu").contiguous()
    if codec == "raw":
        return TensorBlob(DTYPE_NAMES[t.dtype], shape, _bytes(t))
    rows = t.reshape(-1, shape[-1] if shape and shape[-1] else 1).float()   # [N, hidden]
    scales = rows.abs().amax(dim=1) / 127.0                                  # [N]
    q = torch.round(rows / scales.clamp_min(1e-30)[:, None]).clamp(-127, 127).to(torch.int8)
    scales_blob = TensorBlob("float32", (scales.numel(),), _bytes(scales))
    return TensorBlob(DTYPE_NAMES[t.dtype], shape, _bytes(q), codec="int8", scales=scales_blob)


def decode(blob: TensorBlob) -> torch.Tensor:
    """The tensor a blob carries; InvalidInput naming the field when the blob is malformed."""
    _check_header(blob)
    if blob.codec == "raw":
        return _from_bytes(blob.data, TORCH_DTYPES[blob.dtype], blob.shape, "blob.data")
    q = _from_bytes(blob.data, torch.int8, blob.shape, "blob.data")
    num_rows = q.numel() // blob.shape[-1] if blob.shape and blob.shape[-1] else q.numel()
    scales = _check_scales(blob.scales, num_rows)
    rows = q.reshape(num_rows, -1).float() * scales[:, None]
    return rows.reshape(blob.shape).to(TORCH_DTYPES[blob.dtype])


def _check_header(blob: TensorBlob) -> None:
    if blob.dtype not in TORCH_DTYPES:
        raise InvalidInput(f"blob.dtype {blob.dtype!r} is not one of {DTYPES}")
    if blob.codec not in CODECS:
        raise InvalidInput(f"blob.codec {blob.codec!r} is not one of {CODECS}")
    if not all(isinstance(d, int) and d >= 0 for d in blob.shape):
        raise InvalidInput(f"blob.shape {blob.shape!r} must be non-negative integers")


def _check_scales(scales: TensorBlob | None, num_rows: int) -> torch.Tensor:
    if scales is None:
        raise InvalidInput("blob.scales is required by the int8 codec")
    if scales.dtype != "float32" or scales.codec != "raw" or tuple(scales.shape) != (num_rows,):
        raise InvalidInput(f"blob.scales must be raw float32 of shape ({num_rows},), got {scales.dtype} "
                           f"{scales.codec} {tuple(scales.shape)}")
    t = _from_bytes(scales.data, torch.float32, (num_rows,), "blob.scales.data")
    if not bool(torch.isfinite(t).all()):
        raise InvalidInput("blob.scales holds a non-finite value")
    return t


def _bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()   # a uint8 view works for bfloat16 too


def _from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...], field: str) -> torch.Tensor:
    want = math.prod(shape) * dtype.itemsize
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) != want:
        got = len(data) if isinstance(data, (bytes, bytearray, memoryview)) else type(data).__name__
        raise InvalidInput(f"{field} holds {got} bytes, dtype and shape {tuple(shape)} need {want}")
    if want == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
