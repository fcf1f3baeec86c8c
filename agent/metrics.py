"""The agent's Prometheus metrics: vLLM's names where vLLM has one, stratamesh's own per stage and per hop."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from stratamesh.fleet.boxes import Telemetry
from stratamesh.fleet.stages import StageSpec

log = logging.getLogger(__name__)

STAGE_LABELS = ("model_name", "stage")
# Seconds: from a tenth of a millisecond (a decode step of a small stage) to tens of seconds (a long prefill).
STEP_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                  5.0, 10.0, 30.0)
BATCH_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
IMBALANCE_BUCKETS = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 8.0, 16.0, 64.0)


def stage_labels(spec: StageSpec) -> tuple[str, str]:
    """(model_name, stage) labels of a stage: the stage is its layer range, "0-12"."""
    return spec.model_id, f"{spec.start_layer}-{spec.end_layer}"


class AgentMetrics:
    """Every metric one agent exports, on a registry of its own (several agents may share a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.compute_s = Histogram("stratamesh:stage_compute_seconds", "Forward pass time of one stage step.",
                                   STAGE_LABELS, buckets=STEP_BUCKETS_S, registry=r)
        self.queue_s = Histogram("stratamesh:stage_queue_seconds",
                                 "Time a chunk waited at a stage between arriving and its first computation.",
                                 STAGE_LABELS, buckets=STEP_BUCKETS_S, registry=r)
        self.hop_s = Histogram("stratamesh:hop_transfer_seconds",
                               "Time from the previous hop finishing a step to its message arriving at this stage.",
                               STAGE_LABELS, buckets=STEP_BUCKETS_S, registry=r)
        self.batch_tokens = Histogram("stratamesh:stage_batch_tokens", "Tokens in one stage step.", STAGE_LABELS,
                                      buckets=BATCH_TOKEN_BUCKETS, registry=r)
        self.tokens = Counter("stratamesh:stage_tokens", "Tokens run through a stage's layers.", STAGE_LABELS,
                              registry=r)
        self.prefill_tokens = Counter("stratamesh:stage_prefill_tokens",
                                      "Tokens of prompts (and of replayed histories) run through a stage's layers.",
                                      STAGE_LABELS, registry=r)
        self.kv_sessions = Counter("stratamesh:kv_migrated_sessions",
                                   "Sessions whose KV moved to (export) or from (import) another stage.",
                                   ("direction",), registry=r)
        self.kv_bytes = Counter("stratamesh:kv_migrated_bytes", "Bytes of KV moved to or from another stage.",
                                ("direction",), registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Sessions preempted for want of KV blocks.",
                                   STAGE_LABELS, registry=r)
        # vLLM's speculative decoding counters (a last stage's verifications; vllm: appends _total)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Decode steps that carried drafted tokens.",
                                   STAGE_LABELS, registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Drafted tokens verified.",
                                         STAGE_LABELS, registry=r)
        self.spec_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens",
                                            "Drafted tokens the model agreed with (kept).", STAGE_LABELS, registry=r)
        # runs a last stage sent into the pipeline behind an unverified one (keeping the ring full), and of those,
        # the ones verified (the others were dropped where they had got to)
        self.spec_follow_runs = Counter("stratamesh:spec_decode_follow_runs", "Runs of drafted tokens sent following "
                                        "an unverified one.", STAGE_LABELS, registry=r)
        self.spec_follow_runs_verified = Counter("stratamesh:spec_decode_follow_runs_verified", "Runs that followed "
                                                 "an unverified one and were verified.", STAGE_LABELS, registry=r)
        # a mixture of experts' stage: where its routers send tokens
        self.expert_tokens = Counter("stratamesh:expert_tokens", "Tokens a stage's routers sent to each expert, over "
                                     "its sparse layers.", (*STAGE_LABELS, "expert"), registry=r)
        self.expert_imbalance = Histogram("stratamesh:expert_step_imbalance",
                                          "Per step of a mixture-of-experts stage: the most tokens an expert got "
                                          "over the mean per expert, in its most uneven layer (1: even).",
                                          STAGE_LABELS, buckets=IMBALANCE_BUCKETS, registry=r)
        self.sent_bytes = Counter("stratamesh:hop_transfer_bytes", "Bytes this agent sent to the next hop.",
                                  ("peer",), registry=r)
        self.sent_messages = Counter("stratamesh:hop_messages", "Messages this agent sent to the next hop.",
                                     ("peer",), registry=r)
        self.activation_bytes = Counter("stratamesh:link_activation_bytes",
                                        "Bytes of activations this agent sent to a next stage, by the codec of the "
                                        "link (float32, float16, bfloat16: raw in that dtype; int8: per-token).",
                                        ("peer", "codec"), registry=r)
        self.transport_messages = Counter("stratamesh:transport_messages",
                                          "Data-plane messages this agent sent to or received from a peer, by "
                                          "transport (grpc: a stream it dialed or took; webrtc: a data channel, to "
                                          "or from a peer behind NAT).", ("peer", "transport", "direction"),
                                          registry=r)
        self.load = LoadCollector()
        r.register(self.load)

    def serve(self, host: str, port: int = 0) -> tuple[object, int]:
        """Serves /metrics on host:port (0 picks a free port) from a thread; returns the server and its port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server, server.server_port


@dataclass(frozen=True, slots=True)
class _Snapshot:
    telemetry: Telemetry
    labels: dict[str, tuple[str, str]]     # assignment id -> (model_name, stage)


class LoadCollector(Collector):
    """Gauges and cumulative counters read from the agent's newest telemetry when Prometheus scrapes."""

    def __init__(self) -> None:
        self._snapshot: _Snapshot | None = None

    def update(self, telemetry: Telemetry, labels: dict[str, tuple[str, str]]) -> None:
        """Called on the event loop after each sample; a scrape (another thread) reads it whole."""
        self._snapshot = _Snapshot(telemetry, labels)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snapshot = self._snapshot
        stages = snapshot.telemetry.stages if snapshot else ()
        labels = snapshot.labels if snapshot else {}

        def family(kind, name, doc, value_of):
            metric = kind(name, doc, labels=STAGE_LABELS)
            for stage in stages:
                metric.add_metric(labels.get(stage.assignment_id, ("", stage.assignment_id)), value_of(stage))
            return metric

        yield family(GaugeMetricFamily, "vllm:num_requests_running", "Sessions holding KV blocks on a stage.",
                     lambda s: s.num_running)
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting", "Sessions with work queued on a stage.",
                     lambda s: s.num_waiting)
        yield family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage of a stage. 1 means 100 percent.",
                     lambda s: s.kv_usage)
        yield family(CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     lambda s: s.prefix_query_tokens)
        yield family(CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                     lambda s: s.prefix_hit_tokens)
        yield family(GaugeMetricFamily, "stratamesh:stage_decode_step_seconds",
                     "A stage's recent decode steps' time (a moving average).", lambda s: s.decode_step_s)
        yield family(GaugeMetricFamily, "stratamesh:stage_decode_roofline",
                     "A stage's recent decode steps' bandwidth roofline (weights and KV read at the box's streaming "
                     "read bandwidth) over their time: 1 means at the memory's speed.", lambda s: s.decode_roofline)
        yield from _agent_gauges(snapshot.telemetry if snapshot else None)


