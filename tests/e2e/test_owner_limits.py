"""The owner's limits on a real mesh: an agent whose sensor crosses its --max-gpu-temp mid-stream rests (its
stage and live sessions move to a spare, nothing lost or changed), stays up, and serves again after its cool-down.

The sensor is the agent's --sensor-file, which an owner's script would keep current (for sensors NVML does not
see); here the test writes it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from stratamesh.bench.chaos import FailoverRun, StreamOutcome, disturb_stage_mid_stream, make_jobs
from stratamesh.bench.datasets import regular_token_ids
from stratamesh.bench.margins import decisive
from stratamesh.launcher import LocalMesh
from tests.patience import patient

from .streams import held, settled_requests, which_diverged

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
COOL, HOT = '{"temperatures_c": [55]}', '{"temperatures_c": [91]}'


def agent_state(mesh: LocalMesh, agent_id: str) -> str:
    agents = httpx.get(f"{mesh.url}/admin/api/agents", headers=mesh.headers).json()["agents"]
    return next(a["state"] for a in agents if a["agent_id"] == agent_id)


def until(done, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_an_agent_past_its_owners_limit_rests_mid_stream_and_serves_again_after_the_cool_down(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    model_dir = tiny_models["llama"]
    sensors = [tmp_path / f"sensors-{i}.json" for i in range(3)]
    for sensor in sensors:
        sensor.write_text(COOL)
    limits = {i: ["--max-gpu-temp", "80", "--sensor-file", str(sensors[i]), "--limit-grace", "1s",
                  "--limit-cooldown", "2s"] for i in range(3)}
    # held open: every stream still runs when the rest is over, however busy the box
    jobs = held(decisive(make_jobs(6, regular_token_ids(model_dir), prompt_len=20, max_tokens=96, seed=5), model_dir))
    with LocalMesh(str(model_dir), num_agents=3, num_stages=2, agent_args_by_index=limits,
                   log_dir=str(tmp_path / "logs"), db=str(tmp_path / "registry.db")) as mesh:

        async def heat(run: FailoverRun, outcomes: list[StreamOutcome]) -> None:
            index = mesh.agent_index(run.killed_address)
            sensors[index].write_text(HOT)
            async with httpx.AsyncClient(headers=mesh.headers, timeout=10) as client:
                deadline = time.monotonic() + patient(60)
                while True:
                    drain = await client.get(f"{mesh.url}/admin/api/agents/{mesh.agent_ids[index]}/drain")
                    if drain.status_code == 200 and drain.json()["drain"]["state"] in ("drained", "failed"):
                        run.drain_output = str(drain.json()["drain"])
                        return
                    assert time.monotonic() < deadline, "the agent never rested"
                    await asyncio.sleep(0.1)

        run = asyncio.run(disturb_stage_mid_stream(mesh.url, mesh.headers, MODEL, jobs, 1, 16, heat))
        records = settled_requests(mesh, 6)
        rested = mesh.agent_index(run.killed_address)
        rested_id = mesh.agent_ids[rested]
        assert "'rest': 'at 91 C, above 80 C'" in run.drain_output and "'state': 'drained'" in run.drain_output
        assert agent_state(mesh, rested_id) == "resting" and mesh.agents[rested].poll() is None   # it stays up
        sensors[rested].write_text(COOL)
        until(lambda: agent_state(mesh, rested_id) == "connected")        # after its cool-down
        events = httpx.get(f"{mesh.url}/admin/api/events", headers=mesh.headers).json()["events"]
    assert [o.error for o in run.reference + run.outcomes if o.error] == []
    assert [o.tokens for o in run.outcomes] == [r.tokens for r in run.reference], which_diverged(   # identical,
        model_dir, jobs, reference=run.reference, rested=run.outcomes)                              # none lost
    assert run.routes_after and all(run.killed_address not in route for route in run.routes_after)
    assert [r["num_failovers"] for r in records] == [0] * 6                         # moved, not failed over
    kinds = [e["kind"] for e in events if e.get("agent_id") == rested_id]
    assert "agent_resting" in kinds and "agent_serving" in kinds
