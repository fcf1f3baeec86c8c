"""Traces: the spans a process recorded, kept by trace id (bounded), and their export through OpenTelemetry.

Spans are recorded as plain values on the hot path (about a microsecond each) and turned into
OpenTelemetry spans only when an exporter wants them, on a background thread: the SDK's own span
objects cost tens of microseconds, too much for a span per stage per step per session.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stratamesh.fleet.errors import MeshError

log = logging.getLogger(__name__)


class TracingUnavailable(MeshError):
    """An exporter was asked for whose package is not installed."""


@dataclass(frozen=True, slots=True)
class Span:
    """One finished span; times are Unix nanoseconds on the clock of the process that recorded it."""

    name: str
    trace_id: str                   # 32 hex digits
    span_id: str                    # 16 hex digits
    parent_span_id: str             # "" for a root span
    start_unix_ns: int
    end_unix_ns: int
    attributes: Mapping[str, str] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return (self.end_unix_ns - self.start_unix_ns) / 1e9


def new_trace_id() -> str:
    return f"{random.getrandbits(128) or 1:032x}"


def new_span_id() -> str:
    return f"{random.getrandbits(64) or 1:016x}"


def traceparent(trace_id: str, span_id: str) -> str:
    """The W3C trace context header value of a sampled span."""
    return f"00-{trace_id}-{span_id}-01"


def parse_traceparent(value: str) -> tuple[str, str]:
    """(trace id, parent span id) of a traceparent the wire converter validated; ("", "") for none."""
    if not value:
        return "", ""
    return value[3:35], value[36:52]


class SpanStore:
    """The spans of the newest traces, by trace id: at most max_traces traces of max_spans_per_trace spans.

    Call it from one thread (the event loop); exporters get their spans on their own thread.
    """

    def __init__(self, service: str, max_traces: int = 2048, max_spans_per_trace: int = 20_000,
                 exporter: SpanExport | None = None):
        self.service = service
        self._max_traces = max_traces
        self._max_spans = max_spans_per_trace
        self._traces: OrderedDict[str, list[Span]] = OrderedDict()
        self._exporter = exporter

    def record(self, name: str, trace_id: str, parent_span_id: str, start_unix_ns: int, end_unix_ns: int,
               attributes: Mapping[str, str], span_id: str = "") -> Span:
        """Keeps one finished span (an end before its start is clamped: clocks of two hosts may disagree)."""
        span = Span(name, trace_id, span_id or new_span_id(), parent_span_id, start_unix_ns,
                    max(end_unix_ns, start_unix_ns), attributes)
        spans = self._traces.get(trace_id)
        if spans is None:
            spans = self._traces[trace_id] = []
            if len(self._traces) > self._max_traces:
                self._traces.popitem(last=False)
        if len(spans) < self._max_spans:
            spans.append(span)
        if self._exporter is not None:
            self._exporter.submit(span)
        return span

    def trace(self, trace_id: str) -> list[Span]:
        """Every kept span of one trace, in the order recorded."""
        return list(self._traces.get(trace_id, ()))

    def close(self) -> None:
        if self._exporter is not None:
            self._exporter.close()


class SpanExport:
    """Hands spans to OpenTelemetry span exporters in batches from a background thread."""

    def __init__(self, exporters: Sequence[Any], service: str, interval_s: float = 1.0, max_pending: int = 100_000):
        from opentelemetry.sdk.resources import Resource

        self._exporters = list(exporters)
        self._resource = Resource.create({"service.name": service})
        self._interval_s = interval_s
        self._max_pending = max_pending
        self._pending: list[Span] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="span-export", daemon=True)
        self._thread.start()

    def submit(self, span: Span) -> None:
        with self._lock:
            if len(self._pending) < self._max_pending:   # an exporter that cannot keep up loses spans, not memory
                self._pending.append(span)

    def flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        if not batch:
            return
        readable = [to_otel(s, self._resource) for s in batch]
        for exporter in self._exporters:
            try:
                exporter.export(readable)
            except Exception:  # noqa: BLE001  a failing collector never breaks serving
                log.warning("span exporter %s failed", type(exporter).__name__, exc_info=True)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.flush()
        for exporter in self._exporters:
            exporter.shutdown()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.flush()


def to_otel(span: Span, resource: Any) -> Any:
    """The span as OpenTelemetry's ReadableSpan, under the given resource."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext, TraceFlags

    trace_id = int(span.trace_id, 16)
    context = SpanContext(trace_id, int(span.span_id, 16), False, TraceFlags(TraceFlags.SAMPLED))
    parent = SpanContext(trace_id, int(span.parent_span_id, 16), True, TraceFlags(TraceFlags.SAMPLED)) \
        if span.parent_span_id else None
    return ReadableSpan(name=span.name, context=context, parent=parent, resource=resource,
                        attributes=dict(span.attributes), start_time=span.start_unix_ns, end_time=span.end_unix_ns)


def json_lines_exporter(path: str) -> Any:
    """An OpenTelemetry exporter appending each span as one line of OpenTelemetry's JSON to path."""
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    out = open(path, "a", encoding="utf-8")  # noqa: SIM115  closed by the exporter's shutdown
    return ConsoleSpanExporter(out=out, formatter=lambda s: s.to_json(indent=None) + "\n")


def otlp_exporter(endpoint: str) -> Any:
    """An OTLP/HTTP exporter to endpoint (e.g. http://collector:4318/v1/traces)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise TracingUnavailable("--otlp-traces-endpoint needs the opentelemetry-exporter-otlp-proto-http "
                                 "package: pip install 'stratamesh[otlp]'") from exc
    return OTLPSpanExporter(endpoint=endpoint)


def span_store(service: str, json_path: str = "", otlp_endpoint: str = "") -> SpanStore:
    """A process's span store, exporting to a JSON-lines file and/or an OTLP endpoint when given."""
    exporters = ([json_lines_exporter(json_path)] if json_path else []) + \
                ([otlp_exporter(otlp_endpoint)] if otlp_endpoint else [])
    return SpanStore(service, exporter=SpanExport(exporters, service) if exporters else None)
