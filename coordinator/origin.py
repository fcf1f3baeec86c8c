"""The origin: owns each generation, sends token ids to stage 1 and takes sampled tokens from the last."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import aclosing, contextmanager
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
# A session preempted for want of KV blocks is replayed after this pause, doubling up to 1 s.
REPLAY_BACKOFF_S = 0.05


def chunk_tokens(hidden_size: int, activation_bytes: int = 4) -> int:
    """Tokens per prefill chunk so the activations a stage sends stay under CHUNK_BYTES."""
    return max(1, min(MAX_CHUNK_TOKENS, CHUNK_BYTES // (hidden_size * activation_bytes)))


@dataclass(slots=True)
class _Live:
    first_hop: str
    events: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)


class _Preempted(Exception):
    """A stage ran out of KV blocks for this attempt; the generation replays it."""


class Generation:
    """One generation: async-iterate for its token ids; aclose() ends it on every stage."""

    def __init__(self, origin: Origin, route: Sequence[Hop], prompt_ids: Sequence[int],
                 params: SamplingParams, request_id: str, hidden_size: int, block_size: int):
        self.cached_tokens = 0      # prompt tokens the stages' prefix caches served
        self.num_preemptions = 0
        self._origin = origin
        self._route = list(route)
        self._prompt = list(prompt_ids)
        self._params = params
        self._request_id = request_id
        self._chunk = chunk_tokens(hidden_size)
        self._block_size = block_size
        self._tokens = self._run()

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> int:
        return await self._tokens.__anext__()

    async def aclose(self) -> None:
        await self._tokens.aclose()

    async def _run(self) -> AsyncIterator[int]:
        emitted: list[int] = []
        while True:
            try:
                async with aclosing(self._attempt(self._prompt + emitted, first=not emitted)) as tokens:
                    async for token in tokens:
                        emitted.append(token)
                        yield token
                return
            except _Preempted:
                self.num_preemptions += 1
                await asyncio.sleep(min(REPLAY_BACKOFF_S * 2 ** (self.num_preemptions - 1), 1.0))

    async def _attempt(self, token_ids: list[int], first: bool) -> AsyncIterator[int]:
        """One pass over the route: open, prefill token_ids (from what is cached), then decode."""
        session_id = f"{self._request_id}.{self.num_preemptions}"
        with self._origin.session(session_id, self._route[0].address) as (live, stream):
            cacheable = len(token_ids) > self._block_size
            stream.send(convert.stage_message_to_pb(SessionOpen(
                session_id, self._route[0].assignment_id, tuple(self._route[1:]), self._origin.address,
                self._params, prompt_token_ids=tuple(token_ids),
                max_cached_tokens=len(token_ids) - 1 if cacheable else 0)))
            cached = (await self._origin.next_event(live, session_id, opened=True)).cached_tokens \
                if cacheable else 0
            if first:
                self.cached_tokens = cached
            step = self._send_prefill(stream, session_id, token_ids, cached)
            position = len(token_ids)
            while True:
                token = (await self._origin.next_event(live, session_id)).token_id
                # Send the next step before handing the token out: the pipeline works meanwhile.
                stream.send(convert.stage_message_to_pb(
                    StepChunk(session_id, step, position, token_ids=(token,), sample=True)))
                step, position = step + 1, position + 1
                yield token

    def _send_prefill(self, stream: OutboundStream, session_id: str, token_ids: list[int], start: int) -> int:
        step = 0
        for begin in range(start, len(token_ids), self._chunk):
            piece = tuple(token_ids[begin:begin + self._chunk])
            last = begin + self._chunk >= len(token_ids)
            stream.send(convert.stage_message_to_pb(
                StepChunk(session_id, step, begin, token_ids=piece, sample=last)))
            step += 1
        return step


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

    def generate(self, route: Sequence[Hop], prompt_ids: Sequence[int], params: SamplingParams,
                 request_id: str, hidden_size: int, block_size: int = 16) -> Generation:
        """A generation over route; iterate it for token ids, aclose() it to stop."""
        return Generation(self, route, prompt_ids, params, request_id, hidden_size, block_size)

    def deliver(self, event: TokenEvent) -> None:
        """Hands a token (or a stage's answer or error) to the generation waiting for it."""
        live = self._sessions.get(event.session_id)
        if live is None:
            log.debug("event for finished session %s dropped", event.session_id)
            return
        live.events.put_nowait(event)

    @contextmanager
    def session(self, session_id: str, first_hop: str) -> Iterator[tuple[_Live, OutboundStream]]:
        """Registers a session for a with-block; closes it on every stage at exit."""
        if session_id in self._sessions:
            raise StageFailed(f"session {session_id} is already running")
        live = self._sessions[session_id] = _Live(first_hop)
        stream = self._streams.get(first_hop)
        try:
            yield live, stream
        finally:
            del self._sessions[session_id]
            if stream.alive:
                stream.send(convert.stage_message_to_pb(SessionClose(session_id)))

    async def next_event(self, live: _Live, session_id: str, opened: bool = False) -> TokenEvent:
        """The session's next token (or, with opened, its open answer); raises on errors."""
        while True:
            try:
                event = await asyncio.wait_for(live.events.get(), self._step_timeout_s)
            except asyncio.TimeoutError:
                raise StageFailed(f"no answer for session {session_id} in {self._step_timeout_s:.0f} s") from None
            if event.preempted:
                raise _Preempted(session_id)
            if event.error:
                raise StageFailed(f"stage {event.error_stage or '?'} failed: {event.error}")
            if event.opened == opened:
                return event
            if opened:
                raise StageFailed(f"session {session_id}: a token came before the open answer")
            # An open answer nobody waited for (the prompt was too short to be cached): skip it.

    def _stream_broken(self, stream: OutboundStream, exc: BaseException | None) -> None:
        for session_id, live in self._sessions.items():
            if live.first_hop == stream.address:
                live.events.put_nowait(TokenEvent(session_id, -1, error=str(exc), error_stage=stream.address))


class OriginService(pb_grpc.OriginServicer):
    """The Origin gRPC service: last stages stream their tokens here."""

    def __init__(self, origin: Origin):
        self._origin = origin

    async def Deliver(self, request_iterator: AsyncIterator[pb.TokenBatch],
                      context: grpc.aio.ServicerContext) -> pb.DeliverSummary:
        num_events = 0
        async for batch in request_iterator:
            for message in batch.events:
                num_events += 1
                try:
                    self._origin.deliver(convert.token_event_from_pb(message))
                except MeshError as exc:
                    log.info("dropped a token event: %s", exc)
        return pb.DeliverSummary(num_events=num_events)
