"""Prefill/decode disaggregation as processes on loopback (`coordinator --replicas 2 --prefill-replicas 1`): a long
prompt prefills on the prefill replica, its KV moves over gRPC to the decode replica, which generates the rest;
short prompts run whole on the decode replica. Every answer is transformers' greedy one."""

from __future__ import annotations

from pathlib import Path

import pytest

from stratamesh.bench.chaos import make_jobs
from stratamesh.bench.datasets import regular_token_ids
from stratamesh.launcher import LocalMesh
from stratamesh.kernels.models.config import read_config

from .reference import greedy_tokens
from .test_drain import samples
from .test_mesh import complete_ids
from .test_replicas import admin
from .test_supervision import wait_until

pytestmark = pytest.mark.slow


def test_a_long_prompt_prefills_on_the_prefill_replica_and_decodes_on_the_other(tiny_models: dict[str, Path],
                                                                                 tmp_path: Path) -> None:
    model_dir = tiny_models["llama"]
    config = read_config(model_dir)
    vocab = regular_token_ids(model_dir)
    long_prompt, short_prompt = (list(make_jobs(1, vocab, prompt_len=n, max_tokens=1, seed=n)[0].prompt_ids)
                                 for n in (100, 20))
    with LocalMesh(str(model_dir), num_agents=2, num_stages=1, log_dir=str(tmp_path / "logs"),
                   db=str(tmp_path / "registry.db"),
                   coordinator_args=["--replicas", "2", "--prefill-replicas", "1", "--disagg-min-prompt", "64"]) as mesh:
        assert wait_until(lambda: admin(mesh, "models")["models"][0]["ready_replicas"] == 2), "both replicas load"
        plans = admin(mesh, "plans")["plans"]
        assert {p["replica"]: p["role"] for p in plans} == {0: "prefill", 1: "decode"}
        replica_of = {p["stages"][0]["assignment_id"]: p["replica"] for p in plans}
        assert complete_ids(mesh, model_dir, long_prompt, 12) == greedy_tokens(model_dir, long_prompt, 12)
        assert complete_ids(mesh, model_dir, short_prompt, 12) == greedy_tokens(model_dir, short_prompt, 12)
        short, long = admin(mesh, "requests?limit=2")["requests"]
        assert replica_of[long["route"][0]["assignment_id"]] == 1 == replica_of[short["route"][0]["assignment_id"]]
        metrics = samples(mesh.url)
        assert metrics["stratamesh:prefill_handoffs_total"] == 1
        # the whole prompt's KV, every layer, K and V, float32: nothing more, nothing computed again
        kv_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4 * len(long_prompt)
        assert metrics["stratamesh:handoff_kv_bytes_total"] == kv_bytes
        assert metrics["stratamesh:replayed_tokens_total"] == 0
