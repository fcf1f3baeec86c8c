"""OpenAI's response shapes: whole responses and stream chunks of completions and chat completions."""

from __future__ import annotations

import logging
import time
from typing import Any

from stratamesh.coordinator.api.generation import Delta

log = logging.getLogger(__name__)


class ResponseFormat:
    """Shapes one response's bodies; subclasses name the objects and where the text goes."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, response_id: str, model: str, include_usage: bool = False,
                 return_token_ids: bool = False) -> None:
        self.response_id = response_id
        self.model = model
        self.include_usage = include_usage
        self.return_token_ids = return_token_ids
        self.created = int(time.time())

    def head(self) -> list[dict[str, Any]]:
        """Chunks sent before any text."""
        return []

    def pieces(self, delta: Delta) -> list[dict[str, Any]]:
        """Chunks carrying one delta."""
        raise NotImplementedError

    def whole(self, text: str, finish_reason: str, usage: dict[str, int],
              token_ids: list[int] | None = None) -> dict[str, Any]:
        """The non-streamed response."""
        raise NotImplementedError

    def _ids(self, token_ids: list[int] | tuple[int, ...] | None) -> dict[str, Any]:
        """vLLM's return_token_ids: the choice names the token ids it decodes."""
        return {"token_ids": list(token_ids or ())} if self.return_token_ids else {}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage: no choices, only usage."""
        return {**self._envelope(self.chunk_object_name), "choices": [], "usage": usage}

    def _chunk(self, choice: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        chunk = {**self._envelope(self.chunk_object_name),
                 "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": finish_reason}]}
        if self.include_usage:  # as OpenAI: every chunk has "usage": null but the last
            chunk["usage"] = None
        return chunk

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": None}


class CompletionFormat(ResponseFormat):
    """/v1/completions: choices carry "text"."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def pieces(self, delta: Delta) -> list[dict[str, Any]]:
        return [self._chunk({"text": delta.text, **self._ids(delta.token_ids)}, delta.finish_reason)]

    def whole(self, text: str, finish_reason: str, usage: dict[str, int],
              token_ids: list[int] | None = None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                  **self._ids(token_ids)}
        return {**self._envelope(self.object_name), "choices": [choice], "usage": usage}


class ChatFormat(ResponseFormat):
    """/v1/chat/completions: a message, or deltas after a first {"role": "assistant"} chunk."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def head(self) -> list[dict[str, Any]]:
        return [self._chunk({"delta": {"role": "assistant", "content": ""}})]

    def pieces(self, delta: Delta) -> list[dict[str, Any]]:
        ids = self._ids(delta.token_ids)
        chunks = [self._chunk({"delta": {"content": delta.text}, **ids})] if delta.text else []
        if delta.finish_reason is not None:  # as OpenAI: the finish reason comes with an empty delta
            chunks.append(self._chunk({"delta": {}, **({} if delta.text else ids)}, delta.finish_reason))
        return chunks

    def whole(self, text: str, finish_reason: str, usage: dict[str, int],
              token_ids: list[int] | None = None) -> dict[str, Any]:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason, **self._ids(token_ids)}
        return {**self._envelope(self.object_name), "choices": [choice], "usage": usage}
