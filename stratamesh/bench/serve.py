"""`stratamesh bench serve`: streams completions of token-id prompts at a server and reports like vLLM."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx

from stratamesh.bench.datasets import (
    BenchRequest,
    make_requests,
    random_requests,
    regular_token_ids,
)
from stratamesh.bench.metrics import (
    BenchError,
    BenchMetrics,
    RequestRecord,
    compute_metrics,
)
from stratamesh.bench.options import RateSchedule, ServeOptions
from stratamesh.bench.report import format_json, format_report


@dataclass(frozen=True, slots=True)
class Chunk:
    """What one server-sent event says: tokens it carries, usage, or an error."""

    num_tokens: int = 0
    has_token_ids: bool = False
    usage: dict[str, Any] | None = None
    error: str = ""


def arrival_offsets_s(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times from the start: the first at 0, then exponential gaps of mean 1/rate (inf: all at 0)."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng, offsets, now = random.Random(seed), [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


def scheduled_offsets_s(schedule: RateSchedule, seed: int) -> list[float]:
    """Send times from the start of a rate schedule: Poisson arrivals at each step's rate through its seconds."""
    rng, offsets, begin = random.Random(seed), [], 0.0
    for rate, seconds in schedule:
        now = begin + (rng.expovariate(rate) if rate > 0 else seconds)
        while now < begin + seconds:
            offsets.append(now)
            now += rng.expovariate(rate)
        begin += seconds
    return offsets


def auth_headers(api_key: str) -> dict[str, str]:
    """The bearer header that carries api_key; none for an empty key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def request_body(model: str, request: BenchRequest) -> dict[str, Any]:
    """The /v1/completions body: token-id prompt, exact length, greedy, streamed with token ids."""
    return {"model": model, "prompt": list(request.prompt_ids), "max_tokens": request.output_len,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}


def parse_sse_line(line: str) -> Chunk | None:
    """One line of an SSE stream; None for anything that is not a JSON data event."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if not payload or payload == "[DONE]":
        return None
    try:
        data = json.loads(payload)
    except ValueError:
        return Chunk(error=f"bad event: {payload[:100]}")
    if "error" in data:
        return Chunk(error=str(data["error"])[:200])
    choices = data.get("choices") or []
    choice = choices[0] if choices else {}
    if "token_ids" in choice:
        return Chunk(len(choice["token_ids"] or ()), True, data.get("usage"))
    return Chunk(1 if choice.get("text") else 0, False, data.get("usage"))


def record_from_stream(prompt_len: int, start_s: float, events: list[tuple[float, str]]) -> RequestRecord:
    """A request's record from its (arrival time, SSE line) pairs, as vLLM times a stream."""
    token_times, num_tokens, saw_ids, usage = [], 0, False, {}
    for now, line in events:
        chunk = parse_sse_line(line)
        if chunk is None:
            continue
        if chunk.error:
            return RequestRecord(False, prompt_len, error=chunk.error)
        usage = chunk.usage or usage
        saw_ids |= chunk.has_token_ids
        if chunk.num_tokens:
            token_times.append(now)
            num_tokens += chunk.num_tokens
    if not token_times:
        return RequestRecord(False, prompt_len, error="no chunk carried a token")
    if not saw_ids:   # the server ignored return_token_ids: trust its usage, else count chunks
        num_tokens = usage.get("completion_tokens") or len(token_times)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    gaps = tuple(b - a for a, b in itertools.pairwise(token_times))
    return RequestRecord(True, prompt_len, num_tokens, token_times[0] - start_s, token_times[-1] - start_s,
                         gaps, cached)


async def send_request(client: httpx.AsyncClient, url: str, model: str, request: BenchRequest) -> RequestRecord:
    """Streams one completion; a failure becomes a failed record, never an exception."""
    events: list[tuple[float, str]] = []
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=request_body(model, request)) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return RequestRecord(False, request.prompt_len, error=f"HTTP {response.status_code}: {text[:200]}")
            async for line in response.aiter_lines():
                events.append((time.perf_counter(), line))
    except httpx.HTTPError as exc:
        return RequestRecord(False, request.prompt_len, error=f"{type(exc).__name__}: {exc}")
    return record_from_stream(request.prompt_len, start, events)


async def run_requests(url: str, model: str, requests: list[BenchRequest], request_rate: float,
                       max_concurrency: int | None, seed: int, timeout_s: float = 600.0, api_key: str = "",
                       offsets: Sequence[float] | None = None) -> tuple[list[RequestRecord], float]:
    """Sends requests on a Poisson schedule (or at offsets, seconds from the start, one per request), at most
    max_concurrency in flight; (records, duration_s)."""
    offsets = arrival_offsets_s(len(requests), request_rate, seed) if offsets is None else offsets
    in_flight = asyncio.Semaphore(max_concurrency or len(requests))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=auth_headers(api_key)) as client:
        start = time.perf_counter()

        async def one(offset_s: float, request: BenchRequest) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + offset_s - time.perf_counter()))
            async with in_flight:
                return await send_request(client, url, model, request)

        records = await asyncio.gather(*(one(o, r) for o, r in zip(offsets, requests)))
        return list(records), time.perf_counter() - start


