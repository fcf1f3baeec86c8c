"""A stage placed on a GPU runs there: weights in its dtype on the device, a KV cache sized from what the GPU has
left, decode steps as CUDA graphs, the same tokens as on the CPU in float32."""

from __future__ import annotations

import pytest
import torch

from stratamesh.agent.engine.stage_runner import StageRunner
from stratamesh.fleet.stages import StageSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_bfloat16_stage_loads_onto_its_gpu_and_sizes_its_kv_cache_from_the_gpu(tiny_model) -> None:
    model_dir = tiny_model("llama", num_layers=2, dtype="bfloat16")
    spec = StageSpec("m", str(model_dir), 0, 2, 2, dtype="bfloat16", device="cuda:0")
    runner = StageRunner.load(spec, kv_cache_bytes=1 << 20, gpu_memory_utilization=0.5, graph_batch=8)
    assert {(t.device.type, t.dtype) for t in runner.model.tensors.values()} == {("cuda", torch.bfloat16)}
    assert runner.cache.device.type == "cuda" and runner.cache.dtype == torch.bfloat16
    free, total = torch.cuda.mem_get_info()
    assert runner.cache.nbytes > 1 << 30 and runner.cache.nbytes <= 0.5 * total   # the GPU's share, not 1 MiB
    assert runner.graphs is not None and runner.graphs.sizes[-1] == 8
