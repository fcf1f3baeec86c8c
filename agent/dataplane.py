"""The Stage gRPC service: receives a hop's stream, runs each message in order, streams the result on."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import Executor

import grpc

from stratamesh.agent.engine.stage_runner import StageRunner
from stratamesh.fleet.errors import InvalidInput, MeshError, StageFailed
from stratamesh.fleet.types import SessionClose, SessionOpen, StepChunk, TokenEvent
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.stream import OutboundStream, StreamPool

log = logging.getLogger(__name__)

# Chunks of at most this many tokens run on the event loop; bigger ones (prefill) on the runner thread.
INLINE_MAX_TOKENS = 4


def _num_tokens(chunk: StepChunk) -> int:
    return chunk.hidden.shape[0] if chunk.hidden is not None and chunk.hidden.shape else len(chunk.token_ids)


class StageService(pb_grpc.StageServicer):
    """Feeds every inbound message to one worker, so each session's chunks run in arrival order."""

    def __init__(self, runner: StageRunner, executor: Executor, agent_id: str):
        self._runner = runner
        self._executor = executor
        self._agent_id = agent_id
        self._inbox: asyncio.Queue[convert.StageMessage] = asyncio.Queue()
        self._next_stages = StreamPool(lambda ch, it: pb_grpc.StageStub(ch).Push(it),
                                       on_broken=self._next_broken)
        self._origins = StreamPool(lambda ch, it: pb_grpc.OriginStub(ch).Deliver(it))
        self._worker: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._worker = asyncio.get_running_loop().create_task(self._work())

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        await self._next_stages.close()
        await self._origins.close()

    # ------------------------------------------------------------ gRPC
    async def Push(self, request_iterator: AsyncIterator[pb.StageMessage],
                   context: grpc.aio.ServicerContext) -> pb.PushSummary:
        num_messages = 0
        async for message in request_iterator:
            num_messages += 1
            try:
                self._inbox.put_nowait(convert.stage_message_from_pb(message))
            except InvalidInput as exc:
                self._reject(message, exc)
        return pb.PushSummary(num_messages=num_messages)

    async def Info(self, request: pb.StageInfoRequest,
                   context: grpc.aio.ServicerContext) -> pb.StageInfo:
        runner = self._runner
        return convert.stage_info_to_pb(self._agent_id, runner.assignments(), runner.tensor_names(),
                                        runner.param_bytes(), runner.num_sessions)

    # ------------------------------------------------------------ worker
    async def _work(self) -> None:
        while True:
            message = await self._inbox.get()
            try:
                await self._handle(message)
            except MeshError as exc:
                self._fail(message.session_id, exc)
            except Exception as exc:  # a bug in one session must not stop the stage for the others
                log.exception("session %s failed", message.session_id)
                self._fail(message.session_id, exc)

    async def _handle(self, message: convert.StageMessage) -> None:
        match message:
            case SessionOpen():
                self._runner.open(message)
                if message.route:
                    self._send_next(message.route[0].address, message.forwarded())
            case StepChunk():
                await self._step(message)
            case _Poison():
                raise message.exc
            case SessionClose():
                session = self._runner.close(message.session_id)
                if session is not None and session.open.route:
                    self._send_next(session.open.route[0].address, message)

    async def _step(self, chunk: StepChunk) -> None:
        session = self._runner.session(chunk.session_id)
        if _num_tokens(chunk) <= INLINE_MAX_TOKENS:
            # A decode step takes about a millisecond: a thread hand-off would cost a good part of it.
            result = self._runner.run(chunk)
        else:
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(self._executor, self._runner.run, chunk)
        if session is None:
            return
        if result.hidden is not None:
            forwarded = StepChunk(chunk.session_id, chunk.step, chunk.start_pos,
                                  hidden=result.hidden, sample=chunk.sample)
            self._send_next(session.open.route[0].address, forwarded)
        elif result.token_id is not None:
            event = TokenEvent(chunk.session_id, chunk.step, result.token_id)
            self._origins.get(session.open.origin).send(convert.token_event_to_pb(event))

    def _send_next(self, address: str, message: convert.StageMessage) -> None:
        self._next_stages.get(address).send(convert.stage_message_to_pb(message))

    # ------------------------------------------------------------ failures
    def _fail(self, session_id: str, exc: BaseException) -> None:
        """Ends the session here and downstream, and tells its origin why."""
        session = self._runner.close(session_id)
        if session is None:
            log.info("dropped a message for unknown session %s: %s", session_id, exc)
            return
        log.warning("session %s failed on %s: %s", session_id, self._agent_id, exc)
        if session.open.route:
            try:
                self._send_next(session.open.route[0].address, SessionClose(session_id))
            except MeshError:
                pass
        event = TokenEvent(session_id, -1, error=str(exc), error_stage=self._agent_id)
        try:
            self._origins.get(session.open.origin).send(convert.token_event_to_pb(event))
        except MeshError as send_exc:
            log.warning("could not tell origin %s: %s", session.open.origin, send_exc)

    def _next_broken(self, stream: OutboundStream, exc: BaseException | None) -> None:
        """Fails, in order, every session whose next hop was on the broken stream."""
        for session_id in self._runner.sessions_via(stream.address):
            self._inbox.put_nowait(_Poison(session_id, StageFailed(str(exc))))

    def _reject(self, message: pb.StageMessage, exc: MeshError) -> None:
        kind = message.WhichOneof("kind")
        session_id = getattr(message, kind).session_id if kind else ""
        if session_id and self._runner.session(session_id) is not None:
            # Queue the failure behind the session's earlier messages.
            self._inbox.put_nowait(_Poison(session_id, exc))
        else:
            log.info("rejected a stage message: %s", exc)


class _Poison:
    """Stands in the inbox for a malformed message of a known session: fails it in order."""

    def __init__(self, session_id: str, exc: MeshError):
        self.session_id = session_id
        self.exc = exc
