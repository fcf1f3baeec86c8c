"""KV migration over real gRPC: a session moves between two agents mid-generation and goes on as if it had not."""

from __future__ import annotations

import asyncio
import zlib
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import grpc
import pytest
import torch
from prometheus_client import generate_latest

from stratamesh.agent import kv_transfer
from stratamesh.agent.dataplane import StageService
from stratamesh.agent.engine.stage_engine import SessionKv
from stratamesh.agent.stages import StageHost
from stratamesh.fleet.kv import KvExportRequest, KvImportRequest, KvLayout, KvPiece
from stratamesh.fleet.sessions import Hop, SamplingParams, SessionOpen, StepChunk
from stratamesh.fleet.stages import StageSpec
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import make_channel
from stratamesh.fleet.wire.stream import OutboundStream
from tests.agent.test_dataplane import Origin, greedy_reference, send, serving
from tests.patience import eventually

PROMPT = list(range(40, 63))        # 23 tokens: 5 full blocks of 4 and a partial one


@dataclass
class Agent:
    spec: StageSpec
    assignment_id: str
    host: StageHost
    service: StageService
    address: str
    stream: OutboundStream          # the origin's Push stream to it
    origin: Origin                  # where its tokens go (every agent here serves the whole model)

    def open(self, session_id: str, prompt: list[int], resume_from: str = "") -> None:
        send(self.stream, SessionOpen(session_id, self.assignment_id, (), self.address, SamplingParams(),
                                      prompt_token_ids=tuple(prompt), max_cached_tokens=len(prompt) - 1,
                                      resume_from=resume_from))

    async def opened(self, session_id: str) -> int:
        answer = await self.origin.next(session_id)
        assert answer.opened and not answer.error, answer.error
        return answer.cached_tokens

    async def generate(self, session_id: str, token_ids: list[int], start: int, num_tokens: int) -> list[int]:
        """Sends token_ids[start:], then decodes; stops quiet: the last token is not sent on."""
        send(self.stream, StepChunk(session_id, 0, start, tuple(token_ids[start:]), sample=True))
        tokens = []
        for step in range(num_tokens):
            event = await self.origin.next(session_id)
            assert not event.error, event.error
            tokens.append(event.token_id)
            if step + 1 < num_tokens:
                send(self.stream, StepChunk(session_id, step + 1, len(token_ids) + step, (event.token_id,), True))
        return tokens

    def metric(self, name: str, labels: str) -> float:
        text = generate_latest(self.service.observer.metrics.registry).decode()
        lines = [line for line in text.splitlines() if line.startswith(f"{name}{{") and labels in line]
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


@asynccontextmanager
async def agent(spec: StageSpec, assignment_id: str):
    async with serving(spec, assignment_id, f"agent-{assignment_id}") as (host, service, origin, address, stream):
        yield Agent(spec, assignment_id, host, service, address, stream, origin)


@pytest.fixture
def spec(tiny_model) -> StageSpec:
    path = tiny_model("llama", num_layers=2, hidden_size=64, intermediate_size=128)
    return StageSpec("m", str(path), 0, 2, 2, kv_block_size=4)


async def import_kv(importer: Agent, session_id: str, source: Agent):
    channel = make_channel(importer.address)
    try:
        request = KvImportRequest(session_id, importer.assignment_id, Hop(source.address, source.assignment_id))
        answer = await pb_grpc.StageStub(channel).ImportKv(convert.kv_import_request_to_pb(request))
        return convert.kv_import_summary_from_pb(answer)
    finally:
        await channel.close()


async def export_kv(source: Agent, request: KvExportRequest) -> list:
    channel = make_channel(source.address)
    try:
        return [m async for m in pb_grpc.StageStub(channel).ExportKv(convert.kv_export_request_to_pb(request))]
    finally:
        await channel.close()


