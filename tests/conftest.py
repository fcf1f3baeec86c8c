"""Fixtures for every test: tiny random checkpoints, written once per session and shared."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from stratamesh.forked import FORK_SERVER_ENV
from stratamesh.kernels.tiny_model import write_tiny_model
from tests.patience import patience, patient

# postgres_url and postgres_database: a real PostgreSQL server, started when a test first asks for it
pytest_plugins = ["tests.postgres"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():
    # the paged-decode kernel's tests run in Triton's interpreter; it must be chosen before anything imports Triton
    # (transformers' modeling modules do, when a test module imports one at its top)
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # each worker computes on its share of the cores: two workers' OpenMP pools of one thread a core each would
    # spin-wait on one another (a step 10-50x slower), the agents of the other worker's meshes in between
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
# agents started by tests (and their subprocesses) cache measured speeds here, not in ~/.cache: one folder for the
# whole run, since pytest-xdist's workers inherit it from the controller, which imported this module first
_OWN_CACHE_DIR = "" if "STRATAMESH_CACHE_DIR" in os.environ else tempfile.mkdtemp(prefix="stratamesh-test-cache-")
os.environ.setdefault("STRATAMESH_CACHE_DIR", _OWN_CACHE_DIR)
# the agents of the suite's local meshes (LocalMesh, in tests and the benchmarks they run; not `stratamesh up`'s) are
# forked from a fork server that imported torch once (stratamesh/forked.py): an agent's start then costs ~1 s of CPU, not ~3
os.environ.setdefault(FORK_SERVER_ENV, "1")
patience()  # measured once, in the controller: its workers and every process they start read it from the environment


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run's cache folder goes with the run (ONNX exports: tens of MB a run), deleted by the process that made
    it: the controller, once its workers are done (they inherit the folder, and made none)."""
    if _OWN_CACHE_DIR:
        shutil.rmtree(_OWN_CACHE_DIR, ignore_errors=True)


def pytest_report_header() -> str:
    return f"patience {patience():.2f} (STRATAMESH_PATIENCE: the suite's limits stretched for this machine)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test's limit (pytest-timeout's, unless it sets its own) scaled by the machine's patience; and the tests
    that start processes (marked slow) first, so that pytest-xdist's workers end on short tests, not one on a long
    one while the other idles."""
    limit = patient(float(config.getini("timeout") or 0))
    for item in items:
        if limit and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(limit))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)    # stable: the order within each stays


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_model(arch="llama", **write_tiny_model_kwargs) -> the folder; the same arguments reuse one folder."""
    made: dict[tuple, Path] = {}

    def make(arch: str = "llama", **kwargs) -> Path:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in made:
            made[key] = write_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch, **kwargs)
        return made[key]

    return make

