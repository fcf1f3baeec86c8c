"""/metrics on the coordinator: vLLM's families and units, exact counts after requests, phases from a test clock."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from stratamesh.coordinator.api.generation import TextStream, Timeline
from stratamesh.coordinator.api.openai import create_app
from stratamesh.coordinator.metrics import ApiMetrics, Phases, one_two_five_buckets
from stratamesh.coordinator.serving.request import Request, Stops
from stratamesh.coordinator.text import IncrementalDetokenizer, Tokenizer
from stratamesh.fleet.sessions import SamplingParams
from tests.coordinator.served import served
from tests.coordinator.test_api import CHAT, FAIL_AFTER, FakeServing, chat_tokenizers, sse_events  # noqa: F401  (a fixture)

TINY = {"model_name": "tiny", "engine": "0"}
CACHED_TOKENS = 3     # what MeshLikeServing's streams say the prefix caches served
NUM_PREEMPTIONS = 1   # ... and how often they say each generation was preempted

COUNTERS = ["vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:prefix_cache_queries",
            "vllm:prefix_cache_hits", "vllm:num_preemptions", "stratamesh:request_errors"]
PER_REQUEST_HISTOGRAMS = ["vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                          "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                          "vllm:request_inference_time_seconds", "vllm:request_time_per_output_token_seconds",
                          "vllm:request_prompt_tokens", "vllm:request_generation_tokens"]
HISTOGRAMS = ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", *PER_REQUEST_HISTOGRAMS]
EXPECTED_TYPES = {**{n: "counter" for n in COUNTERS}, **{n: "histogram" for n in HISTOGRAMS},
                  "vllm:num_requests_running": "gauge"}


class Reported:
    """A token stream that says what the origin's Generation says: cached prompt tokens and preemptions."""

    def __init__(self, tokens: AsyncIterator[int]) -> None:
        self.cached_tokens, self.num_preemptions = CACHED_TOKENS, NUM_PREEMPTIONS
        self._tokens = tokens

    def __aiter__(self) -> Reported:
        return self

    async def __anext__(self) -> int:
        return await anext(self._tokens)

    async def aclose(self) -> None:
        await self._tokens.aclose()  # type: ignore[attr-defined]


class MeshLikeServing(FakeServing):
    """FakeServing whose streams report cached tokens and preemptions, as the mesh's do."""

    def generate(self, request: Request) -> AsyncIterator[int]:
        return Reported(super().generate(request))


class Scrape:
    """One /metrics exposition, parsed with prometheus_client's own parser."""

    def __init__(self, text: str) -> None:
        self.families: dict[str, Metric] = {f.name: f for f in text_string_to_metric_families(text)}

    def value(self, sample: str, **labels: str) -> float:
        """The sample's value (0 when absent, as Prometheus treats a series that was never incremented)."""
        found = [s.value for f in self.families.values() for s in f.samples if s.name == sample and s.labels == labels]
        assert len(found) <= 1, found
        return found[0] if found else 0.0

    def samples(self, family: str) -> list[Any]:
        return [s for s in self.families[family].samples if not s.name.endswith("_created")]


@pytest.fixture
def gen(chat_tokenizers: tuple[Tokenizer, Tokenizer]) -> MeshLikeServing:
    return MeshLikeServing(*chat_tokenizers)


@pytest.fixture
async def client(gen: MeshLikeServing) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(gen, ApiMetrics()))
    async with httpx.AsyncClient(transport=transport, base_url="http://mesh") as c:
        yield c


async def scrape(client: httpx.AsyncClient) -> Scrape:
    resp = await client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return Scrape(resp.text)


