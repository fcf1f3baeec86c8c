"""Log records that carry who logged them (agent id) and for which request (trace id), as text or JSON lines."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from collections.abc import Iterator
from contextvars import ContextVar

# The trace of the request being handled; set around the work done for one session or request.
trace_id_var: ContextVar[str] = ContextVar("stratamesh_trace_id", default="")
# Fields every record of this process carries, e.g. {"agent_id": "3fa2..."}.
_process_fields: dict[str, str] = {}

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(context)s: %(message)s"


def set_process_fields(**fields: str) -> None:
    """Adds fields (agent_id=...) to every later record of this process."""
    _process_fields.update({k: v for k, v in fields.items() if v})


@contextlib.contextmanager
def trace_context(trace_id: str) -> Iterator[None]:
    """Records logged inside carry trace_id ("" leaves the current one)."""
    if not trace_id:
        yield
        return
    token = trace_id_var.set(trace_id)
    try:
        yield
    finally:
        trace_id_var.reset(token)


class ContextFilter(logging.Filter):
    """Puts the process fields and the current trace id on each record (and a text rendering of them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = dict(_process_fields)
        if trace_id := trace_id_var.get():
            fields["trace_id"] = trace_id
        record.stratamesh = fields
        pairs = " ".join(f"{k}={v}" for k, v in fields.items())
        record.context = f" [{pairs}]" if pairs else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, the context fields, and exc when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "message": record.getMessage(),
               **getattr(record, "stratamesh", {})}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str = "info", fmt: str = "text", stream=None) -> logging.Handler:
    """Sets up the root logger (only the CLI calls this); fmt is "text" or "json"."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    return handler
