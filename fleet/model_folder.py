"""A model folder checked before any agent loads it (`stratamesh up`, the coordinator's models): its config names a
family, rope type and dtype a stage computes, and its weights and tokenizer are there. What is wrong is said in one
line, at once, rather than by every agent's failed load in a log."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from stratamesh.fleet.errors import CheckpointError
from stratamesh.fleet.gguf_files import GgufModel, is_gguf
from stratamesh.fleet.stages import check_model_config, text_model_config
from stratamesh.fleet.weight_files import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, TOKENIZER_FILE


def check_model_folder(model_dir: str | Path) -> dict[str, Any]:
    """The folder's config.json as a dict; CheckpointError, one line naming the problem, unless a mesh can serve the
    model in it (fleet.stages.check_model_config) and it holds safetensors weights and a tokenizer.json. A GGUF
    file is a model too: its config as fleet.gguf_files reads it, its tokenizer one it can read."""
    if is_gguf(model_dir):
        if not Path(model_dir).is_file():
            raise CheckpointError(f"model file {model_dir} does not exist")
        model = GgufModel(model_dir)
        config = model.config()
        check_model_config(config)
        model.tokenizer_json()
        return config
    folder = Path(model_dir)
    if not folder.is_dir():
        raise CheckpointError(f"model folder {folder} does not exist")
    config = read_config_json(folder)
    check_model_config(config)
    if not (folder / SINGLE_FILE).exists() and not (folder / INDEX_FILE).exists():
        raise CheckpointError(f"model folder {folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    if not (folder / TOKENIZER_FILE).exists():
        raise CheckpointError(f"model folder {folder} has no {TOKENIZER_FILE}")
    return config


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    """A model folder's config.json as a dict, as the mesh reads it (a multimodal model's: its text model's,
    fleet.stages.text_model_config); CheckpointError, naming the file, where it is missing, unreadable or not a JSON
    object. A GGUF file's: what it says of its model (fleet.gguf_files)."""
    if is_gguf(model_dir):
        return GgufModel(model_dir).config()
    path = Path(model_dir) / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"model folder {path.parent} has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return text_model_config(config)


def default_model_id(path: str | Path) -> str:
    """The name a model is served under unless its operator names it: its folder's name, or its GGUF file's
    without the suffix."""
    resolved = Path(path).resolve()
    return resolved.stem if is_gguf(resolved) else resolved.name


def stored_quantize(path: str | Path) -> str:
    """The weight format a model is served in where its operator names none: a GGUF file's nearest its own blocks
    (fleet.gguf_files.FORMAT_OF_TYPE: a Q4_0 file stays in 4 bits), else none (a folder's weights as stored)."""
    return GgufModel(path).stored_format() if is_gguf(path) else ""


REVISED_BY = ("*.json", "*.safetensors", "*.gguf", "*.model", "*.txt")   # what a folder's revision is read from


def revision_of(path: str | Path) -> str:
    """Which revision a model folder (or GGUF file) is: 12 hex digits of a hash over where it is, its config's text
    and each weight and tokenizer file's name, size and modification time, so that another folder, or the same
    folder with a file replaced, is another revision. Cheap: no weight is read."""
    resolved = Path(path).resolve()
    digest = hashlib.sha256(f"{resolved}\0".encode())
    files = [resolved] if resolved.is_file() else sorted(
        {f for pattern in REVISED_BY for f in resolved.glob(pattern) if f.is_file()})
    for file in files:
        stat = file.stat()
        digest.update(f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        if file.name == CONFIG_FILE:
            digest.update(file.read_bytes())
    return digest.hexdigest()[:12]