async def test_families_and_counts_after_a_completion_and_a_streamed_chat(client: httpx.AsyncClient) -> None:
    whole = (await client.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 12})).json()
    chunks = sse_events(await client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": CHAT, "max_tokens": 20, "stream": True,
        "stream_options": {"include_usage": True}}))
    usages = [whole["usage"], chunks[-1]["usage"]]
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [CACHED_TOKENS] * 2
    m = await scrape(client)

    assert {name: m.families[name].type for name in EXPECTED_TYPES} == EXPECTED_TYPES
    num_prompt, num_generated = (sum(u[key] for u in usages) for key in ("prompt_tokens", "completion_tokens"))
    assert num_generated == 32
    assert m.value("vllm:generation_tokens_total", **TINY) == num_generated
    assert m.value("vllm:prompt_tokens_total", **TINY) == num_prompt
    assert m.value("vllm:prefix_cache_queries_total", **TINY) == num_prompt
    assert m.value("vllm:prefix_cache_hits_total", **TINY) == 2 * CACHED_TOKENS
    assert m.value("vllm:num_preemptions_total", **TINY) == 2 * NUM_PREEMPTIONS
    assert [m.value("vllm:request_success_total", **TINY, finished_reason=r) for r in ("stop", "length", "abort")] \
        == [0, 2, 0]
    assert m.value("vllm:num_requests_running", **TINY) == 0
    assert m.samples("stratamesh:request_errors") == []
    for name in PER_REQUEST_HISTOGRAMS:
        assert m.value(f"{name}_count", **TINY) == 2, name
    assert m.value("vllm:time_to_first_token_seconds_count", **TINY) == 2
    assert m.value("vllm:inter_token_latency_seconds_count", **TINY) == (12 - 1) + (20 - 1)
    assert m.value("vllm:request_generation_tokens_sum", **TINY) == num_generated
    queue_and_inference_s = sum(m.value(f"vllm:request_{phase}_time_seconds_sum", **TINY)
                                for phase in ("queue", "inference"))
    assert m.value("vllm:e2e_request_latency_seconds_sum", **TINY) == pytest.approx(queue_and_inference_s)
    assert m.value("vllm:request_prompt_tokens_sum", **TINY) == num_prompt
    assert m.value("vllm:request_generation_tokens_bucket", **TINY, le="10.0") == 0  # 12 and 20 tokens
    assert m.value("vllm:request_generation_tokens_bucket", **TINY, le="20.0") == 2


async def test_stop_reason_and_running_gauge(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/completions", json={"model": "tiny-eos", "prompt": "x"})
    assert resp.json()["choices"][0]["finish_reason"] == "stop"
    m = await scrape(client)
    labels = {"model_name": "tiny-eos", "engine": "0"}
    assert m.value("vllm:request_success_total", **labels, finished_reason="stop") == 1
    assert m.value("vllm:generation_tokens_total", **labels) == resp.json()["usage"]["completion_tokens"]
    assert m.value("vllm:num_requests_running", **labels) == 0


async def test_failures_after_acceptance_are_errors_not_successes(client: httpx.AsyncClient) -> None:
    for model, stream in (("flaky", True), ("flaky", False), ("broken", True), ("crashy", True)):
        await client.post("/v1/completions", json={"model": model, "prompt": "x", "stream": stream})
    await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1})  # rejected: 400
    await client.post("/v1/completions", json={"model": "warming", "prompt": "x"})                 # rejected: 503
    m = await scrape(client)

    errors = {(s.labels["model_name"], s.labels["status"], s.labels["reason"]): s.value
              for s in m.samples("stratamesh:request_errors")}
    assert errors == {("flaky", "502", "stage_failed"): 2, ("broken", "502", "stage_failed"): 1,
                      ("crashy", "500", "internal_error"): 1}
    assert sum(s.value for s in m.samples("vllm:request_success")) == 0
    for model in ("flaky", "broken", "crashy"):
        labels = {"model_name": model, "engine": "0"}
        assert m.value("vllm:num_requests_running", **labels) == 0
        assert m.value("vllm:e2e_request_latency_seconds_count", **labels) == 0
        assert m.value("vllm:num_preemptions_total", **labels) == (2 if model == "flaky" else 1) * NUM_PREEMPTIONS
    # The tokens that did arrive before each failure were generated, and counted once.
    assert m.value("vllm:generation_tokens_total", model_name="flaky", engine="0") == 2 * FAIL_AFTER
    assert m.value("vllm:time_to_first_token_seconds_count", model_name="broken", engine="0") == 0


