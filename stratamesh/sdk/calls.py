"""What both clients share and do without I/O: request bodies, model choice, response parsing."""

from __future__ import annotations

import os

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict, TypeVar
from urllib.parse import urlencode

from stratamesh.sdk.errors import (
    AmbiguousModelError,
    EmbeddingsNotSupportedError,
    MeshAPIError,
    NotFoundError,
    UnexpectedResponseError,
)
from stratamesh.sdk.results import Agent, ChatChunk, CompletionChunk, Message, Model

DEFAULT_URL = "http://127.0.0.1:8000"
CONNECT_TIMEOUT_S = 10.0
AGENTS_PAGE = 10_000        # agents asked for per call when listing them all: the admin API's largest page

MessageLike = Message | Mapping[str, Any]
T = TypeVar("T")


class SamplingOptions(TypedDict, total=False):
    """The settings generate() and chat() take, named and meant as in the API (OpenAI's, and vLLM's for top_k,
    min_p, repetition_penalty, min_tokens, ignore_eos and the guided_* constraints); what is left out takes the
    API's default, but max_tokens (64 here) and temperature (0 here: greedy)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: str | Sequence[str]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: Mapping[int, float]     # token id -> added to its logit
    min_tokens: int
    ignore_eos: bool    # generate past the end-of-text token, up to max_tokens
    logprobs: int       # each generated token's log-probability, and this many likeliest tokens' with it
    n: int              # answers to the prompt: the result's choices
    response_format: Mapping[str, Any]      # {"type": "json_object"} or {"type": "json_schema", "json_schema": ...}
    guided_json: Mapping[str, Any]          # a JSON schema the answer follows
    guided_choice: Sequence[str]            # the answer is one of these
    guided_regex: str
    guided_grammar: str                     # a Lark grammar


class ChatOptions(SamplingOptions, total=False):
    """What chat() takes besides SamplingOptions: the functions the model may call (OpenAI's tools), and how."""

    tools: Sequence[Mapping[str, Any]]      # {"type": "function", "function": {"name", "description", "parameters"}}
    tool_choice: str | Mapping[str, Any]    # "none", "auto", "required" or {"type": "function", "function": ...}
    parallel_tool_calls: bool


SAMPLING_DEFAULTS: SamplingOptions = {"max_tokens": 64, "temperature": 0.0}


def sampling_json(options: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """The API's fields of options (SamplingOptions) for /v1/completions, or /v1/chat/completions (chat: logprobs
    as logprobs + top_logprobs); a TypeError naming an option it does not know, as a call with it would."""
    unknown = sorted(set(options) - set((ChatOptions if chat else SamplingOptions).__annotations__))
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
    body: dict[str, Any] = {**SAMPLING_DEFAULTS, **options}
    if isinstance(body.get("stop"), str):
        body["stop"] = [body["stop"]]
    elif "stop" in body:
        body["stop"] = list(body["stop"])
    if "logit_bias" in body:
        body["logit_bias"] = {str(token): bias for token, bias in body["logit_bias"].items()}
    if chat and "logprobs" in body:
        body.update(logprobs=True, top_logprobs=body.pop("logprobs"))
    for name in ("tools", "guided_choice"):
        if name in body:
            body[name] = list(body[name])
    return body


def api_root(url: str) -> str:
    """The server's root URL; a trailing "/" or "/v1" (as OpenAI clients take it) is dropped."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The bearer header of api_key, or of $STRATAMESH_API_KEY when api_key is None."""
    api_key = api_key if api_key is not None else os.environ.get("STRATAMESH_API_KEY", "")
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def generation_body(model: str, sampling: Mapping[str, Any], stream: bool, **fields: Any) -> dict[str, Any]:
    """The body of /v1/completions (fields: prompt) or /v1/chat/completions (fields: messages); sampling: the API's
    fields of the call's options (sampling_json)."""
    body = {"model": model, **fields, **sampling, "stream": stream}
    if stream:      # (the token ids: what a resume elsewhere goes on after, Mesh.resume)
        body.update(stream_options={"include_usage": True}, return_token_ids=True)
    return body


def message_json(message: MessageLike) -> dict[str, Any]:
    """A Message or a {"role", "content"} mapping (with "tool_calls" or "tool_call_id", say) as the API takes it."""
    return message.as_json() if isinstance(message, Message) else dict(message)


def embeddings_body(model: str, inputs: str | Sequence[str]) -> dict[str, Any]:
    return {"model": model, "input": [inputs] if isinstance(inputs, str) else list(inputs)}


def choose_model(models: Sequence[Model]) -> str:
    """The id of the only model the mesh serves; AmbiguousModelError if it serves none or several."""
    if len(models) == 1:
        return models[0].id
    if not models:
        raise AmbiguousModelError("the mesh serves no model yet; pass model=... once one is deployed")
    names = ", ".join(repr(m.id) for m in models)
    raise AmbiguousModelError(f"the mesh serves several models ({names}); pass model=... to pick one")


def embeddings_error(exc: MeshAPIError, model: str) -> MeshAPIError:
    """exc of POST /v1/embeddings as EmbeddingsNotSupportedError where it says the model has none; others unchanged."""
    if exc.code == "model_not_embedding":
        return EmbeddingsNotSupportedError(exc.status_code, exc.message, exc.type, exc.param, exc.code)
    if not isinstance(exc, NotFoundError) or exc.code == "model_not_found":
        return exc
    return EmbeddingsNotSupportedError(   # a server without the route
        exc.status_code, f"the mesh serves no embeddings for model {model!r} (POST /v1/embeddings answered "
        f"{exc.status_code}: {exc.message})", exc.type, exc.param, exc.code)


def parse(body_json: bytes) -> Any:
    """The JSON of a successful response; UnexpectedResponseError if it is not JSON."""
    try:
        return json.loads(body_json)
    except ValueError as e:
        raise UnexpectedResponseError(f"the server answered with invalid JSON: {body_json[:200]!r}") from e


def shaped(what: str, build: Callable[[Any], T], body: Any) -> T:
    """build(body), with a missing or mistyped field reported as UnexpectedResponseError naming what."""
    try:
        return build(body)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise UnexpectedResponseError(f"unexpected {what} from the server ({type(e).__name__}: {e}): "
                                      f"{str(body)[:300]}") from e


def models_from_json(body: Any) -> list[Model]:
    return shaped("model list", lambda b: [Model.from_json(m) for m in b["data"]], body)


def agents_path(after: str | None) -> str:
    """GET /admin/api/agents for the page after the agent id `after` (None: the first page)."""
    params = {"limit": AGENTS_PAGE} if after is None else {"limit": AGENTS_PAGE, "after": after}
    return f"/admin/api/agents?{urlencode(params)}"


def agents_from_json(body: Any) -> list[Agent]:
    return shaped("agent list", lambda b: [Agent.from_json(a) for a in b["agents"]], body)


def next_after(body: Any, after: str | None) -> str | None:
    """The cursor of the page after this one (None: it was the last; a coordinator older than paging sends every
    agent at once, and no cursor)."""
    cursor = body.get("next_after") if isinstance(body, dict) else None
    if cursor is not None and (not isinstance(cursor, str) or cursor == after):
        raise UnexpectedResponseError(f"the agent list's next_after {cursor!r} does not page on from {after!r}")
    return cursor


def embeddings_from_json(body: Any) -> list[list[float]]:
    def build(b: Any) -> list[list[float]]:
        data = sorted(b["data"], key=lambda d: d.get("index", 0))
        return [[float(x) for x in d["embedding"]] for d in data]

    return shaped("embeddings", build, body)


def completion_chunk(event: dict[str, Any]) -> CompletionChunk | None:
    """The chunk of one completion event; None for one that carries nothing."""
    chunk = CompletionChunk.from_json(event)
    return chunk if chunk.text or chunk.finish_reason or chunk.usage else None


def chat_chunk(event: dict[str, Any]) -> ChatChunk | None:
    """The chunk of one chat event; None for one that carries nothing (such as the role-only first one)."""
    chunk = ChatChunk.from_json(event)
    return chunk if chunk.content or chunk.tool_calls or chunk.finish_reason or chunk.usage else None
