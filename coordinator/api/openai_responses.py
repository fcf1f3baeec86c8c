"""OpenAI's Responses API (POST /v1/responses) on the chat path: a request becomes a chat completion's (its
instructions the first message, a system one; its input a string or message items, their text parts joined as
chat's; text.format its response_format), and the answer is a Response object holding one output message, or the
named events response.created, response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta..., response.output_text.done, response.content_part.done, response.output_item.done and
response.completed (response.incomplete where max_output_tokens cut it), each with its sequence_number. Nothing is
stored, so previous_response_id is a 400. Errors take OpenAI's shape, as the rest of /v1."""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stratamesh.coordinator.api.errors import ApiError
from stratamesh.coordinator.api.generation import Delta, TextStream
from stratamesh.coordinator.api.responses import ResponseFormat
from stratamesh.coordinator.api.schemas import INT32_MAX, ChatCompletionRequest
from stratamesh.coordinator.api.sse import sse_event
from stratamesh.coordinator.api.tool_parsers import ToolCall, ToolCallFormat
from stratamesh.fleet.states import FinishReason

CHAT_ROLES = {"developer": "system"}    # chat templates know system, not OpenAI's newer name for it


class Status(StrEnum):
    """A Response's status, and its output message's."""

    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    INCOMPLETE = "incomplete"


class InputText(BaseModel):
    """A text part of an input message (an assistant's earlier answer is output_text)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(BaseModel):
    """A message item of input."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def as_chat(self) -> dict[str, Any]:
        """The chat message; its text parts become chat's, which the chat path joins."""
        content = self.content if isinstance(self.content, str) else [
            {"type": "text", "text": part.text} for part in self.content]
        return {"role": CHAT_ROLES.get(self.role, self.role), "content": content}


class FunctionCallItem(BaseModel):
    """A function call the model made in an earlier turn."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str

    def as_chat(self) -> dict[str, Any]:
        return {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class FunctionCallOutputItem(BaseModel):
    """What an earlier call returned."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str
    output: str

    def as_chat(self) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": self.call_id, "content": self.output}


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(BaseModel):
    """A function the model may call (the Responses API's flat shape of chat's function tool)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat(self) -> dict[str, Any]:
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class TextFormat(BaseModel):
    """text.format: plain text, any JSON object, or JSON that its schema validates."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema format needs its schema")
        return self

    def response_format(self) -> dict[str, Any] | None:
        """The chat request's response_format (coordinator/api/structured.py); None for plain text."""
        match self.type:
            case "json_object":
                return {"type": "json_object"}
            case "json_schema":
                return {"type": "json_schema", "json_schema": {
                    "name": self.name or "response", "schema": self.json_schema, "strict": self.strict}}
        return None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(BaseModel):
    """POST /v1/responses: OpenAI's fields for text in and text out (store is ignored: nothing is stored)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    stream: bool = False
    text: TextConfig = Field(default_factory=TextConfig)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: str | list[InputItem]) -> str | list[InputItem]:
        if not value:
            raise ValueError("input is empty: give a string or a list of message items")
        return value

    @field_validator("previous_response_id")
    @classmethod
    def _nothing_stored(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("responses are not stored here; send the whole conversation as input instead")
        return value

    def as_chat(self) -> ChatCompletionRequest:
        """The chat completion this request asks for (a 400 ApiError for what the chat path does not serve)."""
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        messages = chat_messages(items, self.instructions)
        choice = self.tool_choice
        return ChatCompletionRequest(model=self.model, messages=messages, max_tokens=self.max_output_tokens,
                                     temperature=self.temperature, top_p=self.top_p, stream=self.stream,
                                     stream_options={"include_usage": True} if self.stream else None,
                                     response_format=self.text.format.response_format(),
                                     tools=[tool.as_chat() for tool in self.tools] if self.tools else None,
                                     tool_choice={"type": "function", "function": {"name": choice.get("name")}}
                                     if isinstance(choice, dict) else choice,
                                     parallel_tool_calls=self.parallel_tool_calls)

    def settings(self) -> dict[str, Any]:
        """What a Response object repeats of its request (the sampling defaults filled in)."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p, "tool_choice": self.tool_choice,
                "tools": [tool.model_dump(exclude_none=True) for tool in self.tools or ()],
                "parallel_tool_calls": self.parallel_tool_calls, "previous_response_id": None, "store": False,
                "text": {"format": self.text.format.model_dump(by_alias=True, exclude_none=True)},
                "metadata": self.metadata or {}}


