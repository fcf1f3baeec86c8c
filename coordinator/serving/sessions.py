"""The origin's session table: every attempt's session while it runs, its stream to the first stage, and the events
(tokens, answers, errors) delivered for it; sessions between two routes; the work each route has in hand."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from stratamesh.coordinator.serving.outcomes import Preempted, RouteLost
from stratamesh.coordinator.serving.router import RouteWork
from stratamesh.fleet.errors import StageFailed
from stratamesh.fleet.tracing import SpanStore
from stratamesh.fleet.sessions import Hop, SessionClose, SessionHold, SessionOpen, StageMessage, TokenEvent
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.stream import OutboundStream, RtcDialer, StreamPool

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Session:
    """One attempt's session while it runs: its route, its stream to the route's first stage, and its events."""

    session_id: str
    route: tuple[Hop, ...]
    stream: OutboundStream
    trace_id: str = ""
    parent_span_id: str = ""
    movable: bool = True        # a generation; an embedding ends after its prompt and is never moved
    events: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)
    leaving: str = ""           # a Stage address being drained: the session holds, then moves off it
    moved: bool = False         # it moved: the stages keep the session for its next route to adopt
    prefill_tokens: int = 0     # tokens it has still to prefill: its prompt's uncached ones, until the first token

    def runs_through(self, address: str) -> bool:
        return any(hop.address == address for hop in self.route)

    def send(self, message: StageMessage) -> None:
        """Sends a data-plane message to the route's first stage (an open names its assignment itself)."""
        to = "" if isinstance(message, SessionOpen) else self.route[0].assignment_id
        self.stream.send(convert.stage_message_to_pb(message, to))


