"""A persistent client stream to one peer: callers enqueue messages, one task writes them in order."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from stratamesh.fleet.errors import StageFailed
from stratamesh.fleet.wire.channels import make_channel

log = logging.getLogger(__name__)

_CLOSE = object()

# Opens the stream on a channel: e.g. `lambda ch, it: StageStub(ch).Push(it)`.
OpenCall = Callable[[grpc.aio.Channel, AsyncIterator[Any]], grpc.aio.StreamUnaryCall]


class OutboundStream:
    """One long-lived client-streaming call; send() never blocks and keeps message order."""

    def __init__(self, address: str, open_call: OpenCall,
                 on_broken: Callable[[OutboundStream, BaseException | None], None] | None = None):
        self.address = address
        self._open_call = open_call
        self._on_broken = on_broken
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None
        self.broken: BaseException | None = None
        self.closed = False

    def start(self) -> OutboundStream:
        """Dials the peer and starts the call; messages sent before it connects wait in the queue."""
        self._channel = make_channel(self.address)
        call = self._open_call(self._channel, self._drain())
        self._task = asyncio.get_running_loop().create_task(self._watch(call))
        return self

    @property
    def alive(self) -> bool:
        return self.broken is None and not self.closed

    def send(self, message: Any) -> None:
        """Queues a message for the peer; raises StageFailed if the stream has already broken."""
        if not self.alive:
            raise StageFailed(f"stream to {self.address} is down: {self.broken or 'closed'}")
        self._queue.put_nowait(message)

    async def close(self) -> None:
        """Ends the stream after the queued messages and closes the channel."""
        if self.closed:
            return
        self.closed = True
        self._queue.put_nowait(_CLOSE)
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout=2.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()
        if self._channel is not None:
            await self._channel.close(grace=None)

    async def _drain(self) -> AsyncIterator[Any]:
        while True:
            message = await self._queue.get()
            if message is _CLOSE:
                return
            yield message

    async def _watch(self, call: grpc.aio.StreamUnaryCall) -> None:
        error: BaseException | None = None
        try:
            await call
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            error = StageFailed(f"stream to {self.address} failed: {exc.code().name} {exc.details()}")
        except Exception as exc:  # any other failure of the call breaks the stream the same way
            error = StageFailed(f"stream to {self.address} failed: {exc!r}")
        if self.closed and error is None:
            return
        self.broken = error or StageFailed(f"stream to {self.address} ended")
        log.warning("%s", self.broken)
        if self._on_broken is not None:
            self._on_broken(self, self.broken)


class StreamPool:
    """Keeps one OutboundStream per peer address and replaces a broken one on next use."""

    def __init__(self, open_call: OpenCall,
                 on_broken: Callable[[OutboundStream, BaseException | None], None] | None = None):
        self._open_call = open_call
        self._on_broken = on_broken
        self._streams: dict[str, OutboundStream] = {}

    def get(self, address: str) -> OutboundStream:
        """The live stream to address, dialing a new one if there is none."""
        stream = self._streams.get(address)
        if stream is None or not stream.alive:
            stream = OutboundStream(address, self._open_call, self._on_broken).start()
            self._streams[address] = stream
        return stream

    async def close(self) -> None:
        """Closes every stream."""
        streams, self._streams = list(self._streams.values()), {}
        await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)
