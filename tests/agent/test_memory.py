"""A GPU stage's KV cache gets what its share of the GPU leaves after the weights and a step's workspace; a CPU
stage's, what its plan reserved for it (or what the operator set)."""

from __future__ import annotations

import pytest

from stratamesh.agent.engine.memory import (MIN_CPU_KV_BYTES, GpuMemory, OutOfGpuMemory, cpu_kv_bytes, gpu_kv_bytes,
                                            step_workspace_bytes)
from stratamesh.agent.engine.stage_runner import StageRunner
from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels.models.config import ModelConfig
from stratamesh.kernels.ops.paged_attention import PagedKVCache

GiB = 1 << 30
LLAMA_1B = ModelConfig("llama", 32000, 2048, 5632, 16, 32, 8, 64)


@pytest.mark.parametrize("memory, utilization, workspace, kv", [
    # an 80 GiB GPU to itself, 10 GiB of weights: 90% of it less weights and workspace
    (GpuMemory(80 * GiB, 70 * GiB, 10 * GiB), 0.9, 1 * GiB, 61 * GiB),
    # two agents share it at 0.45 each: the second sees the first's 36 GiB gone, and keeps to its own share
    (GpuMemory(80 * GiB, 34 * GiB, 10 * GiB), 0.45, 1 * GiB, 25 * GiB),
    # another process holds most of it: no more than is free, less the workspace
    (GpuMemory(80 * GiB, 8 * GiB, 10 * GiB), 0.9, 1 * GiB, 7 * GiB),
])
def test_the_kv_cache_takes_what_the_share_of_the_gpu_leaves(memory, utilization, workspace, kv) -> None:
    assert gpu_kv_bytes(memory, utilization, workspace) == kv


def test_a_gpu_without_room_for_a_kv_cache_is_refused_saying_what_filled_it() -> None:
    with pytest.raises(OutOfGpuMemory, match="no GPU memory left for a KV cache.*--gpu-memory-utilization"):
        gpu_kv_bytes(GpuMemory(24 * GiB, 2 * GiB, 22 * GiB), 0.9, 1 * GiB)   # 21.6 GiB allowed, 22 of weights


def test_the_workspace_grows_with_the_step_and_the_last_stage_holds_the_logits() -> None:
    middle = step_workspace_bytes(LLAMA_1B, 512, 2, is_last=False)
    assert step_workspace_bytes(LLAMA_1B, 1024, 2, is_last=False) == 2 * middle
    last = step_workspace_bytes(LLAMA_1B, 512, 2, is_last=True)
    assert last - middle == 2 * 4 * 32000 * 512                 # float32 logits of every token, twice over
    assert step_workspace_bytes(LLAMA_1B, 512, 2, is_last=False, tp_degree=2) < middle   # a rank's share


@pytest.mark.parametrize("planned, configured, kv", [
    (3 * GiB, 0, 3 * GiB),                        # what the plan reserved ...
    (GiB // 64, 0, MIN_CPU_KV_BYTES),             # ... and at least the floor
    (0, 0, MIN_CPU_KV_BYTES),                     # a plan from before plans said (or none)
    (3 * GiB, GiB // 8, GiB // 8),                # the operator's --kv-cache-gib wins either way
    (0, 2 * GiB, 2 * GiB),
])
def test_a_cpu_stages_kv_cache_is_what_its_plan_reserved_unless_the_operator_says(planned, configured, kv) -> None:
    assert cpu_kv_bytes(planned, configured) == kv


@pytest.mark.parametrize("configured", [0, 16 << 20])
def test_a_cpu_stage_loads_the_kv_cache_its_spec_carries(tiny_model, configured: int) -> None:
    """Through the real loader: the plan's reserve (here past the floor) becomes the cache's blocks."""
    model_dir = tiny_model("llama")
    planned = MIN_CPU_KV_BYTES + (64 << 20)
    spec = StageSpec("tiny", str(model_dir), 0, 2, 6, kv_cache_bytes=planned)
    runner = StageRunner.load(spec, configured)
    config = runner.model.config
    want = PagedKVCache.blocks_for_bytes(configured or planned, 2, spec.kv_block_size, config.num_kv_heads,
                                         config.head_dim, runner.cache.dtype)
    assert runner.num_blocks == want > 2