class SessionTable:
    """Every live session by id, and the sessions between two routes (a move: the stages of the old route hold it
    until the new one resumes it). Tokens reach a session through deliver_batch(); the control plane sees the table
    as its Sessions (it fails sessions over, moves them off a drained agent, keeps the stages they use)."""

    def __init__(self, step_timeout_s: float = 60.0, spans: SpanStore | None = None,
                 on_hop: Callable[[float], None] | None = None, rtc_dialer: RtcDialer | None = None) -> None:
        """on_hop: gets each token's time from the last stage finishing it to its arrival here. rtc_dialer: how to
        reach a first stage behind NAT (None: over gRPC like any other)."""
        self.spans = spans or SpanStore("stratamesh-origin")
        self._step_timeout_s = step_timeout_s
        self._on_hop = on_hop
        self._streams = StreamPool(lambda ch, it: pb_grpc.StageStub(ch).Push(it),
                                   on_broken=self._stream_broken, rtc_dialer=rtc_dialer)
        self._live: dict[str, Session] = {}
        self._moving: dict[str, tuple[Hop, ...]] = {}

    async def close(self) -> None:
        await self._streams.close()

    @property
    def num_sessions(self) -> int:
        return len(self._live)

    @contextmanager
    def session(self, session_id: str, route: Sequence[Hop], trace_id: str = "", parent_span_id: str = "",
                movable: bool = True) -> Iterator[Session]:
        """Registers a session for a with-block; closes it on every stage at exit (unless it moved)."""
        if session_id in self._live:
            raise StageFailed(f"session {session_id} is already running")
        self._streams.learn(route[:1])
        session = Session(session_id, tuple(route), self._streams.get(route[0].address), trace_id, parent_span_id,
                          movable)
        self._live[session_id] = session
        try:
            yield session
        finally:
            del self._live[session_id]
            if session.stream.alive and not session.moved:
                session.send(SessionClose(session_id))

    async def next_event(self, session: Session, opened: bool = False) -> TokenEvent | Preempted | RouteLost:
        """The session's next token (or, with opened, its open answer), or how the attempt ended if a stage
        preempted it or was lost; StageFailed on a stage's error or after step_timeout_s without an answer."""
        while True:
            try:
                event = await asyncio.wait_for(session.events.get(), self._step_timeout_s)
            except asyncio.TimeoutError:
                raise StageFailed(f"no answer for session {session.session_id} in {self._step_timeout_s:.0f} s") \
                    from None
            if event.preempted:
                return Preempted()
            if event.error and event.unreachable:
                return RouteLost(event.unreachable, event.error)
            if event.error:
                raise StageFailed(f"stage {event.error_stage or '?'} failed: {event.error}")
            if event.opened == opened:
                return event
            if opened:
                raise StageFailed(f"session {session.session_id}: a token came before the open answer")
            # An open answer nobody waited for (the prompt was too short to be cached): skip it.

    def deliver_batch(self, events: Sequence[TokenEvent], arrived_ns: int = 0) -> None:
        """Hands tokens (and stages' answers and errors) to the sessions waiting for them."""
        for event in events:
            session = self._live.get(event.session_id)
            if session is None:
                log.debug("event for finished session %s dropped", event.session_id)
                continue
            self._timed(session, event, arrived_ns)
            session.events.put_nowait(event)

    def span(self, session: Session, name: str, start_ns: int, end_ns: int, attributes: dict[str, str]) -> None:
        """Records one of a traced session's spans."""
        if session.trace_id:
            self.spans.record(name, session.trace_id, session.parent_span_id, start_ns, end_ns,
                              {"stratamesh.session": session.session_id, **attributes})

    def _timed(self, session: Session, event: TokenEvent, arrived_ns: int) -> None:
        """Records the last hop of a token (or embedding): the metric, and a span if its session is traced."""
        if event.sent_unix_ns and arrived_ns and (event.token_id >= 0 or event.embedding):
            if self._on_hop is not None:
                self._on_hop(max(arrived_ns - event.sent_unix_ns, 0) / 1e9)
            self.span(session, "send", event.sent_unix_ns, arrived_ns,
                      {"stratamesh.to": "origin", "stratamesh.step": str(event.step)})

    # ------------------------------------------------------------ moves
    def moving(self, session_id: str, route: Sequence[Hop]) -> None:
        """The session stopped, quiet, on the stages of route, to resume on another route."""
        self._moving[session_id] = tuple(route)

    def moved(self, session_id: str) -> None:
        """The session left the route it was quiet on: resumed on its new one, or given up."""
        self._moving.pop(session_id, None)

    # ------------------------------------------------------------ what the control plane and the router see
    def work(self) -> dict[str, RouteWork]:
        """The live sessions' work by the assignment id of their route's first stage (the router weighs it)."""
        work: dict[str, RouteWork] = {}
        for session in self._live.values():
            first = session.route[0].assignment_id
            there = work.get(first, RouteWork())
            work[first] = RouteWork(there.prefill_tokens + session.prefill_tokens,
                                    there.num_decoding + (session.prefill_tokens == 0))
        return work

    def assignments_in_use(self) -> set[str]:
        """The assignment ids of every stage a live (or moving) session runs on."""
        return {hop.assignment_id for route in self._routes() for hop in route}

    def sessions_through(self, address: str) -> int:
        """Live and moving sessions routed through this Stage address."""
        return sum(1 for route in self._routes() if any(hop.address == address for hop in route))

    def move_off(self, address: str) -> int:
        """Asks every live session routed through this Stage address to move, KV and all, to the route it gets
        next (at its next token: it is quiet then); returns how many were asked now."""
        asked = 0
        for session in self._live.values():
            if session.movable and session.runs_through(address) and not session.leaving:
                session.leaving = address
                if session.stream.alive:
                    session.send(SessionHold(session.session_id))
                asked += 1
        return asked

    def route_lost(self, address: str) -> None:
        """The agent at this Stage address was declared dead: every session routed through it fails over."""
        for session in self._live.values():
            if session.runs_through(address):
                session.events.put_nowait(TokenEvent(session.session_id, -1, error="its agent was declared dead",
                                                     unreachable=address))

    def _routes(self) -> list[tuple[Hop, ...]]:
        return [session.route for session in self._live.values()] + list(self._moving.values())

    def _stream_broken(self, stream: OutboundStream, exc: BaseException | None) -> None:
        for session in self._live.values():
            if session.route[0].address == stream.address:
                session.events.put_nowait(TokenEvent(session.session_id, -1, error=str(exc),
                                                     error_stage=stream.address, unreachable=stream.address))
