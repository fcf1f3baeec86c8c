"""Span store bounds, W3C trace context, and export through OpenTelemetry: a JSON-lines file and a real OTLP receiver."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from stratamesh.fleet.tracing import (
    SpanExport, SpanStore, TracingUnavailable, new_span_id, new_trace_id, otlp_exporter, parse_traceparent,
    span_store, to_otel, traceparent,
)
from stratamesh.fleet.wire import convert

T0 = 1_700_000_000_000_000_000


def test_traceparent_round_trips_and_the_wire_accepts_it() -> None:
    trace_id, span_id = new_trace_id(), new_span_id()
    assert len(trace_id) == 32 and len(span_id) == 16 and int(trace_id, 16) and int(span_id, 16)
    value = traceparent(trace_id, span_id)
    assert parse_traceparent(value) == (trace_id, span_id)
    assert parse_traceparent("") == ("", "")
    assert convert._TRACEPARENT.fullmatch(value)


def test_store_keeps_the_newest_traces_and_caps_spans_per_trace() -> None:
    store = SpanStore("test", max_traces=2, max_spans_per_trace=3)
    for trace in ("a" * 32, "b" * 32, "c" * 32):
        for i in range(5):
            store.record("compute", trace, "p" * 16, T0 + i, T0 + i + 10, {"i": str(i)})
    assert store.trace("a" * 32) == []
    kept = store.trace("c" * 32)
    assert [s.attributes["i"] for s in kept] == ["0", "1", "2"] and len(store.trace("b" * 32)) == 3
    assert all(s.duration_s == 10e-9 and s.parent_span_id == "p" * 16 for s in kept)


def test_an_end_before_its_start_is_clamped_to_a_zero_span() -> None:
    span = SpanStore("test").record("send", "a" * 32, "", T0, T0 - 500, {})
    assert span.end_unix_ns == span.start_unix_ns and span.duration_s == 0


def test_spans_become_opentelemetry_spans_with_our_ids_and_parent() -> None:
    from opentelemetry.sdk.resources import Resource

    span = SpanStore("test").record("queue", "ab" * 16, "cd" * 8, T0, T0 + 7, {"stratamesh.step": "3"})
    otel = to_otel(span, Resource.create({"service.name": "unit"}))
    assert (otel.context.trace_id, otel.context.span_id) == (int("ab" * 16, 16), int(span.span_id, 16))
    assert otel.parent.span_id == int("cd" * 8, 16) and (otel.start_time, otel.end_time) == (T0, T0 + 7)
    assert otel.attributes["stratamesh.step"] == "3" and otel.resource.attributes["service.name"] == "unit"
    root = to_otel(SpanStore("t").record("request", "ab" * 16, "", T0, T0 + 1, {}), Resource.create({}))
    assert root.parent is None


def test_json_lines_export_writes_one_opentelemetry_object_per_span(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    store = span_store("agent-x", json_path=str(path))
    for step in range(3):
        store.record("compute", "ab" * 16, "cd" * 8, T0 + step, T0 + step + 5, {"stratamesh.step": str(step)})
    store.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["attributes"]["stratamesh.step"] for line in lines] == ["0", "1", "2"]
    assert all(line["context"]["trace_id"] == "0x" + "ab" * 16 and line["parent_id"] == "0x" + "cd" * 8
               for line in lines)
    assert lines[0]["resource"]["attributes"]["service.name"] == "agent-x"


def test_a_failing_exporter_never_reaches_the_caller() -> None:
    class Broken:
        shut = False

        def export(self, spans):
            raise ConnectionError("collector down")

        def shutdown(self):
            Broken.shut = True

    store = SpanStore("t", exporter=SpanExport([Broken()], "t", interval_s=0.01))
    store.record("compute", "ab" * 16, "", T0, T0 + 1, {})
    store.close()   # flushes into the broken exporter: logged, not raised
    assert Broken.shut and len(store.trace("ab" * 16)) == 1


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver: decodes each export request with OpenTelemetry's protobuf messages."""

    received: list = []

    def do_POST(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Collector.received.append((self.path, ExportTraceServiceRequest.FromString(body)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def collector():
    server = HTTPServer(("127.0.0.1", 0), _Collector)
    _Collector.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/v1/traces"
    server.shutdown()


def test_otlp_export_reaches_a_real_receiver(collector: str) -> None:
    store = span_store("stratamesh-agent-a", otlp_endpoint=collector)
    store.record("compute", "ab" * 16, "cd" * 8, T0, T0 + 9, {"stratamesh.assignment": "p-1"})
    store.close()
    ((path, request),) = _Collector.received
    (resource_spans,) = request.resource_spans
    (span,) = resource_spans.scope_spans[0].spans
    assert path == "/v1/traces" and span.name == "compute" and span.trace_id == bytes.fromhex("ab" * 16)
    assert span.parent_span_id == bytes.fromhex("cd" * 8) and span.end_time_unix_nano - span.start_time_unix_nano == 9
    assert any(a.key == "service.name" and a.value.string_value == "stratamesh-agent-a"
               for a in resource_spans.resource.attributes)


def test_otlp_needs_its_exporter_package_or_says_which(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)  # not installed
    with pytest.raises(TracingUnavailable, match=r"stratamesh\[otlp\]"):
        otlp_exporter("http://127.0.0.1:1/v1/traces")
