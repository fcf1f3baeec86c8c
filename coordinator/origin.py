"""The origin: owns each generation, sends token ids to stage 1 and takes sampled tokens from the last."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator, Sequence
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field

import grpc

from stratamesh.coordinator.control.events import RouteWork
from stratamesh.coordinator.kv_moves import move_kv
from stratamesh.fleet.errors import MeshError, StageFailed
from stratamesh.fleet.tracing import SpanStore, new_span_id, new_trace_id, traceparent
from stratamesh.fleet.types import Hop, SamplingParams, SessionClose, SessionHold, SessionOpen, StepChunk, TokenEvent
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import CHUNK_BYTES
from stratamesh.fleet.wire.stream import OutboundStream, RtcDialer, StreamPool

log = logging.getLogger(__name__)

# Prefill is sent in chunks of at most this many tokens (and under CHUNK_BYTES of activations).
MAX_CHUNK_TOKENS = 512
# A session preempted for want of KV blocks is replayed after this pause, doubling up to 1 s.
REPLAY_BACKOFF_S = 0.05
# A generation whose route loses a stage resumes on a new route; after this many losses it fails.
MAX_FAILOVERS = 8

# Where a generation gets its route (and KV block size) for each attempt: given the addresses just lost, to avoid,
# and the token ids the route will prefill (a router may pick by what its replicas' prefix caches hold).
RouteSource = Callable[[Collection[str], Sequence[int]], Awaitable[tuple[Sequence[Hop], int]]]
# Where a generation may prefill its prompt apart from the route that will decode it (prefill/decode
# disaggregation): given that route, the prompt's token ids and the addresses to avoid, a route whose stages hold
# the same layers (the session's KV then moves to the decoding route), or None to prefill where it decodes.
PrefillSource = Callable[[Sequence[Hop], Sequence[int], Collection[str]], Sequence[Hop] | None]


def chunk_tokens(hidden_size: int, activation_bytes: int = 4) -> int:
    """Tokens per prefill chunk so the activations a stage sends stay under CHUNK_BYTES."""
    return max(1, min(MAX_CHUNK_TOKENS, CHUNK_BYTES // (hidden_size * activation_bytes)))


# The origin remembers this many finished requests (route, trace id, outcome) for the admin API.
MAX_RECENT_REQUESTS = 1000


@dataclass(slots=True)
class RequestRecord:
    """One generation as the admin API shows it; end_unix_ns is 0 while it runs."""

    request_id: str
    trace_id: str               # "" when the request was not traced
    route: tuple[Hop, ...]
    start_unix_ns: int
    num_prompt_tokens: int
    end_unix_ns: int = 0
    num_tokens: int = 0
    num_preemptions: int = 0
    num_failovers: int = 0      # times a lost stage made it resume on a new route
    num_moves: int = 0          # times it moved, KV and all, off a draining agent
    num_handoffs: int = 0       # times its KV moved from the route that prefilled it to the one that decodes it
    num_replayed_tokens: int = 0    # tokens computed again after a failover, preemption or move (0 for a clean move)
    cached_tokens: int = 0
    error: str = ""

    @property
    def state(self) -> str:
        return "running" if not self.end_unix_ns else ("failed" if self.error else "finished")


@dataclass(slots=True)
class OriginStats:
    """What the origin's generations went through, since it started (exported as counters)."""

    num_moves: int = 0
    num_failovers: int = 0
    num_replayed_tokens: int = 0
    kv_moved_bytes: int = 0         # by moves and hand-offs
    num_handoffs: int = 0           # prefills whose KV moved to the route that decodes them
    handoff_kv_bytes: int = 0


@dataclass(slots=True)
class _Live:
    route: tuple[Hop, ...]
    trace_id: str = ""
    parent_span_id: str = ""
    events: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)
    movable: bool = True        # a generation; an embedding ends after its prompt and is never moved
    leaving: str = ""           # a Stage address being drained: the session holds, then moves off it
    moved: bool = False         # it moved: the stages keep the session for its next route to adopt
    stream: OutboundStream | None = None    # to its first stage
    prefill_tokens: int = 0     # tokens it has still to prefill: its prompt's uncached ones, until the first token

    def runs_through(self, address: str) -> bool:
        return any(hop.address == address for hop in self.route)


