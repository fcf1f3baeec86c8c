"""Deployed models' weights as the coordinator offers them: manifests for agents that fetch a stage's tensors, and
the folders its Weights service serves chunks from (fleet.weight_files, fleet.weight_service)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from stratamesh.fleet.errors import ModelNotFound
from stratamesh.fleet.weight_files import ModelFiles, files_root
from stratamesh.fleet.weights import MAX_CHUNK_BYTES, WeightManifest


class ModelWeights:
    """Answers manifest requests from each model's folder, read once (again when its files change)."""

    def __init__(self, model_path: Callable[[str], str | None],
                 sources: Callable[[str, str], Sequence[str]] = lambda model_id, agent_id: (),
                 chunk_bytes: int = MAX_CHUNK_BYTES) -> None:
        """model_path: a deployed model's folder (None: no such model); sources: the Weights services an agent
        should try before the coordinator for a model's chunks, best first; chunk_bytes: see ModelFiles."""
        self._model_path = model_path
        self._chunk_bytes = chunk_bytes
        self._sources = sources
        self._files: dict[str, ModelFiles] = {}
        self._lock = threading.Lock()

    async def manifest(self, model_id: str, tensor_names: Sequence[str], agent_id: str) -> WeightManifest:
        """The chunks of the named tensors (ModelNotFound, InvalidInput for a tensor it lacks, CheckpointError);
        hashing a chunk for the first time reads it, on a thread."""
        path = self._model_path(model_id)
        if path is None:
            raise ModelNotFound(f"model {model_id!r} is not deployed")
        sources = tuple(self._sources(model_id, agent_id))
        return await asyncio.to_thread(lambda: self._read(path).manifest(model_id, tensor_names, sources))

    def roots(self, model_id: str, revision: str) -> list[Path]:
        """The folder the coordinator serves a model's chunks from (every chunk is checked against its hash): its
        folder, or the one its GGUF file is in."""
        path = self._model_path(model_id)
        return [files_root(path)] if path is not None else []

    def _read(self, path: str) -> ModelFiles:
        with self._lock:
            files = self._files.get(path)
            if files is None or not files.is_current():
                files = self._files[path] = ModelFiles(path, self._chunk_bytes)
            return files
