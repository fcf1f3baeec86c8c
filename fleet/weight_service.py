"""The Weights service: the coordinator and every agent serve the chunks of model files they hold, each checked
against the sha256 asked for before it is sent; fetch_chunks is its client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import grpc

from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.weight_files import read_verified
from stratamesh.fleet.weights import WeightChunk
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc

MAX_CHUNKS_PER_FETCH = 64     # one Fetch call asks for at most this many chunks (256 MiB at 4 MiB a chunk)

# (model id, revision) -> the folders that may hold its files, best first
Roots = Callable[[str, str], Sequence[Path]]


class WeightsService(pb_grpc.WeightsServicer):
    """Streams the chunks asked for, in order, from the folders roots names; one it does not hold is sent as
    missing, so the fetcher asks the next source for it."""

    def __init__(self, roots: Roots) -> None:
        self._roots = roots

    async def Fetch(self, request: pb.WeightFetch, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.WeightData]:
        try:
            model_id, revision, chunks = convert.weight_fetch_from_pb(request)
        except InvalidInput as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if len(chunks) > MAX_CHUNKS_PER_FETCH:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"weight_fetch.chunks: at most {MAX_CHUNKS_PER_FETCH} per call, got {len(chunks)}")
        roots = self._roots(model_id, revision)
        for index, chunk in enumerate(chunks):
            data = await asyncio.to_thread(read_verified, roots, chunk)
            yield convert.weight_data_to_pb(index, data)


async def fetch_chunks(channel: grpc.aio.Channel, model_id: str, revision: str,
                       chunks: Sequence[WeightChunk]) -> AsyncIterator[tuple[WeightChunk, bytes | None]]:
    """Each chunk asked for with its bytes as the server sent them (unverified), or None where it has none."""
    for first in range(0, len(chunks), MAX_CHUNKS_PER_FETCH):
        batch = chunks[first:first + MAX_CHUNKS_PER_FETCH]
        call = pb_grpc.WeightsStub(channel).Fetch(convert.weight_fetch_to_pb(model_id, revision, batch))
        async for message in call:
            if not 0 <= message.index < len(batch):
                raise InvalidInput(f"weight_data.index {message.index} is not one of the {len(batch)} asked for")
            yield batch[message.index], None if message.missing else message.data
