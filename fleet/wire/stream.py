"""A persistent client stream to one peer: callers enqueue messages, one task writes them in order.

The stream is a gRPC call, or, to a peer behind NAT, a WebRTC data channel (fleet/wire/rtc.py) carrying the same
messages in the same order: from the start when the coordinator says the peer is behind a NAT this process is not
behind, or once a direct connection to the peer's address fails (no route to it, or no answer).
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc

from stratamesh.fleet.errors import MeshError, StageFailed
from stratamesh.fleet.sessions import Hop
from stratamesh.fleet.wire import rtc
from stratamesh.fleet.wire.channels import make_channel

log = logging.getLogger(__name__)

_CLOSE = object()
DIAL_CHECK_S = 3.0      # a peer that has not accepted a TCP connection by then is taken as unreachable

# Opens the stream on a channel: e.g. `lambda ch, it: StageStub(ch).Push(it)`.
OpenCall = Callable[[grpc.aio.Channel, AsyncIterator[Any]], grpc.aio.StreamUnaryCall]
# Opens a data channel to the peer.
DialRtc = Callable[[], Awaitable[rtc.DataChannel]]

GRPC, WEBRTC, GRPC_OR_WEBRTC = "grpc", "webrtc", "grpc-or-webrtc"


class OutboundStream:
    """One long-lived stream to a peer; send() never blocks and keeps message order.

    reach: GRPC (a client-streaming call), WEBRTC (a data channel that dial_rtc opens), or GRPC_OR_WEBRTC (a call,
    unless the peer's address cannot be connected to: then a data channel). transport says which it uses."""

    def __init__(self, address: str, open_call: OpenCall,
                 on_broken: Callable[[OutboundStream, BaseException | None], None] | None = None,
                 reach: str = GRPC, dial_rtc: DialRtc | None = None):
        self.address = address
        self._open_call = open_call
        self._on_broken = on_broken
        self._reach = reach if dial_rtc is not None else GRPC
        self._dial_rtc = dial_rtc
        self.transport = WEBRTC if self._reach == WEBRTC else GRPC
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._channel: grpc.aio.Channel | None = None
        self._data_channel: rtc.DataChannel | None = None
        self._task: asyncio.Task[None] | None = None
        self.broken: BaseException | None = None
        self.closed = False

    def start(self) -> OutboundStream:
        """Dials the peer and starts the stream; messages sent before it connects wait in the queue."""
        self._task = asyncio.get_running_loop().create_task(self._run())
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
        if self._data_channel is not None:
            await self._data_channel.close()

    async def _run(self) -> None:
        error: BaseException | None = None
        try:
            if self._reach == GRPC_OR_WEBRTC and not await dialable(self.address):
                log.info("%s cannot be dialed: reaching it over WebRTC", self.address)
                self.transport = WEBRTC
            if self.transport == WEBRTC:
                await self._send_over_data_channel()
            else:
                self._channel = make_channel(self.address)
                await self._open_call(self._channel, self._drain())
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            error = StageFailed(f"stream to {self.address} failed: {exc.code().name} {exc.details()}")
        except Exception as exc:  # any other failure (a refused data channel, one that closed) breaks it the same way
            reason = exc if isinstance(exc, MeshError) else repr(exc)
            error = StageFailed(f"{self.transport} stream to {self.address} failed: {reason}")
        if self.closed and error is None:
            return
        self.broken = error or StageFailed(f"stream to {self.address} ended")
        log.warning("%s", self.broken)
        if self._on_broken is not None:
            self._on_broken(self, self.broken)

    async def _drain(self) -> AsyncIterator[Any]:
        while True:
            message = await self._queue.get()
            if message is _CLOSE:
                return
            yield message

    async def _send_over_data_channel(self) -> None:
        self._data_channel = channel = await self._dial_rtc()
        lost = asyncio.ensure_future(channel.closed.wait())
        try:
            while True:
                got = asyncio.ensure_future(self._queue.get())
                await asyncio.wait((got, lost), return_when=asyncio.FIRST_COMPLETED)
                if not got.done():
                    got.cancel()
                    raise StageFailed("the data channel closed")
                if (message := got.result()) is _CLOSE:
                    return
                channel.send(message.SerializeToString())
        finally:
            lost.cancel()


def address_host(address: str) -> str:
    """The host part of a "host:port" address, IPv6 brackets dropped ("[::1]:50051" -> "::1")."""
    return address.rpartition(":")[0].strip("[]")


async def dialable(address: str, timeout_s: float = DIAL_CHECK_S) -> bool:
    """Whether a TCP connection to host:port can be opened: False when there is no route to it or nothing answers
    in timeout_s; True when it opens, and when it is refused (the host is there and its daemon is not: the gRPC
    stream fails as for any peer that is down)."""
    host, _, port = address.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), timeout_s)
    except ConnectionRefusedError:
        return True
    except asyncio.TimeoutError:
        return False
    except OSError as exc:
        return exc.errno not in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ETIMEDOUT)
    writer.close()
    return True


class RtcDialer:
    """How this process reaches a peer it cannot dial: a data channel signalled through the coordinator."""

    def __init__(self, signal: rtc.Signal, nat: Callable[[], str] = lambda: ""):
        """nat: the address this process's own connections come from when it is behind NAT ("": it is not); a peer
        behind the same one is on its LAN, and dialed directly."""
        self._signal = signal
        self._nat = nat

    def reach(self, hop: Hop) -> str:
        """How to reach hop's agent from here: WEBRTC if it is behind another NAT than this process, GRPC_OR_WEBRTC
        if the agent is known (a data channel can be signalled to it), else GRPC."""
        if not hop.agent_id:
            return GRPC
        return WEBRTC if hop.nat and hop.nat != self._nat() else GRPC_OR_WEBRTC

    async def dial(self, agent_id: str) -> rtc.DataChannel:
        return await rtc.dial(agent_id, self._signal)


class StreamPool:
    """Keeps one stream per peer address and replaces a broken one on next use; with an RtcDialer, reaches the peers
    it cannot dial over WebRTC (as the hops it learned say, or as a failed dial does)."""

    def __init__(self, open_call: OpenCall,
                 on_broken: Callable[[OutboundStream, BaseException | None], None] | None = None,
                 rtc_dialer: RtcDialer | None = None):
        self._open_call = open_call
        self._on_broken = on_broken
        self._rtc = rtc_dialer
        self._streams: dict[str, OutboundStream] = {}
        self._hops: dict[str, Hop] = {}    # address -> the newest hop naming it, of those naming their agent

    def learn(self, hops: Iterable[Hop]) -> None:
        """Takes note of the agent behind each hop's address, and whether it is behind NAT (a route's hops, before
        sending to them)."""
        if self._rtc is not None:
            self._hops.update((hop.address, hop) for hop in hops if hop.agent_id)

    def get(self, address: str) -> OutboundStream:
        """The live stream to address, dialing a new one if there is none."""
        stream = self._streams.get(address)
        if stream is None or not stream.alive:
            hop = self._hops.get(address)
            if self._rtc is None or hop is None:
                stream = OutboundStream(address, self._open_call, self._on_broken)
            else:
                dialer, agent_id = self._rtc, hop.agent_id
                stream = OutboundStream(address, self._open_call, self._on_broken, dialer.reach(hop),
                                        lambda: dialer.dial(agent_id))
            self._streams[address] = stream.start()
        return stream

    async def close(self) -> None:
        """Closes every stream."""
        streams, self._streams = list(self._streams.values()), {}
        await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)
