"""A request's timeline: the origin's spans and those its stages kept, gathered and put in pipeline order."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import grpc

from stratamesh.coordinator.serving.records import RequestRecord
from stratamesh.fleet.tracing import Span, SpanStore
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import make_channel

log = logging.getLogger(__name__)

ORIGIN_STAGE = "origin"


async def fetch_spans(address: str, trace_id: str, timeout_s: float) -> list[Span]:
    """The spans one agent kept for a trace (its Stage.Trace RPC)."""
    channel = make_channel(address)
    try:
        reply = await pb_grpc.StageStub(channel).Trace(pb.TraceRequest(trace_id=trace_id), timeout=timeout_s)
        return convert.spans_from_pb(reply)
    finally:
        await channel.close(grace=None)


async def request_trace(record: RequestRecord, spans: SpanStore, timeout_s: float = 2.0) -> dict[str, Any]:
    """The request's timeline as JSON: every span of its trace, tagged with the stage it belongs to."""
    addresses = sorted({hop.address for hop in record.route})
    gathered: list[Span] = spans.trace(record.trace_id) if record.trace_id else []
    unreachable = []
    if record.trace_id:
        replies = await asyncio.gather(*(fetch_spans(a, record.trace_id, timeout_s) for a in addresses),
                                       return_exceptions=True)
        for address, reply in zip(addresses, replies, strict=True):
            if isinstance(reply, grpc.aio.AioRpcError | OSError | asyncio.TimeoutError):
                log.info("no spans from %s for trace %s: %s", address, record.trace_id, reply)
                unreachable.append(address)
            elif isinstance(reply, BaseException):
                raise reply
            else:
                gathered.extend(reply)
    assignments = [hop.assignment_id for hop in record.route]
    timeline = sorted((_span_json(s, assignments) for s in gathered),
                      key=lambda s: (s["start_unix_ns"], s["end_unix_ns"]))
    return {"request_id": record.request_id, "trace_id": record.trace_id, "state": record.state,
            "start_unix_ns": record.start_unix_ns, "end_unix_ns": record.end_unix_ns,
            "duration_s": (record.end_unix_ns - record.start_unix_ns) / 1e9 if record.end_unix_ns else None,
            "route": [{"stage": i, "address": h.address, "assignment_id": h.assignment_id}
                      for i, h in enumerate(record.route)],
            "spans": timeline, "unreachable": unreachable}


def stage_of(span: Span, assignments: Sequence[str]) -> int | str | None:
    """The pipeline stage a span belongs to (ORIGIN_STAGE for the origin's own hop), None for the request span.

    A "send" span is recorded by the hop that received the message, so it belongs to the hop before that.
    """
    if span.name == "send":
        to = span.attributes.get("stratamesh.to", "")
        if to == ORIGIN_STAGE:
            return len(assignments) - 1
        index = assignments.index(to) if to in assignments else -1
        return ORIGIN_STAGE if index == 0 else (index - 1 if index > 0 else None)
    if span.name == "open":
        return ORIGIN_STAGE
    assignment = span.attributes.get("stratamesh.assignment", "")
    return assignments.index(assignment) if assignment in assignments else None


def _span_json(span: Span, assignments: Sequence[str]) -> dict[str, Any]:
    step = span.attributes.get("stratamesh.step")
    return {"name": span.name, "stage": stage_of(span, assignments), "step": int(step) if step else None,
            "span_id": span.span_id, "parent_span_id": span.parent_span_id,
            "start_unix_ns": span.start_unix_ns, "end_unix_ns": span.end_unix_ns, "duration_s": span.duration_s,
            "attributes": dict(span.attributes)}
