"""Streamed responses: server-sent events parsed into chunks, as sync and async iterators."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator
from types import TracebackType
from typing import Any, Generic, TypeVar

import httpx

from stratamesh.sdk.calls import shaped
from stratamesh.sdk.errors import MeshConnectionError, UnexpectedResponseError, error_from_event, transport_error

__all__ = ["AsyncStream", "EventParser", "Resumable", "SSEDecoder", "Stream", "resumed_request"]

T = TypeVar("T")
DONE = "[DONE]"


class SSEDecoder:
    """Turns the lines of an event stream into the data of each event (its data lines joined by newlines)."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """The data of the event this line ends (a blank line ends one), else None."""
        if not line:
            return self.flush()
        if line.startswith(":"):  # a comment, such as a keep-alive
            return None
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        """The data of an event not yet ended by a blank line, if any."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


class Resumable(Generic[T]):
    """What a generation's stream keeps to go on elsewhere (Mesh.resume): its request, and the token ids of its
    answer received so far (each event's, a chunk with no text yet among them)."""

    def __init__(self, path: str, body: dict[str, Any], parse: Callable[[dict[str, Any]], T | None]) -> None:
        self.path, self.body, self.parse = path, body, parse
        self.token_ids: list[int] = []

    def record(self, event: dict[str, Any]) -> T | None:
        """parse(event), having kept its token ids (those of the first choice: a resumed request has one)."""
        for choice in event.get("choices") or ():
            if isinstance(choice, dict) and not choice.get("index"):
                self.token_ids += choice.get("token_ids") or ()
        return self.parse(event)

    def resumed_body(self) -> dict[str, Any]:
        """The same request, going on after every token it generated (the server's resume_token_ids). Greedy and
        seeded sampling give what the broken stream would have given; a request whose output those tokens would
        have to count as (penalties on it, structured output, tools, n > 1, echo) is refused (MeshAPIError)."""
        return {**self.body, "resume_token_ids": [*self.body.get("resume_token_ids", ()), *self.token_ids]}


def resumed_request(resumable: Resumable[T] | None) -> tuple[str, dict[str, Any], Callable[[dict[str, Any]], T | None]]:
    """The path, body and parser of a broken generation's stream, resumed (ValueError for another stream)."""
    if resumable is None:
        raise ValueError("only a stream of generate() or chat() can be resumed")
    return resumable.path, resumable.resumed_body(), resumable.parse


class EventParser(Generic[T]):
    """Turns the lines of an OpenAI stream into chunks; raises the SDK exception an error event carries."""

    def __init__(self, parse: Callable[[dict[str, Any]], T | None]) -> None:
        self._parse = parse
        self._decoder = SSEDecoder()
        self.done = False

    def feed(self, line: str) -> T | None:
        """The chunk this line completes, if any; done turns True at `data: [DONE]`."""
        return self._event(self._decoder.feed(line))

    def finish(self) -> T | None:
        """At the end of the body: the last chunk if one was pending; MeshConnectionError if [DONE] never came."""
        chunk = self._event(self._decoder.flush())
        if not self.done:
            raise MeshConnectionError("the stream ended before the server sent [DONE] (the connection dropped?)")
        return chunk

    def _event(self, data: str | None) -> T | None:
        if data is None or self.done:
            return None
        if data == DONE:
            self.done = True
            return None
        try:
            event = json.loads(data)
        except ValueError as e:
            raise UnexpectedResponseError(f"a stream event is not JSON: {data[:200]!r}") from e
        if not isinstance(event, dict):
            raise UnexpectedResponseError(f"a stream event is not a JSON object: {data[:200]!r}")
        if "error" in event:
            raise error_from_event(event)
        return shaped("stream chunk", self._parse, event)


class Stream(Generic[T]):
    """The chunks of a streamed response: an iterator and a context manager; closes the response when done.
    resumable: a generation's, which Mesh.resume can go on with on another coordinator."""

    def __init__(self, response: httpx.Response, parse: Callable[[dict[str, Any]], T | None], what: str,
                 resumable: Resumable[T] | None = None) -> None:
        self._response = response
        self.resumable = resumable
        self._chunks = _chunks(response, EventParser(resumable.record if resumable else parse), what)

    @property
    def closed(self) -> bool:
        """Whether the HTTP response is closed (the stream ended, failed, or was closed)."""
        return self._response.is_closed

    def close(self) -> None:
        """Closes the response; the server stops the generation."""
        self._chunks.close()
        self._response.close()

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        return next(self._chunks)

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class AsyncStream(Generic[T]):
    """The chunks of a streamed response for `async for` and `async with`; closes the response when done.
    resumable: as Stream's (AsyncMesh.resume)."""

    def __init__(self, response: httpx.Response, parse: Callable[[dict[str, Any]], T | None], what: str,
                 resumable: Resumable[T] | None = None) -> None:
        self._response = response
        self.resumable = resumable
        self._chunks = _async_chunks(response, EventParser(resumable.record if resumable else parse), what)

    @property
    def closed(self) -> bool:
        """Whether the HTTP response is closed (the stream ended, failed, or was closed)."""
        return self._response.is_closed

    async def aclose(self) -> None:
        """Closes the response; the server stops the generation."""
        await self._chunks.aclose()
        await self._response.aclose()

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        return await self._chunks.__anext__()

    async def __aenter__(self) -> AsyncStream[T]:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


def _chunks(response: httpx.Response, parser: EventParser[T], what: str) -> Generator[T, None, None]:
    """The chunks of response; a function, not a method: a stream dropped unfinished is freed, and so closed."""
    try:
        for line in response.iter_lines():
            chunk = parser.feed(line)
            if chunk is not None:
                yield chunk
            if parser.done:
                return
        chunk = parser.finish()
        if chunk is not None:
            yield chunk
    except httpx.TransportError as e:
        raise transport_error(e, what) from e
    finally:
        response.close()


async def _async_chunks(response: httpx.Response, parser: EventParser[T], what: str) -> AsyncGenerator[T, None]:
    """The chunks of response, for AsyncStream."""
    try:
        async for line in response.aiter_lines():
            chunk = parser.feed(line)
            if chunk is not None:
                yield chunk
            if parser.done:
                return
        chunk = parser.finish()
        if chunk is not None:
            yield chunk
    except httpx.TransportError as e:
        raise transport_error(e, what) from e
    finally:
        await response.aclose()