class _Preempted(Exception):
    """A stage ran out of KV blocks for this attempt; the generation replays it."""


@dataclass(frozen=True, slots=True)
class _HandOff:
    """A prefill's hand-off: the KV move to the route that decodes the session, and that route."""

    move: asyncio.Task[int]
    to: tuple[Hop, ...]


class _Moving(Exception):
    """The session stopped, quiet, to move off a draining stage (or, with hand_off, off the route that prefilled
    it); the generation resumes it on the new route."""

    def __init__(self, session_id: str, hand_off: _HandOff | None = None):
        super().__init__(session_id)
        self.session_id = session_id
        self.hand_off = hand_off


class _RouteLost(Exception):
    """A stage of this attempt's route could not be reached; the generation resumes on a new route."""

    def __init__(self, address: str, detail: str):
        super().__init__(f"{address}: {detail}")
        self.address = address


class _Request:
    """What a generation and an embedding share: the prompt, the record, and one session per attempt, opened and
    prefilled on one route; a preempted attempt or one that lost a stage makes way for the next."""

    def __init__(self, origin: Origin, routes: RouteSource, prompt_ids: Sequence[int],
                 params: SamplingParams, request_id: str, hidden_size: int):
        self.cached_tokens = 0      # prompt tokens the stages' prefix caches served
        self.record = RequestRecord(request_id, origin.sample_trace_id(), (), time.time_ns(), len(prompt_ids))
        self._span_id = new_span_id()   # the request's root span: every stage's spans hang under it
        self._origin = origin
        self._routes = routes
        self._prompt = list(prompt_ids)
        self._params = params
        self._request_id = request_id
        self._chunk = chunk_tokens(hidden_size)
        self._lost: set[str] = set()    # Stage addresses an attempt lost: the next routes avoid them

    @property
    def num_preemptions(self) -> int:
        return self.record.num_preemptions

    def _session_id(self) -> str:
        """The session of this attempt: a new one per attempt, as the stages may still hold the last one."""
        record = self.record
        attempts = record.num_preemptions + record.num_failovers + record.num_moves + record.num_handoffs
        return f"{self._request_id}.{attempts}"

    async def _recover(self, exc: _Preempted | _RouteLost, num_tokens: int) -> None:
        """Readies the next attempt: after a preemption, a pause; after a lost stage, a route around it (StageFailed
        after MAX_FAILOVERS of them)."""
        record, stats = self.record, self._origin.stats
        if isinstance(exc, _Preempted):
            record.num_preemptions += 1
            await asyncio.sleep(min(REPLAY_BACKOFF_S * 2 ** (record.num_preemptions - 1), 1.0))
            return
        record.num_failovers += 1
        stats.num_failovers += 1
        if record.num_failovers > MAX_FAILOVERS:
            raise StageFailed(f"lost {MAX_FAILOVERS + 1} routes in a row; the last: {exc}") from None
        log.warning("request %s lost a stage (%s) after %d tokens; resuming on a new route",
                    self._request_id, exc, num_tokens)
        self._lost.add(exc.address)
        self._origin.on_unreachable(exc.address)

    def _failed(self, exc: BaseException) -> None:
        """Records why the request failed (a caller that stopped it is no failure)."""
        if not isinstance(exc, GeneratorExit | asyncio.CancelledError):
            self.record.error = str(exc) or type(exc).__name__

    def _finish(self, num_tokens: int) -> None:
        record = self.record
        record.end_unix_ns, record.num_tokens, record.cached_tokens = time.time_ns(), num_tokens, self.cached_tokens
        if record.trace_id:
            self._origin.spans.record("request", record.trace_id, "", record.start_unix_ns, record.end_unix_ns,
                                      {"stratamesh.request": record.request_id,
                                       "stratamesh.tokens": str(num_tokens)}, span_id=self._span_id)

    async def _open(self, live: _Live, stream: OutboundStream, session_id: str, route: Sequence[Hop],
                    block_size: int, token_ids: list[int], first: bool, resume_from: str = "",
                    decode: tuple[int, tuple[int, ...]] | None = None) -> int:
        """Opens the session on the route (resuming a moved session's KV); returns the leading tokens of token_ids
        every stage holds already, from which the prefill starts.

        decode: (max new tokens, 0 for no limit; stop token ids) of a generation, whose last stage then feeds
        each token it samples to the first stage; None (an embedding): it samples once."""
        record, origin = self.record, self._origin
        live.prefill_tokens = len(token_ids)
        cacheable = bool(resume_from) or len(token_ids) > block_size
        opened_ns = time.time_ns()
        max_new_tokens, stop_ids = decode or (0, ())
        stream.send(convert.stage_message_to_pb(SessionOpen(
            session_id, route[0].assignment_id, tuple(route[1:]), origin.address,
            self._params, traceparent(record.trace_id, self._span_id) if record.trace_id else "",
            prompt_token_ids=tuple(token_ids), max_cached_tokens=len(token_ids) - 1 if cacheable else 0,
            resume_from=resume_from, feed=_feed(route[0]) if decode else None,
            max_new_tokens=max_new_tokens, stop_token_ids=stop_ids)))
        cached = 0
        if cacheable:
            cached = (await origin.next_event(live, session_id, opened=True)).cached_tokens
            origin.span(live, "open", opened_ns, time.time_ns(), session_id, {})
            live.prefill_tokens = len(token_ids) - cached
        origin.moving.pop(resume_from, None)   # resumed: the stages it left hold nothing of it now
        if first:
            self.cached_tokens = cached
        else:   # the tokens before the newest had all been computed on the route before (at most, for a prompt)
            record.num_replayed_tokens += len(token_ids) - 1 - cached
            origin.stats.num_replayed_tokens += len(token_ids) - 1 - cached
        return cached

    def _send_prefill(self, stream: OutboundStream, first: Hop, session_id: str, token_ids: list[int], start: int,
                      trace_id: str) -> int:
        step = 0
        for begin in range(start, len(token_ids), self._chunk):
            piece = tuple(token_ids[begin:begin + self._chunk])
            last = begin + self._chunk >= len(token_ids)
            stream.send(convert.stage_message_to_pb(
                StepChunk(session_id, step, begin, piece, last, trace_id, time.time_ns()), first.assignment_id))
            step += 1
        return step


