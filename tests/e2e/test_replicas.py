"""A model served by two replicas, as processes on loopback: the router takes them in turn, every answer is
transformers' own, and when one replica's agent dies (kill -9) the other serves every request."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from stratamesh.bench.chaos import make_jobs
from stratamesh.bench.datasets import regular_token_ids
from stratamesh.launcher import LocalMesh

from .reference import greedy_tokens
from .test_mesh import complete_ids
from .test_supervision import wait_until

pytestmark = pytest.mark.slow


def admin(mesh: LocalMesh, path: str) -> dict:
    response = httpx.get(f"{mesh.url}/admin/api/{path}", headers=mesh.headers, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_two_replicas_share_the_requests_and_one_serves_them_all_when_the_other_dies(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    model_dir = tiny_models["llama"]
    prompts = [list(make_jobs(1, regular_token_ids(model_dir), prompt_len=10 + 3 * i, max_tokens=1,
                              seed=i)[0].prompt_ids) for i in range(6)]
    expected = [greedy_tokens(model_dir, ids, 12) for ids in prompts]
    with LocalMesh(str(model_dir), num_agents=2, num_stages=1, coordinator_args=["--replicas", "2"],
                   log_dir=str(tmp_path / "logs"), db=str(tmp_path / "registry.db")) as mesh:
        assert wait_until(lambda: admin(mesh, "models")["models"][0]["ready_replicas"] == 2), "both replicas load"
        plans = [p for p in admin(mesh, "plans")["plans"] if p["state"] == "active"]
        assert sorted(p["replica"] for p in plans) == [0, 1]
        replica_of = {p["stages"][0]["assignment_id"]: p["replica"] for p in plans}
        agent_of = {p["replica"]: p["stages"][0]["agent_id"] for p in plans}
        assert agent_of[0] != agent_of[1]
        for ids, tokens in zip(prompts[:4], expected[:4], strict=True):
            assert complete_ids(mesh, model_dir, ids, 12) == tokens
        served = [replica_of[r["route"][0]["assignment_id"]] for r in admin(mesh, "requests?limit=4")["requests"]]
        assert sorted(served) == [0, 0, 1, 1]               # round-robin: each replica took two

        victim = mesh.agent_ids.index(agent_of[1])
        mesh.kill_agent(victim)
        assert wait_until(lambda: admin(mesh, "models")["models"][0]["ready_replicas"] == 1), "the dead one drops"
        for ids, tokens in zip(prompts[4:], expected[4:], strict=True):
            assert complete_ids(mesh, model_dir, ids, 12) == tokens
        served = [replica_of.get(r["route"][0]["assignment_id"]) for r in admin(mesh, "requests?limit=2")["requests"]]
        assert served == [0, 0]
    print(f"\n2 replicas on {sorted(agent_of.values())}: 4 requests split 2/2; after kill -9 of replica 1's agent, "
          f"2 more served by replica 0; all 6 answers identical to transformers")


def test_kv_routing_sends_prompts_that_share_a_prefix_to_the_replica_whose_cache_holds_it(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """--router-mode kv: the agents' KV events reach the router over the control stream (the admin API shows the
    blocks each stage holds), and prompts that extend a served one go where its prefix is cached and are served
    from that cache, with transformers' tokens."""
    model_dir = tiny_models["llama"]
    vocab = regular_token_ids(model_dir)
    system = list(make_jobs(1, vocab, prompt_len=48, max_tokens=1, seed=3)[0].prompt_ids)     # 3 blocks of 16
    prompts = [system + list(make_jobs(1, vocab, prompt_len=5 + i, max_tokens=1, seed=10 + i)[0].prompt_ids)
               for i in range(3)]
    with LocalMesh(str(model_dir), num_agents=2, num_stages=1, coordinator_args=["--replicas", "2",
                                                                                   "--router-mode", "kv"],
                   log_dir=str(tmp_path / "logs"), db=str(tmp_path / "registry.db")) as mesh:
        assert wait_until(lambda: admin(mesh, "models")["models"][0]["ready_replicas"] == 2), "both replicas load"
        assert complete_ids(mesh, model_dir, system, 8) == greedy_tokens(model_dir, system, 8)
        (first,) = admin(mesh, "requests?limit=1")["requests"]
        home = first["route"][0]["assignment_id"]

        def cached_blocks() -> dict[str, int]:
            return {s["assignment_id"]: s["cached_blocks"] for p in admin(mesh, "plans")["plans"]
                    for s in p["stages"]}

        # the prompt's 3 full blocks and those of the tokens generated after it, as the stage's events said
        assert wait_until(lambda: cached_blocks()[home] >= 3), f"the router heard of the cached blocks: {cached_blocks()}"
        assert [b for a, b in cached_blocks().items() if a != home] == [0]
        for ids in prompts:
            assert complete_ids(mesh, model_dir, ids, 8) == greedy_tokens(model_dir, ids, 8)
        records = admin(mesh, f"requests?limit={len(prompts)}")["requests"]
    assert [r["route"][0]["assignment_id"] for r in records] == [home] * len(prompts)
    assert all(r["cached_tokens"] >= 48 for r in records)
    print(f"\nkv routing: {len(prompts)} prompts extending a served 48-token one all went to its replica and were "
          f"served {sorted(r['cached_tokens'] for r in records)} tokens from its prefix cache")
