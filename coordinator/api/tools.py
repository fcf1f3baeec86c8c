"""Tool calls on the chat path: a request's tools and tool_choice, the messages its chat template renders, and the
grammar that holds the model to calling them.

tools go to the chat template as transformers hands them (the OpenAI function definitions), and earlier
assistant turns' tool_calls with their arguments as objects (as transformers' templates expect; OpenAI sends JSON
strings). The output is split into text and calls by the format the template teaches (tool_parsers.py), or the one
the coordinator was started with (--tool-call-parser). tool_choice "auto" leaves the model free; "required" and a
named function constrain it to the format's calls whose arguments follow each function's parameters (structured
output's grammar engine); "none" renders the tools and parses nothing."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from stratamesh.coordinator.api.errors import ApiError
from stratamesh.coordinator.api.tool_parsers import FORMATS, ToolCallFormat, format_of_template
from stratamesh.coordinator.text import Tokenizer

ANY_OBJECT: dict[str, Any] = {"type": "object"}


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """One of OpenAI's tools: a function the model may call."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolMode(StrEnum):
    NONE = "none"           # render the tools, parse no calls
    AUTO = "auto"           # the model chooses: text, calls, or both
    REQUIRED = "required"   # one call or more (one without parallel_tool_calls)
    NAMED = "named"         # one call of the named function


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What a request asks of its tools: the mode, the named function, parallel calls, the format they come in."""

    tools: tuple[Tool, ...]
    mode: ToolMode
    fmt: ToolCallFormat | None      # None only where nothing is parsed (tool_choice "none")
    name: str | None = None
    parallel: bool = True

    @property
    def parsed_format(self) -> ToolCallFormat | None:
        """The format the output is parsed in for calls; None where calls are not parsed (tool_choice "none")."""
        return None if self.mode == ToolMode.NONE else self.fmt

    @property
    def keeps_special_tokens(self) -> bool:
        """The output's text keeps special tokens: the calls parsed open with one (Llama 3's, Mistral's marker)."""
        return self.parsed_format is not None and self.parsed_format.special_start

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as the chat template gets them."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def grammar(self, tokenizer: Tokenizer) -> str:
        """The Lark grammar of the calls required ("" where the model is free)."""
        if self.mode not in (ToolMode.REQUIRED, ToolMode.NAMED) or self.fmt is None:
            return ""
        chosen = [t.function for t in self.tools if self.mode == ToolMode.REQUIRED or t.function.name == self.name]
        bodies = [self.fmt.call_schema(f.name, f.parameters or ANY_OBJECT) for f in chosen]
        schema = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
        return self.fmt.grammar(schema, self.parallel and self.mode == ToolMode.REQUIRED,
                                _start_token(self.fmt, tokenizer))


def tool_use(tools: Sequence[Tool] | None, tool_choice: Any, parallel: bool | None, tokenizer: Tokenizer,
             parser: str | None) -> ToolUse | None:
    """What the request asks of its tools (None without tools); a 400 naming tool_choice where it names no tool
    given, or tools where calls are to be parsed but the model's template shows no format of them and no
    --tool-call-parser was given."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None
    mode, name = _mode(tool_choice, [t.function.name for t in tools])
    fmt = FORMATS[parser] if parser else format_of_template(tokenizer.config.chat_template)
    if fmt is None and mode != ToolMode.NONE:
        raise ApiError(400, "this model's chat template shows no way to call tools (start the coordinator with "
                            f"--tool-call-parser, one of {', '.join(FORMATS)})", param="tools")
    return ToolUse(tuple(tools), mode, fmt, name, True if parallel is None else parallel)


def _mode(tool_choice: Any, names: list[str]) -> tuple[ToolMode, str | None]:
    if tool_choice is None:
        return ToolMode.AUTO, None
    if tool_choice in ("none", "auto", "required"):
        return ToolMode(tool_choice), None
    name = ((tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict)
            and tool_choice.get("type") == "function" else None)
    if not isinstance(name, str):
        raise ApiError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                            '{"name": ...}}', param="tool_choice")
    if name not in names:
        raise ApiError(400, f"tool_choice names the function {name!r}, which is not among the tools "
                            f"({', '.join(names)})", param="tool_choice")
    return ToolMode.NAMED, name


def _start_token(fmt: ToolCallFormat, tokenizer: Tokenizer) -> str:
    """How a grammar names the format's marker: by token id where the marker is one token, else as its text."""
    token_id = tokenizer.token_to_id(fmt.start)
    return f"<[{token_id}]>" if token_id is not None and fmt.special_start else json.dumps(fmt.start)


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat's messages as chat templates expect them: earlier calls' arguments as objects, not JSON strings."""
    return [{**m, "tool_calls": [_with_object_arguments(c) for c in m["tool_calls"]]}
            if isinstance(m.get("tool_calls"), list) else m for m in messages]


def _with_object_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(function, dict) and isinstance(function.get("arguments"), str)):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call        # left as the string it is: the template renders it as it can
    return {**call, "function": {**function, "arguments": arguments}}
