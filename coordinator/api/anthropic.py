"""Anthropic's Messages API (POST /v1/messages) on the chat path: a request becomes a chat completion's (its system
prompt the first message, its text content blocks joined), and the answer takes Anthropic's shapes: a message with
text content blocks, stop_reason and usage, or the event sequence message_start, content_block_start,
content_block_delta..., content_block_stop, message_delta, message_stop. Errors take its error shape. Clients
authenticate with x-api-key (coordinator/api/auth.py) as with a bearer key."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from stratamesh.coordinator.api.errors import ApiError, to_api_error
from stratamesh.coordinator.api.generation import Delta, TextStream
from stratamesh.coordinator.api.responses import ResponseFormat
from stratamesh.coordinator.api.schemas import INT32_MAX, MAX_STOP_STRINGS, ChatCompletionRequest
from stratamesh.coordinator.api.sse import sse_event
from stratamesh.fleet.states import FinishReason

# Anthropic's error type of each HTTP status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
_ERROR_SCHEMA = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI responses for these error statuses, each with Anthropic's error body."""
    return {status: {"description": ERROR_TYPES.get(status, "api_error"),
                     "content": {"application/json": {"schema": _ERROR_SCHEMA}}} for status in statuses}


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[TextBlock]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class MessagesRequest(BaseModel):
    """POST /v1/messages: Anthropic's fields (text content blocks only; tools are not served yet)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1, le=INT32_MAX)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0, le=INT32_MAX)
    stream: bool = False
    tools: list[Any] | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError("tools are not served on /v1/messages yet")
        return value

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not s for s in value):
            raise ValueError("stop sequences must not be empty")
        return value

    def as_chat(self) -> ChatCompletionRequest:
        """The chat completion this request asks for (Anthropic's temperature default is 1, as OpenAI's)."""
        system = self.system if isinstance(self.system, str) or self.system is None else "".join(
            b.text for b in self.system)
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": m.role, "content": m.text} for m in self.messages]
        return ChatCompletionRequest(model=self.model, messages=messages, max_tokens=self.max_tokens,
                                     temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                     stop=self.stop_sequences, stream=self.stream,
                                     stream_options={"include_usage": True} if self.stream else None)


class MessagesFormat(ResponseFormat):
    """Anthropic's message, and its streaming events (each named by its type; no [DONE])."""

    object_name = "message"

    def __init__(self, response_id: str, model: str) -> None:
        super().__init__(response_id, model, include_usage=True)
        self._stop: tuple[str, str | None] = ("end_turn", None)     # the streamed answer's stop reason, sequence

    def head(self, run: TextStream, index: int = 0) -> list[dict[str, Any]]:
        message = {"id": self.response_id, "type": "message", "role": "assistant", "content": [], "model": self.model,
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": len(run.request.prompt_ids), "output_tokens": 0}}
        return [{"type": "message_start", "message": message},
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}]

    def pieces(self, delta: Delta, index: int = 0) -> list[dict[str, Any]]:
        events = [{"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": delta.text}}
                  ] if delta.text else []
        if delta.finish_reason is not None:
            events.append({"type": "content_block_stop", "index": 0})
        return events

    def finished(self, run: TextStream) -> None:
        self._stop = stop_reason(run)

    def error_event(self, err: ApiError) -> dict[str, Any]:
        return error_event(err)

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {"type": "message_delta", "delta": {"stop_reason": self._stop[0], "stop_sequence": self._stop[1]},
                "usage": {"output_tokens": usage["completion_tokens"]}}

    def tail(self) -> list[dict[str, Any]]:
        return [{"type": "message_stop"}]

    def event(self, chunk: dict[str, Any]) -> bytes:
        return sse_event(chunk, chunk.get("type", ""))

    done = b""

    def whole(self, choices: Sequence[tuple[str, str, TextStream]], usage: dict[str, Any]) -> dict[str, Any]:
        ((text, _, run),) = choices
        reason, sequence = stop_reason(run)
        return {"id": self.response_id, "type": "message", "role": "assistant", "model": self.model,
                "content": [{"type": "text", "text": text}], "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}}


def stop_reason(run: TextStream) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a finished run: a stop string it met, the length, or the turn's
    end."""
    if run.stop_string is not None:
        return "stop_sequence", run.stop_string
    return ("max_tokens", None) if run.finish_reason == FinishReason.LENGTH else ("end_turn", None)


def error_response(exc: Exception) -> JSONResponse:
    """An exception as Anthropic's error body."""
    err = exc if isinstance(exc, ApiError) else to_api_error(exc)
    return JSONResponse({"type": "error", "error": {"type": ERROR_TYPES.get(err.status, "api_error"),
                                                    "message": err.message}}, status_code=err.status)


def error_event(err: ApiError) -> dict[str, Any]:
    """A stream's failure as Anthropic's error event."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}
