"""Agents that fetch their stages' tensors instead of reading the model folder (`agent --fetch-weights always`), as
processes on loopback: each fetches exactly its own layers' bytes, the mesh answers as transformers does, and a
chunk corrupted on an agent's disk is found and fetched again (alone) when the agent comes back."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from stratamesh.launcher import LocalMesh
from stratamesh.fleet.weight_files import SINGLE_FILE, ModelFiles
from stratamesh.kernels.models.checkpoint import stage_tensor_names
from stratamesh.kernels.models.config import read_config
from tests.fleet.test_weight_files import stored_bytes

from .reference import greedy_tokens
from .test_mesh import complete_ids
from .test_supervision import wait_until

pytestmark = pytest.mark.slow


def stages(mesh: LocalMesh) -> list[dict]:
    (plan,) = httpx.get(f"{mesh.url}/admin/api/plans", headers=mesh.headers).json()["plans"]
    return plan["stages"]


def test_agents_without_the_folder_fetch_only_their_layers_and_serve_exactly(tiny_models: dict[str, Path],
                                                                             tmp_path: Path) -> None:
    model_dir = tiny_models["llama"]
    config = read_config(model_dir)
    weights_dirs = [tmp_path / f"weights{i}" for i in range(2)]
    with LocalMesh(str(model_dir), num_agents=2, num_stages=2, log_dir=str(tmp_path / "logs"),
                   db=str(tmp_path / "registry.db"), agent_args=["--fetch-weights", "always"],
                   agent_args_by_index={i: ["--weights-dir", str(d)] for i, d in enumerate(weights_dirs)}) as mesh:
        before = stages(mesh)
        for stage in before:
            w = stage["weights"]
            names = stage_tensor_names(config, stage["start_layer"], stage["end_layer"])
            assert w["done"] and w["num_corrupt"] == 0 and w["source"] == "coordinator"
            assert w["tensor_bytes"] == stored_bytes(model_dir, names)     # its layers' bytes, and no others
            assert w["fetched_bytes"] == w["total_bytes"] and w["reused_bytes"] == 0
            assert 0 < w["total_bytes"] - w["tensor_bytes"] < 64 * 1024   # the file header and config.json
            print(f"\nstage [{stage['start_layer']}, {stage['end_layer']}): fetched {w['fetched_bytes']:,} bytes, "
                  f"its tensors {w['tensor_bytes']:,} (header and config.json: "
                  f"{w['total_bytes'] - w['tensor_bytes']:,})")
        prompt = list(range(3, 40))
        assert complete_ids(mesh, model_dir, prompt, 16) == greedy_tokens(model_dir, prompt, 16)
        logs = "".join((tmp_path / "logs" / f"agent{i}.log").read_text() for i in range(2))
        assert "100%" in logs and "[####################]" in logs       # the progress bar, to its end

        # each agent's copy holds its own half of the checkpoint: the file at full size, the rest a hole
        (copy_0,) = weights_dirs[0].glob(f"*/*/{SINGLE_FILE}")
        assert copy_0.stat().st_size == (model_dir / SINGLE_FILE).stat().st_size
        assert copy_0.stat().st_blocks * 512 < 0.8 * copy_0.stat().st_size

        # corrupt one byte of one chunk of agent 0's copy, then bring agent 0 back: it checks its copy, keeps all
        # the rest, and fetches that chunk (alone) again
        index = 0
        held = next(s for s in before if s["agent_id"] == mesh.agent_ids[index])
        names = stage_tensor_names(config, held["start_layer"], held["end_layer"])
        chunk = ModelFiles(model_dir).manifest("m", names).chunks[-1]
        with open(copy_of(weights_dirs[index]), "r+b") as f:
            f.seek(chunk.offset + chunk.length // 2)
            byte = f.read(1)
            f.seek(chunk.offset + chunk.length // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
        mesh.kill_agent(index)
        mesh.start_agent(index)

        def refetched() -> dict | None:
            now = {s["agent_id"]: s for s in stages(mesh)}.get(mesh.agent_ids[index])
            w = now and now["state"] == "ready" and now["weights"]
            return w if w and w["done"] and w["reused_bytes"] > 0 else None

        assert wait_until(refetched), f"agent {index} came back with its copy checked: {stages(mesh)}"
        w = refetched()
        assert w["fetched_bytes"] == chunk.length and w["reused_bytes"] == w["total_bytes"] - chunk.length
        assert complete_ids(mesh, model_dir, prompt, 16) == greedy_tokens(model_dir, prompt, 16)


def copy_of(weights_dir: Path) -> Path:
    (path,) = weights_dir.glob(f"*/*/{SINGLE_FILE}")
    return path