class Generation(_Request):
    """One generation: async-iterate for its token ids; aclose() ends it on every stage.

    It keeps the prompt and every token it emitted. When a stage of its route is lost it prefills them on
    a new route and goes on from there: sampling is keyed by position, so the continuation is the one an
    uninterrupted run gives, and the caller sees no token twice and none missing. It ends by itself after
    max_tokens tokens or a token of stop_token_ids (None and empty: it runs until the caller closes it)."""

    def __init__(self, origin: Origin, routes: RouteSource, prompt_ids: Sequence[int],
                 params: SamplingParams, request_id: str, hidden_size: int, max_tokens: int | None = None,
                 stop_token_ids: frozenset[int] = frozenset(), prefill: PrefillSource | None = None):
        super().__init__(origin, routes, prompt_ids, params, request_id, hidden_size)
        self._max_tokens, self._stop_token_ids = max_tokens, stop_token_ids
        self._prefill = prefill
        self._tokens = self._run()

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> int:
        return await self._tokens.__anext__()

    async def aclose(self) -> None:
        await self._tokens.aclose()

    async def _run(self) -> AsyncIterator[int]:
        emitted: list[int] = []
        record, stats = self.record, self._origin.stats
        resume_from = left = ""     # the session a move left quiet on the stages (for the next attempt; for good)
        decode_on: tuple[Sequence[Hop], int] | None = None     # where a prefill hands its session off to
        handing_off: _HandOff | None = None     # that hand-off's KV move, asked for as the prefill began
        try:
            while True:
                avoid = frozenset(self._lost)
                if decode_on is not None and not any(hop.address in avoid for hop in decode_on[0]):
                    route, block_size = decode_on
                else:
                    route, block_size = await self._routes(avoid, self._prompt + emitted)
                prefill = self._prefill_route(route, avoid) if not (emitted or resume_from) else None
                decode_on = (route, block_size) if prefill else None
                if resume_from:
                    moved_bytes = await self._moved(resume_from, record.route, route, handing_off)
                    stats.kv_moved_bytes += moved_bytes     # not `+= await`: that reads the total before waiting
                    stats.handoff_kv_bytes += moved_bytes if handing_off else 0
                    handing_off = None
                record.route = tuple(prefill or route)
                try:
                    left = None if self._max_tokens is None else self._max_tokens - len(emitted)
                    attempt = self._attempt(prefill or route, block_size, self._prompt + emitted, left, resume_from,
                                            hand_off_to=route if prefill else None)
                    resume_from = ""
                    async with aclosing(attempt) as tokens:
                        async for token in tokens:
                            emitted.append(token)
                            yield token
                    return
                except _Moving as exc:
                    if exc.hand_off is not None:
                        record.num_handoffs += 1
                        stats.num_handoffs += 1
                    else:
                        record.num_moves += 1
                        stats.num_moves += 1
                    resume_from = left = exc.session_id
                    handing_off = exc.hand_off
                    self._origin.moving[left] = record.route
                except (_Preempted, _RouteLost) as exc:
                    await self._recover(exc, len(emitted))
        except BaseException as exc:
            self._failed(exc)
            raise
        finally:
            if handing_off is not None:
                handing_off.move.cancel()
            self._origin.moving.pop(left, None)
            self._finish(len(emitted))

    @staticmethod
    async def _moved(session_id: str, old: Sequence[Hop], new: Sequence[Hop], hand_off: _HandOff | None) -> int:
        """Bytes of KV the stages of new pulled from those of old: by the hand-off's move if it went to new (else
        that move is called off), or by a move now."""
        if hand_off is not None:
            if hand_off.to == tuple(new):
                return await hand_off.move
            hand_off.move.cancel()
        return await move_kv(session_id, old, new)

    def _prefill_route(self, decode: Sequence[Hop], avoid: Collection[str]) -> Sequence[Hop] | None:
        """Where the prompt prefills apart from decode, if the prefill source says so and a token will follow."""
        if self._prefill is None or self._max_tokens == 1:
            return None
        return self._prefill(decode, self._prompt, avoid) or None

    async def _attempt(self, route: Sequence[Hop], block_size: int, token_ids: list[int], tokens_left: int | None,
                       resume_from: str = "", hand_off_to: Sequence[Hop] | None = None) -> AsyncIterator[int]:
        """One pass over the route: open (resuming a moved session's KV), prefill token_ids from what the
        stages hold, then take the tokens the pipeline's decode loop samples (its last stage feeds each to its
        first; this origin only hands them out). hand_off_to: the route only prefills; the stages of hand_off_to
        are asked at once to pull the session's KV as each stage here finishes the prompt, and after the first token
        the session stops, quiet, to resume there."""
        session_id, trace_id = self._session_id(), self.record.trace_id
        first = len(token_ids) == len(self._prompt)
        decode = (1 if hand_off_to else tokens_left or 0, tuple(sorted(self._stop_token_ids)))
        hand_off: _HandOff | None = None
        with self._origin.session(session_id, route, trace_id, self._span_id) as (live, stream):
            cached = await self._open(live, stream, session_id, route, block_size, token_ids, first, resume_from,
                                      decode)
            self._send_prefill(stream, route[0], session_id, token_ids, cached, trace_id)
            if hand_off_to:
                hand_off = _HandOff(asyncio.create_task(
                    move_kv(session_id, route, hand_off_to, wait_for_prefill=True)), tuple(hand_off_to))
            try:
                async for token in self._session_tokens(live, session_id, tokens_left, hand_off):
                    yield token
            finally:
                if hand_off is not None and not live.moved:     # the prefill failed, or the caller stopped
                    hand_off.move.cancel()

    async def _session_tokens(self, live: _Live, session_id: str, tokens_left: int | None,
                              hand_off: _HandOff | None) -> AsyncIterator[int]:
        """The session's tokens until its last (or, handing off or held, until it must move)."""
        while True:
            event = await self._origin.next_event(live, session_id)
            live.prefill_tokens = 0
            yield event.token_id
            if tokens_left is not None:
                tokens_left -= 1
            if tokens_left == 0 or event.token_id in self._stop_token_ids:
                return                  # its last token: the last stage fed it nowhere
            if event.held or hand_off is not None:  # quiet on every stage now: it moves, KV and all
                live.moved = True
                raise _Moving(session_id, hand_off)


