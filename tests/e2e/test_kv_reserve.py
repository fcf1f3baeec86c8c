"""What the plan reserves is what the agent allocates: a CPU stage's KV cache, as processes on loopback, for a model
whose plan reserve is past the agent's 0.5 GiB floor (before, every CPU stage got 0.5 GiB whatever its plan said)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from stratamesh.launcher import LocalMesh
from stratamesh.kernels.tiny_model import write_tiny_model
from tests.patience import patient

pytestmark = pytest.mark.slow

NUM_LAYERS, KV_HEADS, HEAD_DIM, CONTEXT = 6, 8, 64, 4096


def test_a_cpu_agent_allocates_the_kv_cache_its_plan_reserved(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "wide-kv", num_layers=NUM_LAYERS, hidden_size=KV_HEADS * HEAD_DIM,
                                 num_heads=KV_HEADS, num_kv_heads=KV_HEADS, max_position_embeddings=CONTEXT)
    per_token = NUM_LAYERS * 2 * KV_HEADS * HEAD_DIM * 4         # K and V of every layer, float32
    with LocalMesh(str(model_dir), num_agents=1, log_dir=str(tmp_path / "logs"),
                   db=str(tmp_path / "registry.db")) as mesh:
        (plan,) = httpx.get(f"{mesh.url}/admin/api/plans", headers=mesh.headers, timeout=30).json()["plans"]
        (stage,) = plan["stages"]
        # the sequences the plan's throughput counts on (8 a micro-batch), each of the whole context: 768 MiB a
        # micro-batch, past the agent's floor
        assert stage["kv_cache_bytes"] == plan["predicted"]["concurrency"] * CONTEXT * per_token > 512 << 20
        deadline = time.monotonic() + patient(60)
        while time.monotonic() < deadline:      # the agent reports its stage's blocks with its next heartbeat
            (agent,) = httpx.get(f"{mesh.url}/admin/api/agents", headers=mesh.headers, timeout=30).json()["agents"]
            if agent["telemetry"] and agent["telemetry"]["stages"]:
                break
            time.sleep(0.2)
        (load,) = agent["telemetry"]["stages"]
        assert load["kv_blocks_total"] == stage["kv_cache_bytes"] // (16 * per_token)    # blocks of 16 tokens
        answer = httpx.post(f"{mesh.url}/v1/completions", headers=mesh.headers, timeout=60,
                            json={"model": model_dir.name, "prompt": "the mesh", "max_tokens": 4}).json()
        assert answer["usage"]["completion_tokens"] == 4
