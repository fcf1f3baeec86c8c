"""The OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions, /v1/embeddings, /health and
/metrics."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError

from stratamesh.coordinator.api.errors import (
    ApiError,
    error_response,
    error_responses,
    install_error_handlers,
    to_api_error,
    validation_error,
)
from stratamesh.coordinator.api.admission import Limits
from stratamesh.coordinator.api.embeddings import check_context, embed_all, embedding_body
from stratamesh.coordinator.api.generation import TextStream, Timeline
from stratamesh.coordinator.api.schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                EmbeddingRequest, GenerationRequest, TokenizeRequest)
from stratamesh.coordinator.api import anthropic
from stratamesh.coordinator.api.anthropic import MessagesFormat, MessagesRequest
from stratamesh.coordinator.api.choices import Choices, choice_request
from stratamesh.coordinator.api.logprobs import LogprobsShape
from stratamesh.coordinator.api.openai_responses import ResponsesFormat, ResponsesRequest
from stratamesh.coordinator.api.responses import ChatFormat, CompletionFormat, Echo, ResponseFormat
from stratamesh.coordinator.api.sse import SSEResponse
from stratamesh.coordinator.api.structured import grammar_of
from stratamesh.coordinator.api.tool_parsers import ToolCallFormat
from stratamesh.coordinator.api.tools import ToolUse, template_messages, tool_use
from stratamesh.coordinator.metrics import ApiMetrics
from stratamesh.coordinator.serving.origin import ModelCard
from stratamesh.coordinator.serving.request import Request as MeshRequest
from stratamesh.coordinator.serving.request import Stops
from stratamesh.coordinator.text import IncrementalDetokenizer, Tokenizer
from stratamesh.fleet.errors import ModelNotFound, ModelNotReady
from stratamesh.fleet.sessions import SamplingParams

log = logging.getLogger(__name__)

RequestT = TypeVar("RequestT", bound=BaseModel)
DialectT = TypeVar("DialectT", MessagesRequest, ResponsesRequest)     # the other APIs served on the chat path
T = TypeVar("T")
DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there


class Serving(Protocol):
    """What the API needs from the mesh; the coordinator's Origin (serving/origin.py) is the one."""

    def list_models(self) -> list[ModelCard]: ...

    def text(self, model_id: str) -> Tokenizer: ...  # raises ModelNotFound

    def generate(self, request: MeshRequest) -> AsyncIterator[int]: ...  # ends as its stops say, or sooner if closed

    async def embed(self, model_id: str, prompt_ids: list[int],
                    request_id: str) -> Sequence[float]: ...  # an embed model's normalized vector of the prompt

    def health(self) -> dict[str, Any]: ...


