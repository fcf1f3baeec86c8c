"""Typed results of the SDK, each parsed from the server's JSON by its from_json."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Agent", "ChatChunk", "ChatCompletion", "Completion", "CompletionChunk", "Gpu", "Message", "Model",
           "TokenLogprob", "Usage"]


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message."""

    role: str
    content: str

    def as_json(self) -> dict[str, str]:
        """The message as the API takes it."""
        return {"role": self.role, "content": self.content}


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
class Completion:
    """A whole answer of generate(); logprobs where asked (logprobs=N)."""

    id: str
    model: str
    text: str
    finish_reason: str | None
    usage: Usage | None
    logprobs: tuple[TokenLogprob, ...] | None = None

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Completion:
        choice = body["choices"][0]
        return cls(body["id"], body["model"], choice["text"], choice.get("finish_reason"),
                   Usage.from_json(body.get("usage")), TokenLogprob.of_completion(choice.get("logprobs")))


@dataclass(frozen=True, slots=True)
class CompletionChunk:
    """One streamed piece of generate(): a text delta (and its tokens' logprobs where asked); the last pieces carry
    finish_reason and usage."""

    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> CompletionChunk:
        choice = body["choices"][0] if body.get("choices") else {}
        return cls(choice.get("text") or "", choice.get("finish_reason"), Usage.from_json(body.get("usage")),
                   TokenLogprob.of_completion(choice.get("logprobs")))


@dataclass(frozen=True, slots=True)
class ChatCompletion:
    """A whole answer of chat(); message is the assistant's reply, ready to append to the conversation."""

    id: str
    model: str
    message: Message
    finish_reason: str | None
    usage: Usage | None
    logprobs: tuple[TokenLogprob, ...] | None = None     # where asked (logprobs=N)

    @property
    def content(self) -> str:
        """The reply's text."""
        return self.message.content

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ChatCompletion:
        choice = body["choices"][0]
        message = choice["message"]
        return cls(body["id"], body["model"], Message(message.get("role") or "assistant", message.get("content") or ""),
                   choice.get("finish_reason"), Usage.from_json(body.get("usage")),
                   TokenLogprob.of_chat(choice.get("logprobs")))


@dataclass(frozen=True, slots=True)
class ChatChunk:
    """One streamed piece of chat(): a delta of the reply's content; the last pieces carry finish_reason and usage."""

    content: str
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ChatChunk:
        choice = body["choices"][0] if body.get("choices") else {}
        delta = choice.get("delta") or {}
        return cls(delta.get("content") or "", choice.get("finish_reason"), Usage.from_json(body.get("usage")),
                   TokenLogprob.of_chat(choice.get("logprobs")))


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
