"""How much memory a stage's paged KV cache gets: on a CPU, what its plan reserved for it (or the operator's
--kv-cache-gib); on a GPU, what the operator's share of the GPU (--gpu-memory-utilization, as vLLM's) leaves after
the weights and a step's working memory."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stratamesh.fleet.errors import MeshError
from stratamesh.kernels.models.config import ModelConfig

WORKSPACE_FACTOR = 2         # temporaries alive at once, over the largest tensor of each kind a step makes
MIN_CPU_KV_BYTES = 512 << 20     # a CPU stage's KV cache when its plan reserved less, or nothing


class OutOfGpuMemory(MeshError):
    """The GPU has no room for a stage's KV cache after its weights."""


@dataclass(frozen=True, slots=True)
class GpuMemory:
    """One GPU's memory as this process sees it."""

    total_bytes: int
    free_bytes: int          # free on the device now, whatever other processes hold
    process_bytes: int       # what this process's allocator holds there (its weights, so far)


def read_gpu_memory(device: str) -> GpuMemory:
    """The readings for a CUDA device ("cuda:N")."""
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    return GpuMemory(total_bytes, free_bytes, torch.cuda.memory_reserved(device))


def cpu_kv_bytes(planned_bytes: int, configured_bytes: int = 0) -> int:
    """A CPU stage's KV cache: configured_bytes if the operator set it, else what its plan reserved for it
    (StageSpec.kv_cache_bytes: the sequences and context its predicted throughput counts on), at least
    MIN_CPU_KV_BYTES."""
    return configured_bytes or max(planned_bytes, MIN_CPU_KV_BYTES)


def step_workspace_bytes(config: ModelConfig, max_batch_tokens: int, dtype_bytes: int, is_last: bool,
                         tp_degree: int = 1) -> int:
    """Working memory of the largest step a stage takes (max_batch_tokens tokens): its activations, the fused
    q|k|v and gate|up outputs, and, on the last stage, float32 logits of every token that samples at once."""
    c = config
    per_token = dtype_bytes * (4 * c.hidden_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim // tp_degree
                               + 3 * c.intermediate_size // tp_degree)
    logits = 4 * c.vocab_size * max_batch_tokens if is_last and c.has_lm_head else 0
    return WORKSPACE_FACTOR * (per_token * max_batch_tokens + logits)


def gpu_kv_bytes(memory: GpuMemory, utilization: float, workspace_bytes: int) -> int:
    """The KV cache of a stage whose weights are loaded: this process may hold utilization x the GPU's memory in
    all (weights, workspace, KV), and never more than is free now less the workspace. OutOfGpuMemory if nothing
    is left."""
    allowed = int(utilization * memory.total_bytes) - memory.process_bytes - workspace_bytes
    budget = min(allowed, memory.free_bytes - workspace_bytes)
    if budget <= 0:
        raise OutOfGpuMemory(
            f"no GPU memory left for a KV cache: {memory.process_bytes / 2**30:.2f} GiB of weights and "
            f"{workspace_bytes / 2**30:.2f} GiB of workspace in {utilization:.0%} of {memory.total_bytes / 2**30:.1f} "
            f"GiB ({memory.free_bytes / 2**30:.2f} GiB free); raise --gpu-memory-utilization or give the stage fewer "
            "layers")
    return budget