def create_app(serving: Serving, metrics: ApiMetrics | None = None, limits: Limits = Limits(),
               tool_call_parser: str | None = None) -> FastAPI:
    """The FastAPI app serving the OpenAI-compatible API over serving, counting into metrics (a fresh one if None),
    holding prompts and completions to limits' token caps; tool_call_parser: the format of every model's tool
    calls (coordinator/api/tool_parsers.py), else the one its chat template shows."""
    app = FastAPI(title="stratamesh", summary="OpenAI-compatible API of a stratamesh inference mesh")
    api = OpenAIApi(serving, metrics if metrics is not None else ApiMetrics(), limits, tool_call_parser)
    app.add_api_route("/v1/models", api.models, methods=["GET"], responses=error_responses(401))
    generated = {200: {"description": "the answer, or with stream: true server-sent events ending in [DONE]",
                       "content": {"application/json": {}, "text/event-stream": {}}},
                 **error_responses(400, 401, 404, 413, 429, 499, 502, 503)}
    app.add_api_route("/v1/completions", api.completions, methods=["POST"], responses=generated,
                      openapi_extra=json_body(CompletionRequest))
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"], responses=generated,
                      openapi_extra=json_body(ChatCompletionRequest))
    app.add_api_route("/v1/messages", api.messages, methods=["POST"], openapi_extra=json_body(MessagesRequest),
                      responses={200: {"description": "the message, or with stream: true Anthropic's events",
                                       "content": {"application/json": {}, "text/event-stream": {}}},
                                 **anthropic.error_responses(400, 401, 404, 413, 429, 499, 502, 503)})
    app.add_api_route("/v1/responses", api.responses, methods=["POST"], openapi_extra=json_body(ResponsesRequest),
                      responses={200: {"description": "the response, or with stream: true its named events",
                                       "content": {"application/json": {}, "text/event-stream": {}}},
                                 **error_responses(400, 401, 404, 413, 429, 499, 502, 503)})
    app.add_api_route("/v1/embeddings", api.embeddings, methods=["POST"],
                      responses=error_responses(400, 401, 404, 413, 429, 502, 503),
                      openapi_extra=json_body(EmbeddingRequest))
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"], responses=error_responses(400, 401, 404),
                      openapi_extra=json_body(TokenizeRequest))
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"], responses=error_responses(400, 401, 404),
                      openapi_extra=json_body(DetokenizeRequest))
    app.add_api_route("/health", api.health, methods=["GET"],
                      responses={503: {"description": "the mesh does not serve (yet)"}})
    app.add_api_route("/metrics", api.metrics, methods=["GET"], response_class=PlainTextResponse,
                      responses={200: {"description": "Prometheus' text exposition"}})
    install_error_handlers(app)
    return app


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI requestBody of a route that parses its JSON body itself (parse_body, for OpenAI's error shape)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:   # pydantic's "#/$defs/X" refs mean nothing inside an OpenAPI document
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            return inline(defs[ref.rsplit("/", 1)[-1]]) if ref.startswith("#/$defs/") else {
                k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


class OpenAIApi:
    """The endpoints; every error becomes an OpenAI error body and never reaches the server."""

    def __init__(self, serving: Serving, metrics: ApiMetrics, limits: Limits = Limits(),
                 tool_parser: str | None = None) -> None:
        self._serving = serving
        self._metrics = metrics
        self._limits = limits
        self._tool_parser = tool_parser

    async def models(self) -> Response:
        """GET /v1/models."""
        try:
            data = [{"id": c.id, "object": "model", "created": c.created, "owned_by": "stratamesh",
                     "max_model_len": c.max_context, "ready": c.ready, "task": c.task}
                    for c in self._serving.list_models()]
        except Exception as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": data})

    async def health(self) -> Response:
        """GET /health: 200 while the mesh serves ("ok", or "degraded": recovering from a lost agent), else 503."""
        try:
            body = self._serving.health()
        except Exception:
            log.warning("health check failed", exc_info=True)
            return JSONResponse({"status": "error"}, status_code=503)
        return JSONResponse(body, status_code=200 if body.get("status") in ("ok", "degraded") else 503)

    async def metrics(self) -> Response:
        """GET /metrics: Prometheus' text exposition (served on the event loop, where the counts change)."""
        body, content_type = self._metrics.render()
        return Response(body, media_type=content_type)

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        arrival_s = self._metrics.clock()
        try:
            req = await parse_body(request, CompletionRequest)
            card, tokenizer = self._model(req.model)
            prompt_ids = _prompt_ids(tokenizer, req.prompt)
            if req.max_tokens == 0 and not req.echo:
                raise ApiError(400, "max_tokens 0 asks for the prompt alone, which only echo returns",
                               param="max_tokens")
            echo = None if not req.echo else Echo(
                req.prompt if isinstance(req.prompt, str) else tokenizer.decode(prompt_ids), tuple(prompt_ids),
                only=req.max_tokens == 0)
            fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", req.model, req.include_usage, req.return_token_ids,
                                   _logprobs_shape(tokenizer, req.logprobs), echo)
            max_tokens = 1 if req.max_tokens == 0 else req.max_tokens      # the prompt's logprobs come with a token
            return await self._run(request, req, card, tokenizer, prompt_ids, max_tokens, fmt, arrival_s)
        except Exception as e:
            return error_response(e)

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        arrival_s = self._metrics.clock()
        try:
            req = await parse_body(request, ChatCompletionRequest)
            card, tokenizer = self._model(req.model)
            prompt_ids, tools = self._chat_prompt(req, tokenizer)
            fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", req.model, req.include_usage, req.return_token_ids,
                             _logprobs_shape(tokenizer, req.num_logprobs), tools.parsed_format if tools else None)
            return await self._run(request, req, card, tokenizer, prompt_ids, req.max_new_tokens, fmt, arrival_s,
                                   tools)
        except Exception as e:
            return error_response(e)

    async def messages(self, request: Request) -> Response:
        """POST /v1/messages: Anthropic's Messages API, on the chat path (coordinator/api/anthropic.py)."""
        try:
            return await self._on_chat_path(request, MessagesRequest, lambda asked, tools: MessagesFormat(
                f"msg_{uuid.uuid4().hex}", asked.model, tools))
        except Exception as e:
            return anthropic.error_response(e)

    async def responses(self, request: Request) -> Response:
        """POST /v1/responses: OpenAI's Responses API, on the chat path (coordinator/api/openai_responses.py)."""
        try:
            return await self._on_chat_path(request, ResponsesRequest, lambda asked, tools: ResponsesFormat(
                f"resp_{uuid.uuid4().hex}", asked.model, asked.settings(), tools))
        except Exception as e:
            return error_response(e)

    async def _on_chat_path(self, request: Request, model: type[DialectT],
                            shape: Callable[[DialectT, ToolCallFormat | None], ResponseFormat]) -> Response:
        """A request of another API (its body parsed as model) run as the chat completion it asks for (as_chat), its
        answer shaped by the format shape makes of it and of the tool-call format its output is parsed in."""
        arrival_s = self._metrics.clock()
        asked = await parse_body(request, model)
        try:
            req = asked.as_chat()
        except ValidationError as e:
            raise validation_error(e) from e
        card, tokenizer = self._model(req.model)
        prompt_ids, tools = self._chat_prompt(req, tokenizer)
        fmt = shape(asked, tools.parsed_format if tools else None)
        return await self._run(request, req, card, tokenizer, prompt_ids, req.max_new_tokens, fmt, arrival_s, tools)

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize: vLLM's count and ids of a prompt, or of a chat as the model's template renders it."""
        try:
            req = await parse_body(request, TokenizeRequest)
            card, tokenizer = self._card(req.model), self._serving.text(req.model)
            ids = (tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens) if req.prompt is not None
                   else tokenizer.encode_chat([m.model_dump(exclude_none=True) for m in req.messages],
                                              req.add_generation_prompt))
            return JSONResponse({"count": len(ids), "max_model_len": card.max_context, "tokens": ids})
        except Exception as e:
            return error_response(e)

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize: vLLM's text of token ids."""
        try:
            req = await parse_body(request, DetokenizeRequest)
            self._card(req.model)
            tokenizer = self._serving.text(req.model)
            ids = _prompt_ids(tokenizer, req.tokens, "tokens") if req.tokens else []
            return JSONResponse({"prompt": tokenizer.decode(ids, skip_special_tokens=False)})
        except Exception as e:
            return error_response(e)

    async def embeddings(self, request: Request) -> Response:
        """POST /v1/embeddings: an embedding model's vector of each input; a text-generation model gets a 400
        model_not_embedding, an unknown one a 404."""
        try:
            req = await parse_body(request, EmbeddingRequest)
            card, tokenizer = self._model(req.model, task="embed")
            prompts = [_prompt_ids(tokenizer, text_or_ids, "input") for text_or_ids in req.input]
            for prompt in prompts:
                self._check_prompt(prompt, "input")
            check_context(prompts, card.max_context)
            request_id = f"embd-{uuid.uuid4().hex}"
            vectors = await _unless_gone(request, request_id, embed_all(
                lambda ids, i: self._serving.embed(req.model, ids, f"{request_id}-{i}"), prompts))
            if vectors is None:
                return Response(status_code=499)  # nobody is listening any more
            return JSONResponse(embedding_body(req.model, vectors, sum(map(len, prompts)), req.encoding_format))
        except Exception as e:
            return error_response(e)

    def _chat_prompt(self, req: ChatCompletionRequest, tokenizer: Tokenizer) -> tuple[list[int], ToolUse | None]:
        """A chat's prompt as the model's template renders it, and what the request asks of its tools (None
        without)."""
        tools = tool_use(req.tools, req.tool_choice, req.parallel_tool_calls, tokenizer, self._tool_parser)
        messages = template_messages([m.model_dump(exclude_none=True) for m in req.messages])
        return tokenizer.encode_chat(messages, req.add_generation_prompt, req.chat_template_kwargs,
                                     tools.template_tools() if tools else None), tools

    def _model(self, model_id: str, task: str = "generate") -> tuple[ModelCard, Tokenizer]:
        """The card and tokenizer of a model that serves task and is ready (404, 400, 503 otherwise)."""
        card = self._card(model_id)
        if card.task != task:
            raise _wrong_task(card)
        if not card.ready:
            raise ModelNotReady(f"model {model_id!r} is still loading; retry shortly")
        return card, self._serving.text(model_id)

    def _card(self, model_id: str) -> ModelCard:
        for card in self._serving.list_models():
            if card.id == model_id:
                return card
        raise ModelNotFound(f"The model `{model_id}` does not exist.")

    async def _run(self, request: Request, req: GenerationRequest, card: ModelCard, tokenizer: Tokenizer,
                   prompt_ids: list[int], max_tokens: int | None, fmt: ResponseFormat, arrival_s: float,
                   tools: ToolUse | None = None) -> Response:
        if req.resume_token_ids:
            prompt_ids, max_tokens, req = _resumed(req, tokenizer, prompt_ids, max_tokens, tools)
        self._check_prompt(prompt_ids, "prompt" if isinstance(fmt, CompletionFormat) else "messages")
        cap = self._limits.max_tokens
        if cap and max_tokens is not None and max_tokens > cap:
            raise ApiError(400, f"max_tokens is {max_tokens}; this mesh allows at most {cap}", param="max_tokens",
                           code="max_tokens_over_limit")
        mesh_request = _mesh_request(req, tokenizer, prompt_ids, card.max_context, max_tokens, fmt.response_id,
                                     tools.grammar(tokenizer) if tools else "")
        stops = mesh_request.stops
        if cap and stops.max_tokens > cap:      # no max_tokens asked: the context's room, up to the cap
            mesh_request = dataclasses.replace(mesh_request, stops=dataclasses.replace(stops, max_tokens=cap))
        keep_special = tools is not None and tools.keeps_special_tokens
        choices = Choices([self._launch(choice_request(mesh_request, i), tokenizer, arrival_s, keep_special)
                           for i in range(req.num_candidates)], req.n)
        try:
            await choices.start()
            if req.stream:
                return SSEResponse(_sse_events(choices, fmt, partial(self._count_error, choices)),
                                   on_close=partial(self._close, choices))
            result = await _collect_unless_gone(request, choices)
        except Exception as e:
            raise self._failed(choices, e) from e
        except BaseException:  # cancelled: the runs are closed already, and counted as abandoned
            self._finished(choices)
            raise
        self._finished(choices)
        if result is None:
            return Response(status_code=499)  # nobody is listening any more
        return JSONResponse(fmt.whole(result, choices.usage()))

    def _check_prompt(self, prompt_ids: Sequence[int], param: str) -> None:
        cap = self._limits.max_prompt_tokens
        if cap and len(prompt_ids) > cap:
            raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; this mesh takes at most {cap}", param=param,
                           code="prompt_over_limit")

    def _launch(self, request: MeshRequest, tokenizer: Tokenizer, arrival_s: float,
                keep_special: bool = False) -> TextStream:
        """Hands the request to the origin; its run is timed from arrival_s and counted as running; keep_special:
        its text keeps the special tokens' (a tool-call marker that is one)."""
        clock = self._metrics.clock
        scheduled_s = clock()
        tokens = self._serving.generate(request)
        text = IncrementalDetokenizer(tokenizer, request.stops.strings, request.prompt_ids,
                                      skip_special_tokens=not keep_special, min_tokens=request.params.min_tokens)
        run = TextStream(request, tokens, text,
                         Timeline(arrival_s, scheduled_s), clock, observer=self._metrics)
        self._metrics.request_started(run)
        return run

    async def _close(self, choices: Choices) -> None:
        """Closes a streamed request's runs however its response ended; each counted unless it failed."""
        await choices.aclose()
        self._finished(choices)

    def _finished(self, choices: Choices) -> None:
        for run in choices.runs:
            self._metrics.request_finished(run)

    def _failed(self, choices: Choices, exc: Exception) -> ApiError:
        """The error to answer a failed request with, counted for each of its runs still going."""
        err = to_api_error(exc)
        self._count_error(choices, err)
        return err

    def _count_error(self, choices: Choices, err: ApiError) -> None:
        for run in choices.runs:
            self._metrics.request_failed(run, err.status, err.code or err.type)


