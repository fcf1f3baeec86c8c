"""A request's timeline: spans tagged with the stage they belong to, an unreachable stage named, not fatal."""

from __future__ import annotations

import pytest

from stratamesh.coordinator.serving.records import RequestRecord
from stratamesh.coordinator.traces import ORIGIN_STAGE, request_trace, stage_of
from stratamesh.fleet.tracing import Span, SpanStore
from stratamesh.fleet.sessions import Hop

ROUTE = ("a0", "a1", "a2")
TRACE = "ab" * 16


def span(name: str, **attributes: str) -> Span:
    return Span(name, TRACE, "1" * 16, "2" * 16, 10, 20, attributes)


@pytest.mark.parametrize("s, stage", [
    (span("queue", **{"stratamesh.assignment": "a1"}), 1),
    (span("compute", **{"stratamesh.assignment": "a2"}), 2),
    (span("send", **{"stratamesh.to": "a0"}), ORIGIN_STAGE),     # recorded by stage 0: sent by the origin
    (span("send", **{"stratamesh.to": "a2"}), 1),                # recorded by stage 2: sent by stage 1
    (span("send", **{"stratamesh.to": "origin"}), 2),            # recorded by the origin: sent by the last stage
    (span("open"), ORIGIN_STAGE),
    (span("request"), None),
    (span("compute", **{"stratamesh.assignment": "elsewhere"}), None),
    (span("send", **{"stratamesh.to": "elsewhere"}), None),
])
def test_each_span_belongs_to_the_stage_that_did_the_work(s: Span, stage) -> None:
    assert stage_of(s, ROUTE) == stage


async def test_an_unreachable_stage_is_named_and_the_origin_spans_still_come_back() -> None:
    store = SpanStore("origin")
    store.record("send", TRACE, "2" * 16, 100, 250, {"stratamesh.to": "origin", "stratamesh.step": "0"})
    store.record("request", TRACE, "", 50, 300, {}, span_id="2" * 16)
    record = RequestRecord("cmpl-1", TRACE, (Hop("127.0.0.1:1", "a0"),), 50, 3, end_unix_ns=300, num_tokens=1)
    trace = await request_trace(record, store, timeout_s=0.5)
    assert trace["unreachable"] == ["127.0.0.1:1"] and trace["state"] == "finished"
    assert [(s["name"], s["stage"], s["step"]) for s in trace["spans"]] == [("request", None, None), ("send", 0, 0)]
    assert trace["duration_s"] == 250e-9 and trace["spans"][1]["duration_s"] == 150e-9


async def test_an_untraced_request_asks_no_stage() -> None:
    record = RequestRecord("cmpl-2", "", (Hop("127.0.0.1:1", "a0"),), 50, 3)
    trace = await request_trace(record, SpanStore("origin"), timeout_s=0.5)
    assert trace == {**trace, "spans": [], "unreachable": [], "state": "running", "duration_s": None}
