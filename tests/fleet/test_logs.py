"""Log records carry the process's agent id and the current request's trace id, as JSON lines or text."""

from __future__ import annotations

import io
import json
import logging

import pytest

from stratamesh.fleet import logs


@pytest.fixture
def stream():
    out = io.StringIO()
    root = logging.getLogger()
    old_handlers, old_level = list(root.handlers), root.level
    yield out
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in old_handlers:
        root.addHandler(handler)
    root.setLevel(old_level)
    logs._process_fields.clear()


def test_json_lines_carry_agent_and_trace_ids(stream: io.StringIO) -> None:
    logs.configure_logging("info", "json", stream)
    logs.set_process_fields(agent_id="a1b2c3", component="agent", empty="")
    log = logging.getLogger("stratamesh.test")
    log.info("before")
    with logs.trace_context("ab" * 16):
        log.warning("session %s failed", "s-1")
        with logs.trace_context(""):          # no trace id keeps the current one
            log.info("inner")
    log.debug("hidden below info")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("with a traceback")
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [r["message"] for r in records] == ["before", "session s-1 failed", "inner", "with a traceback"]
    assert all(r["agent_id"] == "a1b2c3" and r["component"] == "agent" and "empty" not in r for r in records)
    assert [r.get("trace_id") for r in records] == [None, "ab" * 16, "ab" * 16, None]
    assert records[1]["level"] == "WARNING" and records[1]["logger"] == "stratamesh.test"
    assert "ValueError: boom" in records[3]["exc"] and records[0]["ts"].endswith("Z")


def test_text_lines_show_the_same_fields(stream: io.StringIO) -> None:
    logs.configure_logging("info", "text", stream)
    logs.set_process_fields(agent_id="a1b2c3")
    with logs.trace_context("cd" * 16):
        logging.getLogger("stratamesh.test").info("hello")
    logging.getLogger("stratamesh.test").info("bye")
    first, second = stream.getvalue().splitlines()
    assert first.endswith(f"stratamesh.test [agent_id=a1b2c3 trace_id={'cd' * 16}]: hello")
    assert second.endswith("stratamesh.test [agent_id=a1b2c3]: bye")
