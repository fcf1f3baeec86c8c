"""A generation's text, as the HTTP API streams it: token ids in, text deltas and a finish reason out."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Protocol

import anyio

from stratamesh.coordinator.serving.request import Request
from stratamesh.coordinator.text import IncrementalDetokenizer
from stratamesh.fleet.sessions import Logprobs
from stratamesh.fleet.states import FinishReason

log = logging.getLogger(__name__)

Clock = Callable[[], float]  # seconds on a monotonic scale: time.monotonic, or a test's own


@dataclass(frozen=True, slots=True)
class Delta:
    """New text of a generation; the last one carries finish_reason "stop" or "length"."""

    text: str
    finish_reason: FinishReason | None = None
    token_ids: tuple[int, ...] = ()  # the tokens consumed since the previous delta
    logprobs: tuple[Logprobs | None, ...] = ()     # theirs, where the request asked for them


@dataclass(slots=True)
class Timeline:
    """Clock readings of one request: arrival, hand-off to the origin, first and latest token, end."""

    arrival_s: float
    scheduled_s: float               # when the origin was asked for the tokens
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None  # a stop condition was met, or the run was closed before one

    @classmethod
    def at(cls, now_s: float) -> Timeline:
        """A request that arrived and was handed to the origin at now_s."""
        return cls(now_s, now_s)


class TokenObserver(Protocol):
    """Told of each token as a TextStream receives it (the API's metrics)."""

    def on_token(self, run: TextStream, gap_s: float | None) -> None: ...  # gap_s: None for the first token


class TextStream:
    """Consumes a request's token stream until its stops end it (max_tokens, a stop token, or a stop string the
    detokenizer finds in the text); then closes it."""

    def __init__(self, request: Request, tokens: AsyncIterator[int], detokenizer: IncrementalDetokenizer,
                 timeline: Timeline | None = None, clock: Clock = time.monotonic,
                 observer: TokenObserver | None = None) -> None:
        self.request = request
        self.token_ids: list[int] = []  # every token received, the stop token included
        self.finish_reason: FinishReason | None = None  # once a stop condition is met
        self._clock = clock
        self.timeline = timeline if timeline is not None else Timeline.at(clock())
        self._observer = observer
        self._tokens = tokens
        self._detok = detokenizer
        self._first: int | None = None
        self._closed = False

    async def start(self) -> None:
        """Wait for the first token, so that a failure before any output can still be an HTTP error status."""
        try:
            self._first = await self._receive()
        except BaseException:
            await self.aclose()
            raise

    async def deltas(self) -> AsyncIterator[Delta]:
        """Text deltas, the last with its finish reason; call start() first."""
        try:
            token, sent = self._first, 0
            while token is not None:
                delta = self._step(token)
                if delta.finish_reason is not None:  # recorded before the yield: a consumer may stop at this delta
                    self._finish(delta.finish_reason, at_s=self.timeline.last_token_s)
                if delta.text or delta.finish_reason is not None:
                    yield replace(delta, token_ids=tuple(self.token_ids[sent:]),
                                  logprobs=self._logprobs_from(sent))
                    sent = len(self.token_ids)
                if self.finish_reason is not None:
                    return
                token = await self._receive()
            log.warning("request %s: the token stream ended before a stop condition", self.request.request_id)
            self._finish(FinishReason.STOP)
            yield Delta(self._detok.flush(), FinishReason.STOP)
        finally:
            await self.aclose()

    async def collect(self) -> tuple[str, str]:
        """The whole text and the finish reason."""
        pieces, finish_reason = [], FinishReason.STOP
        async for delta in self.deltas():
            pieces.append(delta.text)
            finish_reason = delta.finish_reason or finish_reason
        return "".join(pieces), finish_reason

    async def aclose(self) -> None:
        """Tells the origin to stop this generation (idempotent, survives cancellation)."""
        if self._closed:
            return
        self._closed = True
        if self.timeline.finished_s is None:
            self.timeline.finished_s = self._clock()
        aclose = getattr(self._tokens, "aclose", None)
        if aclose is None:
            return
        with anyio.CancelScope(shield=True):
            try:
                await aclose()
            except Exception:  # closing must never turn a finished response into an error
                log.warning("request %s: closing the token stream failed", self.request.request_id, exc_info=True)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the mesh's prefix caches served (0 when the token stream does not say)."""
        return getattr(self._tokens, "cached_tokens", 0)

    @property
    def num_preemptions(self) -> int:
        """Times the mesh preempted this generation and replayed it (0 when the token stream does not say)."""
        return getattr(self._tokens, "num_preemptions", 0)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def logprobs(self) -> list[Logprobs | None]:
        """Each received token's log-probabilities where the request asked for them (None for a token the stream
        gave none: one that does not say)."""
        return list(self._logprobs_from(0))

    def _logprobs_from(self, start: int) -> tuple[Logprobs | None, ...]:
        """The received tokens' log-probabilities from the start-th token on (a slice, not the whole list)."""
        given = getattr(self._tokens, "logprobs", [])[start:len(self.token_ids)]
        return (*given, *[None] * (len(self.token_ids) - start - len(given)))

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the generation, if one did."""
        return self._detok.stop_string

    @property
    def prompt_logprobs(self) -> tuple[Logprobs, ...]:
        """The prompt's tokens' log-probabilities from the second on, where the request asked (echo)."""
        return getattr(self._tokens, "prompt_logprobs", ())

    async def _receive(self) -> int | None:
        """The next token (None when the stream ends), recorded with its arrival time and reported."""
        token = await anext(self._tokens, None)
        if token is None:
            return None
        now, timeline = self._clock(), self.timeline
        gap_s = None if timeline.last_token_s is None else now - timeline.last_token_s
        if timeline.first_token_s is None:
            timeline.first_token_s = now
        timeline.last_token_s = now
        self.token_ids.append(token)
        if self._observer is not None:
            self._observer.on_token(self, gap_s)
        return token

    def _finish(self, reason: str, at_s: float | None = None) -> None:
        """Records the stop condition met at at_s (now if None)."""
        self.finish_reason = reason
        self.timeline.finished_s = at_s if at_s is not None else self._clock()

    def _step(self, token: int) -> Delta:
        reason = self.request.stops.reason(token, self.num_completion_tokens)
        if reason == FinishReason.STOP:     # a stop token: its text is not the completion's
            return Delta(self._detok.flush(), FinishReason.STOP)
        text = self._detok.push(token)
        if self._detok.stopped:             # a stop string
            return Delta(text, FinishReason.STOP)
        if reason == FinishReason.LENGTH:
            return Delta(text + self._detok.flush(), FinishReason.LENGTH)
        return Delta(text)
