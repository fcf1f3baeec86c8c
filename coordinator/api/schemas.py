"""The OpenAI request bodies stratamesh accepts, validated at the HTTP boundary."""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from stratamesh.coordinator.api.tools import Tool
from stratamesh.fleet.sessions import MAX_LOGPROBS

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16
INT32_MAX = 2**31 - 1          # what a count or token id may be on the wire (int32 fields of mesh.proto)
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
MAX_EMBEDDING_INPUTS = 2048   # OpenAI's limit on the inputs of one embeddings request
MAX_LOGIT_BIAS = 1024         # token ids one request may bias
MAX_CHOICES = 128             # n and best_of at most (OpenAI's n)


class StreamOptions(BaseModel):
    """stream_options: only include_usage is known."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields /v1/completions and /v1/chat/completions share, OpenAI's plus vLLM's sampling extensions (top_k,
    min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos)."""

    model_config = ConfigDict(extra="ignore")  # like vLLM: clients send fields we do not use

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)  # vLLM: -1 or 0 turn it off
    seed: int | None = Field(default=None, ge=-2**63, lt=2**63)  # int64, as vLLM
    stop: list[str] | None = None
    stop_token_ids: list[TokenId] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension: keep generating past EOS
    return_token_ids: bool = False  # vLLM extension: choices carry the token ids they decode
    # stratamesh's extension: the tokens this same request already generated (on a coordinator that went away); it
    # goes on after them, max_tokens and min_tokens counting them (docs/registry.md: the SDK's resume)
    resume_token_ids: list[TokenId] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0, allow_inf_nan=False)    # vLLM extension
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    min_p: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)          # vLLM extension
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)      # vLLM extension: no stop token before this many
    user: str | None = None
    # Structured output (coordinator/api/structured.py): OpenAI's response_format, vLLM's guided_* extensions
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, min_length=1)
    guided_regex: str | None = Field(default=None, min_length=1)
    guided_grammar: str | None = Field(default=None, min_length=1)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if value is not None and any(not s for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @property
    def num_candidates(self) -> int:
        """The generations the request runs: n, or (completions) best_of to return the best n of."""
        return self.n

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None and len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may bias at most {MAX_LOGIT_BIAS} token ids")
        if value is not None and any(not (key.isdigit() and int(key) <= INT32_MAX) for key in value):
            raise ValueError("logit_bias keys must be token ids (decimal strings)")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    @property
    def num_logprobs(self) -> int | None:
        """The likeliest tokens listed with each generated token's log-probability; None: no logprobs."""
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The same for each prompt token (echo); None: none."""
        return None


class CompletionRequest(GenerationRequest):
    """POST /v1/completions."""

    prompt: Any  # a string or a list of token ids; a list of several prompts is rejected
    max_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)   # 0: with echo, the prompt alone
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)

    @property
    def num_logprobs(self) -> int | None:
        """Those asked, or (best_of ranks its candidates by theirs) 0."""
        return self.logprobs if self.logprobs is not None or self.num_candidates == self.n else 0

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    @property
    def num_candidates(self) -> int:
        return self.best_of or self.n

    @field_validator("best_of")
    @classmethod
    def _best_of_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value < n:
            raise ValueError(f"best_of ({value}) must be at least n ({n})")
        if value is not None and value > n and info.data.get("stream"):
            raise ValueError("best_of above n cannot stream: the best are known only at the end")
        return value

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
            value = value[0]  # ["text"] or [[1, 2, 3]]: one prompt in a batch of one
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(type(t) is int for t in value):
            return value
        if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
            raise ValueError("several prompts in one request are not supported yet; send one per request")
        raise ValueError("prompt must be a string or a non-empty list of token ids")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported (no model served here fills in the middle)")
        return value


class ChatMessage(BaseModel):
    """One chat message; other keys (name, tool_call_id, ...) pass through to the chat template."""

    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1)
    content: Any = None

    @field_validator("content")
    @classmethod
    def _text_content(cls, value: Any) -> str | None:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(_is_text_part(p) for p in value):
            return "\n".join(p["text"] for p in value)  # as vLLM: text parts joined by newlines
        raise ValueError("content must be a string or a list of {\"type\": \"text\", \"text\": ...} parts; "
                         "images and audio are not supported")


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Any = None      # "none", "auto", "required" or {"type": "function", ...}: coordinator/api/tools.py
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True  # vLLM extension
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension: extra template variables

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_new_tokens(self) -> int | None:
        """max_completion_tokens, OpenAI's newer name, wins over max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings; input becomes a list with one entry per input: a string or a list of token ids."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    input: list[str | list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _inputs(cls, value: Any) -> list[str | list[int]]:
        if isinstance(value, str) or _is_token_ids(value):
            value = [value]   # one input
        if not (isinstance(value, list) and value and all(_is_one_input(v) for v in value)):
            raise ValueError("input must be a non-empty string, a non-empty list of token ids, or a non-empty "
                             "list of either")
        if len(value) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request")
        return value

    @field_validator("dimensions")
    @classmethod
    def _no_dimensions(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError("dimensions is not supported: the model's embeddings have the size it gives them")
        return value


def _is_one_input(value: Any) -> bool:
    return (isinstance(value, str) and value != "") or _is_token_ids(value)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a prompt's token ids, or a chat's as its template renders it."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): the text of token ids."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    tokens: list[TokenId]
