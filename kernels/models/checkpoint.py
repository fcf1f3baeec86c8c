"""Lazy access to a Hugging Face safetensors checkpoint: a stage reads only the tensors it holds."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from stratamesh.fleet.errors import CheckpointError
from stratamesh.fleet.gguf_files import is_gguf
from stratamesh.fleet.weights import canonical_name
from stratamesh.kernels.models.config import ModelConfig
from stratamesh.kernels.models.families import layer_class

if TYPE_CHECKING:
    from stratamesh.kernels.models.gguf import GgufCheckpoint

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
_MIXTRAL_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")

@dataclass(frozen=True, slots=True)
class Slice:
    """Parts of a tensor to read instead of all of it: along dimension dim, whose length must be size, the entries
    of each (start, length) range, one after the other (a tensor-parallel rank's rows or columns of a matrix, or of
    each matrix a fused one holds, as Phi-3's qkv_proj: kernels.models.tp)."""

    dim: int
    size: int
    ranges: tuple[tuple[int, int], ...]

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This part of t (a view where it is one range)."""
        parts = [t.narrow(self.dim, start, length) for start, length in self.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


class Checkpoint:
    """A model folder's safetensors, single-file or sharded; files are opened only while loading.

    Tensors go by their canonical names (with the "model." prefix) whether or not the files spell it."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        # canonical name -> (file name, the name in that file)
        self._stored = {canonical_name(name): (file, name) for name, file in self._read_weight_map().items()}

    def tensor_names(self) -> list[str]:
        return sorted(self._stored)

    def load(self, names: Iterable[str], dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu", slices: Mapping[str, Slice] | None = None) -> dict[str, torch.Tensor]:
        """The named tensors as owned copies in dtype on device; CheckpointError naming any missing one. slices: of
        the tensors it names, only that part is read (CheckpointError where the tensor's shape has no such part).

        Each tensor is read onto the device and cast there, one at a time: a stage for a GPU never sits whole in
        RAM, and a tensor stored in dtype is never converted."""
        slices = slices or {}
        by_file: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for name in names:
            if name not in self._stored:
                raise CheckpointError(f"checkpoint {self.model_dir} has no tensor {name!r}")
            file_name, stored_name = self._stored[name]
            by_file[file_name].append((name, stored_name))
        out: dict[str, torch.Tensor] = {}
        for file_name, file_names in sorted(by_file.items()):
            path = self.model_dir / file_name
            if not path.exists():
                raise CheckpointError(f"checkpoint shard {path} is missing")
            on_cpu = torch.device(device).type == "cpu"
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for name, stored_name in file_names:
                    if name in slices:
                        out[name] = _read_slice(f, name, stored_name, slices[name], dtype, device)
                    else:       # on the CPU copy=True, so nothing keeps the file's memory map alive
                        out[name] = f.get_tensor(stored_name).to(dtype=dtype, copy=on_cpu)
        return out

    def _read_weight_map(self) -> dict[str, str]:
        index = self.model_dir / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index} is not a safetensors index: {e}") from None
            return {str(k): str(v) for k, v in weight_map.items()}
        single = self.model_dir / SINGLE_FILE
        if not single.exists():
            raise CheckpointError(f"{self.model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        with safe_open(str(single), framework="pt") as f:
            return {name: SINGLE_FILE for name in f.keys()}


def _read_slice(f, name: str, stored_name: str, part: Slice, dtype: torch.dtype,
                device: str | torch.device) -> torch.Tensor:
    """The part of a tensor a Slice names, read alone, as an owned contiguous tensor in dtype on device."""
    view = f.get_slice(stored_name)
    shape = view.get_shape()
    if len(shape) <= part.dim or shape[part.dim] != part.size:
        raise CheckpointError(f"tensor {name!r} has shape {tuple(shape)}, expected {part.size} along dimension "
                              f"{part.dim}")
    reads = [view[(slice(None),) * part.dim + (slice(start, start + length),)] for start, length in part.ranges]
    read = reads[0] if len(reads) == 1 else torch.cat(reads, dim=part.dim)
    return torch.empty(read.shape, dtype=dtype, device=device).copy_(read)     # one copy, cast as it goes


def stage_tensor_names(config: ModelConfig, start: int, end: int) -> list[str]:
    """The HF names a stage serving layers [start, end) needs, embedding and head only where they belong (an
    embedding model has no LM head: its last stage ends in the final norm)."""
    assert 0 <= start < end <= config.num_layers, (start, end, config.num_layers)
    names, layer = [EMBED] if start == 0 else [], layer_class(config)
    for i in range(start, end):
        names += layer.tensor_names(config, i)
    if end == config.num_layers:
        names.append(FINAL_NORM)
        head = EMBED if config.tie_word_embeddings else LM_HEAD
        if config.has_lm_head and head not in names:
            names.append(head)
    return names


def quantizable(name: str) -> bool:
    """Whether a stage with quantized weights (StageSpec.quantize) holds the named tensor quantized: a projection
    matrix (an expert's too: Mixtral's are w1, w2, w3), the LM head or the embedding (norms, biases and a mixture of
    experts' routers stay as they are)."""
    return name.endswith("_proj.weight") or name in (LM_HEAD, EMBED) or _MIXTRAL_EXPERT.search(name) is not None


def open_checkpoint(path: str | Path, quantize: str = "") -> Checkpoint | GgufCheckpoint:
    """A model's tensors by their Hugging Face names: a safetensors folder's, or a GGUF file's (quantize: the
    stage's weight format, which a GGUF file's Q4_0 matrices are kept in where it is int4: kernels.models.gguf)."""
    from stratamesh.kernels.models.gguf import GgufCheckpoint

    return GgufCheckpoint(path, quantize) if is_gguf(path) else Checkpoint(path)
