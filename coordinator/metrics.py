"""The coordinator's request metrics under vLLM's names and units, so vLLM's dashboards and routers read them."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.registry import Collector

from stratamesh.coordinator.api.generation import Clock, TextStream, Timeline
from stratamesh.coordinator.demand import DemandMeter
from stratamesh.coordinator.live_stats import LiveStats

log = logging.getLogger(__name__)

MODEL_LABELS = ("model_name", "engine")  # vLLM's labels; fleet collectors on the same registry should use them too
FINISHED_REASONS = ("stop", "length", "abort")  # vllm:request_success's finished_reason values

# vLLM's buckets (vllm/v1/metrics/buckets.py), so that quantiles over a mixed fleet line up.
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                             120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                                 10.0, 20.0, 40.0, 80.0)
MAX_TOKEN_BUCKET = 1_000_000  # vLLM caps its 1-2-5 token buckets at max_model_len; models here come and go


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value, as vLLM buckets token counts."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass(frozen=True, slots=True)
class Phases:
    """Where one request's time went, in seconds, as vLLM splits it."""

    queue_s: float      # arrival to the hand-off to the origin
    prefill_s: float    # hand-off to the first token (to the end when none came)
    decode_s: float     # first token to last token
    e2e_s: float        # arrival to the end: the last token, or the moment the request was abandoned

    @property
    def inference_s(self) -> float:
        return self.prefill_s + self.decode_s

    @classmethod
    def of(cls, timeline: Timeline) -> Phases:
        """The phases of an ended request's timeline."""
        t = timeline
        assert t.finished_s is not None, "the request has not ended"
        queue_s, e2e_s = t.scheduled_s - t.arrival_s, t.finished_s - t.arrival_s
        if t.first_token_s is None or t.last_token_s is None:  # abandoned, or failed, before any token
            return cls(queue_s, t.finished_s - t.scheduled_s, 0.0, e2e_s)
        return cls(queue_s, t.first_token_s - t.scheduled_s, t.last_token_s - t.first_token_s, e2e_s)


def time_per_output_token_s(phases: Phases, num_generation_tokens: int) -> float:
    """Mean seconds per token after the first (0 for fewer than two tokens), as vLLM reports it per request."""
    return phases.decode_s / (num_generation_tokens - 1) if num_generation_tokens > 1 else 0.0


