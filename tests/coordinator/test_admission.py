"""Admission over the real OpenAI app (a fake mesh behind it): 429 with Retry-After over a concurrency limit, per
caller too, 413 for a big body, token caps; and the count drops back when a stream ends however it ends."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from stratamesh.coordinator.access import AccessStore
from stratamesh.coordinator.api.admission import Gate, Limits
from stratamesh.coordinator.api.auth import install_access
from stratamesh.coordinator.api.openai import create_app
from stratamesh.coordinator.registry import Registry
from stratamesh.coordinator.text import Tokenizer
from stratamesh.fleet.errors import InvalidInput
from tests.coordinator.served import served
from tests.coordinator.test_api import FakeServing, chat_tokenizers  # noqa: F401 (a fixture)
from tests.patience import eventually

NOW = 1_800_000_000.0


def gated_app(chat_tokenizers: tuple[Tokenizer, Tokenizer], limits: Limits, token_delay_s: float = 0.02):  # noqa: F811
    generator = FakeServing(*chat_tokenizers)
    generator.token_delay_s = token_delay_s
    app = create_app(generator, limits=limits)
    access = AccessStore(Registry(":memory:"))
    gate = install_access(app, access, clock=lambda: NOW, limits=limits)
    keys = [access.create_key("client", f"app-{i}", NOW)[0] for i in range(3)]
    return app, gate, keys


def client(url: str, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


async def settled(gate: Gate) -> None:
    """Waits until every request has left the gate (the server sees a client leave a moment after it closes its
    stream); an AssertionError if that never comes."""
    await eventually(lambda: gate.in_flight == 0 and not gate.per_caller)


BODY = {"model": "tiny", "prompt": "Once", "max_tokens": 40, "stream": True}


async def hold_stream(http: httpx.AsyncClient, started: asyncio.Event, release: asyncio.Event) -> int:
    async with http.stream("POST", "/v1/completions", json=BODY) as response:
        started.set()
        await release.wait()
        return response.status_code


async def test_over_the_mesh_limit_requests_get_429_with_retry_after(chat_tokenizers) -> None:  # noqa: F811
    app, gate, keys = gated_app(chat_tokenizers, Limits(max_requests=2, max_requests_per_caller=10, retry_after_s=3))
    release = asyncio.Event()
    async with served(app) as url, client(url, keys[0]) as a, client(url, keys[1]) as b:
        events = [asyncio.Event(), asyncio.Event()]
        held = [asyncio.create_task(hold_stream(h, e, release)) for h, e in zip((a, b), events)]
        await asyncio.gather(*(e.wait() for e in events))
        assert gate.in_flight == 2
        refused = await a.post("/v1/completions", json={**BODY, "stream": False})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "3"
        assert refused.json()["error"]["code"] == "server_overloaded"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert (await a.get("/health")).status_code == 200           # only /v1 POSTs count
        release.set()
        assert await asyncio.gather(*held) == [200, 200]
        await settled(gate)
        assert (await a.post("/v1/completions", json={**BODY, "stream": False})).status_code == 200
    assert gate.num_refused == 1


async def test_one_caller_over_its_limit_does_not_stop_the_others(chat_tokenizers) -> None:  # noqa: F811
    app, gate, keys = gated_app(chat_tokenizers, Limits(max_requests=10, max_requests_per_caller=1))
    release, started = asyncio.Event(), asyncio.Event()
    async with served(app) as url, client(url, keys[0]) as greedy, client(url, keys[1]) as other:
        held = asyncio.create_task(hold_stream(greedy, started, release))
        await started.wait()
        second = await greedy.post("/v1/completions", json={**BODY, "stream": False})
        assert second.status_code == 429 and second.json()["error"]["code"] == "too_many_requests"
        assert (await other.post("/v1/completions", json={**BODY, "stream": False})).status_code == 200
        release.set()
        assert await held == 200


async def test_a_stream_the_client_leaves_stops_counting(chat_tokenizers) -> None:  # noqa: F811
    app, gate, keys = gated_app(chat_tokenizers, Limits(max_requests=1), token_delay_s=0.05)
    async with served(app) as url, client(url, keys[0]) as http:
        async with http.stream("POST", "/v1/completions", json=BODY) as response:
            async for _ in response.aiter_lines():
                assert gate.in_flight == 1
                break                                # leave mid-stream
        await settled(gate)
        assert (await http.post("/v1/completions", json={**BODY, "stream": False})).status_code == 200


async def test_a_body_over_the_limit_is_a_413(chat_tokenizers) -> None:  # noqa: F811
    app, gate, keys = gated_app(chat_tokenizers, Limits(max_body_bytes=1000))
    async with served(app) as url, client(url, keys[0]) as http:
        big = await http.post("/v1/completions", json={**BODY, "prompt": "x" * 2000})
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"

        async def chunks():   # no Content-Length: the limit holds for a chunked body too
            for _ in range(20):
                yield b" " * 100
        chunked = await http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert chunked.status_code == 413
        assert (await http.post("/v1/completions", json={**BODY, "stream": False})).status_code == 200
    await settled(gate)


async def test_token_caps(chat_tokenizers) -> None:  # noqa: F811
    app, _, keys = gated_app(chat_tokenizers, Limits(max_prompt_tokens=5, max_tokens=8), token_delay_s=0)
    async with served(app) as url, client(url, keys[0]) as http:
        long = await http.post("/v1/completions", json={"model": "tiny", "prompt": list(range(1, 7))})
        assert long.status_code == 400 and long.json()["error"]["code"] == "prompt_over_limit"
        many = await http.post("/v1/completions", json={"model": "tiny", "prompt": "Once", "max_tokens": 9})
        assert many.status_code == 400 and many.json()["error"]["param"] == "max_tokens"
        capped = await http.post("/v1/completions", json={"model": "tiny", "prompt": "Once"})
        assert capped.status_code == 200 and capped.json()["usage"]["completion_tokens"] == 8
        embed = await http.post("/v1/embeddings", json={"model": "embedder", "input": [list(range(1, 7))]})
        assert embed.status_code == 400 and embed.json()["error"]["code"] == "prompt_over_limit"


@pytest.mark.parametrize("limits", [dict(max_requests=0), dict(max_requests_per_caller=-1),
                                    dict(max_tokens=-1), dict(max_body_bytes=0)])
def test_bad_limits_are_refused(limits: dict) -> None:
    with pytest.raises(InvalidInput):
        Limits(**limits)
