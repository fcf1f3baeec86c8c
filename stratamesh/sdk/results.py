"""Typed results of the SDK, each parsed from the server's JSON by its from_json."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Agent", "ChatChoice", "ChatChunk", "ChatCompletion", "Completion", "CompletionChunk", "Gpu", "Message",
           "Model", "TextChoice", "TokenLogprob", "ToolCall", "Usage"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call the model made; arguments is the JSON text it wrote (args: parsed)."""

    id: str
    name: str
    arguments: str

    @property
    def args(self) -> Any:
        """The arguments, parsed (ValueError where the model's text is no JSON)."""
        return json.loads(self.arguments)

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    @classmethod
    def all_of(cls, calls: Any) -> tuple[ToolCall, ...]:
        """The API's tool_calls (a message's, or a chunk's deltas, each whole here)."""
        return tuple(cls(c.get("id") or "", c["function"]["name"], c["function"].get("arguments") or "")
                     for c in calls or ())


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message; an assistant's may hold tool calls (answer them with {"role": "tool", "tool_call_id":
    call.id, "content": ...} messages)."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()

    def as_json(self) -> dict[str, Any]:
        """The message as the API takes it."""
        if not self.tool_calls:
            return {"role": self.role, "content": self.content}
        return {"role": self.role, "content": self.content or None,
                "tool_calls": [call.as_json() for call in self.tool_calls]}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Message:
        return cls(body.get("role") or "assistant", body.get("content") or "", ToolCall.all_of(body.get("tool_calls")))


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request; cached_tokens of the prompt came from a stage's prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def from_json(cls, body: Mapping[str, Any] | None) -> Usage | None:
        if not body:
            return None
        details = body.get("prompt_tokens_details") or {}
        return cls(int(body["prompt_tokens"]), int(body["completion_tokens"]), int(details.get("cached_tokens") or 0))


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token of an answer with its log-probability under the model (None: an echoed prompt's first token) and
    those of its likeliest alternatives, by their text."""

    token: str
    logprob: float | None
    top: Mapping[str, float]

    @classmethod
    def of_completion(cls, body: Mapping[str, Any] | None) -> tuple[TokenLogprob, ...] | None:
        """The completions API's logprobs (tokens, token_logprobs, top_logprobs), None where it has none."""
        if not body:
            return None
        return tuple(cls(token, value, top or {}) for token, value, top in
                     zip(body["tokens"], body["token_logprobs"], body["top_logprobs"], strict=True))

    @classmethod
    def of_chat(cls, body: Mapping[str, Any] | None) -> tuple[TokenLogprob, ...] | None:
        """The chat API's logprobs (content: token, logprob, top_logprobs), None where it has none."""
        if not body:
            return None
        return tuple(cls(e["token"], e["logprob"], {t["token"]: t["logprob"] for t in e.get("top_logprobs") or ()})
                     for e in body.get("content") or ())


@dataclass(frozen=True, slots=True)
class TextChoice:
    """One of generate()'s answers (n > 1 gives several)."""

    text: str
    finish_reason: str | None
    logprobs: tuple[TokenLogprob, ...] | None = None

    @classmethod
    def from_json(cls, choice: Mapping[str, Any]) -> TextChoice:
        return cls(choice["text"], choice.get("finish_reason"), TokenLogprob.of_completion(choice.get("logprobs")))


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole answer of generate(): the first choice's text, finish reason and logprobs (where asked:
    logprobs=N), and every choice (n=N)."""

    id: str
    model: str
    text: str
    finish_reason: str | None
    usage: Usage | None
    logprobs: tuple[TokenLogprob, ...] | None = None
    choices: tuple[TextChoice, ...] = ()

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Completion:
        choices = tuple(TextChoice.from_json(c) for c in sorted(body["choices"], key=lambda c: c.get("index", 0)))
        first = choices[0]
        return cls(body["id"], body["model"], first.text, first.finish_reason, Usage.from_json(body.get("usage")),
                   first.logprobs, choices)


@dataclass(frozen=True, slots=True)
class CompletionChunk:
    """One streamed piece of generate(): a text delta (and its tokens' logprobs where asked); the last pieces carry
    finish_reason and usage."""

    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    index: int = 0      # the choice it belongs to (n > 1)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> CompletionChunk:
        choice = body["choices"][0] if body.get("choices") else {}
        return cls(choice.get("text") or "", choice.get("finish_reason"), Usage.from_json(body.get("usage")),
                   TokenLogprob.of_completion(choice.get("logprobs")), choice.get("index") or 0)


@dataclass(frozen=True, slots=True)
class ChatChoice:
    """One of chat()'s answers (n > 1 gives several)."""

    message: Message
    finish_reason: str | None
    logprobs: tuple[TokenLogprob, ...] | None = None

    @classmethod
    def from_json(cls, choice: Mapping[str, Any]) -> ChatChoice:
        return cls(Message.from_json(choice["message"]), choice.get("finish_reason"),
                   TokenLogprob.of_chat(choice.get("logprobs")))


@dataclass(frozen=True, slots=True)
class ChatCompletion:
    """A whole answer of chat(): the first choice's message (the assistant's reply, ready to append to the
    conversation; its tool_calls where it called tools), finish reason and logprobs (where asked: logprobs=N), and
    every choice (n=N)."""

    id: str
    model: str
    message: Message
    finish_reason: str | None
    usage: Usage | None
    logprobs: tuple[TokenLogprob, ...] | None = None
    choices: tuple[ChatChoice, ...] = ()

    @property
    def content(self) -> str:
        """The reply's text."""
        return self.message.content

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        """The functions the reply calls."""
        return self.message.tool_calls

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ChatCompletion:
        choices = tuple(ChatChoice.from_json(c) for c in sorted(body["choices"], key=lambda c: c.get("index", 0)))
        first = choices[0]
        return cls(body["id"], body["model"], first.message, first.finish_reason, Usage.from_json(body.get("usage")),
                   first.logprobs, choices)


@dataclass(frozen=True, slots=True)
class ChatChunk:
    """One streamed piece of chat(): a delta of the reply's content; the last pieces carry finish_reason and usage."""

    content: str
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    index: int = 0      # the choice it belongs to (n > 1)
    tool_calls: tuple[ToolCall, ...] = ()       # each whole, once the model has written it

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ChatChunk:
        choice = body["choices"][0] if body.get("choices") else {}
        delta = choice.get("delta") or {}
        return cls(delta.get("content") or "", choice.get("finish_reason"), Usage.from_json(body.get("usage")),
                   TokenLogprob.of_chat(choice.get("logprobs")), choice.get("index") or 0,
                   ToolCall.all_of(delta.get("tool_calls")))


@dataclass(frozen=True, slots=True)
class Model:
    """A model the mesh serves; max_context is its context length in tokens; task "generate" (completions and
    chat) or "embed" (embed())."""

    id: str
    created: int
    max_context: int
    ready: bool
    task: str = "generate"

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Model:
        return cls(body["id"], int(body.get("created") or 0), int(body.get("max_model_len") or 0),
                   bool(body.get("ready", True)), str(body.get("task") or "generate"))


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU of an agent's box."""

    name: str
    mem_total_bytes: int


@dataclass(frozen=True, slots=True)
class Agent:
    """An agent as the coordinator knows it; tokens_per_s and queue_depth from its newest heartbeat (None if none)."""

    agent_id: str
    name: str
    state: str
    address: str
    hostname: str
    site: str
    tier: str
    num_cpus: int
    ram_total_bytes: int
    gpus: tuple[Gpu, ...]
    num_ranks: int
    tokens_per_s: float | None
    queue_depth: int | None

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Agent:
        caps = body.get("capabilities") or {}
        telemetry = body.get("telemetry") or {}
        gpus = tuple(Gpu(str(g.get("name", "")), int(g.get("mem_total_bytes") or 0)) for g in caps.get("gpus") or ())
        return cls(body["agent_id"], body.get("name") or "", body.get("state") or "", body.get("address") or "",
                   caps.get("hostname") or "", caps.get("site") or "", caps.get("tier") or "",
                   int(caps.get("num_cpus") or 0), int(caps.get("ram_total_bytes") or 0), gpus,
                   int(caps.get("num_ranks") or 1), _float_or_none(telemetry.get("tokens_per_s")),
                   _int_or_none(telemetry.get("queue_depth")))


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)