class Embedding(_Request):
    """One embedding: await vector() for the prompt's pooled, L2-normalized vector, which the last stage of an
    embedding model returns for the prompt's last chunk. A preempted attempt, or one that lost a stage, is
    replayed: the prompt is prefilled again on the next route."""

    def __init__(self, origin: Origin, routes: RouteSource, prompt_ids: Sequence[int], request_id: str,
                 hidden_size: int):
        super().__init__(origin, routes, prompt_ids, SamplingParams(), request_id, hidden_size)

    async def vector(self) -> tuple[float, ...]:
        """Runs the request: the embedding; StageFailed (or ModelNotReady from the routes) when it cannot."""
        try:
            while True:
                route, block_size = await self._routes(frozenset(self._lost), self._prompt)
                self.record.route = tuple(route)
                try:
                    return await self._attempt(route, block_size)
                except (_Preempted, _RouteLost) as exc:
                    await self._recover(exc, 0)
        except BaseException as exc:
            self._failed(exc)
            raise
        finally:
            self._finish(0)

    async def _attempt(self, route: Sequence[Hop], block_size: int) -> tuple[float, ...]:
        """One pass over the route: open, prefill the prompt from what the stages hold, take the vector; the
        session then ends on every stage, and its KV blocks go back (full ones stay in the prefix cache)."""
        session_id, trace_id, record = self._session_id(), self.record.trace_id, self.record
        first = record.num_preemptions + record.num_failovers == 0
        # not movable: a drain need not move it, it ends as soon as its prompt is through
        with self._origin.session(session_id, route, trace_id, self._span_id, movable=False) as (live, stream):
            cached = await self._open(live, stream, session_id, route, block_size, self._prompt, first)
            self._send_prefill(stream, route[0], session_id, self._prompt, cached, trace_id)
            event = await self._origin.next_event(live, session_id)
        if not event.embedding:
            raise StageFailed(f"the last stage answered session {session_id} with a token, not an embedding")
        if not all(math.isfinite(x) for x in event.embedding):
            raise StageFailed(f"the model gave session {session_id} an embedding with a non-finite value")
        return event.embedding