@pytest.fixture
async def live(gen: MeshLikeServing) -> AsyncIterator[httpx.AsyncClient]:
    """The app behind a real uvicorn on a loopback port, so that a client can really leave."""
    async with served(create_app(gen, ApiMetrics())) as url, httpx.AsyncClient(base_url=url) as c:
        yield c


async def scrape_until(client: httpx.AsyncClient, sample: str, value: float, timeout_s: float = 5.0,
                       **labels: str) -> Scrape:
    """Scrapes until sample reaches value: the server notices a client leaving in its own time."""
    deadline = time.monotonic() + timeout_s
    while (m := await scrape(client)).value(sample, **labels) != value and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return m


async def test_clients_that_leave_are_aborts(live: httpx.AsyncClient, gen: MeshLikeServing) -> None:
    gen.token_delay_s = 0.02  # a whole 512-token context would take 10 s
    async with live.stream("POST", "/v1/chat/completions", json={
            "model": "tiny", "messages": CHAT, "stream": True}) as resp:
        async for _ in resp.aiter_lines():
            break
    with pytest.raises(httpx.ReadTimeout):
        await live.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=0.3)
    m = await scrape_until(live, "vllm:request_success_total", 2, **TINY, finished_reason="abort")

    assert m.value("vllm:request_success_total", **TINY, finished_reason="abort") == 2
    assert m.value("vllm:num_requests_running", **TINY) == 0
    assert m.value("vllm:e2e_request_latency_seconds_count", **TINY) == 2
    # Each token counted once: live, as it arrived, and in the request's total when it ended.
    assert m.value("vllm:generation_tokens_total", **TINY) == m.value("vllm:request_generation_tokens_sum", **TINY)
    assert m.value("vllm:generation_tokens_total", **TINY) >= 2


async def test_every_app_has_its_own_registry(chat_tokenizers: tuple[Tokenizer, Tokenizer]) -> None:
    apps = [create_app(FakeServing(*chat_tokenizers)) for _ in range(2)]  # the global registry would refuse the second
    for app in apps:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mesh") as c:
            m = await scrape(c)
        assert set(EXPECTED_TYPES) <= set(m.families) and m.samples("vllm:generation_tokens") == []


