"""Meshes whose stages torch and ONNX Runtime compute, as processes on loopback.

In the first, the middle agent's operator chose ONNX Runtime (--runtime onnxruntime); the model's first and last
stages are pinned to the other agents' site, so the onnxruntime agent serves the middle stage. In the second, one
agent lets the planner pick (--runtime auto), and the planner picks ONNX Runtime for its stage by the speeds it
measured."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

import httpx
import pytest

from stratamesh.bench.chaos import make_jobs
from stratamesh.bench.datasets import regular_token_ids
from stratamesh.agent.probe import parse_cpu_model, parse_gpu, read_cpuinfo, read_nvml
from stratamesh.agent.speed import ONNX_CACHE_NAME, box_fingerprint, default_cache_path
from stratamesh.launcher import LocalMesh
from stratamesh.fleet.stages import StageSpec

from .conftest import LONG_LEASE
from .reference import greedy_tokens
from .test_mesh import complete_ids

pytestmark = pytest.mark.slow


EDGE, FAR = ["--site", "home"], ["--site", "lab", "--runtime", "onnxruntime"]
# ONNX Runtime's speeds as the probe stores them (agent.speed: tests/agent/test_speed.py times the real probe)
MODEST = {"backend": "onnxruntime-cpu", "dtype": "float32", "flops": 5e10, "mem_bandwidth": 1e10,
          "step_overhead_s": 5e-4, "layer_overhead_s": 1e-4, "decode_flops": 2.5e10, "decode_bandwidth": 1e10}
FAST = {**MODEST, "flops": 1e13, "mem_bandwidth": 1e12, "step_overhead_s": 0.0, "layer_overhead_s": 0.0,
        "decode_flops": 1e13, "decode_bandwidth": 1e12}


@pytest.fixture(scope="module")
def run_cache(tiny_models: dict[str, Path]) -> Path:
    """The run's cache folder (tests/conftest.py) with torch's speeds measured and the tiny Llama's layer traced for
    ONNX Runtime (layer_template: keyed by the layer's shapes, the same for every stage of the model)."""
    from stratamesh.agent.probe import probe
    from stratamesh.kernels.models.decoder import load_stage
    from stratamesh.kernels.models.onnx_stage import layer_template

    cache = Path(os.environ["STRATAMESH_CACHE_DIR"])
    probe()
    model_dir = tiny_models["llama"]
    layer_template(load_stage(StageSpec("tiny-llama", str(model_dir), 2, 4, 6)), cache)
    return cache


def onnx_speeds_cache(cache: Path, speed: dict, run_cache: Path) -> Path:
    """A cache folder whose ONNX Runtime speeds agents of this box read as their own probe's (so that no test
    waits the probe's 15 s, nor does the planner's choice hang on how busy the box is); torch's, and the layers the
    exporter traced, are the run's (what every agent of the run reads from its cache). An export of a stage is
    made here by the agent that serves it."""
    import onnxruntime

    (cache / "onnx").mkdir(parents=True)
    shutil.copy(default_cache_path(), cache / default_cache_path().name)
    for template in (run_cache / "onnx").glob("layer-*.onnx"):
        shutil.copy(template, cache / "onnx" / template.name)
    fingerprint = box_fingerprint(socket.gethostname(), parse_cpu_model(read_cpuinfo()),
                                  [parse_gpu(raw) for raw in read_nvml()], onnxruntime.__version__)
    (cache / ONNX_CACHE_NAME).write_text(json.dumps({"fingerprint": fingerprint, "measured_at": time.time(),
                                                     "speeds": [speed]}))
    return cache


def test_a_torch_onnxruntime_torch_mesh_gives_the_tokens_of_transformers(tiny_models: dict[str, Path],
                                                                          tmp_path: Path, run_cache: Path) -> None:
    model_dir = tiny_models["llama"]
    with LocalMesh(str(model_dir), num_agents=3, num_stages=3, agent_args_by_index={0: EDGE, 1: FAR, 2: EDGE},
                   coordinator_args=["--first-site", "home", "--last-site", "home", *LONG_LEASE],
                   extra_env={"STRATAMESH_CACHE_DIR": str(onnx_speeds_cache(tmp_path / "cache", MODEST, run_cache))},
                   log_dir=str(tmp_path / "logs"), db=str(tmp_path / "registry.db")) as mesh:
        plans = httpx.get(f"{mesh.url}/admin/api/plans", headers=mesh.headers).json()["plans"]
        (plan,) = [p for p in plans if p["state"] == "active"]
        runs = [(s["agent_id"], s["runtime"], s["dtype"]) for s in plan["stages"]]
        assert runs[1] == (mesh.agent_ids[1], "onnxruntime", "float32")
        assert [r[1] for r in runs] == ["torch", "onnxruntime", "torch"]
        exports = [p for p in (tmp_path / "cache" / "onnx").glob("*.onnx") if not p.name.startswith("layer-")]
        assert exports                                                  # the middle stage's export, cached
        for seed, length in ((1, 12), (2, 40)):
            prompt = make_jobs(1, regular_token_ids(model_dir), prompt_len=length, max_tokens=1, seed=seed)[0]
            ids = list(prompt.prompt_ids)
            assert complete_ids(mesh, model_dir, ids, 24) == greedy_tokens(model_dir, ids, 24)
    print(f"\nplan {runs}: 2 prompts x 24 greedy tokens identical to transformers")


def test_the_planner_runs_an_auto_agents_stage_on_onnx_runtime_where_it_measured_it_faster(
        tiny_models: dict[str, Path], tmp_path: Path, run_cache: Path) -> None:
    """The auto agent measured ONNX Runtime far faster than torch (onnx_speeds_cache); the other two run torch."""
    model_dir, cache = tiny_models["llama"], onnx_speeds_cache(tmp_path / "cache", FAST, run_cache)
    with LocalMesh(str(model_dir), num_agents=3, num_stages=3, agent_args_by_index={1: ["--runtime", "auto"]},
                   extra_env={"STRATAMESH_CACHE_DIR": str(cache)},
                   log_dir=str(tmp_path / "logs"), db=str(tmp_path / "registry.db"),
                   coordinator_args=LONG_LEASE) as mesh:
        plans = httpx.get(f"{mesh.url}/admin/api/plans", headers=mesh.headers).json()["plans"]
        (plan,) = [p for p in plans if p["state"] == "active"]
        runs = {s["agent_id"]: s["runtime"] for s in plan["stages"]}
        assert runs == {mesh.agent_ids[0]: "torch", mesh.agent_ids[1]: "onnxruntime", mesh.agent_ids[2]: "torch"}
        prompt = make_jobs(1, regular_token_ids(model_dir), prompt_len=20, max_tokens=1, seed=3)[0]
        ids = list(prompt.prompt_ids)
        assert complete_ids(mesh, model_dir, ids, 24) == greedy_tokens(model_dir, ids, 24)
    print(f"\nruntimes {runs}: 24 greedy tokens identical to transformers")
