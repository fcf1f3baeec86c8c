"""The link probe: every agent serves Echo and Bulk; a prober times them for a link's RTT and bandwidth."""

from __future__ import annotations

import asyncio
import collections
import logging
import statistics
import time
from collections.abc import AsyncIterator, Sequence

import grpc

from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.boxes import Peer
from stratamesh.fleet.control_messages import LinkMeasurement
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import describe_error, make_channel

log = logging.getLogger(__name__)

NUM_PINGS = 20                  # timed round trips; the RTT is their median ...
MIN_PINGS = 5                   # ... or that of at least this many, once ECHO_MAX_S has passed (a long-RTT link)
ECHO_MAX_S = 2.0
NUM_WARMUP_PINGS = 3            # untimed first: they open the connection and warm both ends
PAYLOAD_BYTES = 256             # small, so the RTT is latency and not transfer time on a slow link
BULK_MIN_WINDOW_BYTES = 128 << 10   # bytes the sender may have on their way: this, or what the link carries (by
BULK_BACKLOG_S = 0.25               # the rate so far) in this long or in two round trips, whichever is largest ...
BULK_CHUNK_BYTES = 16 << 10         # ... in chunks (Bulk messages) of an eighth of that, from this (a 2 Mbit/s
BULK_MAX_CHUNK_BYTES = 1 << 20      # link delivers several a second) to this (fewer messages on a fast link)
BULK_MAX_BYTES = 32 << 20       # a fast link stops here (tens of milliseconds on loopback) ...
BULK_MAX_S = 1.0                # ... and a slow one this long after its first chunk arrived, whatever it moved
PEER_TIMEOUT_S = 10.0           # one peer's whole probe; past it the peer is reported as failed


