"""The batched engine end to end: concurrency, prefix caching and preemption keep every answer exact."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from stratamesh.launcher import LocalMesh

from .reference import encode, greedy_tokens

pytestmark = pytest.mark.slow

TEXT = ("Edge boxes and cloud nodes share one pipeline: each holds a slice of the layers and passes the "
        "hidden states on, while the origin keeps the token history of every live generation. ")


async def _complete(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    response = await client.post(f"{url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


async def _complete_all(mesh: LocalMesh, model: str, jobs: list[tuple[list[int], int]]) -> list[dict]:
    async with httpx.AsyncClient(headers=mesh.headers) as client:
        return await asyncio.gather(*(_complete(client, mesh.url, model, p, n) for p, n in jobs))


def _jobs(model_dir: Path, num: int) -> list[tuple[list[int], int]]:
    ids = encode(model_dir, TEXT * 8)
    return [(ids[i * 7: i * 7 + 5 + 9 * i], 8 + (i % 5) * 6) for i in range(num)]   # 5..140 tokens in


def test_sixteen_concurrent_requests_each_equal_their_own_reference(llama_mesh: LocalMesh, tiny_models) -> None:
    model_dir = tiny_models["llama"]
    jobs = _jobs(model_dir, 16)
    results = asyncio.run(_complete_all(llama_mesh, model_dir.name, jobs))
    for (prompt, max_tokens), result in zip(jobs, results, strict=True):
        assert result["choices"][0]["token_ids"] == greedy_tokens(model_dir, prompt, max_tokens)


def test_a_repeated_prefix_is_served_from_the_cache_and_reported(llama_mesh: LocalMesh, tiny_models) -> None:
    model_dir = tiny_models["llama"]
    prefix = encode(model_dir, TEXT * 3)[:100]
    first, second = (asyncio.run(_complete_all(llama_mesh, model_dir.name, [(prefix + tail, 8)]))[0]
                     for tail in ([11, 12, 13], [21, 22]))
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 96     # 6 whole blocks of 16
    assert second["choices"][0]["token_ids"] == greedy_tokens(model_dir, prefix + [21, 22], 8)


def test_preempted_sessions_are_replayed_and_stay_exact(tiny_models, tmp_path: Path) -> None:
    model_dir = tiny_models["llama"]
    # 2 layers x 2 KV heads x 64 dims x 4 bytes x 2 (k, v) = 2 KiB a token: 160 KiB holds 80 tokens.
    mesh = LocalMesh(str(model_dir), num_agents=3, log_dir=str(tmp_path / "logs"), db=str(tmp_path / "r.db"),
                     agent_args=["--kv-cache-gib", str(160 / (1 << 20))])
    jobs = [(encode(model_dir, TEXT)[i:i + 20], 24) for i in range(6)]    # 6 x 44 tokens > 80 slots
    with mesh:
        results = asyncio.run(_complete_all(mesh, model_dir.name, jobs))
        logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("agent*.log"))
    for (prompt, max_tokens), result in zip(jobs, results, strict=True):
        assert result["choices"][0]["token_ids"] == greedy_tokens(model_dir, prompt, max_tokens)
    assert "preempt" in logs
