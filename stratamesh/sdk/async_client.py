"""AsyncMesh: the asyncio client of a stratamesh mesh's HTTP API, mirroring Mesh."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Unpack, overload

import httpx

from stratamesh.sdk import calls
from stratamesh.sdk.calls import ChatOptions, MessageLike, SamplingOptions
from stratamesh.sdk.errors import MeshAPIError, error_from_response, transport_error
from stratamesh.sdk.results import Agent, ChatChunk, ChatCompletion, Completion, CompletionChunk, Model
from stratamesh.sdk.streams import AsyncStream, Resumable, resumed_request

if TYPE_CHECKING:
    from stratamesh.launcher import LocalMesh

__all__ = ["AsyncMesh"]

T = TypeVar("T")


class AsyncMesh:
    """Mesh for asyncio, on one httpx.AsyncClient; `await aclose()` it or use it in an async with block."""

    def __init__(self, url: str = calls.DEFAULT_URL, api_key: str | None = None, timeout_s: float = 600.0, *,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        """transport: httpx's (a proxy, custom TLS, or a mock in tests); default: plain HTTP connections."""
        self.url = calls.api_root(url)
        self.local_mesh: LocalMesh | None = None   # the processes, when AsyncMesh.local() started them
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, calls.CONNECT_TIMEOUT_S))
        self._client = httpx.AsyncClient(base_url=self.url, headers=calls.auth_headers(api_key), timeout=timeout,
                                         transport=transport)
        self._default_model: str | None = None

    @classmethod
    def local(cls, model: str | os.PathLike[str] | None = None, agents: int = 3, stages: int | None = None,
              **kwargs: Any) -> AbstractAsyncContextManager[AsyncMesh]:
        """An async context manager: a coordinator and agents started here (LocalMesh(**kwargs)), stopped on exit."""
        from stratamesh.sdk.local import async_local_mesh

        return async_local_mesh(model, agents, stages, **kwargs)

    async def models(self) -> list[Model]:
        """The models the mesh serves."""
        return calls.models_from_json(await self._json("GET", "/v1/models"))

    async def agents(self) -> list[Agent]:
        """Every agent the coordinator knows, with its newest load figures (a page of the admin API at a time)."""
        agents: list[Agent] = []
        after: str | None = None
        while True:
            body = await self._json("GET", calls.agents_path(after))
            agents += calls.agents_from_json(body)
            if (after := calls.next_after(body, after)) is None:
                return agents

    @overload
    async def generate(self, prompt: str | Sequence[int], *, model: str | None = None, stream: Literal[False] = False,
                 **sampling: Unpack[SamplingOptions]) -> Completion: ...

    @overload
    async def generate(self, prompt: str | Sequence[int], *, model: str | None = None, stream: Literal[True],
                 **sampling: Unpack[SamplingOptions]) -> AsyncStream[CompletionChunk]: ...

    async def generate(self, prompt: str | Sequence[int], *, model: str | None = None, stream: bool = False,
                 **sampling: Unpack[SamplingOptions]) -> Completion | AsyncStream[CompletionChunk]:
        """Completes prompt (text or token ids): POST /v1/completions, with sampling's settings (SamplingOptions:
        max_tokens 64 and greedy unless said); stream=True gives a AsyncStream of chunks."""
        prompt = prompt if isinstance(prompt, str) else list(prompt)
        body = calls.generation_body(await self._model(model), calls.sampling_json(sampling, chat=False), stream,
                                     prompt=prompt)
        if stream:
            return await self._stream("/v1/completions", body, calls.completion_chunk)
        return calls.shaped("completion", Completion.from_json, await self._json("POST", "/v1/completions", body))

    @overload
    async def chat(self, messages: Sequence[MessageLike], *, model: str | None = None, stream: Literal[False] = False,
                   **options: Unpack[ChatOptions]) -> ChatCompletion: ...

    @overload
    async def chat(self, messages: Sequence[MessageLike], *, model: str | None = None, stream: Literal[True],
                   **options: Unpack[ChatOptions]) -> AsyncStream[ChatChunk]: ...

    async def chat(self, messages: Sequence[MessageLike], *, model: str | None = None, stream: bool = False,
                   **options: Unpack[ChatOptions]) -> ChatCompletion | AsyncStream[ChatChunk]:
        """Answers a conversation: POST /v1/chat/completions, with options' settings (ChatOptions: SamplingOptions and
        tools); stream=True gives an AsyncStream of chunks."""
        body = calls.generation_body(await self._model(model), calls.sampling_json(options, chat=True), stream,
                                     messages=[calls.message_json(m) for m in messages])
        if stream:
            return await self._stream("/v1/chat/completions", body, calls.chat_chunk)
        return calls.shaped("chat completion", ChatCompletion.from_json,
                            await self._json("POST", "/v1/chat/completions", body))

    async def embed(self, inputs: str | Sequence[str], model: str | None = None) -> list[list[float]]:
        """One embedding per input: POST /v1/embeddings; EmbeddingsNotSupportedError where the model has none."""
        model_id = await self._model(model)
        try:
            body = await self._json("POST", "/v1/embeddings", calls.embeddings_body(model_id, inputs))
        except MeshAPIError as e:
            raise calls.embeddings_error(e, model_id) from e
        return calls.embeddings_from_json(body)

    async def aclose(self) -> None:
        """Closes the HTTP connections (not a local mesh: its context manager stops that)."""
        await self._client.aclose()

    async def __aenter__(self) -> AsyncMesh:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"AsyncMesh({self.url!r})"

    async def _model(self, model: str | None) -> str:
        """model, or the only model the mesh serves (asked once, then remembered)."""
        if model is not None:
            return model
        if self._default_model is None:
            self._default_model = calls.choose_model(await self.models())
        return self._default_model

    async def _json(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        response = await self._send(method, path, body, stream=False)
        return calls.parse(response.content)

    async def resume(self, stream: AsyncStream[T]) -> AsyncStream[T]:
        """Goes on here with a generation whose stream broke (its coordinator died: MeshConnectionError), from the
        tokens it received: Resumable.resumed_body says how, and what is refused."""
        path, body, parse = resumed_request(stream.resumable)
        return await self._stream(path, body, parse)

    async def _stream(self, path: str, body: dict[str, Any],
                      parse: Callable[[dict[str, Any]], T | None]) -> AsyncStream[T]:
        return AsyncStream(await self._send("POST", path, body, stream=True), parse, f"POST {self.url}{path}",
                           Resumable(path, body, parse))

    async def _send(self, method: str, path: str, body: dict[str, Any] | None, stream: bool) -> httpx.Response:
        """The response of a successful request; the matching SDK exception otherwise."""
        what = f"{method} {self.url}{path}"
        try:
            response = await self._client.send(self._client.build_request(method, path, json=body), stream=stream)
            if response.is_error:
                try:
                    await response.aread()
                finally:
                    await response.aclose()
                raise error_from_response(response)
        except httpx.TransportError as e:
            raise transport_error(e, what) from e
        return response

