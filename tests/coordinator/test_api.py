"""The OpenAI-compatible HTTP layer over an in-test Serving that yields a known, unbounded token sequence."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from stratamesh.coordinator.api.openai import create_app
from stratamesh.coordinator.serving.origin import ModelCard
from stratamesh.coordinator.serving.request import Request
from stratamesh.coordinator.text import Tokenizer
from stratamesh.fleet.errors import ModelNotFound, StageFailed
from stratamesh.fleet.sessions import SamplingParams
from tests.coordinator.served import served

STORY = "The quick brown fox jumps over the lazy dog. Café 🙂 déjà vu. "
FAIL_AFTER = 5  # tokens the "flaky" model yields before its stage dies
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me a story"}]
BROKEN_TOKEN = 7  # embedder-broken fails a prompt that starts with it


def fake_vector(prompt_ids: list[int]) -> tuple[float, ...]:
    """What the fake embedding models give a prompt: a unit vector that depends on its length and its ids."""
    raw = (float(len(prompt_ids)), float(sum(prompt_ids) % 97 + 1), float(prompt_ids[0] + 1), 0.5)
    norm = sum(x * x for x in raw) ** 0.5
    return tuple(x / norm for x in raw)


class FakeServing:
    """Models: tiny (story forever), tiny-eos (story, EOS, story...), small (context 40), strict (BOS tokenizer whose
    template rejects odd roles), warming (not ready), broken (fails before a token), flaky (fails mid-stream),
    crashy (a bug: RuntimeError mid-stream); and embedding models: embedder (fake_vector of each prompt),
    embedder-small (context 8), embedder-warming (not ready), embedder-broken (fails a prompt that starts with
    BROKEN_TOKEN; the others take a second)."""

    def __init__(self, tokenizer: Tokenizer, strict_tokenizer: Tokenizer) -> None:
        self.tokenizer, self.strict_tokenizer = tokenizer, strict_tokenizer
        self.token_delay_s = 0.0
        self.story_ids = tokenizer.encode(STORY)
        names = ["tiny", "tiny-eos", "strict", "broken", "flaky", "crashy"]
        self.cards = {n: ModelCard(n, 1_700_000_000, 512, True) for n in names}
        self.cards["small"] = ModelCard("small", 1_700_000_000, 40, True)
        self.cards["warming"] = ModelCard("warming", 1_700_000_000, 512, False)
        for name, context, ready in (("embedder", 512, True), ("embedder-small", 8, True),
                                     ("embedder-warming", 512, False), ("embedder-broken", 512, True)):
            self.cards[name] = ModelCard(name, 1_700_000_000, context, ready, task="embed")
        self.calls: list[tuple[str, list[int], SamplingParams, str]] = []
        self.limits: list[tuple[int | None, frozenset[int]]] = []   # each call's max_tokens and stop token ids
        self.closed: list[str] = []
        self.embed_calls: list[tuple[str, list[int], str]] = []
        self.embeds_in_flight = self.max_embeds_in_flight = 0
        self.embeds_cancelled: list[str] = []
        self.status = "ok"

    def list_models(self) -> list[ModelCard]:
        return list(self.cards.values())

    def text(self, model_id: str) -> Tokenizer:
        if model_id not in self.cards:
            raise ModelNotFound(model_id)
        return self.strict_tokenizer if model_id == "strict" else self.tokenizer

    async def generate(self, request: Request) -> AsyncIterator[int]:
        model_id, request_id = request.model_id, request.request_id
        self.calls.append((model_id, list(request.prompt_ids), request.params, request_id))
        self.limits.append((request.stops.max_tokens, request.stops.token_ids))
        try:
            if model_id == "broken":
                raise StageFailed("stage 1 is unreachable")
            for i, token in enumerate(self.script(model_id)):
                if i == FAIL_AFTER and model_id in ("flaky", "crashy"):
                    raise StageFailed("stage 2 died") if model_id == "flaky" else RuntimeError("bug")
                await asyncio.sleep(self.token_delay_s)  # 0 still lets concurrent requests interleave
                yield token
        finally:
            self.closed.append(request_id)

    async def embed(self, model_id: str, prompt_ids: list[int], request_id: str) -> tuple[float, ...]:
        self.embed_calls.append((model_id, prompt_ids, request_id))
        self.embeds_in_flight += 1
        self.max_embeds_in_flight = max(self.max_embeds_in_flight, self.embeds_in_flight)
        try:
            await asyncio.sleep(self.token_delay_s)  # 0 still lets the inputs of a request interleave
            if model_id == "embedder-broken":
                if prompt_ids[0] == BROKEN_TOKEN:
                    raise StageFailed("stage 2 died")
                await asyncio.sleep(1.0)
            return fake_vector(prompt_ids)
        except asyncio.CancelledError:
            self.embeds_cancelled.append(request_id)
            raise
        finally:
            self.embeds_in_flight -= 1

    def script(self, model_id: str) -> Iterator[int]:
        if model_id == "tiny-eos":
            eos = min(self.tokenizer.eos_token_ids)
            return itertools.chain(self.story_ids, [eos], itertools.cycle(self.story_ids))
        return itertools.cycle(self.story_ids)

    def expected_text(self, num_tokens: int) -> str:
        return self.tokenizer.decode(list(itertools.islice(itertools.cycle(self.story_ids), num_tokens)))

    def health(self) -> dict[str, Any]:
        if self.status == "raise":
            raise RuntimeError("registry is down")
        return {"status": self.status, "models": {"tiny": "ready"}}


@pytest.fixture(scope="module")
def chat_tokenizers(chatml_dir: Path, bos_dir: Path) -> tuple[Tokenizer, Tokenizer]:
    return Tokenizer.from_dir(chatml_dir), Tokenizer.from_dir(bos_dir)


@pytest.fixture
def gen(chat_tokenizers: tuple[Tokenizer, Tokenizer]) -> FakeServing:
    return FakeServing(*chat_tokenizers)


@pytest.fixture
async def client(gen: FakeServing) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(gen))
    async with httpx.AsyncClient(transport=transport, base_url="http://mesh") as c:
        yield c


def sse_events(resp: httpx.Response) -> list[Any]:
    """Parse an SSE body strictly: only `data: ...` events, each ended by a blank line, [DONE] last."""
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.text.endswith("\n\n")
    blocks = resp.text[:-2].split("\n\n")
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks), blocks
    assert blocks[-1] == "data: [DONE]" and blocks.count("data: [DONE]") == 1
    return [json.loads(b[len("data: "):]) for b in blocks[:-1]]


async def test_models(client: httpx.AsyncClient) -> None:
    resp = await client.get("/v1/models")
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "list"
    tiny = next(m for m in body["data"] if m["id"] == "tiny")
    assert tiny["object"] == "model" and tiny["created"] == 1_700_000_000 and tiny["owned_by"]


async def test_completion(client: httpx.AsyncClient, gen: FakeServing) -> None:
    resp = await client.post("/v1/completions", json={
        "model": "tiny", "prompt": "Hello", "max_tokens": 12, "temperature": 0, "top_k": 5, "seed": 7})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == "tiny"
    assert isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": gen.expected_text(12), "logprobs": None,
                                "finish_reason": "length"}]
    prompt_ids = gen.tokenizer.encode("Hello")
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 12,
                             "total_tokens": len(prompt_ids) + 12,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert gen.calls == [("tiny", prompt_ids, SamplingParams(temperature=0, top_k=5, seed=7), body["id"])]
    assert gen.closed == [body["id"]]  # the unbounded stream was closed at max_tokens


@pytest.mark.parametrize("prompt", [[5, 6, 7], [[5, 6, 7]]])
async def test_token_id_prompt(client: httpx.AsyncClient, gen: FakeServing, prompt: list) -> None:
    resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 3})
    assert resp.status_code == 200, resp.text
    assert gen.calls[0][1] == [5, 6, 7] and resp.json()["usage"]["prompt_tokens"] == 3
    assert gen.calls[0][2] == SamplingParams(temperature=1.0)  # OpenAI's default temperature


async def test_chat_completion(client: httpx.AsyncClient, gen: FakeServing) -> None:
    resp = await client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": CHAT, "max_completion_tokens": 9, "max_tokens": 100})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": gen.expected_text(9)},
                                "logprobs": None, "finish_reason": "length"}]
    assert gen.calls[0][1] == gen.tokenizer.encode_chat(CHAT)
    assert body["usage"]["prompt_tokens"] == len(gen.tokenizer.encode_chat(CHAT))


async def test_chat_text_parts(client: httpx.AsyncClient, gen: FakeServing) -> None:
    parts = [{"type": "text", "text": "tell me"}, {"type": "text", "text": "a story"}]
    resp = await client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": parts}], "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    assert gen.calls[0][1] == gen.tokenizer.encode_chat([{"role": "user", "content": "tell me\na story"}])


async def test_template_kwargs_cannot_replace_messages(client: httpx.AsyncClient, gen: FakeServing) -> None:
    resp = await client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": CHAT, "max_tokens": 1,
        "chat_template_kwargs": {"messages": [], "add_generation_prompt": False, "enable_thinking": False}})
    assert resp.status_code == 200, resp.text
    assert gen.calls[0][1] == gen.tokenizer.encode_chat(CHAT)


async def test_eos_stops_unless_ignored(client: httpx.AsyncClient, gen: FakeServing) -> None:
    body = (await client.post("/v1/completions", json={"model": "tiny-eos", "prompt": "x"})).json()
    assert body["choices"][0]["text"] == STORY and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(gen.story_ids) + 1  # EOS counts, as in vLLM
    n = len(gen.story_ids) + 4
    body = (await client.post("/v1/completions", json={
        "model": "tiny-eos", "prompt": "x", "max_tokens": n, "ignore_eos": True})).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["text"] == STORY + gen.expected_text(3)


async def test_stop_token_ids(client: httpx.AsyncClient, gen: FakeServing) -> None:
    body = (await client.post("/v1/completions", json={
        "model": "tiny", "prompt": "x", "max_tokens": 50, "stop_token_ids": [gen.story_ids[2]]})).json()
    assert body["choices"][0] | {"text": None} == {"index": 0, "text": None, "logprobs": None,
                                                   "finish_reason": "stop"}
    assert body["choices"][0]["text"] == gen.expected_text(2)


async def test_the_generator_is_told_where_the_generation_ends(client: httpx.AsyncClient,
                                                                gen: FakeServing) -> None:
    """max_tokens and the stop ids (EOS unless ignored) go to the mesh, so it asks no step past the last token."""
    eos = gen.tokenizer.eos_token_ids
    await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 7,
                                               "stop_token_ids": [gen.story_ids[2]]})
    await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 5, "ignore_eos": True})
    await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 5, "ignore_eos": True,
                                               "guided_choice": ["yes", "no"]})     # the grammar's end ends it
    assert gen.limits == [(7, frozenset({gen.story_ids[2]}) | eos), (5, frozenset()), (5, eos)]


@pytest.mark.parametrize("stop", ["lazy", ["never", "fox jumps"], ["Café 🙂 d"]])
async def test_stop_strings(client: httpx.AsyncClient, stop: str | list[str]) -> None:
    body = (await client.post("/v1/completions", json={
        "model": "tiny", "prompt": "x", "max_tokens": 100, "stop": stop})).json()
    first = min(i for s in ([stop] if isinstance(stop, str) else stop) if (i := STORY.find(s)) >= 0)
    assert body["choices"][0]["text"] == STORY[:first]
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_default_max_tokens_fills_context(client: httpx.AsyncClient, gen: FakeServing) -> None:
    body = (await client.post("/v1/completions", json={"model": "small", "prompt": "Hello"})).json()
    num_prompt = len(gen.tokenizer.encode("Hello"))
    assert body["usage"]["completion_tokens"] == 40 - num_prompt
    assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("request_body", [
    {"prompt": "Hello", "max_tokens": 30},
    {"prompt": "Hello", "max_tokens": 200, "stop": ["jumps o"]},
])
async def test_completion_stream_equals_whole(client: httpx.AsyncClient, request_body: dict) -> None:
    whole = (await client.post("/v1/completions", json={"model": "tiny", **request_body})).json()
    resp = await client.post("/v1/completions", json={"model": "tiny", "stream": True, **request_body})
    assert resp.status_code == 200
    chunks = sse_events(resp)
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and "usage" not in chunks[0]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert len(chunks) > 3  # streamed in pieces, not in one go


async def test_chat_stream_with_usage(client: httpx.AsyncClient, gen: FakeServing) -> None:
    request = {"model": "tiny", "messages": CHAT, "max_tokens": 20}
    whole = (await client.post("/v1/chat/completions", json=request)).json()
    resp = await client.post("/v1/chat/completions", json={
        **request, "stream": True, "stream_options": {"include_usage": True}})
    chunks = sse_events(resp)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])
    finish = chunks[-2]["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-2])
    assert text == whole["choices"][0]["message"]["content"] == gen.expected_text(20)


def error_of(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "x"}, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": 2.5}, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_k": -2}, "top_k"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_k": 1099511627776}, "top_k"),      # int32 on the wire
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2**31}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop_token_ids": [1, 2**40]}, "stop_token_ids[1]"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 1, "best_of": 2, "stream": True}, "best_of"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "suffix": "end"}, "suffix"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "best_of": 200}, "best_of"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": ""}, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": ["a", 3]}, "stop[1]"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "min_p": 1.5}, "min_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"7": 101}}, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"seven": 1}}, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "seed": 2**64}, "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": []}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 99999]}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stream_options": {"include_usage": 7}},
     "stream_options.include_usage"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}, "response_format"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "response_format": {"type": "json_schema"}},
     "response_format"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "response_format": {"type": "yaml"}},
     "response_format"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "guided_regex": "(unclosed"}, "guided_regex"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "guided_grammar": "start: undefined_rule"},
     "guided_grammar"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "guided_json": {"type": "object"}, "guided_regex": "a+"},
     "guided_regex"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "guided_json": "{not json"}, "guided_json"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "logprobs": True, "top_logprobs": 30},
     "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_completion_tokens": -3},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_completion_tokens": 2**63},
     "max_completion_tokens"),
])
async def test_invalid_request_is_400_naming_the_param(client: httpx.AsyncClient, path: str, body: dict,
                                                       param: str) -> None:
    err = error_of(await client.post(path, json=body), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param


@pytest.mark.parametrize("content", [b'{"model": "tiny", "prompt": ', b"[1, 2]", b"\xff\xfe", b"",
                                     b'{"model": "tiny", "prompt": "x", "temperature": NaN}', b"[" * 100_000])
async def test_malformed_body_is_400(client: httpx.AsyncClient, content: bytes) -> None:
    resp = await client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert error_of(resp, 400)["type"] == "invalid_request_error"


async def test_unknown_model_is_404(client: httpx.AsyncClient) -> None:
    for path, extra in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": CHAT})):
        err = error_of(await client.post(path, json={"model": "nope", **extra}), 404)
        assert err["code"] == "model_not_found" and err["param"] == "model"


@pytest.mark.parametrize("body", [
    {"prompt": "Hello", "max_tokens": 40},  # prompt + max_tokens > 40
    {"prompt": list(range(10, 50))},  # the prompt alone fills the context
    {"prompt": list(range(10, 60)), "max_tokens": 1},
])
async def test_context_length_exceeded(client: httpx.AsyncClient, gen: FakeServing, body: dict) -> None:
    err = error_of(await client.post("/v1/completions", json={"model": "small", **body}), 400)
    assert err["code"] == "context_length_exceeded" and "40" in err["message"]
    assert gen.calls == []


async def test_template_error_is_400(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/chat/completions", json={
        "model": "strict", "messages": [{"role": "robot", "content": "beep"}]})
    assert "unknown role robot" in error_of(resp, 400)["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_not_ready_is_503(client: httpx.AsyncClient, stream: bool) -> None:
    resp = await client.post("/v1/completions", json={"model": "warming", "prompt": "x", "stream": stream})
    assert error_of(resp, 503)["code"] == "model_not_ready" and resp.headers["retry-after"]


@pytest.mark.parametrize("stream", [False, True])
async def test_stage_failure_before_first_token(client: httpx.AsyncClient, gen: FakeServing,
                                                stream: bool) -> None:
    resp = await client.post("/v1/chat/completions", json={"model": "broken", "messages": CHAT, "stream": stream})
    assert error_of(resp, 502)["code"] == "stage_failed"
    assert gen.closed == [gen.calls[0][3]]


async def test_mid_stream_failure_is_an_error_event(client: httpx.AsyncClient, gen: FakeServing) -> None:
    flaky = client.post("/v1/completions", json={"model": "flaky", "prompt": "x", "stream": True})
    good = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 40, "stream": True})
    flaky_resp, good_resp = await asyncio.gather(flaky, good)
    events = sse_events(flaky_resp)
    assert events[-1]["error"]["code"] == "stage_failed" and events[-1]["error"]["type"] == "upstream_error"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == gen.expected_text(FAIL_AFTER)
    good_events = sse_events(good_resp)
    assert "".join(e["choices"][0]["text"] for e in good_events) == gen.expected_text(40)
    assert good_events[-1]["choices"][0]["finish_reason"] == "length"
    assert sorted(gen.closed) == sorted(call[3] for call in gen.calls)


async def test_unexpected_error_is_500_and_server_keeps_serving(client: httpx.AsyncClient) -> None:
    err = error_of(await client.post("/v1/completions", json={"model": "crashy", "prompt": "x"}), 500)
    assert err["type"] == "server_error"
    resp = await client.post("/v1/completions", json={"model": "crashy", "prompt": "x", "stream": True})
    events = sse_events(resp)
    assert events[-1]["error"]["code"] == "internal_error"
    resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert resp.is_success


async def test_mid_stream_failure_without_streaming_is_502(client: httpx.AsyncClient) -> None:
    assert error_of(await client.post("/v1/completions", json={"model": "flaky", "prompt": "x"}),
                    502)["code"] == "stage_failed"


async def test_unknown_route_and_method_in_openai_shape(client: httpx.AsyncClient) -> None:
    error_of(await client.get("/v1/nothing"), 404)
    error_of(await client.get("/v1/completions"), 405)


@pytest.mark.parametrize(("status", "code"), [("ok", 200), ("starting", 503), ("raise", 503)])
async def test_health(client: httpx.AsyncClient, gen: FakeServing, status: str, code: int) -> None:
    gen.status = status
    resp = await client.get("/health")
    assert resp.status_code == code
    assert resp.json()["status"] == ("error" if status == "raise" else status)


async def test_official_openai_client(client: httpx.AsyncClient, gen: FakeServing) -> None:
    openai = pytest.importorskip("openai")
    oai = openai.AsyncOpenAI(base_url="http://mesh/v1", api_key="unused", http_client=client, max_retries=0)
    models = await oai.models.list()
    assert "tiny" in [m.id for m in models.data]
    completion = await oai.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0)
    assert completion.choices[0].text == gen.expected_text(8) and completion.usage.completion_tokens == 8
    chat = await oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, stop=["lazy"])
    assert chat.choices[0].message.content == gen.expected_text(8) and chat.choices[0].finish_reason == "length"
    stream = await oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, stream=True,
                                               stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == gen.expected_text(8)
    assert chunks[-1].usage.completion_tokens == 8
    with pytest.raises(openai.NotFoundError):
        await oai.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        await oai.completions.create(model="tiny", prompt="x", max_tokens=-1)
    with pytest.raises(openai.APIError, match="stage"):
        async for _ in await oai.completions.create(model="flaky", prompt="x", stream=True):
            pass


@pytest.fixture
async def live_url(gen: FakeServing) -> AsyncIterator[str]:
    """The app behind a real uvicorn on a loopback port, so that clients can really disconnect."""
    async with served(create_app(gen)) as url:
        yield url


async def wait_closed(gen: FakeServing, num: int, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(gen.closed) < num and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


async def test_disconnect_stops_generation(live_url: str, gen: FakeServing) -> None:
    gen.token_delay_s = 0.02  # a whole 512-token context would take 10 s
    async with httpx.AsyncClient(base_url=live_url) as c:
        async with c.stream("POST", "/v1/chat/completions", json={
                "model": "tiny", "messages": CHAT, "stream": True}) as resp:
            lines = []
            async for line in resp.aiter_lines():
                lines.append(line)
                if len(lines) == 6:
                    break
        assert lines[0].startswith("data: ") and "[DONE]" not in "".join(lines)
        await wait_closed(gen, 1)
        assert len(gen.closed) == 1, "a streaming client left, its generation kept going"
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=0.3)
        await wait_closed(gen, 2)
        assert len(gen.closed) == 2, "a non-streaming client left, its generation kept going"
        resp = await c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3})
        assert resp.json()["choices"][0]["text"] == gen.expected_text(3)


@pytest.mark.parametrize("path, extra", [
    ("/v1/completions", {"prompt": "Hello"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}),
])
async def test_return_token_ids_whole_and_streamed(client: httpx.AsyncClient, gen: FakeServing,
                                                   path: str, extra: dict) -> None:
    body = {"model": "tiny", "max_tokens": 20, "return_token_ids": True, **extra}
    whole = (await client.post(path, json=body)).json()
    expected = list(itertools.islice(itertools.cycle(gen.story_ids), 20))
    assert whole["choices"][0]["token_ids"] == expected
    chunks = sse_events(await client.post(path, json={**body, "stream": True}))
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == expected
    plain = (await client.post(path, json={**body, "return_token_ids": False})).json()
    assert "token_ids" not in plain["choices"][0]


@pytest.mark.parametrize("path,extra", [
    ("/v1/completions", {"prompt": "Hello"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}),
])
async def test_a_resumed_request_goes_on_after_its_tokens_which_count_against_max_tokens(
        client: httpx.AsyncClient, gen: FakeServing, path: str, extra: dict) -> None:
    body = {"model": "tiny", "max_tokens": 20, "min_tokens": 5, "seed": 3, "temperature": 0.7, **extra}
    await client.post(path, json=body)
    _, prompt, _, _ = gen.calls[-1]
    resumed = (await client.post(path, json={**body, "resume_token_ids": [7, 8, 9]})).json()
    assert gen.calls[-1][1] == [*prompt, 7, 8, 9] and gen.calls[-1][2].min_tokens == 2
    assert gen.limits[-1][0] == 17 and resumed["usage"]["completion_tokens"] == 17


@pytest.mark.parametrize("change,says", [
    ({"n": 2}, "n or best_of"), ({"presence_penalty": 0.5}, "penalties"), ({"frequency_penalty": 0.5}, "penalties"),
    ({"guided_regex": "[a-z]+"}, "structured output"), ({"echo": True}, "echo"),
    ({"max_tokens": 3}, "leaves none"), ({"resume_token_ids": [1, 10**9]}, "outside the vocabulary"),
])
async def test_a_resume_whose_tokens_would_not_count_as_the_outputs_is_refused_by_name(
        client: httpx.AsyncClient, change: dict, says: str) -> None:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 20, "resume_token_ids": [7, 8, 9], **change}
    refused = await client.post("/v1/completions", json=body)
    assert refused.status_code == 400 and says in refused.json()["error"]["message"]
    assert refused.json()["error"]["param"] == "resume_token_ids"


async def test_embeddings_of_a_text_generation_model_are_refused_by_name(client: httpx.AsyncClient) -> None:
    refused = await client.post("/v1/embeddings", json={"model": "tiny", "input": "hello"})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "model_not_embedding" and "LM head" in refused.json()["error"]["message"]
    unknown = await client.post("/v1/embeddings", json={"model": "nope", "input": ["a", "b"]})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    bad = await client.post("/v1/embeddings", json={"model": "tiny", "input": {"text": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"


async def test_tokenize_and_detokenize_as_vllm(client: httpx.AsyncClient, gen: FakeServing) -> None:
    """vLLM's /tokenize (a prompt, or a chat through the template) and /detokenize, round trip."""
    tokenizer = gen.tokenizer
    resp = await client.post("/tokenize", json={"model": "tiny", "prompt": "Hello mesh"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["tokens"] == tokenizer.encode("Hello mesh") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] > 0
    chat = (await client.post("/tokenize", json={"model": "tiny", "messages": CHAT})).json()
    assert chat["tokens"] == tokenizer.encode_chat(CHAT, True, None)
    back = await client.post("/detokenize", json={"model": "tiny", "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "Hello mesh"}
    for path, asked, param in (("/tokenize", {"model": "tiny"}, None),
                               ("/detokenize", {"model": "tiny", "tokens": [99999]}, "tokens"),
                               ("/tokenize", {"model": "nope", "prompt": "x"}, "model")):
        resp = await client.post(path, json=asked)
        assert resp.status_code in (400, 404) and resp.json()["error"]["param"] == param, resp.text


async def test_echo_with_max_tokens_0_returns_the_prompt_alone(client: httpx.AsyncClient, gen: FakeServing) -> None:
    for stream in (False, True):
        resp = await client.post("/v1/completions", json={
            "model": "tiny", "prompt": "Hello there", "max_tokens": 0, "echo": True, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None, "return_token_ids": True})
        if stream:
            events = sse_events(resp)
            chunks, (usage,) = [e for e in events if e["choices"]], [e["usage"] for e in events if e.get("usage")]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        else:
            body = resp.json()
            (choice,), usage = body["choices"], body["usage"]
            text = choice["text"]
            assert choice["finish_reason"] == "length" and choice["token_ids"] == []
        assert text == "Hello there" and usage["completion_tokens"] == 0
        assert usage["total_tokens"] == usage["prompt_tokens"] == len(gen.calls[-1][1])
        assert gen.limits[-1][0] == 1           # the mesh draws one token, for the prompt's log-probabilities
