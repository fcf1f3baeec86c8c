"""OpenAI's response shapes: whole responses and stream chunks of completions and chat completions."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from stratamesh.coordinator.api.generation import Delta, TextStream
from stratamesh.coordinator.api.logprobs import LogprobsShape

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Echo:
    """A completion's prompt, returned before its text (echo)."""

    text: str
    token_ids: tuple[int, ...]


class ResponseFormat:
    """Shapes one response's bodies; subclasses name the objects and where the text goes. logprobs: how the
    tokens' log-probabilities are shown, None where the request did not ask for them."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, response_id: str, model: str, include_usage: bool = False,
                 return_token_ids: bool = False, logprobs: LogprobsShape | None = None) -> None:
        self.response_id = response_id
        self.model = model
        self.include_usage = include_usage
        self.return_token_ids = return_token_ids
        self.logprobs = logprobs
        self.created = int(time.time())

    def head(self, run: TextStream) -> list[dict[str, Any]]:
        """Chunks sent before any text of the started run."""
        return []

    def pieces(self, delta: Delta) -> list[dict[str, Any]]:
        """Chunks carrying one delta."""
        raise NotImplementedError

    def whole(self, text: str, finish_reason: str, usage: dict[str, int], run: TextStream) -> dict[str, Any]:
        """The non-streamed response of the finished run."""
        raise NotImplementedError

    def _ids(self, token_ids: list[int] | tuple[int, ...] | None) -> dict[str, Any]:
        """vLLM's return_token_ids: the choice names the token ids it decodes."""
        return {"token_ids": list(token_ids or ())} if self.return_token_ids else {}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage: no choices, only usage."""
        return {**self._envelope(self.chunk_object_name), "choices": [], "usage": usage}

    def _chunk(self, choice: dict[str, Any], finish_reason: str | None = None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        chunk = {**self._envelope(self.chunk_object_name),
                 "choices": [{"index": 0, **choice, "logprobs": logprobs, "finish_reason": finish_reason}]}
        if self.include_usage:  # as OpenAI: every chunk has "usage": null but the last
            chunk["usage"] = None
        return chunk

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": None}


class CompletionFormat(ResponseFormat):
    """/v1/completions: choices carry "text" (after the prompt's, with echo); logprobs in the legacy shape, their
    text offsets counted through the whole choice."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, response_id: str, model: str, include_usage: bool = False, return_token_ids: bool = False,
                 logprobs: LogprobsShape | None = None, echo: Echo | None = None) -> None:
        super().__init__(response_id, model, include_usage, return_token_ids, logprobs)
        self.echo = echo
        self._offset = 0        # streamed: where the next tokens' text starts in the choice's

    def head(self, run: TextStream) -> list[dict[str, Any]]:
        if self.echo is None:
            return []
        return [self._chunk({"text": self.echo.text}, logprobs=self._logprobs(*self._echoed(run)))]

    def pieces(self, delta: Delta) -> list[dict[str, Any]]:
        return [self._chunk({"text": delta.text, **self._ids(delta.token_ids)}, delta.finish_reason,
                            self._logprobs(delta.token_ids, delta.logprobs))]

    def whole(self, text: str, finish_reason: str, usage: dict[str, int], run: TextStream) -> dict[str, Any]:
        prompt_ids, prompt_logprobs = self._echoed(run)
        ids, logprobs = prompt_ids + tuple(run.token_ids), prompt_logprobs + tuple(run.logprobs)
        choice = {"index": 0, "text": (self.echo.text if self.echo else "") + text,
                  "logprobs": self._logprobs(ids, logprobs), "finish_reason": finish_reason,
                  **self._ids(run.token_ids)}
        return {**self._envelope(self.object_name), "choices": [choice], "usage": usage}

    def _echoed(self, run: TextStream) -> tuple[tuple[int, ...], tuple]:
        """The echoed prompt's token ids and their log-probabilities (none for the first): () without echo."""
        if self.echo is None:
            return (), ()
        return self.echo.token_ids, (None, *run.prompt_logprobs)

    def _logprobs(self, token_ids: tuple[int, ...] | list[int], logprobs: tuple) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        body = self.logprobs.completion(token_ids, logprobs, self._offset)
        self._offset += sum(len(t) for t in body["tokens"])
        return body


class ChatFormat(ResponseFormat):
    """/v1/chat/completions: a message, or deltas after a first {"role": "assistant"} chunk."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def head(self, run: TextStream) -> list[dict[str, Any]]:
        return [self._chunk({"delta": {"role": "assistant", "content": ""}})]

    def pieces(self, delta: Delta) -> list[dict[str, Any]]:
        ids = self._ids(delta.token_ids)
        logprobs = None if self.logprobs is None else self.logprobs.chat(delta.logprobs)
        chunks = [self._chunk({"delta": {"content": delta.text}, **ids}, logprobs=logprobs)] if delta.text else []
        if delta.finish_reason is not None:  # as OpenAI: the finish reason comes with an empty delta
            chunks.append(self._chunk({"delta": {}, **({} if delta.text else ids)}, delta.finish_reason,
                                      None if delta.text else logprobs))
        return chunks

    def whole(self, text: str, finish_reason: str, usage: dict[str, int], run: TextStream) -> dict[str, Any]:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None if self.logprobs is None else self.logprobs.chat(run.logprobs),
                  "finish_reason": finish_reason, **self._ids(run.token_ids)}
        return {**self._envelope(self.object_name), "choices": [choice], "usage": usage}
