"""The origin's request path on its own: a generation's attempts over fake first stages (real gRPC servers in this
process that record what the origin sends), with the last stage's answers delivered to the session table by the test,
as the Deliver service would."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from contextlib import aclosing

import grpc
import pytest

from stratamesh.coordinator.serving.attempt import Run, chunk_tokens
from stratamesh.coordinator.serving.generation import Generation
from stratamesh.coordinator.serving.records import RequestLog
from stratamesh.coordinator.serving.request import Stops
from stratamesh.coordinator.serving.sessions import SessionTable
from stratamesh.fleet.errors import StageFailed
from stratamesh.fleet.kv import KvImportRequest, KvImportSummary
from stratamesh.fleet.sessions import Hop, SamplingParams, SessionClose, SessionHold, SessionOpen, StepChunk, TokenEvent
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import bind, make_server

PROMPT = [5, 6, 7, 8, 9]
BLOCK_SIZE = 4
WAIT_S = 10.0       # how long a test waits for a message it expects (a limit, not a pace)


class FakeStage(pb_grpc.StageServicer):
    """A first stage: keeps every data-plane message the origin sends it, and answers KV imports."""

    def __init__(self) -> None:
        self.received: asyncio.Queue[object] = asyncio.Queue()
        self.imports: list[KvImportRequest] = []

    async def Push(self, request_iterator: AsyncIterator[pb.StageMessage],
                   context: grpc.aio.ServicerContext) -> pb.PushSummary:
        num = 0
        async for message in request_iterator:
            self.received.put_nowait(convert.stage_message_from_pb(message))
            num += 1
        return pb.PushSummary(num_messages=num)

    async def ImportKv(self, request: pb.KvImportRequest, context: grpc.aio.ServicerContext) -> pb.KvImportSummary:
        self.imports.append(convert.kv_import_request_from_pb(request))
        return convert.kv_import_summary_to_pb(KvImportSummary(num_tokens=len(PROMPT), num_bytes=1000, num_pieces=1))

    async def next(self, kind: type) -> object:
        """The next message of this kind (those of other kinds before it are skipped)."""
        while True:
            message = await asyncio.wait_for(self.received.get(), WAIT_S)
            if isinstance(message, kind):
                return message


class Stages:
    """Fake stages on real gRPC servers, each its own one-stage route."""

    def __init__(self) -> None:
        self.stages: list[FakeStage] = []
        self.routes: list[list[Hop]] = []
        self._servers: list[grpc.aio.Server] = []

    async def add(self) -> FakeStage:
        stage, server = FakeStage(), make_server(tls=None)
        pb_grpc.add_StageServicer_to_server(stage, server)
        port = bind(server, "127.0.0.1", 0, tls=None)
        await server.start()
        self.stages.append(stage)
        self._servers.append(server)
        self.routes.append([Hop(f"127.0.0.1:{port}", f"a{len(self.stages)}")])
        return stage

    async def close(self) -> None:
        for server in self._servers:
            await server.stop(grace=None)


@pytest.fixture
async def stages() -> AsyncIterator[Stages]:
    fakes = Stages()
    yield fakes
    await fakes.close()


class Origin:
    """The origin's parts a generation runs on: the session table, the request log, and who heard of lost stages."""

    def __init__(self) -> None:
        self.sessions = SessionTable(step_timeout_s=WAIT_S)
        self.log = RequestLog()
        self.unreachable: list[str] = []

    def generation(self, routes: RouteScript, max_tokens: int | None = 4,
                   stop_token_ids: frozenset[int] = frozenset()) -> Generation:
        run = Run(self.sessions, self.log, "127.0.0.1:9", self.log.begin("r", len(PROMPT)), SamplingParams(),
                  chunk_tokens(64))
        return Generation(run, routes, PROMPT, Stops(max_tokens, stop_token_ids),
                          on_unreachable=self.unreachable.append)

    def token(self, session_id: str, step: int, token_id: int, **flags: object) -> None:
        """What the last stage delivers."""
        self.sessions.deliver_batch([TokenEvent(session_id, step, token_id, **flags)])


@pytest.fixture
async def origin() -> AsyncIterator[Origin]:
    origin = Origin()
    yield origin
    await origin.sessions.close()


class RouteScript:
    """A route source that hands out the given routes in turn (the last one for good); records what it was asked."""

    def __init__(self, *routes: list[Hop]) -> None:
        self.routes = list(routes)
        self.asked: list[tuple[frozenset[str], tuple[int, ...]]] = []

    async def __call__(self, avoid: Collection[str], token_ids: Sequence[int]) -> tuple[list[Hop], int]:
        self.asked.append((frozenset(avoid), tuple(token_ids)))
        return self.routes[min(len(self.asked), len(self.routes)) - 1], BLOCK_SIZE


