"""A GPU stage's KV cache gets what its share of the GPU leaves after the weights and a step's workspace."""

from __future__ import annotations

import pytest

from stratamesh.agent.engine.memory import GpuMemory, OutOfGpuMemory, gpu_kv_bytes, step_workspace_bytes
from stratamesh.kernels.models.config import ModelConfig

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
