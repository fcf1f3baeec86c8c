"""Mixed plans: edge stages and a tensor-parallel group in one pipeline, as processes on loopback.

The "cloud" agent says it may run 2 ranks (--ranks 2); with exactly 3 stages over an edge, a cloud and an edge
agent the planner makes the cloud's 2 ranks one TP=2 stage (see tests/coordinator/test_tp_placement.py), first,
middle or last: on loopback every link is alike, so its place is a tie."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from stratamesh.bench.chaos import kill_rank_mid_stream, make_jobs
from stratamesh.bench.datasets import regular_token_ids
from stratamesh.bench.margins import decisive
from stratamesh.bench.metrics import percentile
from stratamesh.launcher import LocalMesh
from tests.patience import patient

from .reference import greedy_tokens
from .test_mesh import complete_ids

from .conftest import LONG_LEASE
from .streams import held, settled_requests, which_diverged

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
CLOUD = ["--ranks", "2", "--tier", "cloud"]


def active_plan(mesh: LocalMesh) -> dict:
    plans = httpx.get(f"{mesh.url}/admin/api/plans", headers=mesh.headers).json()["plans"]
    (plan,) = [p for p in plans if p["state"] == "active"]
    return plan


def layout(plan: dict) -> list[tuple[int, int, str, int]]:
    """(start layer, end layer, agent, TP degree) of each stage, for the printed record."""
    return [(s["start_layer"], s["end_layer"], s["agent_id"][-2:], s["tp_degree"]) for s in plan["stages"]]


def tp_stages(plan: dict) -> list[tuple[int, dict]]:
    """(index, stage) of each tensor-parallel stage of the plan."""
    return [(i, s) for i, s in enumerate(plan["stages"]) if s["tp_degree"] > 1]


def test_an_edge_tp_edge_pipeline_gives_the_tokens_of_transformers(tiny_models: dict[str, Path],
                                                                   tmp_path: Path) -> None:
    model_dir = tiny_models["llama"]
    with LocalMesh(str(model_dir), num_agents=3, num_stages=3, agent_args_by_index={1: CLOUD},
                   log_dir=str(tmp_path / "logs"), db=str(tmp_path / "registry.db")) as mesh:
        plan = active_plan(mesh)
        ((_, stage),) = tp_stages(plan)
        assert [s["tp_degree"] for s in plan["stages"]].count(1) == 2 and stage["tp_degree"] == 2
        assert stage["agent_id"] == mesh.agent_ids[1]
        # the stages tile the layers; where the group sits is a tie on loopback (every link alike)
        ranges = [(s["start_layer"], s["end_layer"]) for s in plan["stages"]]
        assert ranges[0][0] == 0 and ranges[-1][1] == 6 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert list(mesh.rank_pids(1)) == [1]           # the cloud agent launched its rank 1
        for seed, length in ((1, 12), (2, 40)):
            prompt = make_jobs(1, regular_token_ids(model_dir), prompt_len=length, max_tokens=1, seed=seed)[0]
            ids = list(prompt.prompt_ids)
            assert complete_ids(mesh, model_dir, ids, 24) == greedy_tokens(model_dir, ids, 24)
    print(f"\nplan {layout(plan)}: 2 prompts x 24 greedy tokens identical to transformers")


def test_a_dead_rank_takes_its_group_down_and_the_streams_finish_identically_on_a_new_plan(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """An edge and three 2-rank agents for 3 stages: one agent is left over. kill -9 of rank 1 of a group
    mid-stream: its agent goes down with it, and the streams go on through a re-planned pipeline."""
    model_dir = tiny_models["llama"]
    jobs = decisive(make_jobs(6, regular_token_ids(model_dir), prompt_len=20, max_tokens=64, seed=7), model_dir)
    # the lease: an agent loading a re-plan's 2-rank stage must not be declared dead for it (conftest.py); the killed
    # group's agent is declared dead by its requests' GroupFailed, not by its lease
    with LocalMesh(str(model_dir), num_agents=4, num_stages=3, agent_args_by_index={i: CLOUD for i in (1, 2, 3)},
                   log_dir=str(tmp_path / "logs"), db=str(tmp_path / "registry.db"),
                   coordinator_args=LONG_LEASE) as mesh:
        plan = active_plan(mesh)
        index, _ = tp_stages(plan)[0]
        run = asyncio.run(kill_rank_mid_stream(mesh, MODEL, held(jobs), stage=index, rank=1))
        # the group killed is the one serving the stage when the kill came: the plan read above may have been
        # replaced meanwhile (an agent that joined after the first plan makes a better one, and it takes over)
        group_agent = run.killed_index
        agent_id, rank_pids = mesh.agent_ids[group_agent], run.killed_rank_pids
        exit_code = mesh.agents[group_agent].wait(timeout=30)
        records = settled_requests(mesh, 6)
        deadline = time.monotonic() + patient(30)
        while time.monotonic() < deadline and agent_id in str(active_plan(mesh)["stages"]):
            time.sleep(0.2)
        new_plan = active_plan(mesh)
    assert [o.error for o in run.reference + run.outcomes if o.error] == []
    assert [o.tokens for o in run.outcomes] == [r.tokens for r in run.reference], which_diverged(
        model_dir, jobs, reference=run.reference, failover=run.outcomes)
    assert exit_code != 0                                # the agent went down with its group ...
    assert not any(Path(f"/proc/{pid}").exists() for pids in rank_pids.values() for pid in pids)   # ... and its ranks
    assert all(r["num_failovers"] >= 1 and r["state"] == "finished" for r in records)
    assert all(run.killed_address not in route for route in run.routes_after)
    assert agent_id not in [s["agent_id"] for s in new_plan["stages"]]
    print(f"\nplan {layout(plan)}, stage {index} lost rank 1: stall p50 {percentile(run.stalls, 50) * 1e3:.0f} ms, "
          f"max {max(run.stalls) * 1e3:.0f} ms over {len(run.stalls)} streams; re-planned {layout(new_plan)}")
