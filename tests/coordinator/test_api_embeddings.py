"""POST /v1/embeddings over the in-test FakeServing's embedding models: OpenAI's request and response shapes,
every input embedded concurrently, refusals by name; and the text endpoints refusing an embedding model."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import openai
import pytest

from stratamesh import AsyncMesh
from stratamesh.coordinator.api.embeddings import embed_all
from stratamesh.coordinator.api.openai import create_app
from stratamesh.coordinator.api.schemas import MAX_EMBEDDING_INPUTS
from tests.coordinator import test_api
from tests.coordinator.test_api import BROKEN_TOKEN, FakeServing, fake_vector

# test_api's fixtures: its FakeServing over the tiny chat_tokenizers, and a client of the app serving it
chat_tokenizers, gen, client = test_api.chat_tokenizers, test_api.gen, test_api.client


async def embed(client: httpx.AsyncClient, **body) -> httpx.Response:
    return await client.post("/v1/embeddings", json={"model": "embedder", **body})


async def test_models_say_which_task_each_serves(client: httpx.AsyncClient) -> None:
    data = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
    assert data["embedder"]["task"] == "embed" and data["tiny"]["task"] == "generate"


async def test_one_string_gets_one_embedding_and_its_usage(client: httpx.AsyncClient, gen: FakeServing) -> None:
    resp = await embed(client, input="The mesh embeds text")
    assert resp.status_code == 200, resp.text
    ids = gen.tokenizer.encode("The mesh embeds text")
    assert resp.json() == {"object": "list", "model": "embedder",
                           "data": [{"object": "embedding", "index": 0, "embedding": list(fake_vector(ids))}],
                           "usage": {"prompt_tokens": len(ids), "total_tokens": len(ids)}}
    ((model, prompt_ids, request_id),) = gen.embed_calls
    assert (model, prompt_ids) == ("embedder", ids) and request_id.startswith("embd-") and request_id.endswith("-0")


@pytest.mark.parametrize("given, prompts", [
    (["first text", "second, longer text", "x"], None),
    ([5, 6, 7], [[5, 6, 7]]),
    ([[5, 6], [7, 8, 9], [10]], [[5, 6], [7, 8, 9], [10]]),
    (["text", [11, 12]], None),
], ids=["strings", "token-ids", "token-id-lists", "mixed"])
async def test_every_input_form_gets_one_embedding_per_input_in_order(client: httpx.AsyncClient, gen: FakeServing,
                                                                      given: list, prompts: list | None) -> None:
    prompts = prompts or [gen.tokenizer.encode(p) if isinstance(p, str) else p for p in given]
    gen.token_delay_s = 0.02     # the inputs overlap, and finish in any order
    body = (await embed(client, input=given)).json()
    assert [d["index"] for d in body["data"]] == list(range(len(prompts)))
    assert [tuple(d["embedding"]) for d in body["data"]] == [fake_vector(p) for p in prompts]
    assert body["usage"] == {"prompt_tokens": sum(map(len, prompts)), "total_tokens": sum(map(len, prompts))}
    assert sorted(p for _, p, _ in gen.embed_calls) == sorted(prompts)
    assert gen.max_embeds_in_flight == len(prompts)          # concurrently, not one after another
    assert len({r.rsplit("-", 1)[0] for _, _, r in gen.embed_calls}) == 1   # one request, an id per input


async def test_base64_is_the_little_endian_float32_bytes(client: httpx.AsyncClient) -> None:
    floats = (await embed(client, input=[[5, 6], [7]])).json()["data"]
    encoded = (await embed(client, input=[[5, 6], [7]], encoding_format="base64")).json()["data"]
    for f, e in zip(floats, encoded, strict=True):
        decoded = np.frombuffer(base64.b64decode(e["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.asarray(f["embedding"], dtype=np.float32))


async def test_inputs_beyond_the_concurrency_limit_queue() -> None:
    in_flight, most = 0, 0

    async def one(ids: list[int], index: int) -> tuple[float, ...]:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return (float(index),)

    vectors = await embed_all(one, [[i] for i in range(10)], max_concurrent=3)
    assert vectors == [(float(i),) for i in range(10)] and most == 3


@pytest.mark.parametrize("body, status, param, code, message", [
    ({"input": ""}, 400, "input", None, "non-empty string"),
    ({"input": []}, 400, "input", None, "non-empty"),
    ({"input": [[]]}, 400, "input", None, "non-empty"),
    ({"input": ["a", ""]}, 400, "input", None, "non-empty"),
    ({"input": [1, "a"]}, 400, "input", None, "non-empty"),
    ({"input": [True, 2]}, 400, "input", None, "non-empty"),
    ({"input": ["a"] * (MAX_EMBEDDING_INPUTS + 1)}, 400, "input", None, f"at most {MAX_EMBEDDING_INPUTS}"),
    ({"input": [5, 1_000_000]}, 400, "input", None, "outside the vocabulary"),
    ({"input": [[5], [-1]]}, 400, "input", None, "outside the vocabulary"),
    ({"input": "a", "encoding_format": "binary"}, 400, "encoding_format", None, "'float' or 'base64'"),
    ({"input": "a", "dimensions": 64}, 400, "dimensions", None, "not supported"),
    ({"model": "embedder-small", "input": ["ok", "a text of well over eight tokens, it goes on and on"]}, 400,
     "input", "context_length_exceeded", "input[1] has"),
    ({"model": "embedder-warming", "input": "a"}, 503, None, "model_not_ready", "loading"),
    ({"model": "nope", "input": "a"}, 404, "model", "model_not_found", "does not exist"),
    ({"model": "tiny", "input": "a"}, 400, "model", "model_not_embedding", "LM head"),
], ids=["empty-string", "empty-list", "empty-ids", "an-empty-string", "ids-and-strings", "bools", "too-many",
        "out-of-vocab", "negative-id", "encoding", "dimensions", "context", "not-ready", "unknown", "generative"])
async def test_bad_requests_are_refused_by_name(client: httpx.AsyncClient, gen: FakeServing, body: dict,
                                                status: int, param: str | None, code: str | None,
                                                message: str) -> None:
    resp = await embed(client, **body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == (param, code) and message in error["message"]
    assert gen.embed_calls == []
    assert (await embed(client, input="still serving")).status_code == 200


@pytest.mark.parametrize("path, extra", [
    ("/v1/completions", {"prompt": "Hello"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}),
])
async def test_an_embedding_model_generates_no_text(client: httpx.AsyncClient, gen: FakeServing, path: str,
                                                    extra: dict) -> None:
    resp = await client.post(path, json={"model": "embedder", "max_tokens": 4, **extra})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_generative") and "/v1/embeddings" in error["message"]
    assert gen.calls == []


async def test_a_failed_input_fails_the_request_and_stops_the_others(client: httpx.AsyncClient,
                                                                     gen: FakeServing) -> None:
    resp = await embed(client, model="embedder-broken", input=[[1, 2], [BROKEN_TOKEN, 3], [4]])
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "stage_failed"
    assert sorted(r.rsplit("-", 1)[1] for r in gen.embeds_cancelled) == ["0", "2"]
    assert gen.embeds_in_flight == 0


async def test_the_openai_client_and_the_sdk_get_the_same_vectors(gen: FakeServing) -> None:
    """openai's client asks for base64 and decodes it; the SDK asks for floats."""
    transport = httpx.ASGITransport(app=create_app(gen))
    texts = ["first text", "second text"]
    expected = [fake_vector(gen.tokenizer.encode(t)) for t in texts]
    formats: list[str] = []

    async def note_format(request: httpx.Request) -> None:
        formats.append(json.loads(request.content).get("encoding_format", "float"))

    async with httpx.AsyncClient(transport=transport, base_url="http://mesh/v1",
                                 event_hooks={"request": [note_format]}) as http:
        oai = openai.AsyncOpenAI(base_url="http://mesh/v1", api_key="unused", http_client=http)
        reply = await oai.embeddings.create(model="embedder", input=texts)
    assert formats == ["base64"] and reply.usage.prompt_tokens == sum(len(gen.tokenizer.encode(t)) for t in texts)
    for got, want in zip(reply.data, expected, strict=True):
        np.testing.assert_allclose(got.embedding, want, rtol=1e-6)
    async with AsyncMesh("http://mesh", transport=transport) as mesh:
        assert await mesh.embed(texts, model="embedder") == [list(v) for v in expected]
