"""What the data plane reports about itself: metrics for every step, spans for the steps of traced sessions.

Per stage and step a traced session gets three spans: "queue" (its chunk arrived, then waited for a
step), "compute" (the step's forward pass) and "send" (from the previous hop finishing the step to the
chunk arriving here; the receiver records it, since only it knows when the message arrived).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from prometheus_client.metrics import MetricWrapperBase

from stratamesh.agent.engine.scheduler import Batch
from stratamesh.agent.engine.stage_engine import StageEngine
from stratamesh.agent.metrics import AgentMetrics, stage_labels
from stratamesh.fleet.tracing import SpanStore, parse_traceparent
from stratamesh.fleet.sessions import StepChunk


class _StageMetrics(NamedTuple):
    """One stage's metric children, bound to its labels once (a labels() lookup costs microseconds)."""

    compute_s: MetricWrapperBase
    queue_s: MetricWrapperBase
    hop_s: MetricWrapperBase
    batch_tokens: MetricWrapperBase
    tokens: MetricWrapperBase
    prefill_tokens: MetricWrapperBase
    preemptions: MetricWrapperBase
    spec_drafts: MetricWrapperBase
    spec_draft_tokens: MetricWrapperBase
    spec_accepted_tokens: MetricWrapperBase
    spec_follow_runs: MetricWrapperBase
    spec_follow_runs_verified: MetricWrapperBase


class _ExpertMetrics(NamedTuple):
    """A mixture of experts' stage's metric children, bound once: each expert's token counter, the tokens exported
    of each so far, and the step imbalance histogram."""

    tokens: list[MetricWrapperBase]
    seen: list[int]
    imbalance: MetricWrapperBase


DECODE_AVERAGE_WEIGHT = 0.1    # each decode step's share of a stage's moving averages of decode steps


@dataclass(slots=True)
class DecodeSpeed:
    """A stage's recent decode steps: their seconds and their bandwidth roofline's fraction of those (the weights
    and KV they read at the box's streaming read bandwidth over the time they took), as moving averages."""

    step_s: float = 0.0
    roofline: float = 0.0

    def add(self, seconds: float, read_bytes: int, read_bandwidth: float) -> None:
        fraction = read_bytes / read_bandwidth / seconds if read_bandwidth > 0 and seconds > 0 else 0.0
        weight = DECODE_AVERAGE_WEIGHT if self.step_s else 1.0
        self.step_s += weight * (seconds - self.step_s)
        self.roofline += weight * (fraction - self.roofline)


