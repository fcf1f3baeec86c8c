"""An agent's Link service alone, run inside a test-bed host: `link_peer.py PORT` serves it (plaintext), prints
"ready", and then "bulk N" as each Bulk call ends, N the bytes that call received."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable

import grpc

from stratamesh.fleet.links import LinkService
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import bind, make_server


class ReportingLinkService(LinkService):
    """LinkService that calls on_bulk_end with the bytes each Bulk call received, as the call ends (also when the
    prober ends it under chunks still on their way)."""

    def __init__(self, on_bulk_end: Callable[[int], None]) -> None:
        self._on_bulk_end = on_bulk_end

    async def Bulk(self, request_iterator: AsyncIterator[pb.BulkChunk],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[pb.BulkSummary]:
        latest = pb.BulkSummary()
        try:
            async for latest in super().Bulk(request_iterator, context):
                yield latest
        finally:
            self._on_bulk_end(latest.num_bytes)


async def serve(port: int) -> None:
    server = make_server()
    pb_grpc.add_LinkServicer_to_server(ReportingLinkService(lambda num_bytes: print(f"bulk {num_bytes}", flush=True)),
                                       server)
    bind(server, "0.0.0.0", port)
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1])))
