"""The wire: generated stubs match the proto, streams deliver (the converter's own tests: test_convert.py)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from stratamesh.fleet.errors import StageFailed
from stratamesh.fleet.wire import gen
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import bind, make_server
from stratamesh.fleet.wire.stream import OutboundStream, StreamPool
from tests.patience import eventually


# The generators stamp their own versions (the oldest runtime the stubs accept) into what they write: a grpcio-tools
# or protobuf release newer than the one the stubs were generated with changes those lines and nothing else.
_STAMPS = (re.compile(r"^(GRPC_GENERATED_VERSION = ')[^']*'", re.MULTILINE),
           re.compile(r"^(# Protobuf Python Version: ).*$", re.MULTILINE),
           re.compile(r"(ValidateProtobufRuntimeVersion\(\n\s*_runtime_version\.Domain\.PUBLIC,\n)(\s*\d+,\n){3}"))


def _unstamped(text: str) -> str:
    for stamp in _STAMPS:
        text = stamp.sub(r"\1<version>", text)
    return text


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    for fresh in gen.generate(tmp_path):
        committed = gen.HERE / fresh.name
        assert _unstamped(committed.read_text()).count("<version>") == {"mesh_pb2.py": 2, "mesh_pb2_grpc.py": 1}.get(
            fresh.name, 0)
        assert _unstamped(fresh.read_text()) == _unstamped(committed.read_text()), \
            f"{fresh.name} is stale: run the generator"


class _Sink(pb_grpc.OriginServicer):
    def __init__(self) -> None:
        self.events: asyncio.Queue[pb.TokenEvent] = asyncio.Queue()

    async def Deliver(self, request_iterator, context):
        count = 0
        async for batch in request_iterator:
            for event in batch.events:
                count += 1
                self.events.put_nowait(event)
        return pb.DeliverSummary(num_events=count)


def _open(channel, it):
    return pb_grpc.OriginStub(channel).Deliver(it)


async def test_outbound_stream_delivers_in_order_and_reports_a_dead_peer() -> None:
    sink, server = _Sink(), make_server()
    pb_grpc.add_OriginServicer_to_server(sink, server)
    port = bind(server, "127.0.0.1", 0)
    await server.start()
    broken: list[BaseException | None] = []
    pool = StreamPool(_open, on_broken=lambda stream, exc: broken.append(exc))
    stream = pool.get(f"127.0.0.1:{port}")
    for step in range(100):
        stream.send(pb.TokenBatch(events=[pb.TokenEvent(session_id="s", step=step, token_id=step)]))
    got = [(await asyncio.wait_for(sink.events.get(), 5)).step for _ in range(100)]
    assert got == list(range(100))
    assert pool.get(f"127.0.0.1:{port}") is stream
    await server.stop(grace=None)
    await eventually(lambda: broken)
    assert isinstance(broken[0], StageFailed)
    with pytest.raises(StageFailed):
        stream.send(pb.TokenBatch())
    await pool.close()


async def test_a_stream_to_nobody_breaks_instead_of_hanging() -> None:
    broken = asyncio.Event()
    stream = OutboundStream("127.0.0.1:1", _open, on_broken=lambda s, e: broken.set()).start()
    stream.send(pb.TokenBatch())
    await asyncio.wait_for(broken.wait(), 20)
    assert not stream.alive
    await stream.close()