class ApiMetrics:
    """Request, token and latency metrics of the HTTP API, on a registry of its own (several apps share a process)."""

    # Each request is reported once: request_started, on_token per token (its TextStream calls it), then
    # request_finished (stop, length or abort) or request_failed. Fleet-wide gauges (vllm:num_requests_waiting,
    # vllm:kv_cache_usage_perc) are not defined here: they come from collectors added with register().

    def __init__(self, engine: str = "0", clock: Clock = time.monotonic, wall_clock: Clock = time.time) -> None:
        self.registry = CollectorRegistry()
        self.clock = clock
        self.wall_clock = wall_clock
        self.live = LiveStats()     # the admin UI's per-second charts
        self.demand = DemandMeter()     # each model's load, for the autoscaler
        self._engine = engine
        self._running: set[str] = set()  # request ids started and not yet ended
        self._counters = _Counters(self.registry)
        self._histograms = _Histograms(self.registry)

    def register(self, collector: Collector) -> None:
        """Adds a collector to what /metrics serves; its collect() runs on the event loop at each scrape."""
        self.registry.register(collector)

    def render(self) -> tuple[bytes, str]:
        """The exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def request_started(self, run: TextStream) -> None:
        """A request was handed to the origin: it runs until request_finished or request_failed."""
        if run.request.request_id in self._running:
            log.warning("request %s was started twice; counted once", run.request.request_id)
            return
        self._running.add(run.request.request_id)
        self.live.request_started(self.wall_clock())
        self.demand.arrived(run.request.model_id, self.wall_clock())
        labels = self._labels(run)
        for reason in FINISHED_REASONS:  # every series from the start, so rate() sees the first request
            self._counters.success.labels(*labels, reason)
        self._counters.running.labels(*labels).inc()

    def on_token(self, run: TextStream, gap_s: float | None) -> None:
        """A token arrived, gap_s after the previous one (None: the first, which ends the prefill)."""
        labels = self._labels(run)
        self._counters.generation_tokens.labels(*labels).inc()
        if gap_s is not None:
            self._histograms.inter_token_latency.labels(*labels).observe(gap_s)
            self.live.token(self.wall_clock(), gap_s)
            self.demand.token(run.request.model_id, self.wall_clock(), gap_s)
            return
        timeline, num_prompt_tokens = run.timeline, len(run.request.prompt_ids)
        assert timeline.first_token_s is not None
        self.live.first_token(self.wall_clock(), timeline.first_token_s - timeline.arrival_s)
        self.demand.first_token(run.request.model_id, self.wall_clock(), timeline.first_token_s - timeline.arrival_s)
        self._histograms.time_to_first_token.labels(*labels).observe(timeline.first_token_s - timeline.arrival_s)
        self._counters.prompt_tokens.labels(*labels).inc(num_prompt_tokens)
        self._counters.prefix_cache_queries.labels(*labels).inc(num_prompt_tokens)
        self._counters.prefix_cache_hits.labels(*labels).inc(run.cached_tokens)

    def request_finished(self, run: TextStream) -> None:
        """A request ended without an error: at a stop condition, or abandoned ("abort") before one."""
        if not self._end(run):
            return
        labels = self._labels(run)
        self._counters.success.labels(*labels, run.finish_reason or "abort").inc()
        self._histograms.observe_request(labels, run)

    def request_failed(self, run: TextStream, status: int, reason: str) -> None:
        """A request ended in an error after it was accepted; status and reason are what the client was told."""
        if self._end(run):
            self._counters.errors.labels(run.request.model_id, str(status), reason).inc()

    def _end(self, run: TextStream) -> bool:
        """Marks run ended; False if it already was (or never started), so that nothing is counted twice."""
        if run.request.request_id not in self._running:
            return False
        self._running.discard(run.request.request_id)
        self.live.request_ended(self.wall_clock(), had_first_token=run.timeline.first_token_s is not None)
        self.demand.ended(run.request.model_id, run.num_completion_tokens, run.timeline.first_token_s is not None)
        labels = self._labels(run)
        self._counters.running.labels(*labels).dec()
        self._counters.preemptions.labels(*labels).inc(run.num_preemptions)
        return True

    def _labels(self, run: TextStream) -> tuple[str, str]:
        return run.request.model_id, self._engine


class _Counters:
    """The counters and the running gauge."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, MODEL_LABELS + extra, registry=registry)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of requests that reached a first token.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated, stop tokens included.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the mesh's prefix caches.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens the mesh's prefix caches served.")
        self.preemptions = counter("vllm:num_preemptions", "Times the mesh preempted a request and replayed it.")
        self.success = counter("vllm:request_success", "Requests that ended without an error, by finish reason.",
                               ("finished_reason",))
        self.errors = Counter("stratamesh:request_errors",
                              "Requests that ended in an error after they were accepted, by HTTP status and code.",
                              ("model_name", "status", "reason"), registry=registry)
        self.running = Gauge("vllm:num_requests_running", "Generations in progress through this API.",
                             MODEL_LABELS, registry=registry)


class _Histograms:
    """The per-token and per-request histograms."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, MODEL_LABELS, buckets=buckets, registry=registry)

        latency, tokens = REQUEST_LATENCY_BUCKETS_S, one_two_five_buckets(MAX_TOKEN_BUCKET)
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Seconds from a request's arrival to its first token.",
                                             TIME_TO_FIRST_TOKEN_BUCKETS_S)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Seconds between consecutive tokens of a request.",
                                             INTER_TOKEN_LATENCY_BUCKETS_S)
        self.time_per_output_token = histogram("vllm:request_time_per_output_token_seconds",
                                               "Mean seconds per token after the first, per request.",
                                               INTER_TOKEN_LATENCY_BUCKETS_S)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Seconds from arrival to the end.", latency)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Seconds from arrival to the hand-off to the mesh.", latency)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Seconds from the hand-off to the mesh to the first token.", latency)
        self.decode = histogram("vllm:request_decode_time_seconds", "Seconds from the first token to the last.",
                                latency)
        self.inference = histogram("vllm:request_inference_time_seconds", "Prefill plus decode seconds.", latency)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Generated tokens per request.", tokens)

    def observe_request(self, labels: tuple[str, str], run: TextStream) -> None:
        """Observes an ended request once in each per-request histogram."""
        phases, num_tokens = Phases.of(run.timeline), run.num_completion_tokens
        for histogram, value in ((self.e2e, phases.e2e_s), (self.queue, phases.queue_s),
                                 (self.prefill, phases.prefill_s), (self.decode, phases.decode_s),
                                 (self.inference, phases.inference_s),
                                 (self.time_per_output_token, time_per_output_token_s(phases, num_tokens)),
                                 (self.prompt_tokens, len(run.request.prompt_ids)),
                                 (self.generation_tokens, num_tokens)):
            histogram.labels(*labels).observe(value)