async def test_a_generation_opens_prefills_and_ends_at_max_tokens(origin: Origin, stages: Stages) -> None:
    stage = await stages.add()
    gen = origin.generation(RouteScript(stages.routes[0]), max_tokens=3)
    reader = asyncio.ensure_future(collect(gen))
    opened = await stage.next(SessionOpen)
    assert (opened.session_id, opened.prompt_token_ids, opened.max_new_tokens) == ("r.0", tuple(PROMPT), 3)
    assert opened.max_cached_tokens == len(PROMPT) - 1 and opened.feed is not None   # a prompt over one block
    origin.token("r.0", 0, -1, opened=True, cached_tokens=BLOCK_SIZE)     # the stages hold its first block
    chunk = await stage.next(StepChunk)
    assert (chunk.start_pos, chunk.token_ids, chunk.sample) == (BLOCK_SIZE, tuple(PROMPT[BLOCK_SIZE:]), True)
    for step, token_id in enumerate((11, 12, 13, 14)):
        origin.token("r.0", step + 1, token_id)
    assert await asyncio.wait_for(reader, WAIT_S) == [11, 12, 13]
    assert (await stage.next(SessionClose)).session_id == "r.0"
    record = origin.log.recent["r"]
    assert (record.state, record.num_tokens, record.cached_tokens) == ("finished", 3, BLOCK_SIZE)
    assert origin.sessions.num_sessions == 0


async def test_a_stop_token_ends_the_generation(origin: Origin, stages: Stages) -> None:
    stage = await stages.add()
    gen = origin.generation(RouteScript(stages.routes[0]), max_tokens=None, stop_token_ids=frozenset({2}))
    reader = asyncio.ensure_future(collect(gen))
    assert (await stage.next(SessionOpen)).stop_token_ids == (2,)
    origin.token("r.0", 0, -1, opened=True)
    for step, token_id in enumerate((11, 2, 12)):
        origin.token("r.0", step + 1, token_id)
    assert await asyncio.wait_for(reader, WAIT_S) == [11, 2]


async def test_a_preempted_attempt_is_replayed_from_the_prompt(origin: Origin, stages: Stages) -> None:
    stage = await stages.add()
    gen = origin.generation(RouteScript(stages.routes[0]), max_tokens=2)
    reader = asyncio.ensure_future(collect(gen))
    await stage.next(SessionOpen)
    origin.token("r.0", 0, -1, preempted=True)
    reopened = await stage.next(SessionOpen)
    assert reopened.session_id == "r.1" and reopened.prompt_token_ids == tuple(PROMPT)
    origin.token("r.1", 0, -1, opened=True)
    origin.token("r.1", 1, 21)
    origin.token("r.1", 2, 22)
    assert await asyncio.wait_for(reader, WAIT_S) == [21, 22]
    assert origin.log.recent["r"].num_preemptions == 1


async def test_a_lost_stage_resumes_on_another_route_with_the_tokens_so_far(origin: Origin, stages: Stages) -> None:
    first, second = await stages.add(), await stages.add()
    routes = RouteScript(stages.routes[0], stages.routes[1])
    gen = origin.generation(routes, max_tokens=3)
    reader = asyncio.ensure_future(collect(gen))
    await first.next(SessionOpen)
    origin.token("r.0", 0, -1, opened=True)
    origin.token("r.0", 1, 31)
    lost = stages.routes[0][0].address
    origin.token("r.0", 2, -1, error="gone", unreachable=lost)
    resumed = await second.next(SessionOpen)
    assert resumed.session_id == "r.1" and resumed.prompt_token_ids == (*PROMPT, 31)
    assert resumed.max_new_tokens == 2                    # what is left of max_tokens
    origin.token("r.1", 0, -1, opened=True)
    origin.token("r.1", 1, 32)
    origin.token("r.1", 2, 33)
    assert await asyncio.wait_for(reader, WAIT_S) == [31, 32, 33]
    assert routes.asked[1] == (frozenset({lost}), (*PROMPT, 31)) and origin.unreachable == [lost]
    assert origin.log.recent["r"].num_failovers == 1


async def test_a_stage_error_fails_the_generation_and_is_recorded(origin: Origin, stages: Stages) -> None:
    stage = await stages.add()
    gen = origin.generation(RouteScript(stages.routes[0]))
    reader = asyncio.ensure_future(collect(gen))
    await stage.next(SessionOpen)
    origin.token("r.0", 0, -1, error="out of memory", error_stage="s1")
    with pytest.raises(StageFailed, match="stage s1 failed: out of memory"):
        await asyncio.wait_for(reader, WAIT_S)
    assert origin.log.recent["r"].state == "failed" and origin.sessions.num_sessions == 0


