"""A mesh whose middle stage ONNX Runtime computes: torch -> onnxruntime -> torch, as processes on loopback.

The middle agent's operator chose ONNX Runtime (--runtime onnxruntime); the model's first and last stages are
pinned to the other agents' site, so the onnxruntime agent serves the middle stage."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from stratamesh.bench.chaos import make_jobs
from stratamesh.bench.datasets import regular_token_ids
from stratamesh.fleet.launcher import LocalMesh

from .reference import greedy_tokens
from .test_mesh import complete_ids

pytestmark = pytest.mark.slow

EDGE, FAR = ["--site", "home"], ["--site", "lab", "--runtime", "onnxruntime"]


def test_a_torch_onnxruntime_torch_mesh_gives_the_tokens_of_transformers(tiny_models: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    model_dir = tiny_models["llama"]
    with LocalMesh(str(model_dir), num_agents=3, num_stages=3, agent_args_by_index={0: EDGE, 1: FAR, 2: EDGE},
                   coordinator_args=["--first-site", "home", "--last-site", "home"],
                   extra_env={"STRATAMESH_CACHE_DIR": str(tmp_path / "cache")},
                   log_dir=str(tmp_path / "logs"), db=str(tmp_path / "registry.db")) as mesh:
        plans = httpx.get(f"{mesh.url}/admin/api/plans", headers=mesh.headers).json()["plans"]
        (plan,) = [p for p in plans if p["state"] == "active"]
        runs = [(s["agent_id"], s["runtime"], s["dtype"]) for s in plan["stages"]]
        assert runs[1] == (mesh.agent_ids[1], "onnxruntime", "float32")
        assert [r[1] for r in runs] == ["torch", "onnxruntime", "torch"]
        assert list((tmp_path / "cache" / "onnx").glob("*.onnx"))       # the middle stage's export, cached
        for seed, length in ((1, 12), (2, 40)):
            prompt = make_jobs(1, regular_token_ids(model_dir), prompt_len=length, max_tokens=1, seed=seed)[0]
            ids = list(prompt.prompt_ids)
            assert complete_ids(mesh, model_dir, ids, 24) == greedy_tokens(model_dir, ids, 24)
    print(f"\nplan {runs}: 2 prompts x 24 greedy tokens identical to transformers")