class FleetCollector:
    """A collector like the daemon's fleet gauges: what register() is for."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests queued on stages.", labels=["model_name"])
        waiting.add_metric(["tiny"], 4)
        yield waiting


def test_registered_collectors_are_served() -> None:
    metrics = ApiMetrics()
    metrics.register(FleetCollector())
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    assert Scrape(body.decode()).value("vllm:num_requests_waiting", model_name="tiny") == 4


class ManualClock:
    """A clock the test sets."""

    def __init__(self, now_s: float) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


class TimedTokens:
    """A token stream that moves the test's clock to each token's arrival time before handing the token out."""

    def __init__(self, clock: ManualClock, arrivals: list[tuple[float, int]]) -> None:
        self._clock, self._arrivals = clock, list(arrivals)
        self.closed = False

    def __aiter__(self) -> TimedTokens:
        return self

    async def __anext__(self) -> int:
        if not self._arrivals:
            raise StopAsyncIteration
        self._clock.now_s, token = self._arrivals.pop(0)
        return token

    async def aclose(self) -> None:
        self.closed = True


def timed_run(tokenizer: Tokenizer, metrics: ApiMetrics, clock: ManualClock, arrival_times_s: list[float],
              max_tokens: int) -> TextStream:
    """A run of request "r" for model "m" that arrived at 100.0 and was handed to the mesh at 100.25."""
    story = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    request = Request("m", "r", prompt_ids=(5, 6, 7), params=SamplingParams(), stops=Stops(max_tokens))
    tokens = TimedTokens(clock, list(zip(arrival_times_s, story, strict=False)))
    return TextStream(request, tokens, IncrementalDetokenizer(tokenizer, (), request.prompt_ids), Timeline(100.0, 100.25),
                         clock, observer=metrics)


def sample(metrics: ApiMetrics, name: str, **extra: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "m", "engine": "0", **extra})


async def test_phases_come_from_the_run_clock(chat_tokenizers: tuple[Tokenizer, Tokenizer]) -> None:
    clock = ManualClock(100.25)
    metrics = ApiMetrics(clock=clock)
    run = timed_run(chat_tokenizers[0], metrics, clock, [101.0, 101.5, 102.25, 103.0], max_tokens=4)
    metrics.request_started(run)
    assert sample(metrics, "vllm:num_requests_running") == 1
    await run.start()
    assert sample(metrics, "vllm:time_to_first_token_seconds_sum") == 1.0  # observed at the first token
    assert (await run.collect())[1] == "length"
    metrics.request_finished(run)

    expected = {"vllm:request_queue_time_seconds_sum": 0.25, "vllm:request_prefill_time_seconds_sum": 0.75,
                "vllm:request_decode_time_seconds_sum": 2.0, "vllm:request_inference_time_seconds_sum": 2.75,
                "vllm:e2e_request_latency_seconds_sum": 3.0, "vllm:time_to_first_token_seconds_sum": 1.0,
                "vllm:inter_token_latency_seconds_sum": 2.0, "vllm:inter_token_latency_seconds_count": 3,
                "vllm:request_time_per_output_token_seconds_sum": pytest.approx(2.0 / 3),
                "vllm:generation_tokens_total": 4, "vllm:prompt_tokens_total": 3,
                "vllm:num_requests_running": 0}
    assert {name: sample(metrics, name) for name in expected} == expected
    assert sample(metrics, "vllm:request_success_total", finished_reason="length") == 1
    assert sample(metrics, "vllm:time_to_first_token_seconds_bucket", le="0.75") == 0
    assert sample(metrics, "vllm:time_to_first_token_seconds_bucket", le="1.0") == 1


async def test_abandoned_run_ends_when_closed_and_counts_once(chat_tokenizers: tuple[Tokenizer, Tokenizer]) -> None:
    clock = ManualClock(100.25)
    metrics = ApiMetrics(clock=clock)
    run = timed_run(chat_tokenizers[0], metrics, clock, [101.0, 101.5, 102.0], max_tokens=10)
    metrics.request_started(run)
    await run.start()
    deltas = run.deltas()
    await anext(deltas)       # the client reads a little ...
    clock.now_s = 103.0
    await deltas.aclose()     # ... and leaves
    clock.now_s = 104.0
    metrics.request_finished(run)
    metrics.request_finished(run)
    metrics.request_failed(run, 502, "stage_failed")

    assert sample(metrics, "vllm:request_success_total", finished_reason="abort") == 1
    assert sample(metrics, "vllm:e2e_request_latency_seconds_count") == 1
    assert sample(metrics, "vllm:e2e_request_latency_seconds_sum") == 3.0  # arrival to the close
    assert sample(metrics, "vllm:num_requests_running") == 0
    assert metrics.registry.get_sample_value("stratamesh:request_errors_total",
                                             {"model_name": "m", "status": "502", "reason": "stage_failed"}) is None


@pytest.mark.parametrize(("timeline", "phases"), [
    (Timeline(10.0, 10.5, 11.0, 14.0, 14.0), Phases(queue_s=0.5, prefill_s=0.5, decode_s=3.0, e2e_s=4.0)),
    (Timeline(10.0, 10.5, 11.0, 11.0, 11.0), Phases(queue_s=0.5, prefill_s=0.5, decode_s=0.0, e2e_s=1.0)),
    (Timeline(10.0, 10.5, 11.0, 12.0, 20.0), Phases(queue_s=0.5, prefill_s=0.5, decode_s=1.0, e2e_s=10.0)),
    (Timeline(10.0, 10.5, None, None, 13.0), Phases(queue_s=0.5, prefill_s=2.5, decode_s=0.0, e2e_s=3.0)),
])
def test_phases(timeline: Timeline, phases: Phases) -> None:
    assert Phases.of(timeline) == phases
    assert Phases.of(timeline).inference_s == phases.prefill_s + phases.decode_s


def test_token_buckets_are_vllms_one_two_five_series() -> None:
    assert one_two_five_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert one_two_five_buckets(4096)[-1] == 2000
