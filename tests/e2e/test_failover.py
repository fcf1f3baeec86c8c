"""Nothing lost when a box dies: kill -9 of a stage's agent mid-stream, checked against uninterrupted runs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from stratamesh.bench.chaos import kill_stage_mid_stream, make_jobs, percentile
from stratamesh.bench.datasets import regular_token_ids
from stratamesh.fleet.launcher import LocalMesh

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"


def test_killing_the_middle_agent_mid_stream_loses_no_token(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """3 stages and a spare; 8 streams of 64 tokens (greedy and seeded); kill -9 the middle stage's agent."""
    model_dir = tiny_models["llama"]
    jobs = make_jobs(8, regular_token_ids(model_dir), prompt_len=20, max_tokens=64, seed=3)
    with LocalMesh(str(model_dir), num_agents=4, num_stages=3, log_dir=str(tmp_path / "logs"),
                   db=str(tmp_path / "registry.db")) as mesh:
        run = asyncio.run(kill_stage_mid_stream(mesh, MODEL, jobs, stage=1))
        records = httpx.get(f"{mesh.url}/admin/api/requests", params={"limit": 8}).json()["requests"]
    assert [o.error for o in run.reference + run.outcomes if o.error] == []
    assert [o.tokens for o in run.outcomes] == [r.tokens for r in run.reference]   # none repeated, none missing
    assert len(run.routes_after) == 8 and all(run.killed_address not in r for r in run.routes_after)
    assert all(r["num_failovers"] >= 1 and r["state"] == "finished" for r in records)
    assert len(run.stalls) == 8
    print(f"\nkill -9 of the middle stage: stall (kill to next token) p50 {percentile(run.stalls, 50) * 1e3:.0f} ms, "
          f"max {max(run.stalls) * 1e3:.0f} ms over {len(run.stalls)} streams")
