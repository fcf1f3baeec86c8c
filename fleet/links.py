"""The link probe: every agent serves Echo and Bulk; a prober times them for a link's RTT and bandwidth."""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import AsyncIterator, Sequence

import grpc

from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.types import LinkMeasurement, Peer
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import describe_error, make_channel

log = logging.getLogger(__name__)

NUM_PINGS = 20                  # timed round trips; the RTT is their median
NUM_WARMUP_PINGS = 3            # untimed first: they open the connection and warm both ends
PAYLOAD_BYTES = 256             # small, so the RTT is latency and not transfer time on a slow link
BULK_CHUNK_BYTES = 1 << 20      # one Bulk message
BULK_MAX_BYTES = 32 << 20       # a fast link stops here (tens of milliseconds on loopback) ...
BULK_MAX_S = 1.0                # ... and a slow one after this long, whatever it moved
PEER_TIMEOUT_S = 10.0           # one peer's whole probe; past it the peer is reported as failed


class LinkService(pb_grpc.LinkServicer):
    """What a peer times: Echo sends every message back on the stream, Bulk counts the bytes it received."""

    async def Echo(self, request_iterator: AsyncIterator[pb.EchoMessage],
                   context: grpc.aio.ServicerContext) -> None:
        while (message := await context.read()) is not grpc.aio.EOF:
            await context.write(message)

    async def Bulk(self, request_iterator: AsyncIterator[pb.BulkChunk],
                   context: grpc.aio.ServicerContext) -> pb.BulkSummary:
        num_bytes = 0
        async for chunk in request_iterator:
            num_bytes += len(chunk.data)
        return pb.BulkSummary(num_bytes=num_bytes)


async def measure_link(address: str, *, num_pings: int = NUM_PINGS, payload_bytes: int = PAYLOAD_BYTES,
                       bulk_max_bytes: int = BULK_MAX_BYTES, bulk_max_s: float = BULK_MAX_S) -> tuple[float, float]:
    """(rtt_s, bandwidth_bytes_per_s) to the Link service at host:port; raises gRPC errors as they come."""
    async with make_channel(address) as channel:
        stub = pb_grpc.LinkStub(channel)
        rtt_s = statistics.median(await echo_round_trips_s(stub, num_pings, payload_bytes))
        num_bytes, elapsed_s = await bulk_transfer(stub, bulk_max_bytes, bulk_max_s)
    # The clock also ran while the first chunk went out and the summary came back: about one round trip.
    transfer_s = max(elapsed_s - rtt_s, elapsed_s / 2)
    return rtt_s, num_bytes / transfer_s


async def echo_round_trips_s(stub: pb_grpc.LinkStub, num_pings: int, payload_bytes: int) -> list[float]:
    """num_pings round trips of one message each on one open Echo stream, after a few untimed ones."""
    payload = bytes(payload_bytes)
    call = stub.Echo()
    rtts_s = []
    for seq in range(NUM_WARMUP_PINGS + num_pings):
        start = time.perf_counter()
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


async def bulk_transfer(stub: pb_grpc.LinkStub, max_bytes: int, max_s: float) -> tuple[int, float]:
    """Streams chunks until max_bytes are sent or max_s has passed; (bytes the peer got, seconds it took)."""
    chunk = pb.BulkChunk(data=bytes(max(1, min(BULK_CHUNK_BYTES, max_bytes))))
    call = stub.Bulk()
    num_sent = 0
    start = time.perf_counter()
    while num_sent < max_bytes and (num_sent == 0 or time.perf_counter() - start < max_s):
        await call.write(chunk)
        num_sent += len(chunk.data)
    await call.done_writing()
    summary = await call
    elapsed_s = time.perf_counter() - start
    if summary.num_bytes <= 0:
        raise InvalidInput(f"bulk summary: the peer counted {summary.num_bytes} bytes of {num_sent} sent")
    return summary.num_bytes, elapsed_s


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

