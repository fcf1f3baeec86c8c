"""Real meshes for end-to-end tests: a coordinator and agents as processes on loopback."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from stratamesh.launcher import LocalMesh
from stratamesh.kernels.tiny_model import TINY_ARCHS, write_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

NUM_LAYERS = 6
# A lease for meshes whose agents load heavy stages (ONNX exports, tensor-parallel groups) while their tests run:
# such a load holds the agent's GIL for seconds, and on a loaded box its heartbeats can come later than the 2 s
# lease, so the coordinator declares a live agent dead (a known bug, noted on issues 47 and 48: heartbeats wait on
# the GIL a load holds). Tests about something else take this one.
LONG_LEASE = ["--agent-lease", "10"]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 6-layer tiny checkpoint of every supported family."""
    root = tmp_path_factory.mktemp("models")
    return {arch: write_tiny_model(root / f"tiny-{arch}", arch=arch, num_layers=NUM_LAYERS)
            for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def tiny_embedding_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 6-layer tiny embedding model: Llama's base model (LlamaModel), without an LM head."""
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-embed", num_layers=NUM_LAYERS, embedding=True)


def start_mesh(model_dir: Path, tmp_path: Path, num_agents: int = 3) -> LocalMesh:
    return LocalMesh(str(model_dir), num_agents=num_agents, log_dir=str(tmp_path / "logs"),
                     db=str(tmp_path / "registry.db")).start()


@pytest.fixture(scope="module")
def llama_mesh(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[LocalMesh]:
    mesh = start_mesh(tiny_models["llama"], tmp_path_factory.mktemp("llama-mesh"))
    try:
        yield mesh
    finally:
        mesh.stop()