def _agent_gauges(telemetry: Telemetry | None) -> Iterator[GaugeMetricFamily]:
    queue = GaugeMetricFamily("stratamesh:queue_depth", "Messages and chunks waiting for a step, all stages.")
    rate = GaugeMetricFamily("stratamesh:tokens_per_second", "Tokens computed per second over the last interval.")
    serving = GaugeMetricFamily("stratamesh:serving_cpu_seconds_per_token",
                                "CPU seconds per token of a step spent outside the layers (0 until measured).")
    gpu = {name: GaugeMetricFamily(f"stratamesh:gpu_{name}", doc, labels=("gpu",)) for name, doc in (
        ("utilization_perc", "GPU utilization, 0 to 100."), ("memory_used_bytes", "GPU memory in use."),
        ("temperature_celsius", "GPU temperature."), ("power_watts", "GPU power draw."))}
    if telemetry is not None:
        queue.add_metric([], telemetry.queue_depth)
        rate.add_metric([], telemetry.tokens_per_s)
        serving.add_metric([], telemetry.serving_cpu_per_token_s)
        for g in telemetry.gpus:
            readings = {"utilization_perc": g.utilization_pct,
                        "memory_used_bytes": g.mem_total_bytes - g.mem_free_bytes,
                        "temperature_celsius": g.temperature_c, "power_watts": g.power_w}
            for name, value in readings.items():
                if value is not None:
                    gpu[name].add_metric([str(g.index)], value)
    yield queue
    yield rate
    yield serving
    yield from gpu.values()
