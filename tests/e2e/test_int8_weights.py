"""A mesh serving a model whose operator chose int8 weights (`coordinator --quantize int8`), as processes on
loopback: every stage holds int8 weights, and the mesh's greedy tokens are those of the same model run in one
process with int8 weights (kernels.models.decoder.greedy_tokens)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from stratamesh.bench.chaos import make_jobs
from stratamesh.bench.datasets import regular_token_ids
from stratamesh.launcher import LocalMesh
from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels.models.decoder import greedy_tokens, load_stage

from .test_mesh import complete_ids

pytestmark = pytest.mark.slow


def test_a_mesh_of_int8_stages_gives_the_tokens_of_the_int8_model_in_one_process(tiny_models: dict[str, Path],
                                                                                 tmp_path: Path) -> None:
    model_dir = tiny_models["llama"]
    with LocalMesh(str(model_dir), num_agents=2, num_stages=2, coordinator_args=["--quantize", "int8"],
                   log_dir=str(tmp_path / "logs"), db=str(tmp_path / "registry.db")) as mesh:
        (model,) = httpx.get(f"{mesh.url}/admin/api/models", headers=mesh.headers).json()["models"]
        assert model["quantize"] == "int8"
        (plan,) = httpx.get(f"{mesh.url}/admin/api/plans", headers=mesh.headers).json()["plans"]
        assert [s["quantize"] for s in plan["stages"]] == ["int8", "int8"]
        num_layers = plan["stages"][-1]["end_layer"]
        one_process = load_stage(StageSpec("m", str(model_dir), 0, num_layers, num_layers, quantize="int8"))
        for seed, length in ((1, 12), (2, 40)):
            prompt = make_jobs(1, regular_token_ids(model_dir), prompt_len=length, max_tokens=1, seed=seed)[0]
            ids = list(prompt.prompt_ids)
            assert complete_ids(mesh, model_dir, ids, 24) == greedy_tokens(one_process, ids, 24)
