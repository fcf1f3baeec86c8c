"""Anthropic's Messages API (POST /v1/messages) on the chat path: a request becomes a chat completion's (its system
prompt the first message, its text content blocks joined, tool_use blocks an assistant's tool_calls, tool_result
blocks "tool" messages, its tools and tool_choice OpenAI's), and the answer takes Anthropic's shapes: a message with
text and tool_use content blocks, stop_reason and usage, or the event sequence message_start, content_block_start,
content_block_delta..., content_block_stop, message_delta, message_stop. Errors take its error shape. Clients
authenticate with x-api-key (coordinator/api/auth.py) as with a bearer key."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from stratamesh.coordinator.api.errors import ApiError, to_api_error
from stratamesh.coordinator.api.generation import Delta, TextStream
from stratamesh.coordinator.api.responses import ResponseFormat
from stratamesh.coordinator.api.schemas import INT32_MAX, MAX_STOP_STRINGS, ChatCompletionRequest
from stratamesh.coordinator.api.sse import sse_event
from stratamesh.coordinator.api.tool_parsers import ToolCall, ToolCallFormat
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


class ToolUseBlock(BaseModel):
    """An assistant's call of a tool, in an earlier turn."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    """What a call of an earlier turn returned, in a user turn."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[Block]

    def as_chat(self) -> list[dict[str, Any]]:
        """The chat messages of this turn: its tool results each a "tool" message, then its text and calls."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text}
                   for b in self.content if isinstance(b, ToolResultBlock)]
        text = "".join(b.text for b in self.content if isinstance(b, TextBlock))
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in self.content if isinstance(b, ToolUseBlock)]
        turn = {"role": self.role, "content": text or None, **({"tool_calls": calls} if calls else {})}
        return results + ([turn] if text or calls or not results else [])


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    input_schema: dict[str, Any]

    def as_chat(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.input_schema}}


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    def as_chat(self) -> Any:
        """OpenAI's tool_choice of this one."""
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class MessagesRequest(BaseModel):
    """POST /v1/messages: Anthropic's fields (content blocks of text, tool_use and tool_result)."""

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
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None

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
            turn for m in self.messages for turn in m.as_chat()]
        choice = self.tool_choice
        return ChatCompletionRequest(model=self.model, messages=messages, max_tokens=self.max_tokens,
                                     temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                     stop=self.stop_sequences, stream=self.stream,
                                     stream_options={"include_usage": True} if self.stream else None,
                                     tools=[t.as_chat() for t in self.tools] if self.tools else None,
                                     tool_choice=choice.as_chat() if choice else None,
                                     parallel_tool_calls=not choice.disable_parallel_tool_use if choice else None)


class MessagesFormat(ResponseFormat):
    """Anthropic's message, and its streaming events (each named by its type; no [DONE]). With tools, the text
    block (index 0) is followed by a tool_use block per call, each streamed whole once the model has written it."""

    object_name = "message"

    def __init__(self, response_id: str, model: str, tools: ToolCallFormat | None = None) -> None:
        super().__init__(response_id, model, include_usage=True, tools=tools)
        self._stop: tuple[str, str | None] = ("end_turn", None)     # the streamed answer's stop reason, sequence
        self._text_open = True

    def head(self, run: TextStream, index: int = 0) -> list[dict[str, Any]]:
        message = {"id": self.response_id, "type": "message", "role": "assistant", "content": [], "model": self.model,
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": len(run.request.prompt_ids), "output_tokens": 0}}
        return [{"type": "message_start", "message": message},
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}]

    def pieces(self, delta: Delta, index: int = 0) -> list[dict[str, Any]]:
        text, calls, num_before = self.split(delta, index)
        events = [{"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}
                  ] if text else []
        if self._text_open and (calls or delta.finish_reason is not None):
            events.append({"type": "content_block_stop", "index": 0})
            self._text_open = False
        for i, block in enumerate(map(_tool_use, calls), start=num_before + 1):
            events += [{"type": "content_block_start", "index": i, "content_block": {**block, "input": {}}},
                       {"type": "content_block_delta", "index": i,
                        "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}},
                       {"type": "content_block_stop", "index": i}]
        if calls:
            self._stop = ("tool_use", None)
        return events

    def finished(self, run: TextStream) -> None:
        if self._stop[0] != "tool_use":
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
        text, calls = self.split_whole(text)
        reason, sequence = ("tool_use", None) if calls else stop_reason(run)
        blocks = ([{"type": "text", "text": text}] if text.strip() or not calls else []) + [
            _tool_use(call) for call in calls]
        return {"id": self.response_id, "type": "message", "role": "assistant", "model": self.model,
                "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}}


def _tool_use(call: ToolCall) -> dict[str, Any]:
    """A call as Anthropic's tool_use block (its arguments an object: {} where the model's were no JSON object)."""
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": arguments if isinstance(arguments, dict) else {}}


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