async def parse_body(request: Request, model: type[RequestT]) -> RequestT:
    """The request's JSON body validated as model; a 400 ApiError naming the bad field otherwise."""
    body = await request.body()
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError(400, f"malformed JSON body: {e}") from e
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from e


def _prompt_ids(tokenizer: Tokenizer, prompt: str | list[int], param: str = "prompt") -> list[int]:
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise ApiError(400, f"the {param} is empty", param=param)
    bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise ApiError(400, f"token ids {bad[:8]} are outside the vocabulary [0, {tokenizer.vocab_size})",
                       param=param)
    return ids


def _resumed(req: GenerationRequest, tokenizer: Tokenizer, prompt_ids: list[int], max_tokens: int | None,
             tools: ToolUse | None) -> tuple[list[int], int | None, GenerationRequest]:
    """A request that goes on after the tokens it already generated (resume_token_ids): its prompt followed by them,
    max_tokens and min_tokens counting them. Sampling keyed by (seed, position) draws what it would have drawn;
    what would see them as the output's (penalties on it, a constraint's or a tool parser's state, several
    choices, echo) is refused, naming it."""
    resumed = _prompt_ids(tokenizer, req.resume_token_ids, "resume_token_ids")
    why = ("n or best_of above 1" if req.num_candidates > 1 else "echo" if getattr(req, "echo", False)
           else "tools" if tools is not None else "structured output" if grammar_of(req, tokenizer)
           else "presence or frequency penalties" if req.presence_penalty or req.frequency_penalty else "")
    if why:
        raise ApiError(400, f"resume_token_ids cannot go with {why}: the tokens resumed would not count as the "
                            "output's", param="resume_token_ids")
    if max_tokens is not None and len(resumed) >= max_tokens:
        raise ApiError(400, f"resume_token_ids holds {len(resumed)} tokens: max_tokens {max_tokens} leaves none to "
                            "generate", param="resume_token_ids")
    left = None if max_tokens is None else max_tokens - len(resumed)
    return [*prompt_ids, *resumed], left, req.model_copy(update={"min_tokens": max(req.min_tokens - len(resumed), 0)})