async def test_a_held_session_moves_to_the_next_route_with_its_kv(origin: Origin, stages: Stages) -> None:
    first, second = await stages.add(), await stages.add()
    gen = origin.generation(RouteScript(stages.routes[0], stages.routes[1]), max_tokens=3)
    reader = asyncio.ensure_future(collect(gen))
    await first.next(SessionOpen)
    origin.token("r.0", 0, -1, opened=True)
    assert origin.sessions.move_off(stages.routes[0][0].address) == 1
    assert (await first.next(SessionHold)).session_id == "r.0"
    origin.token("r.0", 1, 41, held=True)                # the last token before the hold
    resumed = await second.next(SessionOpen)
    assert (resumed.session_id, resumed.resume_from) == ("r.1", "r.0")
    assert [(i.session_id, i.source.address) for i in second.imports] == [("r.0", stages.routes[0][0].address)]
    assert origin.sessions.sessions_through(stages.routes[0][0].address) == 1     # the old stages hold it till it resumes
    origin.token("r.1", 0, -1, opened=True, cached_tokens=len(PROMPT))
    await until(lambda: origin.sessions.sessions_through(stages.routes[0][0].address) == 0)     # resumed: they hold none
    origin.token("r.1", 1, 42)
    origin.token("r.1", 2, 43)
    assert await asyncio.wait_for(reader, WAIT_S) == [41, 42, 43]
    assert origin.log.recent["r"].num_moves == 1 and origin.log.stats.kv_moved_bytes == 1000


async def test_a_move_whose_resume_loses_its_route_leaves_no_session_behind(origin: Origin, stages: Stages) -> None:
    """The bug of issue #46: the attempt loop kept the moved session's id and a token count in one variable, so a
    resume that lost its route before it opened left the session counted on the old stages for good (and a drain
    of them waited for it)."""
    first, second, third = await stages.add(), await stages.add(), await stages.add()
    gen = origin.generation(RouteScript(*stages.routes), max_tokens=3)
    reader = asyncio.ensure_future(collect(gen))
    await first.next(SessionOpen)
    origin.token("r.0", 0, -1, opened=True)
    origin.sessions.move_off(stages.routes[0][0].address)
    origin.token("r.0", 1, 51, held=True)
    await second.next(SessionOpen)
    origin.token("r.1", 0, -1, error="gone", unreachable=stages.routes[1][0].address)   # before it opened
    await third.next(SessionOpen)
    origin.token("r.2", 0, -1, opened=True)
    origin.token("r.2", 1, 52)
    origin.token("r.2", 2, 53)
    assert await asyncio.wait_for(reader, WAIT_S) == [51, 52, 53]
    assert origin.sessions.sessions_through(stages.routes[0][0].address) == 0
    assert origin.sessions.assignments_in_use() == set()


async def test_a_move_whose_resume_fails_leaves_no_session_behind(origin: Origin, stages: Stages) -> None:
    first, second = await stages.add(), await stages.add()
    gen = origin.generation(RouteScript(*stages.routes), max_tokens=3)
    reader = asyncio.ensure_future(collect(gen))
    await first.next(SessionOpen)
    origin.token("r.0", 0, -1, opened=True)
    origin.sessions.move_off(stages.routes[0][0].address)
    origin.token("r.0", 1, 71, held=True)
    await second.next(SessionOpen)
    origin.token("r.1", 0, -1, error="out of memory", error_stage="s2")
    with pytest.raises(StageFailed, match="out of memory"):
        await asyncio.wait_for(reader, WAIT_S)
    assert origin.sessions.sessions_through(stages.routes[0][0].address) == 0
    assert origin.log.recent["r"].state == "failed"


async def test_the_caller_closing_a_generation_closes_its_session(origin: Origin, stages: Stages) -> None:
    stage = await stages.add()
    gen = origin.generation(RouteScript(stages.routes[0]), max_tokens=None)
    async with aclosing(gen) as tokens:
        first = asyncio.ensure_future(anext(tokens))
        await stage.next(SessionOpen)
        origin.token("r.0", 0, -1, opened=True)
        origin.token("r.0", 1, 61)
        assert await asyncio.wait_for(first, WAIT_S) == 61
    assert (await stage.next(SessionClose)).session_id == "r.0"
    assert origin.log.recent["r"].state == "finished" and origin.sessions.num_sessions == 0


async def test_work_counts_prefill_and_decoding_sessions_by_first_stage(origin: Origin) -> None:
    a, b = [Hop("127.0.0.1:1", "a1")], [Hop("127.0.0.1:2", "b1")]
    sessions = origin.sessions
    with sessions.session("s1", a) as one, sessions.session("s2", a) as two, sessions.session("s3", b) as three:
        one.prefill_tokens, two.prefill_tokens, three.prefill_tokens = 100, 0, 7
        work = sessions.work()
        assert (work["a1"].prefill_tokens, work["a1"].num_decoding) == (100, 1)
        assert (work["b1"].prefill_tokens, work["b1"].num_decoding) == (7, 0)
    assert sessions.work() == {}


async def until(done: Callable[[], bool]) -> None:
    """Waits until done() holds (a failure after WAIT_S)."""
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not done():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def collect(tokens: AsyncIterator[int]) -> list[int]:
    return [t async for t in tokens]
