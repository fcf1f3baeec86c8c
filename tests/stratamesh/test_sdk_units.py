"""The SDK without a mesh: request bodies, error mapping and stream parsing over httpx mock transports."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest

from stratamesh import (
    AmbiguousModelError,
    AsyncMesh,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    EmbeddingsNotSupportedError,
    InternalServerError,
    Mesh,
    MeshAPIError,
    MeshConnectionError,
    MeshError,
    MeshTimeoutError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    ServiceUnavailableError,
    UnexpectedResponseError,
    Usage,
)
from stratamesh.sdk.errors import error_from_event, parse_retry_after
from stratamesh.sdk.local import builtin_model_dir
from stratamesh.sdk.streams import AsyncStream, SSEDecoder, Stream

MODELS = {"object": "list", "data": [{"id": "m", "object": "model", "created": 1, "max_model_len": 512,
                                      "ready": True}]}


def sse(*events: dict[str, Any] | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def chat_event(content: str | None, finish_reason: str | None = None, usage: dict | None = None) -> dict[str, Any]:
    choices = [] if content is None else [{"index": 0, "delta": {"content": content}, "finish_reason": finish_reason}]
    return {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": choices, "usage": usage}


def serve(handler: Callable[[httpx.Request], httpx.Response], **kwargs: Any) -> Mesh:
    return Mesh("http://mesh.test:8000/v1/", transport=httpx.MockTransport(handler), **kwargs)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def test_import_stratamesh_stays_cheap() -> None:
    code = ("import sys, stratamesh; heavy = [m for m in ('httpx', 'torch', 'grpc', 'stratamesh.sdk') "
            "if m in sys.modules]; assert not heavy, heavy; from stratamesh import Mesh, MeshError; "
            "from stratamesh.fleet.errors import MeshError as Base; assert MeshError is Base")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_request_bodies_headers_and_the_only_model() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        return httpx.Response(200, json={"id": "x", "model": "m", "usage": {"prompt_tokens": 3, "completion_tokens": 2},
                                         "choices": [{"text": "hi", "finish_reason": "stop"}]})

    with serve(handler, api_key="sk-1") as mesh:
        result = mesh.generate("Hello", max_tokens=5, temperature=0.5, top_p=0.9, top_k=3, seed=11, stop="\n")
        mesh.generate([1, 2, 3])
    assert result.text == "hi" and result.usage == Usage(3, 2, 0) and result.usage.total_tokens == 5
    assert [r.url.path for r in seen] == ["/v1/models", "/v1/completions", "/v1/completions"]  # models asked once
    assert all(r.headers["authorization"] == "Bearer sk-1" for r in seen)
    assert json.loads(seen[1].content) == {"model": "m", "prompt": "Hello", "max_tokens": 5, "temperature": 0.5,
                                           "top_p": 0.9, "top_k": 3, "seed": 11, "stop": ["\n"], "stream": False}
    assert json.loads(seen[2].content)["prompt"] == [1, 2, 3]


@pytest.mark.parametrize("data, match", [([], "serves no model"), ([{"id": "a"}, {"id": "b"}], "'a', 'b'")])
def test_no_model_or_several_need_a_model_argument(data: list[dict[str, Any]], match: str) -> None:
    with serve(lambda r: httpx.Response(200, json={"data": data})) as mesh, \
            pytest.raises(AmbiguousModelError, match=match):
        mesh.chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("status, cls", [
    (400, BadRequestError), (422, BadRequestError), (401, AuthenticationError), (403, PermissionDeniedError),
    (404, NotFoundError), (409, ConflictError), (429, RateLimitError), (503, ServiceUnavailableError),
    (500, InternalServerError), (502, InternalServerError), (418, MeshAPIError),
])
def test_status_codes_become_exceptions(status: int, cls: type[MeshAPIError]) -> None:
    body = error_body(f"failed with {status}", param="model", code="c")
    with serve(lambda r: httpx.Response(status, json=body, headers={"Retry-After": "7"})) as mesh, \
            pytest.raises(cls) as info:
        mesh.generate("x", model="m")
    err = info.value
    assert type(err) is cls and isinstance(err, MeshError)
    assert (err.status_code, err.message, err.type, err.param, err.code, err.retry_after_s) == \
        (status, f"failed with {status}", "invalid_request_error", "model", "c", 7.0)


def test_an_error_without_an_openai_body_keeps_its_text() -> None:
    with serve(lambda r: httpx.Response(502, text="<html>bad gateway</html>")) as mesh, \
            pytest.raises(InternalServerError, match="bad gateway") as info:
        mesh.models()
    assert info.value.status_code == 502 and info.value.retry_after_s is None


def test_retry_after_as_seconds_or_a_date() -> None:
    now = datetime(2025, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
    assert parse_retry_after("3", now) == 3.0
    assert parse_retry_after("Wed, 01 Jan 2025 12:00:30 GMT", now) == 30.0
    assert parse_retry_after("Wed, 01 Jan 2025 12:00:10 -0000", now) == 10.0
    assert parse_retry_after("Wed, 01 Jan 2025 11:00:00 GMT", now) == 0.0
    assert parse_retry_after("soon", now) is None and parse_retry_after(None, now) is None


@pytest.mark.parametrize("error, cls, status", [
    ({"message": "m", "type": "upstream_error", "code": "stage_failed"}, InternalServerError, 502),
    ({"message": "m", "type": "service_unavailable_error", "code": "model_not_ready"}, ServiceUnavailableError, 503),
    ({"message": "m", "type": "invalid_request_error", "code": None}, BadRequestError, 400),
    ({"message": "m", "type": "server_error", "code": "internal_error"}, InternalServerError, 500),
])
def test_error_events_map_by_type_and_code(error: dict[str, Any], cls: type[MeshAPIError], status: int) -> None:
    err = error_from_event({"error": error})
    assert type(err) is cls and err.status_code == status and err.message == "m"


def test_a_mid_stream_error_event_raises_from_the_iterator() -> None:
    body = sse(chat_event("Hel"), chat_event("lo"),
               error_body("a pipeline stage failed: gone", "upstream_error", code="stage_failed"), "[DONE]")
    mesh = serve(lambda r: httpx.Response(200, content=body, headers={"content-type": "text/event-stream"}))
    stream = mesh.chat([{"role": "user", "content": "hi"}], model="m", stream=True)
    assert [next(stream).content, next(stream).content] == ["Hel", "lo"]
    with pytest.raises(InternalServerError, match="stage failed") as info:
        next(stream)
    assert info.value.code == "stage_failed" and stream.closed


def test_a_stream_cut_before_done_is_a_connection_error() -> None:
    body = sse(chat_event("Hel"))
    with serve(lambda r: httpx.Response(200, content=body)) as mesh, pytest.raises(MeshConnectionError, match="DONE"):
        list(mesh.chat([{"role": "user", "content": "hi"}], model="m", stream=True))


def test_chat_stream_skips_empty_chunks_and_ends_with_usage() -> None:
    role = chat_event(None) | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    usage = {"prompt_tokens": 4, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 3}}
    body = sse(role, chat_event("a"), chat_event("b"), chat_event("", "length"), chat_event(None, usage=usage),
               "[DONE]")
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return httpx.Response(200, content=body)

    with serve(handler) as mesh, mesh.chat([{"role": "user", "content": "hi"}], model="m", stream=True) as stream:
        chunks = list(stream)
    assert [(c.content, c.finish_reason) for c in chunks] == [("a", None), ("b", None), ("", "length"), ("", None)]
    assert chunks[-1].usage == Usage(4, 2, 3) and stream.closed
    sent = json.loads(requests[0].content)
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}


class _DyingThenLive:
    """Two coordinators for a resumed stream: the first sends 3 tokens (one with no text yet), then its connection
    drops (no [DONE]); the second sends one more and ends. sent: the bodies each was sent."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    @staticmethod
    def event(text: str, ids: list[int]) -> dict[str, Any]:
        return {"id": "c", "object": "text_completion", "model": "m",
                "choices": [{"index": 0, "text": text, "token_ids": ids, "finish_reason": None}]}

    def first(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(json.loads(request.content))
        return httpx.Response(200, content=sse(self.event("a", [5]), self.event("", [6]), self.event("b", [7])))

    def second(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(json.loads(request.content))
        return httpx.Response(200, content=sse(self.event("c", [8]), "[DONE]"))

    def check(self, texts: list[str], resumed_texts: list[str], resumed: Stream | AsyncStream) -> None:
        assert texts == ["a", "b"]      # (the token with no text yet made no chunk, and is resumed after)
        assert resumed_texts == ["c"] and resumed.resumable.token_ids == [8]
        assert self.sent[0]["return_token_ids"] is True
        assert self.sent[1] == {**self.sent[0], "resume_token_ids": [5, 6, 7]}   # the same request, after its tokens
        assert resumed.resumable.resumed_body()["resume_token_ids"] == [5, 6, 7, 8]    # and again, after those too


def test_a_broken_stream_is_resumed_elsewhere_as_the_same_request_after_the_tokens_it_received() -> None:
    coordinators, texts = _DyingThenLive(), []
    with serve(coordinators.first) as a, serve(coordinators.second) as b:
        stream = a.generate("hi", model="m", stream=True, max_tokens=9, seed=4, temperature=0.5)
        with pytest.raises(MeshConnectionError, match="before the server sent"):
            for chunk in stream:
                texts.append(chunk.text)
        resumed = b.resume(stream)
        coordinators.check(texts, [chunk.text for chunk in resumed], resumed)
    with pytest.raises(ValueError, match="only a stream of generate"):
        b.resume(Stream(httpx.Response(200), lambda event: None, "GET /"))


async def test_an_async_broken_stream_is_resumed_elsewhere_too() -> None:
    coordinators, texts = _DyingThenLive(), []
    async with (AsyncMesh("http://a.test", transport=httpx.MockTransport(coordinators.first)) as a,
                AsyncMesh("http://b.test", transport=httpx.MockTransport(coordinators.second)) as b):
        stream = await a.generate("hi", model="m", stream=True, max_tokens=9, seed=4, temperature=0.5)
        with pytest.raises(MeshConnectionError):
            async for chunk in stream:
                texts.append(chunk.text)
        resumed = await b.resume(stream)
        coordinators.check(texts, [chunk.text async for chunk in resumed], resumed)


@pytest.mark.parametrize("status, error, cls, match", [
    (400, error_body("'m' generates text", param="model", code="model_not_embedding"), EmbeddingsNotSupportedError,
     "'m' generates text"),
    (404, error_body("Not Found"), EmbeddingsNotSupportedError, "no embeddings for model 'm'.*404: Not Found"),
    (404, error_body("The model `m` does not exist.", code="model_not_found"), NotFoundError, "does not exist"),
    (400, error_body("input: field required", param="input"), BadRequestError, "field required"),
])
def test_embed_errors(status: int, error: dict[str, Any], cls: type[MeshAPIError], match: str) -> None:
    with serve(lambda r: httpx.Response(status, json=error)) as mesh, pytest.raises(cls, match=match) as info:
        mesh.embed("x", model="m")
    assert type(info.value) is cls and info.value.status_code == status


def test_embed_returns_vectors_in_input_order() -> None:
    data = [{"index": 1, "embedding": [3, 4]}, {"index": 0, "embedding": [1.5, 2]}]
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return httpx.Response(200, json={"object": "list", "data": data, "model": "e"})

    with serve(handler) as mesh:
        assert mesh.embed(["a", "b"], model="e") == [[1.5, 2.0], [3.0, 4.0]]
    assert json.loads(requests[0].content) == {"model": "e", "input": ["a", "b"]}


def test_invalid_json_is_an_unexpected_response() -> None:
    with serve(lambda r: httpx.Response(200, content=b"not json")) as mesh, pytest.raises(UnexpectedResponseError):
        mesh.models()
    with serve(lambda r: httpx.Response(200, json={"data": [{"name": "no id"}]})) as mesh, \
            pytest.raises(UnexpectedResponseError, match="model list"):
        mesh.models()


def test_sse_decoder_follows_the_spec() -> None:
    decoder = SSEDecoder()
    lines = [": keep-alive", "event: message", "data: {\"a\":", "data:1}", "", "", "data: [DONE]"]
    assert [decoder.feed(line) for line in lines] == [None, None, None, None, "{\"a\":\n1}", None, None]
    assert decoder.flush() == "[DONE]" and decoder.flush() is None


def test_a_closed_port_is_a_connection_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with Mesh(f"http://127.0.0.1:{port}") as mesh, pytest.raises(MeshConnectionError, match=f":{port}/v1/models"):
        mesh.models()


def test_a_silent_server_is_a_timeout() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()            # connections are queued, never answered
        port = sock.getsockname()[1]
        with Mesh(f"http://127.0.0.1:{port}", timeout_s=0.3) as mesh, pytest.raises(MeshTimeoutError):
            mesh.generate("x", model="m")


async def test_async_client_maps_errors_and_streams() -> None:
    body = sse(chat_event("x"), chat_event("y", "stop"), "[DONE]")

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(503, json=error_body("loading", "service_unavailable_error"),
                                  headers={"Retry-After": "5"})
        return httpx.Response(200, content=body)

    async with AsyncMesh("http://mesh.test", transport=httpx.MockTransport(handler)) as mesh:
        with pytest.raises(ServiceUnavailableError) as info:
            await mesh.chat([{"role": "user", "content": "hi"}])
        assert info.value.retry_after_s == 5.0
        async with await mesh.chat([{"role": "user", "content": "hi"}], model="m", stream=True) as stream:
            chunks = [c async for c in stream]
    assert [(c.content, c.finish_reason) for c in chunks] == [("x", None), ("y", "stop")] and stream.closed


def test_the_builtin_model_is_the_shipped_demo_model() -> None:
    from stratamesh.kernels.demo_model import DEMO_DIR

    assert Path(builtin_model_dir()) == DEMO_DIR and (DEMO_DIR / "model.safetensors").is_file()
