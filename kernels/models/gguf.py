"""A GGUF file's tensors as a stage loads them (fleet.gguf_files reads what the file says of the model).

Each tensor type, as a stage takes it:
- F32, F16, BF16: read as stored, cast to the stage's dtype.
- Q4_0 (blocks of 32 weights, a float16 scale each, the zero point 8): repacked, exactly, into the int4 format
  (kernels.ops.quant: the same groups, scales and zero point; only the nibbles' order within a block differs)
  where the stage's weights are int4 (StageSpec.quantize); dequantized otherwise.
- Q8_0, Q4_K, Q6_K and the other quantized types: dequantized (gguf.quants) into the stage's dtype, then quantized
  again in the stage's format where it asks for one (no kernel here takes their blocks as they are).
A stage reads only its own tensors: the file is a memory map, and a tensor's bytes are read when it is loaded."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import torch

from stratamesh.fleet.errors import CheckpointError
from stratamesh.fleet.gguf_files import GgufModel
from stratamesh.kernels.models.checkpoint import quantizable
from stratamesh.kernels.ops.quant import INT4_GROUP, SCALE_SUFFIX, pack_int4, takes_int4

Q4_0_BLOCK_BYTES = 2 + INT4_GROUP // 2           # a float16 scale, then 32 weights in 16 bytes
_FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}


class GgufCheckpoint:
    """A GGUF file as Checkpoint is a safetensors folder: tensors by their Hugging Face names. quantize: the
    stage's weight format (StageSpec.quantize), which Q4_0 matrices are kept in where it is int4."""

    def __init__(self, path: str | Path, quantize: str = "") -> None:
        self.model = GgufModel(path)
        self.quantize = quantize

    def tensor_names(self) -> list[str]:
        return sorted(self.model.tensors)

    def tensor_type(self, name: str) -> str:
        return self.model.tensors[name].tensor_type.name

    def load(self, names: Iterable[str], dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
             slices: Mapping[str, object] | None = None) -> dict[str, torch.Tensor]:
        """The named tensors, each as its type is taken (see the module's doc): floats in dtype on device, a Q4_0
        matrix of an int4 stage as its packed bytes with its scales under name + SCALE_SUFFIX. CheckpointError
        naming a missing tensor, or for slices (tensor-parallel stages read safetensors folders only)."""
        if slices:
            raise CheckpointError(f"{self.model.path}: tensor-parallel stages read Hugging Face folders, not GGUF "
                                  "files")
        out: dict[str, torch.Tensor] = {}
        for name in names:
            tensor = self.model.tensors.get(name)
            if tensor is None:
                raise CheckpointError(f"{self.model.path} has no tensor {name!r} (GGUF's name for it is missing)")
            order = self.model.unpermuted_rows(name)
            if self._repacks(name, tensor):
                packed, scale = q4_0_as_int4(np.asarray(tensor.data), int(tensor.shape[0]))
                if order is not None:
                    packed, scale = packed[order], scale[order]
                out[name], out[name + SCALE_SUFFIX] = packed.to(device), scale.to(device)
                continue
            values = torch.from_numpy(_as_float32(tensor))
            out[name] = (values if order is None else values[order]).to(device=device, dtype=dtype).contiguous()
        return out

    def _repacks(self, name: str, tensor) -> bool:  # noqa: ANN001 (a gguf ReaderTensor)
        """Whether a tensor goes to the stage as the int4 format's bytes: a Q4_0 matrix an int4 stage quantizes
        (checkpoint.quantizable) of a shape the int4 kernels take (quant.takes_int4)."""
        return (self.quantize == "int4" and tensor.tensor_type.name == "Q4_0" and quantizable(name)
                and takes_int4([int(d) for d in reversed(tensor.shape)]))       # (GGML lists columns first)


def _as_float32(tensor) -> np.ndarray:  # noqa: ANN001 (a gguf ReaderTensor)
    """A tensor's values as float32 [rows, columns] (or [n] for a vector), dequantized where it is quantized."""
    from gguf import GGMLQuantizationType, quants

    shape = tuple(int(d) for d in reversed(tensor.shape))       # GGML lists the innermost dimension first
    kind = tensor.tensor_type
    if kind.name in _FLOAT_TYPES:
        return np.asarray(tensor.data).astype(np.float32).reshape(shape)
    if kind == GGMLQuantizationType.BF16:
        raw = np.asarray(tensor.data).view(np.uint16).astype(np.uint32) << 16
        return raw.view(np.float32).reshape(shape)
    try:
        return quants.dequantize(np.asarray(tensor.data), kind).astype(np.float32).reshape(shape)
    except NotImplementedError:
        raise CheckpointError(f"GGUF tensor {tensor.name} is {kind.name}, which cannot be dequantized here") from None


def q4_0_as_int4(blocks: np.ndarray, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 rows [out, blocks x 18 bytes] -> the int4 format's packed [out, in / 2] uint8 (the even weight of each
    pair in the low nibble) and scales [out, in / 32] float32: the same values. A Q4_0 block holds its first 16
    weights in the low nibbles of its 16 bytes and the next 16 in the high ones."""
    rows = blocks.reshape(blocks.shape[0], in_features // INT4_GROUP, Q4_0_BLOCK_BYTES)
    scale = rows[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = torch.from_numpy(np.ascontiguousarray(rows[..., 2:]))
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)             # [out, blocks, 32]: the weights in order
    return pack_int4(q).reshape(blocks.shape[0], in_features // 2), torch.from_numpy(scale)
