"""OpenAI's response shapes: whole responses and stream chunks of completions and chat completions."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stratamesh.coordinator.api.errors import ApiError
from stratamesh.coordinator.api.generation import Delta, TextStream
from stratamesh.coordinator.api.logprobs import LogprobsShape
from stratamesh.coordinator.api.sse import DONE, sse_event
from stratamesh.coordinator.api.tool_parsers import CallSplitter, ToolCall, ToolCallFormat, split_calls
from stratamesh.fleet.states import FinishReason

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Echo:
    """A completion's prompt, returned before its text (echo)."""

    text: str
    token_ids: tuple[int, ...]
    only: bool = False      # max_tokens 0: the prompt alone (the token the mesh draws to get there is no answer)


class ResponseFormat:
    """Shapes one response's bodies; subclasses name the objects and where the text goes. logprobs: how the
    tokens' log-probabilities are shown, None where the request did not ask for them."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, response_id: str, model: str, include_usage: bool = False,
                 return_token_ids: bool = False, logprobs: LogprobsShape | None = None,
                 tools: ToolCallFormat | None = None) -> None:
        self.response_id = response_id
        self.model = model
        self.include_usage = include_usage
        self.return_token_ids = return_token_ids
        self.logprobs = logprobs
        self.tools = tools      # how the model writes tool calls, where the request's output is parsed for them
        self.created = int(time.time())
        self._splitters: dict[int, CallSplitter] = {}      # streamed with tools: each choice's

    def head(self, run: TextStream, index: int = 0) -> list[dict[str, Any]]:
        """Chunks of choice index sent before any text of its started run."""
        return []

    def pieces(self, delta: Delta, index: int = 0) -> list[dict[str, Any]]:
        """Chunks carrying one delta of choice index."""
        raise NotImplementedError

    def whole(self, choices: Sequence[tuple[str, str, TextStream]], usage: dict[str, Any]) -> dict[str, Any]:
        """The non-streamed response: each choice's (text, finish reason, finished run), in index order."""
        return {**self._envelope(self.object_name),
                "choices": [self._choice(i, *choice) for i, choice in enumerate(choices)], "usage": usage}

    def _choice(self, index: int, text: str, finish_reason: str, run: TextStream) -> dict[str, Any]:
        raise NotImplementedError

    def split(self, delta: Delta, index: int) -> tuple[str, list[ToolCall], int]:
        """A streamed delta's text and the tool calls it completes (none without tools), and how many calls the
        choice made before them."""
        if self.tools is None:
            return delta.text, [], 0
        splitter = self._splitters.setdefault(index, CallSplitter(self.tools))
        num_before = splitter.num_calls
        text, calls = splitter.push(delta.text)
        if delta.finish_reason is not None:
            more_text, more_calls = splitter.finish()
            text, calls = text + more_text, calls + more_calls
        return text, calls, num_before

    def split_whole(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole output's text and tool calls (none without tools)."""
        return (text, []) if self.tools is None else split_calls(self.tools, text)

    def _ids(self, token_ids: list[int] | tuple[int, ...] | None) -> dict[str, Any]:
        """vLLM's return_token_ids: the choice names the token ids it decodes."""
        return {"token_ids": list(token_ids or ())} if self.return_token_ids else {}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage: no choices, only usage."""
        return {**self._envelope(self.chunk_object_name), "choices": [], "usage": usage}

    # How a stream is framed: each chunk as an SSE event, what follows the usage, the end
    done = DONE

    def event(self, chunk: dict[str, Any]) -> bytes:
        return sse_event(chunk)

    def finished(self, run: TextStream) -> None:
        """A streamed choice's run reached its end (before the usage chunk)."""

    def tail(self) -> list[dict[str, Any]]:
        return []

    def error_event(self, err: ApiError) -> dict[str, Any]:
        return err.body()

    def _chunk(self, choice: dict[str, Any], finish_reason: str | None = None,
               logprobs: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
        chunk = {**self._envelope(self.chunk_object_name),
                 "choices": [{"index": index, **choice, "logprobs": logprobs, "finish_reason": finish_reason}]}
        if self.include_usage:  # as OpenAI: every chunk has "usage": null but the last
            chunk["usage"] = None
        return chunk

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": None}


class CompletionFormat(ResponseFormat):
    """/v1/completions: choices carry "text" (after the prompt's, with echo); logprobs in the legacy shape, their
    text offsets counted through each choice's whole text."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, response_id: str, model: str, include_usage: bool = False, return_token_ids: bool = False,
                 logprobs: LogprobsShape | None = None, echo: Echo | None = None) -> None:
        super().__init__(response_id, model, include_usage, return_token_ids, logprobs)
        self.echo = echo
        self._offsets: dict[int, int] = {}      # streamed: where each choice's next tokens' text starts in it

    def head(self, run: TextStream, index: int = 0) -> list[dict[str, Any]]:
        if self.echo is None:
            return []
        return [self._chunk({"text": self.echo.text}, logprobs=self._logprobs(*self._echoed(run), index),
                            index=index)]

    @property
    def _prompt_alone(self) -> bool:
        """max_tokens 0 with echo: the answer is the prompt."""
        return self.echo is not None and self.echo.only

    def pieces(self, delta: Delta, index: int = 0) -> list[dict[str, Any]]:
        if self._prompt_alone:
            return [] if delta.finish_reason is None else [
                self._chunk({"text": "", **self._ids(())}, FinishReason.LENGTH, index=index)]
        return [self._chunk({"text": delta.text, **self._ids(delta.token_ids)}, delta.finish_reason,
                            self._logprobs(delta.token_ids, delta.logprobs, index), index)]

    def whole(self, choices: Sequence[tuple[str, str, TextStream]], usage: dict[str, Any]) -> dict[str, Any]:
        return super().whole(choices, self._billed(usage))

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return super().usage_chunk(self._billed(usage))

    def _billed(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The usage the client sees: with the prompt alone (max_tokens 0), no completion tokens."""
        if not self._prompt_alone:
            return usage
        return {**usage, "completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}

    def _choice(self, index: int, text: str, finish_reason: str, run: TextStream) -> dict[str, Any]:
        prompt_ids, prompt_logprobs = self._echoed(run)
        if self._prompt_alone:
            return {"index": index, "text": self.echo.text, "logprobs": self._logprobs(
                prompt_ids, prompt_logprobs, index), "finish_reason": FinishReason.LENGTH, **self._ids(())}
        ids, logprobs = prompt_ids + tuple(run.token_ids), prompt_logprobs + tuple(run.logprobs)
        return {"index": index, "text": (self.echo.text if self.echo else "") + text,
                "logprobs": self._logprobs(ids, logprobs, index), "finish_reason": finish_reason,
                **self._ids(run.token_ids)}

    def _echoed(self, run: TextStream) -> tuple[tuple[int, ...], tuple]:
        """The echoed prompt's token ids and their log-probabilities (none for the first): () without echo."""
        if self.echo is None:
            return (), ()
        return self.echo.token_ids, (None, *run.prompt_logprobs)

    def _logprobs(self, token_ids: Sequence[int], logprobs: tuple, index: int) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        body = self.logprobs.completion(token_ids, logprobs, self._offsets.get(index, 0))
        self._offsets[index] = self._offsets.get(index, 0) + sum(len(t) for t in body["tokens"])
        return body


class ChatFormat(ResponseFormat):
    """/v1/chat/completions: a message, or deltas after a first {"role": "assistant"} chunk. With tools, each
    choice's output is split into content and tool calls (tool_parsers.py): a call streams as one tool_calls delta
    once the model has written it whole, and a choice that made calls finishes with "tool_calls"."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def head(self, run: TextStream, index: int = 0) -> list[dict[str, Any]]:
        return [self._chunk({"delta": {"role": "assistant", "content": ""}}, index=index)]

    def pieces(self, delta: Delta, index: int = 0) -> list[dict[str, Any]]:
        ids = self._ids(delta.token_ids)
        logprobs = None if self.logprobs is None else self.logprobs.chat(delta.logprobs)
        text, calls, num_before = self.split(delta, index)
        chunks = [self._chunk({"delta": {"content": text}, **ids}, logprobs=logprobs, index=index)] if text else []
        chunks += [self._chunk({"delta": {"tool_calls": [_call_delta(num_before + i, call)]},
                                **({} if chunks else ids)}, logprobs=None if chunks else logprobs, index=index)
                   for i, call in enumerate(calls)]
        if delta.finish_reason is not None:  # as OpenAI: the finish reason comes with an empty delta
            reason = finish_reason_of(delta.finish_reason, num_before + len(calls))
            chunks.append(self._chunk({"delta": {}, **({} if chunks else ids)}, reason,
                                      None if chunks else logprobs, index))
        return chunks

    def _choice(self, index: int, text: str, finish_reason: str, run: TextStream) -> dict[str, Any]:
        text, calls = self.split_whole(text)
        message = {"role": "assistant", "content": text if text.strip() or not calls else None,
                   **({"tool_calls": [_call(call) for call in calls]} if calls else {})}
        return {"index": index, "message": message,
                "logprobs": None if self.logprobs is None else self.logprobs.chat(run.logprobs),
                "finish_reason": finish_reason_of(finish_reason, len(calls)), **self._ids(run.token_ids)}


def finish_reason_of(reason: str, num_calls: int) -> str:
    """OpenAI's finish reason of a choice that made num_calls tool calls: "tool_calls" where it ended by itself."""
    return "tool_calls" if num_calls and reason == FinishReason.STOP else reason


def _call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _call_delta(index: int, call: ToolCall) -> dict[str, Any]:
    return {"index": index, **_call(call)}