class Origin:
    """Drives generations over routes of stages; tokens come back through deliver()."""

    def __init__(self, address: str, step_timeout_s: float = 60.0, spans: SpanStore | None = None,
                 trace_sample_rate: float = 1.0, on_hop: Callable[[float], None] | None = None,
                 on_unreachable: Callable[[str], None] = lambda address: None, rtc_dialer: RtcDialer | None = None):
        """rtc_dialer: how to reach a first stage behind NAT (None: over gRPC like any other)."""
        self.address = address
        self.on_unreachable = on_unreachable   # told each Stage address a generation lost (the coordinator's liveness)
        self._on_hop = on_hop       # gets each token's time from the last stage finishing it to its arrival
        self.spans = spans or SpanStore("stratamesh-origin")
        self._trace_sample_rate = trace_sample_rate
        self._step_timeout_s = step_timeout_s
        self._streams = StreamPool(lambda ch, it: pb_grpc.StageStub(ch).Push(it),
                                   on_broken=self._stream_broken, rtc_dialer=rtc_dialer)
        self._sessions: dict[str, _Live] = {}
        # Sessions between two routes (a move): their old route's stages hold them until the new one resumes them.
        self.moving: dict[str, tuple[Hop, ...]] = {}
        self.recent: OrderedDict[str, RequestRecord] = OrderedDict()
        self.stats = OriginStats()

    async def close(self) -> None:
        await self._streams.close()

    def sample_trace_id(self) -> str:
        """A new trace id for a request that is to be traced, "" for one that is not."""
        return new_trace_id() if random.random() < self._trace_sample_rate else ""

    def remember(self, record: RequestRecord) -> None:
        """Keeps a request's record for the admin API (the newest MAX_RECENT_REQUESTS)."""
        self.recent[record.request_id] = record
        self.recent.move_to_end(record.request_id)
        while len(self.recent) > MAX_RECENT_REQUESTS:
            self.recent.popitem(last=False)

    def span(self, live: _Live, name: str, start_ns: int, end_ns: int, session_id: str,
             attributes: dict[str, str]) -> None:
        """Records one of a traced session's spans in the origin's store."""
        if live.trace_id:
            self.spans.record(name, live.trace_id, live.parent_span_id, start_ns, end_ns,
                              {"stratamesh.session": session_id, **attributes})

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def generate(self, routes: RouteSource, prompt_ids: Sequence[int], params: SamplingParams,
                 request_id: str, hidden_size: int, max_tokens: int | None = None,
                 stop_token_ids: frozenset[int] = frozenset(), prefill: PrefillSource | None = None) -> Generation:
        """A generation over the routes the source gives; iterate it for token ids, aclose() it to stop (it stops by
        itself after max_tokens, or at a stop token). prefill: where it may prefill apart from where it decodes."""
        generation = Generation(self, routes, prompt_ids, params, request_id, hidden_size, max_tokens,
                                stop_token_ids, prefill)
        self.remember(generation.record)
        return generation

    def embed(self, routes: RouteSource, prompt_ids: Sequence[int], request_id: str, hidden_size: int) -> Embedding:
        """An embedding of the prompt over the routes the source gives (an embedding model's); await its vector()."""
        embedding = Embedding(self, routes, prompt_ids, request_id, hidden_size)
        self.remember(embedding.record)
        return embedding

    def deliver(self, event: TokenEvent, arrived_ns: int = 0) -> None:
        """deliver_batch of one event."""
        self.deliver_batch([event], arrived_ns)

    def deliver_batch(self, events: Sequence[TokenEvent], arrived_ns: int = 0) -> None:
        """Hands tokens (and stages' answers and errors) to the generations waiting for them."""
        for event in events:
            live = self._sessions.get(event.session_id)
            if live is None:
                log.debug("event for finished session %s dropped", event.session_id)
                continue
            self._timed(live, event, arrived_ns)
            live.events.put_nowait(event)

    def _timed(self, live: _Live, event: TokenEvent, arrived_ns: int) -> None:
        """Records the last hop of a token (or embedding): the metric, and a span if its session is traced."""
        if event.sent_unix_ns and arrived_ns and (event.token_id >= 0 or event.embedding):
            if self._on_hop is not None:
                self._on_hop(max(arrived_ns - event.sent_unix_ns, 0) / 1e9)
            self.span(live, "send", event.sent_unix_ns, arrived_ns, event.session_id,
                      {"stratamesh.to": "origin", "stratamesh.step": str(event.step)})

    @contextmanager
    def session(self, session_id: str, route: Sequence[Hop], trace_id: str = "", parent_span_id: str = "",
                movable: bool = True) -> Iterator[tuple[_Live, OutboundStream]]:
        """Registers a session for a with-block; closes it on every stage at exit."""
        if session_id in self._sessions:
            raise StageFailed(f"session {session_id} is already running")
        live = self._sessions[session_id] = _Live(tuple(route), trace_id, parent_span_id, movable=movable)
        self._streams.learn(route[:1])
        stream = live.stream = self._streams.get(route[0].address)
        try:
            yield live, stream
        finally:
            del self._sessions[session_id]
            if stream.alive and not live.moved:
                stream.send(convert.stage_message_to_pb(SessionClose(session_id), route[0].assignment_id))

    async def next_event(self, live: _Live, session_id: str, opened: bool = False) -> TokenEvent:
        """The session's next token (or, with opened, its open answer); raises on errors."""
        while True:
            try:
                event = await asyncio.wait_for(live.events.get(), self._step_timeout_s)
            except asyncio.TimeoutError:
                raise StageFailed(f"no answer for session {session_id} in {self._step_timeout_s:.0f} s") from None
            if event.preempted:
                raise _Preempted(session_id)
            if event.error and event.unreachable:
                raise _RouteLost(event.unreachable, event.error)
            if event.error:
                raise StageFailed(f"stage {event.error_stage or '?'} failed: {event.error}")
            if event.opened == opened:
                return event
            if opened:
                raise StageFailed(f"session {session_id}: a token came before the open answer")
            # An open answer nobody waited for (the prompt was too short to be cached): skip it.

    def assignments_in_use(self) -> set[str]:
        """The assignment ids of every stage a live (or moving) session runs on."""
        return {hop.assignment_id for route in self._routes() for hop in route}

    def work(self) -> dict[str, RouteWork]:
        """The live generations' work by the assignment id of their route's first stage (the router weighs it)."""
        work: dict[str, RouteWork] = {}
        for live in self._sessions.values():
            first = live.route[0].assignment_id
            there = work.get(first, RouteWork())
            work[first] = RouteWork(there.prefill_tokens + live.prefill_tokens,
                                    there.num_decoding + (live.prefill_tokens == 0))
        return work

    def _routes(self) -> list[tuple[Hop, ...]]:
        return [live.route for live in self._sessions.values()] + list(self.moving.values())

    def move_off(self, address: str) -> int:
        """Asks every live session routed through this Stage address to move, KV and all, to the route it gets
        next (at its next token: it is quiet then); returns how many were asked now."""
        asked = 0
        for session_id, live in self._sessions.items():
            if live.movable and live.runs_through(address) and not live.leaving:
                live.leaving = address
                if live.stream is not None and live.stream.alive:
                    live.stream.send(convert.stage_message_to_pb(SessionHold(session_id),
                                                                 live.route[0].assignment_id))
                asked += 1
        return asked

    def sessions_through(self, address: str) -> int:
        """Live and moving sessions routed through this Stage address."""
        return sum(1 for route in self._routes() if any(hop.address == address for hop in route))

    def route_lost(self, address: str) -> None:
        """The agent at this Stage address was declared dead: every session routed through it fails over."""
        for session_id, live in self._sessions.items():
            if live.runs_through(address):
                live.events.put_nowait(TokenEvent(session_id, -1, error="its agent was declared dead",
                                                  unreachable=address))

    def _stream_broken(self, stream: OutboundStream, exc: BaseException | None) -> None:
        for session_id, live in self._sessions.items():
            if live.route[0].address == stream.address:
                live.events.put_nowait(TokenEvent(session_id, -1, error=str(exc), error_stage=stream.address,
                                                  unreachable=stream.address))


class OriginService(pb_grpc.OriginServicer):
    """The Origin gRPC service: last stages stream their tokens here."""

    def __init__(self, origin: Origin):
        self._origin = origin

    async def Deliver(self, request_iterator: AsyncIterator[pb.TokenBatch],
                      context: grpc.aio.ServicerContext) -> pb.DeliverSummary:
        num_events = 0
        async for batch in request_iterator:
            arrived_ns, events = time.time_ns(), []
            for message in batch.events:
                num_events += 1
                try:
                    events.append(convert.token_event_from_pb(message))
                except MeshError as exc:
                    log.info("dropped a token event: %s", exc)
            self._origin.deliver_batch(events, arrived_ns)
        return pb.DeliverSummary(num_events=num_events)


def _feed(first: Hop) -> Hop:
    """The hop the last stage feeds sampled tokens to: the first stage (token ids travel: no dtype, no codec)."""
    return Hop(first.address, first.assignment_id, agent_id=first.agent_id, nat=first.nat)
