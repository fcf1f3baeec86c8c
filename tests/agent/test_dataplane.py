"""The Stage service over real gRPC: one bad session fails alone, the others keep their tokens."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from stratamesh.agent.dataplane import StageService
from stratamesh.agent.engine.stage_runner import StageRunner
from stratamesh.fleet.types import Assignment, SamplingParams, SessionClose, SessionOpen, StageSpec, StepChunk
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import bind, make_server
from stratamesh.fleet.wire.stream import OutboundStream
from stratamesh.kernels.models.decoder import load_stage


class Origin(pb_grpc.OriginServicer):
    def __init__(self) -> None:
        self.events: dict[str, asyncio.Queue[pb.TokenEvent]] = {}

    def queue(self, session_id: str) -> asyncio.Queue[pb.TokenEvent]:
        return self.events.setdefault(session_id, asyncio.Queue())

    async def Deliver(self, request_iterator, context):
        async for event in request_iterator:
            self.queue(event.session_id).put_nowait(event)
        return pb.DeliverSummary()


def greedy_reference(spec: StageSpec, prompt: list[int], num_tokens: int) -> list[int]:
    model = load_stage(spec)
    cache, tokens, ids = model.new_cache(), [], torch.tensor(prompt)
    with torch.inference_mode():
        for _ in range(num_tokens):
            start = cache.num_tokens
            hidden = model.forward(ids, torch.arange(start, start + ids.shape[0]), cache)
            tokens.append(int(model.logits(hidden[-1:])[0].argmax()))
            ids = torch.tensor(tokens[-1:])
    return tokens


@pytest.fixture
async def stage(tiny_model):
    """One agent serving the whole model as a single stage, and an origin to receive its tokens."""
    spec = StageSpec("m", str(tiny_model("llama", num_layers=2, hidden_size=64, intermediate_size=128)), 0, 2, 2)
    runner = StageRunner()
    runner.load(Assignment("a0", spec))
    service = StageService(runner, ThreadPoolExecutor(1), "agent-under-test")
    origin = Origin()
    server = make_server()
    pb_grpc.add_StageServicer_to_server(service, server)
    pb_grpc.add_OriginServicer_to_server(origin, server)
    port = bind(server, "127.0.0.1", 0)
    await server.start()
    service.start()
    stream = OutboundStream(f"127.0.0.1:{port}", lambda ch, it: pb_grpc.StageStub(ch).Push(it)).start()
    yield spec, stream, origin, f"127.0.0.1:{port}", runner
    await stream.close()
    await service.close()
    await server.stop(grace=None)


def send(stream: OutboundStream, message) -> None:
    stream.send(convert.stage_message_to_pb(message))


async def test_a_bad_session_fails_alone_while_another_completes(stage) -> None:
    spec, stream, origin, address, runner = stage
    prompt = [5, 17, 42, 99, 7]
    for sid in ("good", "bad"):
        send(stream, SessionOpen(sid, "a0", (), address, SamplingParams()))
    send(stream, StepChunk("good", 0, 0, token_ids=tuple(prompt), sample=True))
    send(stream, StepChunk("bad", 0, 3, token_ids=(1, 2), sample=True))       # skips positions 0..2
    tokens, position = [], len(prompt)
    for step in range(8):
        event = await asyncio.wait_for(origin.queue("good").get(), 10)
        assert not event.error
        tokens.append(event.token_id)
        send(stream, StepChunk("good", step + 1, position, token_ids=(event.token_id,), sample=True))
        position += 1
    bad = await asyncio.wait_for(origin.queue("bad").get(), 10)
    assert "start_pos" in bad.error and bad.error_stage == "agent-under-test"
    assert tokens == greedy_reference(spec, prompt, 8)
    send(stream, SessionClose("good"))
    await asyncio.sleep(0.2)
    assert runner.num_sessions == 0                 # the bad one was dropped, the good one closed


@pytest.mark.parametrize("chunk, field", [
    (StepChunk("s", 0, 0, token_ids=(5000,), sample=True), "token_ids"),               # outside the vocabulary
    (StepChunk("s", 0, 0, token_ids=(1,), sample=True, hidden=None), None),            # fine: control case
    (StepChunk("nobody", 0, 0, token_ids=(1,), sample=True), None),                    # unknown session: dropped
])
async def test_malformed_chunks_are_reported_to_the_origin(stage, chunk: StepChunk, field: str | None) -> None:
    _, stream, origin, address, _ = stage
    send(stream, SessionOpen("s", "a0", (), address, SamplingParams()))
    send(stream, chunk)
    if chunk.session_id == "nobody":
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(origin.queue("nobody").get(), 0.5)
        return
    event = await asyncio.wait_for(origin.queue("s").get(), 10)
    assert (field in event.error) if field else (not event.error and event.token_id >= 0)


async def test_a_wire_message_that_fails_validation_fails_its_session(stage) -> None:
    _, stream, origin, address, _ = stage
    send(stream, SessionOpen("s", "a0", (), address, SamplingParams()))
    stream.send(pb.StageMessage(chunk=pb.StepChunk(session_id="s", start_pos=-4, token_ids=[1])))
    event = await asyncio.wait_for(origin.queue("s").get(), 10)
    assert "start_pos" in event.error
