"""Server-sent events framing, as OpenAI streams: `data: {json}\n\n` ... `data: [DONE]\n\n`."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(data: dict[str, Any], event: str = "") -> bytes:
    """One `data:` event (of type event, if given); compact JSON never holds a raw newline, so one line is enough."""
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class SSEResponse(StreamingResponse):
    """A text/event-stream response that runs on_close however the stream ends (done, disconnect, cancel)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(events, headers=SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled request must still release its generation
                await self._on_close()
