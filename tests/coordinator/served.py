"""An ASGI app on a real uvicorn server on a loopback port, for tests that need a real connection: streams that
arrive as they are sent (httpx's ASGI transport buffers them whole), clients that really leave."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn


@asynccontextmanager
async def served(app) -> AsyncIterator[str]:  # noqa: ANN001
    """The app served on 127.0.0.1 at a free port until the block ends: its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, access_log=False))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
