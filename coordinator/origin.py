"""The origin: owns each generation, sends token ids to stage 1 and takes sampled tokens from the last."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from stratamesh.fleet.errors import MeshError, StageFailed
from stratamesh.fleet.types import Hop, SamplingParams, SessionClose, SessionOpen, StepChunk, TokenEvent
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import CHUNK_BYTES
from stratamesh.fleet.wire.stream import OutboundStream, StreamPool

log = logging.getLogger(__name__)

# Prefill is sent in chunks of at most this many tokens (and under CHUNK_BYTES of activations).
MAX_CHUNK_TOKENS = 512


@dataclass(slots=True)
class _Live:
    first_hop: str
    events: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)


def chunk_tokens(hidden_size: int, activation_bytes: int = 4) -> int:
    """Tokens per prefill chunk so the activations a stage sends stay under CHUNK_BYTES."""
    return max(1, min(MAX_CHUNK_TOKENS, CHUNK_BYTES // (hidden_size * activation_bytes)))


class Origin:
    """Drives generations over routes of stages; tokens come back through deliver()."""

    def __init__(self, address: str, step_timeout_s: float = 60.0):
        self.address = address
        self._step_timeout_s = step_timeout_s
        self._streams = StreamPool(lambda ch, it: pb_grpc.StageStub(ch).Push(it),
                                   on_broken=self._stream_broken)
        self._sessions: dict[str, _Live] = {}

    async def close(self) -> None:
        await self._streams.close()

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def deliver(self, event: TokenEvent) -> None:
        """Hands a token (or a stage's error) to the generation waiting for it."""
        live = self._sessions.get(event.session_id)
        if live is None:
            log.debug("token for finished session %s dropped", event.session_id)
            return
        live.events.put_nowait(event)

    async def generate(self, route: Sequence[Hop], prompt_ids: Sequence[int], params: SamplingParams,
                       session_id: str, hidden_size: int) -> AsyncIterator[int]:
        """Yields sampled token ids until the caller stops iterating; raises StageFailed."""
        if session_id in self._sessions:
            raise StageFailed(f"session {session_id} is already running")
        live = self._sessions[session_id] = _Live(route[0].address)
        stream = self._streams.get(route[0].address)
        try:
            stream.send(convert.stage_message_to_pb(SessionOpen(
                session_id, route[0].assignment_id, tuple(route[1:]), self.address, params)))
            step = self._send_prefill(stream, session_id, prompt_ids, chunk_tokens(hidden_size))
            position = len(prompt_ids)
            while True:
                token = await self._next_token(live, session_id)
                # Send the next step before handing the token out: the pipeline works meanwhile.
                stream.send(convert.stage_message_to_pb(
                    StepChunk(session_id, step, position, token_ids=(token,), sample=True)))
                step += 1
                position += 1
                yield token
        finally:
            del self._sessions[session_id]
            if stream.alive:
                stream.send(convert.stage_message_to_pb(SessionClose(session_id)))

    def _send_prefill(self, stream: OutboundStream, session_id: str, prompt_ids: Sequence[int],
                      size: int) -> int:
        step = 0
        for start in range(0, len(prompt_ids), size):
            piece = tuple(prompt_ids[start:start + size])
            last = start + size >= len(prompt_ids)
            stream.send(convert.stage_message_to_pb(
                StepChunk(session_id, step, start, token_ids=piece, sample=last)))
            step += 1
        return step

    async def _next_token(self, live: _Live, session_id: str) -> int:
        try:
            event = await asyncio.wait_for(live.events.get(), self._step_timeout_s)
        except asyncio.TimeoutError:
            raise StageFailed(f"no token for session {session_id} in {self._step_timeout_s:.0f} s") from None
        if event.error:
            raise StageFailed(f"stage {event.error_stage or '?'} failed: {event.error}")
        return event.token_id

    def _stream_broken(self, stream: OutboundStream, exc: BaseException | None) -> None:
        for session_id, live in self._sessions.items():
            if live.first_hop == stream.address:
                live.events.put_nowait(TokenEvent(session_id, -1, error=str(exc), error_stage=stream.address))


class OriginService(pb_grpc.OriginServicer):
    """The Origin gRPC service: last stages stream their tokens here."""

    def __init__(self, origin: Origin):
        self._origin = origin

    async def Deliver(self, request_iterator: AsyncIterator[pb.TokenEvent],
                      context: grpc.aio.ServicerContext) -> pb.DeliverSummary:
        num_events = 0
        async for message in request_iterator:
            num_events += 1
            try:
                self._origin.deliver(convert.token_event_from_pb(message))
            except MeshError as exc:
                log.info("dropped a token event: %s", exc)
        return pb.DeliverSummary(num_events=num_events)