def first_model(url: str, api_key: str = "") -> str:
    """The id of the first model the server lists at /v1/models."""
    try:
        response = httpx.get(f"{url}/v1/models", headers=auth_headers(api_key), timeout=30)
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot list the models at {url}: {exc}") from None
    if response.status_code == 401:
        raise BenchError(f"{url}/v1/models answered 401: give the server's API key with "
                         "--api-key or $STRATAMESH_API_KEY")
    if response.status_code != 200:
        raise BenchError(f"cannot list the models at {url}: HTTP {response.status_code}: {response.text[:200]}")
    models = response.json().get("data") or []
    if not models:
        raise BenchError(f"{url}/v1/models lists no model")
    return models[0]["id"]


def build_requests(options: ServeOptions) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(warm-up, measured) requests; warm-ups are random prompts so they never warm a shared prefix."""
    vocab = regular_token_ids(options.tokenizer) if options.tokenizer else list(range(options.vocab_size or 0))
    measured = make_requests(options.dataset, vocab, options.num_prompts, options.input_len, options.output_len,
                             options.seed, options.prefix_len, options.range_ratio, options.num_prefixes)
    warmup = random_requests(vocab, options.warmup, options.input_len, options.output_len, options.seed + 1)
    return warmup, measured


def speculation_counts(url: str, api_key: str, model: str) -> tuple[int, int] | None:
    """(drafted, kept) tokens of the model's speculative decoding so far, as GET /admin/api/models says (an
    operator's key); None where this key may not read it."""
    try:
        response = httpx.get(f"{url}/admin/api/models", headers=auth_headers(api_key), timeout=30)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    for m in response.json().get("models", []):
        if m.get("model_id") == model:
            spec = m.get("speculation") or {}
            return int(spec.get("draft_tokens", 0)), int(spec.get("accepted_tokens", 0))
    return None


def settled_speculation_counts(url: str, api_key: str, model: str, reads: int = 5) -> tuple[int, int] | None:
    """speculation_counts once two reads a second apart agree (they come with the agents' heartbeats), or after
    `reads` reads."""
    last = speculation_counts(url, api_key, model)
    for _ in range(reads - 1):
        if last is None:
            return None
        time.sleep(1.0)
        now = speculation_counts(url, api_key, model)
        if now == last:
            return now
        last = now
    return last


def bench_serve(options: ServeOptions, measuring: Callable[[], None] | None = None
                ) -> tuple[BenchMetrics, list[RequestRecord]]:
    """Runs the warm-up, then (measuring() called between) the measured requests; (metrics, each measured request's
    record)."""
    if not options.model:
        options = replace(options, model=first_model(options.url, options.api_key))
    offsets = scheduled_offsets_s(options.rate_schedule, options.seed) if options.rate_schedule else None
    if offsets is not None:
        if not offsets:
            raise BenchError("--rate-schedule makes no request")
        options = replace(options, num_prompts=len(offsets))
    warmup, measured = build_requests(options)
    if warmup:
        asyncio.run(run_requests(options.url, options.model, warmup, math.inf, options.max_concurrency,
                                 options.seed, options.timeout_s, options.api_key))
    if measuring is not None:
        measuring()
    records, duration_s = asyncio.run(run_requests(
        options.url, options.model, measured, options.request_rate, options.max_concurrency, options.seed,
        options.timeout_s, options.api_key, offsets))
    return compute_metrics(records, duration_s, options.goodput_ms or None), records


def main(options: ServeOptions, as_json: bool) -> None:
    """The `bench serve` command: runs the benchmark, prints the table (or JSON); exit 1 if nothing completed."""
    logging.getLogger("httpx").setLevel(logging.WARNING)   # it logs every request at info
    if not options.model:
        options = replace(options, model=first_model(options.url, options.api_key))
    before: list[tuple[int, int] | None] = []
    metrics, records = bench_serve(options, lambda: before.append(
        settled_speculation_counts(options.url, options.api_key, options.model)))
    after = settled_speculation_counts(options.url, options.api_key, options.model) if before[0] else None
    drafts = None if after is None else (after[0] - before[0][0], after[1] - before[0][1])
    print(format_json(metrics, options, records, drafts) if as_json else format_report(metrics, options, drafts),
          flush=True)
    if metrics.completed == 0:
        raise SystemExit(1)
