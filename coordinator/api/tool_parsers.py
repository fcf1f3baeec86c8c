"""How a model family writes tool calls into its output, and how that output is split back into text and calls.

Each format names the marker that opens its calls, where a call ends, how a call's body parses, and the grammar
that makes the model write calls in it (tool_choice "required" or a named function). Formats, as vLLM names its
parsers:
- hermes: Hermes, Qwen 2.5/3 and most ChatML models: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block per call;
- llama3_json: Llama 3.1+: ``{"name": ..., "parameters": {...}}``, several joined by "; ", optionally after
  ``<|python_tag|>``;
- mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (its marker a special token)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from stratamesh.coordinator.text import stop_prefix_len
from stratamesh.fleet.states import TOOL_CALL_PARSERS

# llguidance's options for JSON in a grammar: compact, no run of spaces or newlines a model may get lost in
COMPACT_JSON = {"whitespace_flexible": False}


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call the model made: its name and its arguments as a JSON string (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


class ToolCallFormat:
    """A family's way of writing tool calls (see the module)."""

    name: ClassVar[str]
    start: ClassVar[str]                 # the text that opens the calls
    end: ClassVar[str | None] = None     # the text that closes one call; None: the calls run to the output's end
    bare_json: ClassVar[bool] = False    # an output that starts with "{" is calls too (Llama 3 writes them so)
    arguments_key: ClassVar[str] = "arguments"
    special_start: ClassVar[bool] = False   # the marker is a special token (kept in the text of tool requests)

    def parse(self, body: str) -> list[ToolCall]:
        """The calls in the text after the marker (up to the end marker, or the output's end); ValueError if it is
        not calls of this format."""
        return [self._call(obj) for obj in _json_values(body)]

    def _call(self, obj: Any) -> ToolCall:
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            raise ValueError(f"a tool call must be an object with a name, got {obj!r:.80}")
        arguments = obj.get(self.arguments_key, obj.get("arguments", {}))
        return ToolCall(obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                                          ensure_ascii=False))

    def grammar(self, call_schema: dict[str, Any], parallel: bool, start_token: str) -> str:
        """A Lark grammar (llguidance's) of one call, or of one or more with parallel, whose bodies follow
        call_schema; start_token: how the grammar names the marker (a special token's reference, or its text)."""
        raise NotImplementedError

    def call_schema(self, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        """The JSON schema of one call's body for function name."""
        return {"type": "object", "properties": {"name": {"const": name}, self.arguments_key: parameters},
                "required": ["name", self.arguments_key], "additionalProperties": False}


class Hermes(ToolCallFormat):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def grammar(self, call_schema: dict[str, Any], parallel: bool, start_token: str) -> str:
        calls = 'call ("\\n" call)*' if parallel else "call"
        return (f"start: {calls}\n"
                f'call: {start_token} "\\n" {_json(call_schema)} "\\n" {json.dumps(self.end)}\n')


class Llama3Json(ToolCallFormat):
    name = "llama3_json"
    start = "<|python_tag|>"
    bare_json = True
    arguments_key = "parameters"
    special_start = True

    def grammar(self, call_schema: dict[str, Any], parallel: bool, start_token: str) -> str:
        calls = 'call ("; " call)*' if parallel else "call"
        return f"start: {calls}\ncall: {_json(call_schema)}\n"


class Mistral(ToolCallFormat):
    name = "mistral"
    start = "[TOOL_CALLS]"
    special_start = True

    def grammar(self, call_schema: dict[str, Any], parallel: bool, start_token: str) -> str:
        array = {"type": "array", "items": call_schema, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        return f"start: {start_token} {_json(array)}\n"


FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (Hermes(), Llama3Json(), Mistral())}
assert tuple(FORMATS) == TOOL_CALL_PARSERS


def format_of_template(template: str | None) -> ToolCallFormat | None:
    """The tool-call format a chat template teaches its model (the marker it renders), None if it shows none."""
    for fmt in FORMATS.values():
        if template and fmt.start in template:
            return fmt
    return None


def _json(schema: dict[str, Any]) -> str:
    """A JSON schema in a Lark grammar: compact JSON that schema validates."""
    return f"%json {json.dumps({**schema, 'x-guidance': COMPACT_JSON})}"


def _json_values(text: str) -> list[Any]:
    """The JSON values in text, one after another, separated by whitespace or ";"; ValueError if there are none or
    anything else."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            break
        value, i = decoder.raw_decode(text, i)
        values.extend(value if isinstance(value, list) else [value])
    if not values:
        raise ValueError("no tool call")
    return values


class Phase(StrEnum):
    TEXT = "text"       # the model writes text
    CALLS = "calls"     # after a marker: a call's body, held until it ends


class CallSplitter:
    """One choice's output, as it streams, split into text and tool calls: text before a marker goes out at once
    (but for a tail that may start one), a call once it ends. A body that does not parse goes out as text."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self._fmt = fmt
        self._phase = Phase.TEXT
        self._held = ""                 # text not yet given out: a possible marker's start, or a call's body
        self._opened = ""               # the marker that opened the calls held ("" where an output's "{" did)
        self._wrote_text = False        # the output has text before any call (so "{" no longer opens calls)
        self.num_calls = 0

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """The text and calls that text completes."""
        self._held += text
        out: list[str] = []
        calls: list[ToolCall] = []
        end = self._fmt.end
        while True:
            if self._phase == Phase.TEXT:
                if not self._leave_text(out):
                    break
            elif end is not None and (i := self._held.find(end)) >= 0:
                body, self._held = self._held[:i], self._held[i + len(end):]
                calls += self._parsed(body, out, self._opened + body + end)
                self._phase = Phase.TEXT
            else:
                break
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is still held, at the output's end."""
        out: list[str] = []
        held, self._held = self._held, ""
        calls = self._parsed(held, out, self._opened + held) if self._phase == Phase.CALLS else []
        if self._phase == Phase.TEXT:
            self._give_text(held, out)
        return "".join(out), calls

    def _leave_text(self, out: list[str]) -> bool:
        """Gives out the text before a marker; True if one was found (and the phase is CALLS)."""
        fmt = self._fmt
        if fmt.bare_json and not self._wrote_text and not self.num_calls:
            stripped = self._held.lstrip()
            if stripped.startswith("{"):
                self._held, self._opened, self._phase = stripped, "", Phase.CALLS
                return True
            if not stripped:
                return False        # only whitespace yet: it may still open with "{"
        i = self._held.find(fmt.start)
        if i >= 0:
            self._give_text(self._held[:i], out)
            self._held, self._opened, self._phase = self._held[i + len(fmt.start):], fmt.start, Phase.CALLS
            return True
        keep = stop_prefix_len(self._held, (fmt.start,))
        self._give_text(self._held[:len(self._held) - keep], out)
        self._held = self._held[len(self._held) - keep:]
        return False

    def _give_text(self, text: str, out: list[str]) -> None:
        if text.strip() or not self.num_calls:      # whitespace between and after calls is not text
            out.append(text)
            self._wrote_text = self._wrote_text or bool(text.strip())

    def _parsed(self, body: str, out: list[str], raw: str) -> list[ToolCall]:
        """The calls in body, or none (and raw, the text they came as, given out) if it does not parse."""
        try:
            calls = self._fmt.parse(body)
        except ValueError:
            out.append(raw)
            self._wrote_text = True
            return []
        self.num_calls += len(calls)
        return calls


def split_calls(fmt: ToolCallFormat, text: str) -> tuple[str, list[ToolCall]]:
    """A whole output's text and tool calls."""
    splitter = CallSplitter(fmt)
    text_a, calls_a = splitter.push(text)
    text_b, calls_b = splitter.finish()
    return text_a + text_b, calls_a + calls_b
