"""The Stage service over real gRPC: sessions batch together, a bad one fails alone, opens are answered."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stratamesh.agent.dataplane import StageService
from stratamesh.agent.engine.stage_engine import EngineConfig, StageEngine
from stratamesh.agent.stages import StageHost
from stratamesh.fleet.sessions import SamplingParams, SessionClose, SessionOpen, StepChunk
from stratamesh.fleet.stages import Assignment, StageSpec
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.tracing import traceparent
from stratamesh.fleet.wire.channels import bind, make_channel, make_server
from stratamesh.fleet.wire.stream import OutboundStream
from stratamesh.kernels.models.decoder import load_stage
from tests.patience import eventually


class Origin(pb_grpc.OriginServicer):
    def __init__(self) -> None:
        self.events: dict[str, asyncio.Queue[pb.TokenEvent]] = {}

    def queue(self, session_id: str) -> asyncio.Queue[pb.TokenEvent]:
        return self.events.setdefault(session_id, asyncio.Queue())

    async def next(self, session_id: str) -> pb.TokenEvent:
        return await asyncio.wait_for(self.queue(session_id).get(), 10)

    async def Deliver(self, request_iterator, context):
        async for batch in request_iterator:
            for event in batch.events:
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
async def stage(served):
    """One agent serving the whole model as a single stage, and an origin to receive its tokens."""
    yield served[:5]


@pytest.fixture
async def served(tiny_model):
    """What `stage` yields, and the StageService itself."""
    spec = StageSpec("m", str(tiny_model("llama", num_layers=2, hidden_size=64, intermediate_size=128)), 0, 2, 2,
                     kv_block_size=4)
    async with serving(spec, "a0", "agent-under-test") as (host, service, origin, address, stream):
        yield spec, stream, origin, address, host, service


@asynccontextmanager
async def serving(spec: StageSpec, assignment_id: str, agent_id: str):
    """An agent serving one stage over real gRPC, its own origin, and the origin's Push stream to it."""
    host = StageHost(EngineConfig(kv_cache_bytes=1 << 20))
    await host.load(Assignment(assignment_id, spec))
    service, origin, server = StageService(host, agent_id), Origin(), make_server()
    pb_grpc.add_StageServicer_to_server(service, server)
    pb_grpc.add_OriginServicer_to_server(origin, server)
    address = f"127.0.0.1:{bind(server, '127.0.0.1', 0)}"
    await server.start()
    service.start()
    stream = OutboundStream(address, lambda ch, it: pb_grpc.StageStub(ch).Push(it)).start()
    try:
        yield host, service, origin, address, stream
    finally:
        await stream.close()
        await service.close()
        await server.stop(grace=None)
        host.close()


def send(stream: OutboundStream, message, to: str = "") -> None:
    stream.send(convert.stage_message_to_pb(message, to))


async def open_session(stream, origin, address, session_id: str, prompt: list[int], cache: bool = True) -> int:
    send(stream, SessionOpen(session_id, "a0", (), address, SamplingParams(), prompt_token_ids=tuple(prompt),
                             max_cached_tokens=len(prompt) - 1 if cache else 0))
    answer = await origin.next(session_id)
    assert answer.opened and not answer.error
    return answer.cached_tokens


async def decode(stream, origin, session_id: str, prompt: list[int], start: int, num_tokens: int) -> list[int]:
    send(stream, StepChunk(session_id, 0, start, token_ids=tuple(prompt[start:]), sample=True))
    tokens, position = [], len(prompt)
    for step in range(num_tokens):
        event = await origin.next(session_id)
        assert not event.error, event.error
        tokens.append(event.token_id)
        send(stream, StepChunk(session_id, step + 1, position, token_ids=(event.token_id,), sample=True))
        position += 1
    return tokens