class LinkService(pb_grpc.LinkServicer):
    """What a peer times: Echo sends every message back on the stream, Bulk counts the bytes it received."""

    async def Echo(self, request_iterator: AsyncIterator[pb.EchoMessage],
                   context: grpc.aio.ServicerContext) -> None:
        while (message := await context.read()) is not grpc.aio.EOF:
            await context.write(message)

    async def Bulk(self, request_iterator: AsyncIterator[pb.BulkChunk],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[pb.BulkSummary]:
        """Answers every chunk with what has arrived so far, timed from the first chunk's arrival."""
        num_bytes = first_bytes = 0
        first_at = 0.0
        async for chunk in request_iterator:
            now = time.perf_counter()
            num_bytes += len(chunk.data)
            if not first_bytes:
                first_bytes, first_at = num_bytes, now
            yield pb.BulkSummary(num_bytes=num_bytes, timed_bytes=num_bytes - first_bytes, timed_s=now - first_at)


async def measure_link(address: str, *, num_pings: int = NUM_PINGS, payload_bytes: int = PAYLOAD_BYTES,
                       bulk_max_bytes: int = BULK_MAX_BYTES, bulk_max_s: float = BULK_MAX_S) -> tuple[float, float]:
    """(rtt_s, bandwidth_bytes_per_s) to the Link service at host:port; raises gRPC errors as they come."""
    async with make_channel(address) as channel:
        stub = pb_grpc.LinkStub(channel)
        rtt_s = statistics.median(await echo_round_trips_s(stub, num_pings, payload_bytes))
        return rtt_s, await bulk_bandwidth(stub, bulk_max_bytes, bulk_max_s, rtt_s)


async def echo_round_trips_s(stub: pb_grpc.LinkStub, num_pings: int, payload_bytes: int) -> list[float]:
    """num_pings round trips of one message each on one open Echo stream, after a few untimed ones (fewer, but at
    least MIN_PINGS, where they take over ECHO_MAX_S: 23 of a satellite link's 600 ms would take 14 s)."""
    payload = bytes(payload_bytes)
    call = stub.Echo()
    rtts_s: list[float] = []
    timed_from = 0.0
    for seq in range(NUM_WARMUP_PINGS + num_pings):
        start = time.perf_counter()
        if seq == NUM_WARMUP_PINGS:
            timed_from = start
        elif len(rtts_s) >= MIN_PINGS and start - timed_from >= ECHO_MAX_S:
            break
        await call.write(pb.EchoMessage(seq=seq, payload=payload))
        reply = await call.read()
        elapsed_s = time.perf_counter() - start
        if reply is grpc.aio.EOF or reply.seq != seq:
            call.cancel()
            raise InvalidInput(f"echo reply {seq}: the peer answered {reply!r:.40}")
        if seq >= NUM_WARMUP_PINGS:
            rtts_s.append(elapsed_s)
    await call.done_writing()
    return rtts_s


async def bulk_bandwidth(stub: pb_grpc.LinkStub, max_bytes: int, max_s: float, rtt_s: float) -> float:
    """Bytes/s of a stream of chunks by the receiver's clock, over the later half of the time they took (the first
    half holds TCP's slow start); sent until max_bytes have arrived or the receiver has been receiving for max_s.

    The sender keeps at most a window of unanswered bytes on their way. Its writes would otherwise run ahead of a
    slow link by whatever gRPC's and the kernel's buffers take (megabytes: at 2 Mbit/s the probe's answer and then
    the stages' traffic would queue behind them for over ten seconds). The window is what the link carries in a
    quarter second, or in two round trips where that is longer (twice its bandwidth-delay product), at the rate
    measured so far, sized again at each answer: a fast link soon has room to show its speed, and what is left on
    the link when the probe stops drains in about that long."""
    call = stub.Bulk()
    window, num_sent, rate = BULK_MIN_WINDOW_BYTES, 0, 0.0
    replies: collections.deque[pb.BulkSummary] = collections.deque([pb.BulkSummary()])
    try:
        while replies[-1].num_bytes < max_bytes and not (replies[-1].timed_bytes and replies[-1].timed_s >= max_s):
            while num_sent < max_bytes and num_sent - replies[-1].num_bytes < window:
                # at least two chunks, so that one arrives after the first and is timed
                size = min(max(BULK_CHUNK_BYTES, window // 8), BULK_MAX_CHUNK_BYTES, max(1, max_bytes // 2),
                           max_bytes - num_sent)
                await call.write(pb.BulkChunk(data=bytes(size)))
                num_sent += size
            reply = await call.read()
            if reply is grpc.aio.EOF:
                raise InvalidInput(f"bulk: the peer ended the stream after {replies[-1].num_bytes} of {num_sent} bytes")
            replies.append(reply)
            while len(replies) > 2 and replies[1].timed_s <= reply.timed_s / 2:
                replies.popleft()
            rate = later_half_rate(replies)
            if reply.timed_s >= rtt_s:      # a round trip's worth: not a burst of chunks the kernel held
                window = max(BULK_MIN_WINDOW_BYTES, int(rate * max(2 * rtt_s, BULK_BACKLOG_S)))
        if replies[-1].num_bytes >= num_sent:       # all arrived: end the stream cleanly
            await call.done_writing()
            await call.code()
    finally:    # bytes still on their way are at most a window: dropping the stream leaves no backlog on the link
        call.cancel()
    if rate <= 0:
        raise InvalidInput(f"bulk: {replies[-1].num_bytes} bytes arrived in one chunk, nothing to time "
                           f"(max_bytes {max_bytes})")
    return rate


def later_half_rate(replies: Sequence[pb.BulkSummary]) -> float:
    """Bytes/s: the least-squares slope of the bytes that arrived against the time they took, over replies (gRPC
    hands chunks over in bursts: two points alone can be a burst's); 0 while they span no time."""
    n = len(replies)
    mean_s = sum(r.timed_s for r in replies) / n
    mean_bytes = sum(r.timed_bytes for r in replies) / n
    spread = sum((r.timed_s - mean_s) ** 2 for r in replies)
    if spread <= 0:
        return 0.0
    return sum((r.timed_s - mean_s) * (r.timed_bytes - mean_bytes) for r in replies) / spread


async def measure_peers(peers: Sequence[Peer], *, timeout_s: float = PEER_TIMEOUT_S, num_pings: int = NUM_PINGS,
                        payload_bytes: int = PAYLOAD_BYTES, bulk_max_bytes: int = BULK_MAX_BYTES,
                        bulk_max_s: float = BULK_MAX_S) -> list[LinkMeasurement]:
    """Measures each peer in turn (so probes do not share the wire); a peer that fails gets an error, never raises."""
    measurements = []
    for peer in peers:
        try:
            rtt_s, bandwidth = await asyncio.wait_for(
                measure_link(peer.address, num_pings=num_pings, payload_bytes=payload_bytes,
                             bulk_max_bytes=bulk_max_bytes, bulk_max_s=bulk_max_s), timeout_s)
            measurements.append(LinkMeasurement(peer.agent_id, rtt_s, bandwidth))
        except Exception as exc:  # one unreachable or misbehaving peer must not hide the others' links
            error = describe_error(exc)
            log.debug("link probe to %s at %s failed: %s", peer.agent_id, peer.address, error)
            measurements.append(LinkMeasurement(peer.agent_id, error=error))
    return measurements

