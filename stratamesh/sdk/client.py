"""Mesh: the synchronous client of a stratamesh mesh's HTTP API."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, closing
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Unpack, overload

import httpx

from stratamesh.sdk import calls
from stratamesh.sdk.calls import ChatOptions, MessageLike, SamplingOptions
from stratamesh.sdk.errors import MeshAPIError, error_from_response, transport_error
from stratamesh.sdk.results import Agent, ChatChunk, ChatCompletion, Completion, CompletionChunk, Model
from stratamesh.sdk.streams import Resumable, Stream, resumed_request

if TYPE_CHECKING:
    from stratamesh.launcher import LocalMesh

__all__ = ["Mesh"]

T = TypeVar("T")


class Mesh:
    """A client of a mesh's OpenAI-compatible API on one httpx.Client; close() it or use it in a with block."""

    def __init__(self, url: str = calls.DEFAULT_URL, api_key: str | None = None, timeout_s: float = 600.0, *,
                 transport: httpx.BaseTransport | None = None) -> None:
        """transport: httpx's (a proxy, custom TLS, or a mock in tests); default: plain HTTP connections."""
        self.url = calls.api_root(url)
        self.local_mesh: LocalMesh | None = None   # the processes, when Mesh.local() started them
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, calls.CONNECT_TIMEOUT_S))
        self._client = httpx.Client(base_url=self.url, headers=calls.auth_headers(api_key), timeout=timeout,
                                    transport=transport)
        self._default_model: str | None = None

    @classmethod
    def local(cls, model: str | os.PathLike[str] | None = None, agents: int = 3, stages: int | None = None,
              **kwargs: Any) -> AbstractContextManager[Mesh]:
        """A context manager: a coordinator and agents started here (LocalMesh(**kwargs)), stopped on exit."""
        from stratamesh.sdk.local import local_mesh

        return local_mesh(model, agents, stages, **kwargs)

    def models(self) -> list[Model]:
        """The models the mesh serves."""
        return calls.models_from_json(self._json("GET", "/v1/models"))

    def agents(self) -> list[Agent]:
        """Every agent the coordinator knows, with its newest load figures (a page of the admin API at a time)."""
        agents: list[Agent] = []
        after: str | None = None
        while True:
            body = self._json("GET", calls.agents_path(after))
            agents += calls.agents_from_json(body)
            if (after := calls.next_after(body, after)) is None:
                return agents

    @overload
    def generate(self, prompt: str | Sequence[int], *, model: str | None = None, stream: Literal[False] = False,
                 **sampling: Unpack[SamplingOptions]) -> Completion: ...

    @overload
    def generate(self, prompt: str | Sequence[int], *, model: str | None = None, stream: Literal[True],
                 **sampling: Unpack[SamplingOptions]) -> Stream[CompletionChunk]: ...

    def generate(self, prompt: str | Sequence[int], *, model: str | None = None, stream: bool = False,
                 **sampling: Unpack[SamplingOptions]) -> Completion | Stream[CompletionChunk]:
        """Completes prompt (text or token ids): POST /v1/completions, with sampling's settings (SamplingOptions:
        max_tokens 64 and greedy unless said); stream=True gives a Stream of chunks."""
        prompt = prompt if isinstance(prompt, str) else list(prompt)
        body = calls.generation_body(self._model(model), calls.sampling_json(sampling, chat=False), stream,
                                     prompt=prompt)
        if stream:
            return self._stream("/v1/completions", body, calls.completion_chunk)
        return calls.shaped("completion", Completion.from_json, self._json("POST", "/v1/completions", body))

    @overload
    def chat(self, messages: Sequence[MessageLike], *, model: str | None = None, stream: Literal[False] = False,
             **options: Unpack[ChatOptions]) -> ChatCompletion: ...

    @overload
    def chat(self, messages: Sequence[MessageLike], *, model: str | None = None, stream: Literal[True],
             **options: Unpack[ChatOptions]) -> Stream[ChatChunk]: ...

    def chat(self, messages: Sequence[MessageLike], *, model: str | None = None, stream: bool = False,
             **options: Unpack[ChatOptions]) -> ChatCompletion | Stream[ChatChunk]:
        """Answers a conversation: POST /v1/chat/completions, with options' settings (ChatOptions: SamplingOptions and
        tools); stream=True gives a Stream of chunks."""
        body = calls.generation_body(self._model(model), calls.sampling_json(options, chat=True), stream,
                                     messages=[calls.message_json(m) for m in messages])
        if stream:
            return self._stream("/v1/chat/completions", body, calls.chat_chunk)
        return calls.shaped("chat completion", ChatCompletion.from_json,
                            self._json("POST", "/v1/chat/completions", body))

    def embed(self, inputs: str | Sequence[str], model: str | None = None) -> list[list[float]]:
        """One embedding per input: POST /v1/embeddings; EmbeddingsNotSupportedError where the model has none."""
        model_id = self._model(model)
        try:
            body = self._json("POST", "/v1/embeddings", calls.embeddings_body(model_id, inputs))
        except MeshAPIError as e:
            raise calls.embeddings_error(e, model_id) from e
        return calls.embeddings_from_json(body)

    def close(self) -> None:
        """Closes the HTTP connections (not a local mesh: its context manager stops that)."""
        self._client.close()

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Mesh({self.url!r})"

    def _model(self, model: str | None) -> str:
        """model, or the only model the mesh serves (asked once, then remembered)."""
        if model is not None:
            return model
        if self._default_model is None:
            self._default_model = calls.choose_model(self.models())
        return self._default_model

    def _json(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        response = self._send(method, path, body, stream=False)
        return calls.parse(response.content)

    def resume(self, stream: Stream[T]) -> Stream[T]:
        """Goes on here with a generation whose stream broke (its coordinator died: MeshConnectionError), from the
        tokens it received: Resumable.resumed_body says how, and what is refused."""
        path, body, parse = resumed_request(stream.resumable)
        return self._stream(path, body, parse)

    def _stream(self, path: str, body: dict[str, Any], parse: Callable[[dict[str, Any]], T | None]) -> Stream[T]:
        return Stream(self._send("POST", path, body, stream=True), parse, f"POST {self.url}{path}",
                      Resumable(path, body, parse))

    def _send(self, method: str, path: str, body: dict[str, Any] | None, stream: bool) -> httpx.Response:
        """The response of a successful request; the matching SDK exception otherwise."""
        what = f"{method} {self.url}{path}"
        try:
            response = self._client.send(self._client.build_request(method, path, json=body), stream=stream)
            if response.is_error:
                with closing(response):
                    response.read()
                raise error_from_response(response)
        except httpx.TransportError as e:
            raise transport_error(e, what) from e
        return response

