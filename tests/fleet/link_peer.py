"""An agent's Link service alone, run inside a test-bed host: `link_peer.py PORT` serves it (plaintext), prints
"ready", and then "bulk N" as each Bulk call ends, N the bytes that call received."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import grpc

from stratamesh.fleet.links import LinkService
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import bind, make_server


class ReportingLinkService(LinkService):
    async def Bulk(self, request_iterator: AsyncIterator[pb.BulkChunk],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[pb.BulkSummary]:
        latest = pb.BulkSummary()
        try:
            async for latest in super().Bulk(request_iterator, context):
                yield latest
        finally:            # also when the prober ends the call under chunks still on their way
            print(f"bulk {latest.num_bytes}", flush=True)


async def serve(port: int) -> None:
    server = make_server()
    pb_grpc.add_LinkServicer_to_server(ReportingLinkService(), server)
    bind(server, "0.0.0.0", port)
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1])))