class StageObserver:
    """Turns data-plane events into Prometheus observations and trace spans, and keeps each stage's DecodeSpeed
    (read_bandwidth: the box's streaming read, bytes/s, where the agent measured it)."""

    def __init__(self, agent_id: str, metrics: AgentMetrics | None = None, spans: SpanStore | None = None,
                 clock_ns: Callable[[], int] = time.time_ns, read_bandwidth: float = 0.0):
        self.agent_id = agent_id
        self.metrics = metrics or AgentMetrics()
        self.spans = spans or SpanStore(f"stratamesh-agent-{agent_id}")
        self.clock_ns = clock_ns
        self.read_bandwidth = read_bandwidth
        self.decode: dict[str, DecodeSpeed] = {}         # assignment id -> its decode steps' speed
        self._children: dict[str, _StageMetrics] = {}    # assignment id -> its bound metric children
        self._spec_seen: dict[str, tuple[int, ...]] = {}   # assignment id -> its speculation counts exported
        self._experts_bound: dict[str, _ExpertMetrics] = {}    # assignment id -> its experts' metric children

    def arrived(self, engine: StageEngine, chunk: StepChunk, arrived_ns: int, sent_ns: int) -> None:
        """A chunk reached this stage; sent_ns is when the previous hop finished it (0: unknown)."""
        if not sent_ns:
            return
        self._bound(engine).hop_s.observe(max(arrived_ns - sent_ns, 0) / 1e9)
        if chunk.trace_id:
            self._span(engine, "send", chunk.session_id, chunk.step, sent_ns, arrived_ns,
                       {"stratamesh.to": engine.assignment.assignment_id})

    def stepped(self, engine: StageEngine, batch: Batch, start_ns: int, end_ns: int) -> None:
        """A step ran on engine from start_ns to end_ns."""
        bound = self._bound(engine)
        num_tokens = sum(c.num_tokens for c in batch.chunks)
        bound.compute_s.observe((end_ns - start_ns) / 1e9)
        if batch.chunks and all(c.is_decode for c in batch.chunks):
            speed = self.decode.setdefault(engine.assignment.assignment_id, DecodeSpeed())
            context = sum(chunk.start_pos + chunk.num_tokens for chunk in batch.chunks)   # the tokens attended over
            speed.add((end_ns - start_ns) / 1e9, engine.runner.model.decode_read_bytes(context), self.read_bandwidth)
        bound.batch_tokens.observe(num_tokens)
        bound.tokens.inc(num_tokens)
        self._experts(engine)
        bound.prefill_tokens.inc(sum(c.num_tokens for c in batch.chunks if not c.is_decode))
        for chunk in batch.chunks:
            item = chunk.item
            first_piece = chunk.begin == 0 and item.arrived_ns > 0
            if first_piece:
                bound.queue_s.observe(max(start_ns - item.arrived_ns, 0) / 1e9)
            if not item.trace_id:
                continue
            if first_piece:
                self._span(engine, "queue", chunk.session_id, item.step, item.arrived_ns, start_ns, {})
            self._span(engine, "compute", chunk.session_id, item.step, start_ns, end_ns,
                       {"stratamesh.batch_tokens": str(num_tokens), "stratamesh.batch_seqs": str(len(batch.chunks))})

    def _experts(self, engine: StageEngine) -> None:
        """A mixture of experts' step: the tokens its routers sent each expert catch up with its ExpertLoad, and its
        imbalance is observed."""
        load = engine.expert_load
        if load is None or not load.last_imbalance:
            return
        bound = self._experts_bound.get(engine.assignment.assignment_id)
        if bound is None:       # each expert's counter child, bound once (a labels() lookup costs microseconds)
            labels = stage_labels(engine.assignment.stage)
            bound = self._experts_bound[engine.assignment.assignment_id] = _ExpertMetrics(
                [self.metrics.expert_tokens.labels(*labels, str(e)) for e in range(len(load.tokens))],
                [0] * len(load.tokens), self.metrics.expert_imbalance.labels(*labels))
        for expert, (before, now) in enumerate(zip(bound.seen, load.tokens, strict=True)):
            if now > before:
                bound.tokens[expert].inc(now - before)
                bound.seen[expert] = now
        bound.imbalance.observe(load.last_imbalance)

    def verified(self, engine: StageEngine, batch: Batch) -> None:
        """A last stage's step verified the drafted tokens its chunks carried: the counters catch up with the
        engine's (StageEngine.speculation, counted as its step's tokens were delivered)."""
        if not engine.is_last or not any(chunk.item.num_draft for chunk in batch.chunks):
            return
        bound, counts = self._bound(engine), engine.speculation
        seen = self._spec_seen.get(engine.assignment.assignment_id, (0,) * 5)
        now = (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens, counts.num_followers,
               counts.num_followers_verified)
        for counter, before, after in zip((bound.spec_drafts, bound.spec_draft_tokens, bound.spec_accepted_tokens,
                                           bound.spec_follow_runs, bound.spec_follow_runs_verified),
                                          seen, now, strict=True):
            if after > before:
                counter.inc(after - before)
        self._spec_seen[engine.assignment.assignment_id] = now

    def preempted(self, engine: StageEngine, num_sessions: int) -> None:
        if num_sessions:
            self._bound(engine).preemptions.inc(num_sessions)

    def kv_moved(self, direction: str, num_bytes: int) -> None:
        """A session's KV left this agent ("export") or arrived ("import")."""
        self.metrics.kv_sessions.labels(direction).inc()
        self.metrics.kv_bytes.labels(direction).inc(num_bytes)

    def sent(self, peer: str, num_bytes: int, codec: str = "", transport: str = "grpc") -> None:
        """A message of num_bytes went to peer (the next stage or an origin) over transport ("grpc", "webrtc");
        codec: how the activations it carries were coded, if it carries any."""
        self.metrics.sent_bytes.labels(peer).inc(num_bytes)
        self.metrics.sent_messages.labels(peer).inc()
        self.metrics.transport_messages.labels(peer, transport, "sent").inc()
        if codec:
            self.metrics.activation_bytes.labels(peer, codec).inc(num_bytes)

    def receiving(self, peer: str, transport: str) -> Callable[[], None]:
        """What counts each message that arrives from peer (a previous hop) over transport."""
        return self.metrics.transport_messages.labels(peer, transport, "received").inc

    def _span(self, engine: StageEngine, name: str, session_id: str, step: int, start_ns: int, end_ns: int,
              extra: dict[str, str]) -> None:
        session = engine.sessions.get(session_id)
        if session is None or not session.traceparent:
            return
        trace_id, parent = parse_traceparent(session.traceparent)
        stage = engine.assignment.stage
        self.spans.record(name, trace_id, parent, start_ns, end_ns, {
            "stratamesh.agent": self.agent_id, "stratamesh.assignment": engine.assignment.assignment_id,
            "stratamesh.layers": f"{stage.start_layer}-{stage.end_layer}", "stratamesh.session": session_id,
            "stratamesh.step": str(step), **extra})

    def _bound(self, engine: StageEngine) -> _StageMetrics:
        key = engine.assignment.assignment_id
        children = self._children.get(key)
        if children is None:
            labels = stage_labels(engine.assignment.stage)
            m = self.metrics
            children = self._children[key] = _StageMetrics(*(
                family.labels(*labels) for family in (m.compute_s, m.queue_s, m.hop_s, m.batch_tokens, m.tokens,
                                                      m.prefill_tokens, m.preemptions, m.spec_drafts,
                                                      m.spec_draft_tokens, m.spec_accepted_tokens,
                                                      m.spec_follow_runs, m.spec_follow_runs_verified)))
        return children