async def test_concurrent_sessions_batch_and_each_matches_its_reference(stage) -> None:
    spec, stream, origin, address, host = stage
    prompts = [[5, 17, 42, 99, 7], list(range(30, 52)), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
    for i, prompt in enumerate(prompts):
        assert await open_session(stream, origin, address, f"s{i}", prompt) == 0
    results = await asyncio.gather(*(decode(stream, origin, f"s{i}", p, 0, 10) for i, p in enumerate(prompts)))
    for prompt, tokens in zip(prompts, results, strict=True):
        assert tokens == greedy_reference(spec, prompt, 10)
    # each session's prompt is one token of a step, and each of its decodes another (the serving path's unit)
    assert 3 * 10 <= host.num_step_tokens <= 3 * 11 and host.layers_cpu_s > 0
    for i in range(len(prompts)):
        send(stream, SessionClose(f"s{i}"))
    await eventually(lambda: host.num_sessions == 0)


async def test_a_repeated_prompt_is_served_from_the_prefix_cache(stage) -> None:
    spec, stream, origin, address, _ = stage
    prompt = list(range(40, 61))                                  # 21 tokens: 5 full blocks of 4
    assert await open_session(stream, origin, address, "first", prompt) == 0
    first = await decode(stream, origin, "first", prompt, 0, 4)
    send(stream, SessionClose("first"))
    cached = await open_session(stream, origin, address, "again", prompt)
    assert cached == 20
    assert await decode(stream, origin, "again", prompt, cached, 4) == first
    assert await open_session(stream, origin, address, "nocache", prompt, cache=False) == 0


async def test_a_bad_session_fails_alone_while_another_completes(stage) -> None:
    spec, stream, origin, address, host = stage
    prompt = [5, 17, 42, 99, 7]
    for sid in ("good", "bad"):
        await open_session(stream, origin, address, sid, prompt)
    send(stream, StepChunk("bad", 0, 3, token_ids=(1, 2), sample=True))       # skips positions 0..2
    good = asyncio.create_task(decode(stream, origin, "good", prompt, 0, 8))
    bad = await origin.next("bad")
    assert "start_pos" in bad.error and bad.error_stage == "agent-under-test"
    assert await good == greedy_reference(spec, prompt, 8)
    send(stream, SessionClose("good"))
    await eventually(lambda: host.num_sessions == 0)  # the bad one was dropped, the good one closed


async def test_token_ids_outside_the_vocabulary_fail_the_session(stage) -> None:
    _, stream, origin, address, _ = stage
    await open_session(stream, origin, address, "s", [1, 2, 3])
    send(stream, StepChunk("s", 0, 0, token_ids=(1, 2, 5000), sample=True))
    assert "token_ids" in (await origin.next("s")).error


async def test_a_wire_message_that_fails_validation_fails_its_session(stage) -> None:
    _, stream, origin, address, _ = stage
    await open_session(stream, origin, address, "s", [1, 2, 3])
    stream.send(pb.StageMessage(chunk=pb.StepChunk(session_id="s", start_pos=-4, token_ids=[1])))
    assert "start_pos" in (await origin.next("s")).error


async def test_a_traced_session_gets_queue_compute_and_send_spans_per_step_and_trace_serves_them(served) -> None:
    spec, stream, origin, address, host, service = served
    trace_id, parent = "ab" * 16, "cd" * 8
    prompt = [5, 17, 42]
    send(stream, SessionOpen("traced", "a0", (), address, SamplingParams(), traceparent(trace_id, parent),
                             tuple(prompt)))
    await open_session(stream, origin, address, "plain", prompt)   # untraced: no spans
    position, token = 0, None
    for step in range(4):
        ids = tuple(prompt) if step == 0 else (token,)
        for session_id, traced in (("traced", trace_id), ("plain", "")):
            send(stream, StepChunk(session_id, step, position, ids, True, traced, sent_unix_ns=time.time_ns()))
        events = {}
        while len(events) < 2:
            event = await origin.next("traced") if "traced" not in events else await origin.next("plain")
            if not event.opened:
                events[event.session_id] = event
        assert events["traced"].sent_unix_ns > 0   # the last stage stamps when it finished the step
        token, position = events["traced"].token_id, position + len(ids)
    channel = make_channel(address)
    reply = await pb_grpc.StageStub(channel).Trace(pb.TraceRequest(trace_id=trace_id))
    await channel.close()
    spans = convert.spans_from_pb(reply)
    assert service.observer.spans.trace("") == []
    assert {(s.name, int(s.attributes["stratamesh.step"])) for s in spans} == {
        (name, step) for name in ("queue", "compute", "send") for step in range(4)}
    assert all(s.trace_id == trace_id and s.parent_span_id == parent and s.end_unix_ns >= s.start_unix_ns
               and s.attributes["stratamesh.session"] == "traced" and s.attributes["stratamesh.layers"] == "0-2"
               for s in spans)
    by_step = {(s.name, s.attributes["stratamesh.step"]): s for s in spans}
    for step in map(str, range(4)):   # send ends as the chunk arrives; queue runs from then to the compute
        assert by_step["send", step].end_unix_ns == by_step["queue", step].start_unix_ns
        assert by_step["queue", step].end_unix_ns == by_step["compute", step].start_unix_ns
    families = {f.name: f for f in text_string_to_metric_families(
        generate_latest(service.observer.metrics.registry).decode())}
    (count,) = [s.value for s in families["stratamesh:stage_compute_seconds"].samples if s.name.endswith("_count")]
    assert count >= 4
    tokens = [s for s in families["stratamesh:stage_tokens"].samples if s.name.endswith("_total")]
    assert tokens[0].labels == {"model_name": "m", "stage": "0-2"} and tokens[0].value == 2 * (3 + 3)
    sent = [s.value for s in families["stratamesh:hop_transfer_bytes"].samples if s.name.endswith("_total")]
    assert sum(sent) > 0


async def test_a_mixture_of_experts_stage_exports_its_experts_tokens_and_each_steps_imbalance(tiny_model) -> None:
    """Mixtral's tiny model (2 sparse layers, 2 of 5 experts a token): /metrics counts each expert's tokens, 2 x 2
    for every token the stage ran, and observes one imbalance a step; its tokens are still greedy decoding's."""
    spec = StageSpec("m", str(tiny_model("mixtral", num_layers=2, hidden_size=64, intermediate_size=96)), 0, 2, 2,
                     kv_block_size=4)
    async with serving(spec, "a0", "agent-under-test") as (host, service, origin, address, stream):
        prompt = [5, 17, 42, 99, 7, 8]
        await open_session(stream, origin, address, "s", prompt, cache=False)
        assert await decode(stream, origin, "s", prompt, 0, 6) == greedy_reference(spec, prompt, 6)
        await eventually(lambda: not host.engine("a0").scheduler.has_work)
        families = {f.name: f for f in text_string_to_metric_families(
            generate_latest(service.observer.metrics.registry).decode())}
    (tokens,) = [s.value for s in families["stratamesh:stage_tokens"].samples if s.name.endswith("_total")]
    experts = {s.labels["expert"]: s.value for s in families["stratamesh:expert_tokens"].samples
               if s.name.endswith("_total")}
    assert set(experts) <= {str(e) for e in range(5)} and sum(experts.values()) == tokens * 2 * 2
    (steps,) = [s.value for s in families["stratamesh:stage_compute_seconds"].samples if s.name.endswith("_count")]
    imbalance = {s.name: s for s in families["stratamesh:expert_step_imbalance"].samples}
    assert imbalance["stratamesh:expert_step_imbalance_count"].value == steps
    assert 1.0 <= imbalance["stratamesh:expert_step_imbalance_sum"].value / steps <= 5 / 2


async def test_a_bug_after_a_step_fails_its_sessions_saying_so_and_the_stage_serves_on(stage, monkeypatch) -> None:
    """An exception out of the engine after a step (a bug, not a bad message) fails the step's sessions with its
    name, instead of ending the stage's worker (which left every later message unanswered)."""
    spec, stream, origin, address, host = stage
    postprocess, failed = StageEngine.postprocess, []

    def broken_once(engine, batch, output, outbox) -> None:
        if not failed:
            failed.append(batch)
            raise RuntimeError("a bug")
        postprocess(engine, batch, output, outbox)

    monkeypatch.setattr(StageEngine, "postprocess", broken_once)
    await open_session(stream, origin, address, "broken", [5, 17, 42])
    send(stream, StepChunk("broken", 0, 0, token_ids=(5, 17, 42), sample=True))
    event = await origin.next("broken")
    assert event.error == "RuntimeError: a bug"
    await open_session(stream, origin, address, "after", [5, 17, 42])
    assert await decode(stream, origin, "after", [5, 17, 42], 0, 3) == greedy_reference(spec, [5, 17, 42], 3)