def chat_messages(items: Sequence[InputItem], instructions: str | None) -> list[dict[str, Any]]:
    """The chat messages of the input items: instructions a system message first, consecutive function calls one
    assistant message's tool_calls, their outputs "tool" messages."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        if not isinstance(item, FunctionCallItem):
            messages.append(item.as_chat())
        elif messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
            messages[-1]["tool_calls"].append(item.as_chat())
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [item.as_chat()]})
    return messages


class ResponsesFormat(ResponseFormat):
    """OpenAI's Response object, and its streaming events (each named by its type and numbered; no [DONE])."""

    object_name = "response"
    done = b""

    def __init__(self, response_id: str, model: str, settings: dict[str, Any],
                 tools: ToolCallFormat | None = None) -> None:
        super().__init__(response_id, model, include_usage=True, tools=tools)
        self._settings = settings
        self._item_id = "msg_" + response_id.removeprefix("resp_")
        self._texts: list[str] = []             # the streamed answer's text so far
        self._calls: list[ToolCall] = []        # ... and its function calls
        self._status = Status.IN_PROGRESS       # the streamed answer's, once it finishes
        self._sequence_number = 0               # the next event's

    def head(self, run: TextStream, index: int = 0) -> list[dict[str, Any]]:
        started = self._response(Status.IN_PROGRESS, [], None)
        return [{"type": "response.created", "response": started},
                {"type": "response.in_progress", "response": started},
                {"type": "response.output_item.added", "output_index": 0,
                 "item": self._message(Status.IN_PROGRESS, None)},
                {"type": "response.content_part.added", **self._place(), "part": _text_part("")}]

    def pieces(self, delta: Delta, index: int = 0) -> list[dict[str, Any]]:
        text, calls, _ = self.split(delta, index)
        events = []
        if text:
            self._texts.append(text)
            events.append({"type": "response.output_text.delta", **self._place(), "delta": text, "logprobs": []})
        for call in calls:
            self._calls.append(call)
            events += _call_events(len(self._calls), call)
        if delta.finish_reason is not None:
            self._status = status_of(delta.finish_reason)
            text = "".join(self._texts)
            events += [{"type": "response.output_text.done", **self._place(), "text": text, "logprobs": []},
                       {"type": "response.content_part.done", **self._place(), "part": _text_part(text)},
                       {"type": "response.output_item.done", "output_index": 0,
                        "item": self._message(self._status, text)}]
        return events

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The last event: the whole response, response.completed (or response.incomplete)."""
        output = [self._message(self._status, "".join(self._texts)), *map(_function_call, self._calls)]
        return {"type": f"response.{self._status}", "response": self._response(self._status, output,
                                                                               response_usage(usage))}

    def error_event(self, err: ApiError) -> dict[str, Any]:
        return {"type": "error", "code": err.code, "message": err.message, "param": err.param}

    def event(self, chunk: dict[str, Any]) -> bytes:
        numbered = {**chunk, "sequence_number": self._sequence_number}
        self._sequence_number += 1
        return sse_event(numbered, chunk["type"])

    def whole(self, choices: Sequence[tuple[str, str, TextStream]], usage: dict[str, Any]) -> dict[str, Any]:
        ((text, finish_reason, _),) = choices
        text, calls = self.split_whole(text)
        status = status_of(finish_reason)
        output = ([self._message(status, text)] if text.strip() or not calls else []) + [
            _function_call(call) for call in calls]
        return self._response(status, output, response_usage(usage))

    def _response(self, status: Status, output: list[dict[str, Any]],
                  usage: dict[str, Any] | None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == Status.INCOMPLETE else None
        return {"id": self.response_id, "object": self.object_name, "created_at": self.created, "status": status,
                "error": None, "incomplete_details": incomplete, "model": self.model, "output": output,
                "usage": usage, **self._settings}

    def _message(self, status: Status, text: str | None) -> dict[str, Any]:
        """The output message; text None: no content part yet."""
        return {"type": "message", "id": self._item_id, "status": status, "role": "assistant",
                "content": [] if text is None else [_text_part(text)]}

    def _place(self) -> dict[str, Any]:
        return {"item_id": self._item_id, "output_index": 0, "content_index": 0}


def status_of(finish_reason: str) -> Status:
    """A finished answer's status: incomplete where its length cut it, else completed."""
    return Status.INCOMPLETE if finish_reason == FinishReason.LENGTH else Status.COMPLETED


def response_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """The chat path's usage in the Responses API's names."""
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def _function_call(call: ToolCall, status: Status = Status.COMPLETED) -> dict[str, Any]:
    """A call as the Responses API's output item."""
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": status}


def _call_events(output_index: int, call: ToolCall) -> list[dict[str, Any]]:
    """A call streamed whole: its item added, its arguments in one delta, done."""
    item = _function_call(call)
    place = {"item_id": item["id"], "output_index": output_index}
    return [{"type": "response.output_item.added", "output_index": output_index,
             "item": {**item, "arguments": "", "status": Status.IN_PROGRESS}},
            {"type": "response.function_call_arguments.delta", **place, "delta": call.arguments},
            {"type": "response.function_call_arguments.done", **place, "arguments": call.arguments},
            {"type": "response.output_item.done", "output_index": output_index, "item": item}]


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}
