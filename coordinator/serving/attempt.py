"""One attempt of a request: a session opened on one route, the prompt (and the tokens so far) prefilled from what
the stages hold, and what the last stage sends back, until the attempt ends with an Outcome."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from stratamesh.coordinator.serving.kv_moves import move_kv
from stratamesh.coordinator.serving.outcomes import Done, HandOff, Moved, Outcome, Preempted, RouteLost
from stratamesh.coordinator.serving.records import RequestLog, RequestRecord
from stratamesh.coordinator.serving.request import Stops
from stratamesh.coordinator.serving.sessions import Session, SessionTable
from stratamesh.fleet.errors import StageFailed
from stratamesh.fleet.tracing import new_span_id, traceparent
from stratamesh.fleet.sessions import Hop, SamplingParams, SessionOpen, Speculation, StepChunk, TokenEvent
from stratamesh.fleet.wire.channels import CHUNK_BYTES

# Prefill is sent in chunks of at most this many tokens (and under CHUNK_BYTES of activations).
MAX_CHUNK_TOKENS = 512


def chunk_tokens(hidden_size: int, activation_bytes: int = 4) -> int:
    """Tokens per prefill chunk so the activations a stage sends stay under CHUNK_BYTES."""
    return max(1, min(MAX_CHUNK_TOKENS, CHUNK_BYTES // (hidden_size * activation_bytes)))


@dataclass(slots=True)
class Run:
    """What every attempt of one request shares: the origin's sessions and log, where the last stage delivers (the
    origin's address), the request's record, sampling and prefill chunk size, and its root span."""

    sessions: SessionTable
    log: RequestLog
    origin: str
    record: RequestRecord
    params: SamplingParams
    chunk: int
    span_id: str = field(default_factory=new_span_id)   # the request's root span: every stage's spans hang under it
    cached_tokens: int = 0      # prompt tokens the stages' prefix caches served (the first attempt's)
    speculation: Speculation | None = None      # its decode steps carry drafted tokens (a verifiable sampling's)
    revision_of: Callable[[str], str] = lambda assignment_id: ""   # the revision a route's first stage serves

    def next_session_id(self) -> str:
        """The session of the next attempt: a new one per attempt, as the stages may still hold the last one."""
        return f"{self.record.request_id}.{self.record.num_attempts}"


class Attempt:
    """One pass over a route: open (resuming a moved session's KV), prefill token_ids from what the stages hold,
    then take what the last stage sends back. outcome says how it ended; a stage's error raises StageFailed.

    first: token_ids is the prompt as the request began (its cached tokens are the request's; any other attempt
    counts what it computes again). decode: (max new tokens, 0 for no limit; stop token ids) of a generation, whose
    last stage then feeds each token it samples to the first stage; None (an embedding): it samples once.
    output_start: where the generation's output starts in token_ids (the request's prompt's length; 0: at the end)."""

    def __init__(self, run: Run, route: Sequence[Hop], block_size: int, token_ids: Sequence[int], first: bool,
                 resume_from: str = "", decode: tuple[int, tuple[int, ...]] | None = None,
                 output_start: int = 0) -> None:
        self.outcome: Outcome | None = None
        self._run = run
        self._route = tuple(route)
        self._block_size = block_size
        self._token_ids = tuple(token_ids)
        self._first = first
        self._resume_from = resume_from
        self._decode = decode
        self._output_start = output_start
        self._session_id = run.next_session_id()

    async def tokens(self, stops: Stops, num_emitted: int,
                     hand_off_to: Sequence[Hop] | None = None) -> AsyncIterator[TokenEvent]:
        """A generation's token events on this route, the num_emitted-th onwards, until stops says it ends (Done),
        the session is held to move (Moved), or the attempt is Preempted or loses its route (RouteLost).

        hand_off_to: this route only prefills; the stages of hand_off_to are asked at once to pull the session's
        KV as each stage here finishes the prompt, and after the first token the session stops, quiet, to resume
        there."""
        run = self._run
        with run.sessions.session(self._session_id, self._route, run.record.trace_id, run.span_id) as session:
            if not await self._opened(session):
                return
            hand_off = None
            if hand_off_to:
                hand_off = HandOff(asyncio.create_task(move_kv(self._session_id, self._route, hand_off_to,
                                                               wait_for_prefill=True)), tuple(hand_off_to))
            try:
                while True:
                    event = await run.sessions.next_event(session)
                    if not isinstance(event, TokenEvent):
                        self.outcome = event
                        return
                    session.prefill_tokens = 0
                    num_emitted += 1
                    yield event
                    if stops.reason(event.token_id, num_emitted) is not None:
                        self.outcome = Done()       # its last token: the last stage fed it nowhere
                        return
                    if event.held or hand_off is not None:  # quiet on every stage now: it moves, KV and all
                        session.moved = True
                        self.outcome = Moved(self._session_id, self._route, hand_off)
                        return
            finally:
                if hand_off is not None and not session.moved:     # the prefill failed, or the caller stopped
                    hand_off.move.cancel()

    async def vector(self) -> tuple[float, ...] | None:
        """An embedding's vector (Done), or None if the attempt was Preempted or lost its route; the session then
        ends on every stage, and its KV blocks go back (full ones stay in the prefix cache)."""
        run = self._run
        # not movable: a drain need not move it, it ends as soon as its prompt is through
        with run.sessions.session(self._session_id, self._route, run.record.trace_id, run.span_id,
                                  movable=False) as session:
            if not await self._opened(session):
                return None
            event = await run.sessions.next_event(session)
        if not isinstance(event, TokenEvent):
            self.outcome = event
            return None
        if not event.embedding:
            raise StageFailed(f"the last stage answered session {self._session_id} with a token, not an embedding")
        if not all(math.isfinite(x) for x in event.embedding):
            raise StageFailed(f"the model gave session {self._session_id} an embedding with a non-finite value")
        self.outcome = Done()
        return event.embedding

    async def _opened(self, session: Session) -> bool:
        """Opens the session and sends the prefill of what every stage does not hold; False (and the outcome) if a
        stage preempted or lost it first."""
        cached = await self._open(session)
        if isinstance(cached, Preempted | RouteLost):
            self.outcome = cached
            return False
        self._send_prefill(session, cached)
        return True

    async def _open(self, session: Session) -> int | Preempted | RouteLost:
        """Opens the session on the route (resuming a moved session's KV); the leading tokens of token_ids every
        stage holds already, from which the prefill starts."""
        run, token_ids = self._run, self._token_ids
        session.prefill_tokens = len(token_ids)
        # a prompt whose tokens' log-probabilities are asked for is computed whole: the prefix cache holds KV, not
        # the logits of the positions it serves (its blocks are still cached for the requests after it)
        cacheable = bool(self._resume_from) or (len(token_ids) > self._block_size
                                                and run.params.prompt_logprobs is None)
        opened_ns = time.time_ns()
        max_new_tokens, stop_ids = self._decode or (0, ())
        record = run.record
        session.send(SessionOpen(
            self._session_id, self._route[0].assignment_id, self._route[1:], run.origin, run.params,
            traceparent(record.trace_id, run.span_id) if record.trace_id else "", prompt_token_ids=token_ids,
            max_cached_tokens=len(token_ids) - 1 if cacheable else 0, resume_from=self._resume_from,
            feed=_feed(self._route[0]) if self._decode else None, max_new_tokens=max_new_tokens,
            stop_token_ids=stop_ids, output_start=self._output_start,
            speculation=run.speculation if self._decode else None,
            revision=run.revision_of(self._route[0].assignment_id),
            follow_runs=bool(self._decode) and run.speculation is not None))
        cached = 0
        if cacheable:
            answer = await run.sessions.next_event(session, opened=True)
            if not isinstance(answer, TokenEvent):
                return answer
            cached = answer.cached_tokens
            run.sessions.span(session, "open", opened_ns, time.time_ns(), {})
            session.prefill_tokens = len(token_ids) - cached
        run.sessions.moved(self._resume_from)       # resumed: the stages it left hold nothing of it now
        if self._first:
            run.cached_tokens = cached
        else:   # the tokens before the newest had all been computed on the route before (at most, for a prompt)
            run.log.replayed(record, len(token_ids) - 1 - cached)
        return cached

    def _send_prefill(self, session: Session, start: int) -> None:
        """The prefill of token_ids from start, in chunks; the last chunk samples."""
        token_ids, chunk, trace_id = self._token_ids, self._run.chunk, self._run.record.trace_id
        for step, begin in enumerate(range(start, len(token_ids), chunk)):
            piece = token_ids[begin:begin + chunk]
            last = begin + chunk >= len(token_ids)
            session.send(StepChunk(self._session_id, step, begin, piece, last, trace_id, time.time_ns()))


def _feed(first: Hop) -> Hop:
    """The hop the last stage feeds sampled tokens to: the first stage (token ids travel: no dtype, no codec)."""
    return Hop(first.address, first.assignment_id, agent_id=first.agent_id, nat=first.nat)