def _wrong_task(card: ModelCard) -> ApiError:
    """The 400 for a request the model cannot serve: embeddings of a text-generation model, or the reverse."""
    if card.task == "embed":
        return ApiError(400, f"the model {card.id!r} is an embedding model (it has no LM head) and generates no "
                             "text; use /v1/embeddings with it", param="model", code="model_not_generative")
    return ApiError(400, f"the model {card.id!r} generates text (it has an LM head) and serves no embeddings; use "
                         "/v1/completions or /v1/chat/completions with it", param="model", code="model_not_embedding")


def _mesh_request(req: GenerationRequest, tokenizer: Tokenizer, prompt_ids: Sequence[int], max_context: int,
                  max_tokens: int | None, request_id: str, tool_grammar: str = "") -> MeshRequest:
    grammar = grammar_of(req, tokenizer, tool_grammar)
    # EOS stops a constrained generation even with ignore_eos: its grammar's end is the generation's
    eos_ids = frozenset() if req.ignore_eos and not grammar else tokenizer.eos_token_ids
    stop_ids = frozenset(req.stop_token_ids or ()) | eos_ids
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_k=max(req.top_k or 0, 0), top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed,
        min_p=req.min_p or 0.0, presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=_logit_bias(req.logit_bias or {}, tokenizer.vocab_size), min_tokens=req.min_tokens,
        stop_token_ids=tuple(sorted(stop_ids)) if req.min_tokens else (), logprobs=req.num_logprobs,
        prompt_logprobs=req.num_prompt_logprobs, grammar=grammar)
    stops = Stops(_fit_context(len(prompt_ids), max_tokens, max_context), stop_ids, tuple(req.stop or ()))
    return MeshRequest(req.model, request_id, tuple(prompt_ids), params, stops)