async def test_a_session_moved_with_its_kv_continues_identically_without_recompute(spec) -> None:
    async with agent(spec, "a0") as a, agent(spec, "b0") as b:
        a.open("s", PROMPT)
        assert await a.opened("s") == 0
        before = await a.generate("s", PROMPT, 0, 5)

        summary = await import_kv(b, "s", a)
        history = PROMPT + before           # the last token has no KV yet: it is the next step's input
        assert summary.num_tokens == len(history) - 1
        layout = b.host.engines["b0"].kv_layout()
        # K and V, of 2 layers, for every position but the newest, in float32
        assert summary.num_bytes == 2 * 2 * (len(history) - 1) * layout.num_kv_heads * layout.head_dim * 4
        await eventually(lambda: a.host.num_sessions == 0
                         and a.host.engines["a0"].scheduler.block_manager.tables == {})   # the source let it go

        b.open("s.1", history, resume_from="s")
        assert await b.opened("s.1") == len(history) - 1     # every position but the newest is held
        after = await b.generate("s.1", history, len(history) - 1, 7)

        assert before + after == greedy_reference(spec, PROMPT, 12)
        assert b.metric("stratamesh:stage_prefill_tokens_total", "") == 0   # decodes only: no recompute
        assert b.metric("stratamesh:stage_tokens_total", "") == 7
        assert b.metric("stratamesh:kv_migrated_bytes_total", 'direction="import"') == summary.num_bytes
        assert a.metric("stratamesh:kv_migrated_sessions_total", 'direction="export"') == 1


async def test_a_hand_off_asked_before_the_prefill_pulls_once_the_prompt_is_computed(spec) -> None:
    """A prefill/decode hand-off asks for the KV as the prefill starts: the source's export waits for the step that
    completes the prompt there (not for a duration), and the importer then decodes as the source would have."""
    async with agent(spec, "a0") as a, agent(spec, "b0") as b:
        channel = make_channel(b.address)
        request = KvImportRequest("s", "b0", Hop(a.address, "a0"), wait_for_prefill=True)
        pull = asyncio.ensure_future(pb_grpc.StageStub(channel).ImportKv(convert.kv_import_request_to_pb(request)))
        try:
            # the export waits at the source for the session, which is not even open there yet
            await wait_for_waiting_call(a)
            assert not pull.done() and b.host.engines["b0"].parked == set()
            a.open("s", PROMPT)
            await a.opened("s")
            first = await a.generate("s", PROMPT, 0, 1)          # the prefill, and its token: quiet after
            summary = convert.kv_import_summary_from_pb(await pull)
        finally:
            await channel.close()
        assert summary.num_tokens == len(PROMPT) and a.host.num_sessions == 0
        history = PROMPT + first
        b.open("s.1", history, resume_from="s")
        assert await b.opened("s.1") == len(PROMPT)
        assert first + await b.generate("s.1", history, len(PROMPT), 6) == greedy_reference(spec, PROMPT, 7)
        assert b.metric("stratamesh:stage_prefill_tokens_total", "") == 0