def _logprobs_shape(tokenizer: Tokenizer, num_top: int | None) -> LogprobsShape | None:
    """How a response shows its tokens' log-probabilities; None where the request did not ask for them."""
    return None if num_top is None else LogprobsShape(tokenizer, num_top)


def _logit_bias(bias: dict[str, float], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """logit_bias as (token id, bias) pairs in id order; a 400 naming an id outside the vocabulary."""
    pairs = sorted((int(token), value) for token, value in bias.items())
    outside = [token for token, _ in pairs if token >= vocab_size]
    if outside:
        raise ApiError(400, f"logit_bias names token ids {outside[:8]} outside the vocabulary [0, {vocab_size})",
                       param="logit_bias")
    return tuple(pairs)


def _fit_context(num_prompt_tokens: int, max_tokens: int | None, max_context: int) -> int:
    """max_tokens, by default all the context the prompt leaves; a 400 if the request cannot fit."""
    room = max_context - num_prompt_tokens
    if max_tokens is None and room >= 1:
        return room
    if max_tokens is not None and max_tokens <= room:
        return max_tokens
    wanted = f"{num_prompt_tokens + (max_tokens or 1)} tokens ({num_prompt_tokens} in the prompt, " \
             f"{max_tokens or 1} for the completion)"
    raise ApiError(400, f"This model's maximum context length is {max_context} tokens. However, you requested "
                        f"{wanted}. Please reduce the prompt or max_tokens.",
                   param="max_tokens" if max_tokens else "prompt", code="context_length_exceeded")


async def _collect_unless_gone(request: Request, choices: Choices) -> list[tuple[str, str, TextStream]] | None:
    """The returned choices' whole texts and finish reasons, or None (and the runs closed) if the client disconnects
    first."""
    try:
        return await _unless_gone(request, choices.runs[0].request.request_id, choices.collect())
    finally:
        await choices.aclose()   # closed already, unless cancelled before they ran; closing twice does nothing


async def _unless_gone(request: Request, request_id: str, work: Awaitable[T]) -> T | None:
    """What work returns, or None (and work cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    try:
        while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                log.info("request %s: the client went away; its work stopped", request_id)
                return None
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _sse_events(choices: Choices, fmt: ResponseFormat,
                      on_error: Callable[[ApiError], None]) -> AsyncIterator[bytes]:
    """The SSE body of a started request, its choices' chunks interleaved as they come; a failure mid-stream goes to
    on_error and becomes an error event, then [DONE]."""
    try:
        for index, run in enumerate(choices.runs):
            for chunk in fmt.head(run, index):
                yield fmt.event(chunk)
        async for index, delta in choices.deltas():
            for chunk in fmt.pieces(delta, index):
                yield fmt.event(chunk)
            if delta.finish_reason is not None:
                fmt.finished(choices.runs[index])
        if fmt.include_usage:
            yield fmt.event(fmt.usage_chunk(choices.usage()))
        for chunk in fmt.tail():
            yield fmt.event(chunk)
    except Exception as e:
        err = to_api_error(e)
        on_error(err)
        log.warning("request %s failed mid-stream with %d: %s", choices.runs[0].request.request_id, err.status,
                    err.message)
        yield fmt.event(fmt.error_event(err))
    if fmt.done:
        yield fmt.done