async def wait_for_waiting_call(a: Agent, timeout_s: float = 10.0) -> None:
    """Until the source holds a call waiting for a step (an event, polled: the service exposes no hook)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not a.service._waiting:
        assert asyncio.get_running_loop().time() < deadline, "the export never reached the source"
        await asyncio.sleep(0.01)


async def test_an_import_nobody_resumes_is_freed_and_a_resume_of_an_unknown_session_opens_afresh(
        spec, monkeypatch) -> None:
    monkeypatch.setattr(kv_transfer, "PARK_S", 0.2)
    async with agent(spec, "a0") as a, agent(spec, "b0") as b:
        a.open("s", PROMPT)
        await a.opened("s")
        first = await a.generate("s", PROMPT, 0, 3)
        await import_kv(b, "s", a)
        engine = b.host.engines["b0"]
        assert engine.parked == {"s"} and engine.scheduler.block_manager.tables["s"]
        await eventually(lambda: engine.parked == set() and "s" not in engine.scheduler.block_manager.tables)

        history = PROMPT + first
        b.open("t", history, resume_from="s")           # nothing to resume: an ordinary open (prefix cache)
        cached = await b.opened("t")
        assert cached == 24                             # the imported blocks stayed in the prefix cache
        assert first + await b.generate("t", history, cached, 4) == greedy_reference(spec, PROMPT, 7)


@pytest.mark.parametrize("change, words", [
    ({"block_size": 8}, "block_size 4 here, 8 there"),
    ({"start_layer": 1}, "layers [0, 2) here, [1, 2) there"),
    ({"dtype": "bfloat16"}, "dtype float32 here, bfloat16 there"),
    ({"model_id": "other"}, "model 'm' here, 'other' there"),
])
async def test_an_export_to_a_stage_of_another_layout_is_refused_by_name(spec, change, words) -> None:
    async with agent(spec, "a0") as a:
        a.open("s", PROMPT)
        await a.opened("s")
        await a.generate("s", PROMPT, 0, 2)
        layout = replace(a.host.engines["a0"].kv_layout(), **change)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await export_kv(a, KvExportRequest("s", "a0", layout))
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert words in caught.value.details()
        assert a.host.num_sessions == 1                 # a refused export leaves the session where it is


async def test_an_import_from_a_stage_of_another_block_size_is_refused_and_the_source_keeps_the_session(
        spec) -> None:
    async with agent(spec, "a0") as a, agent(replace(spec, kv_block_size=8), "c0") as c:
        a.open("s", PROMPT)
        await a.opened("s")
        await a.generate("s", PROMPT, 0, 2)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await import_kv(c, "s", a)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "block_size 4 here, 8 there" in caught.value.details()
        assert a.host.num_sessions == 1 and c.host.engines["c0"].parked == set()


async def test_exporting_an_unknown_session_or_from_an_unknown_stage_is_refused(spec) -> None:
    async with agent(spec, "a0") as a:
        layout = a.host.engines["a0"].kv_layout()
        for session_id, assignment_id, words in (("nobody", "a0", "not open"), ("s", "zz", "not served here")):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await export_kv(a, KvExportRequest(session_id, assignment_id, layout))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in caught.value.details()


def session_kv(num_tokens: int = 6) -> tuple[KvLayout, SessionKv]:
    layout = KvLayout("m", 0, 2, "float32", 4, 4, 16)
    return layout, SessionKv("s", tuple(range(num_tokens + 1)), 3, num_tokens, torch.randn(2, 2, num_tokens, 4, 16))


def test_pieces_reassemble_to_the_same_kv_and_a_damaged_piece_or_digest_is_caught() -> None:
    layout, session = session_kv()
    header, data = kv_transfer.seal(layout, session)
    receiver = kv_transfer.KvReceiver(layout)
    receiver.add(header)
    parts = list(kv_transfer.pieces(data, piece_bytes=500))
    assert len(parts) == -(-len(data) // 500) > 1
    for piece in parts:
        receiver.add(piece)
    received, summary = receiver.finish()
    assert torch.equal(received.kv, session.kv) and received.token_ids == session.token_ids
    assert summary.num_pieces == len(parts) and summary.num_bytes == len(data)

    damaged = kv_transfer.KvReceiver(layout)
    damaged.add(header)
    bad = parts[1]
    flipped = bytes([bad.data[0] ^ 1]) + bad.data[1:]
    damaged.add(parts[0])
    with pytest.raises(kv_transfer.KvCorrupt, match="CRC-32"):
        damaged.add(replace(bad, data=flipped))
    with pytest.raises(kv_transfer.KvCorrupt, match="does not continue"):
        damaged.add(parts[2])                           # a piece skipped

    forged = kv_transfer.KvReceiver(layout)             # pieces that pass their CRC but not the header's digest
    forged.add(header)
    changed = bytes([parts[0].data[0] ^ 1]) + parts[0].data[1:]
    forged.add(KvPiece(0, changed, zlib.crc32(changed)))
    for piece in parts[1:]:
        forged.add(piece)
    with pytest.raises(kv_transfer.KvCorrupt, match="digest differs"):
        forged.finish()
