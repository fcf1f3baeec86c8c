"""One generation as the HTTP API runs it: token ids from the Generator in, text deltas and a finish reason out."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import anyio

from stratamesh.coordinator.text import IncrementalDetokenizer
from stratamesh.fleet.types import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Job:
    """A validated request: what to generate and when to stop."""

    model_id: str
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()  # EOS ids (unless ignore_eos) and the request's own


@dataclass(frozen=True, slots=True)
class Delta:
    """New text of a generation; the last one carries finish_reason "stop" or "length"."""

    text: str
    finish_reason: str | None = None
    token_ids: tuple[int, ...] = ()  # the tokens consumed since the previous delta


class GenerationRun:
    """Consumes a job's unbounded token stream up to max_tokens, a stop token or a stop string; then closes it."""

    def __init__(self, job: Job, tokens: AsyncIterator[int], detokenizer: IncrementalDetokenizer) -> None:
        self.job = job
        self.token_ids: list[int] = []
        self._tokens = tokens
        self._detok = detokenizer
        self._first: int | None = None
        self._closed = False

    async def start(self) -> None:
        """Wait for the first token, so that a failure before any output can still be an HTTP error status."""
        try:
            self._first = await anext(self._tokens, None)
        except BaseException:
            await self.aclose()
            raise

    async def deltas(self) -> AsyncIterator[Delta]:
        """Text deltas, the last with its finish reason; call start() first."""
        try:
            token, sent = self._first, 0
            while token is not None:
                delta = self._step(token)
                if delta.text or delta.finish_reason is not None:
                    yield replace(delta, token_ids=tuple(self.token_ids[sent:]))
                    sent = len(self.token_ids)
                if delta.finish_reason is not None:
                    return
                token = await anext(self._tokens, None)
            log.warning("request %s: the token stream ended before a stop condition", self.job.request_id)
            yield Delta(self._detok.flush(), "stop")
        finally:
            await self.aclose()

    async def collect(self) -> tuple[str, str]:
        """The whole text and the finish reason."""
        pieces, finish_reason = [], "stop"
        async for delta in self.deltas():
            pieces.append(delta.text)
            finish_reason = delta.finish_reason or finish_reason
        return "".join(pieces), finish_reason

    async def aclose(self) -> None:
        """Tell the Generator to stop this generation (idempotent, survives cancellation)."""
        if self._closed:
            return
        self._closed = True
        aclose = getattr(self._tokens, "aclose", None)
        if aclose is None:
            return
        with anyio.CancelScope(shield=True):
            try:
                await aclose()
            except Exception:  # closing must never turn a finished response into an error
                log.warning("request %s: closing the token stream failed", self.job.request_id, exc_info=True)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the mesh's prefix caches served (0 when the Generator does not say)."""
        return getattr(self._tokens, "cached_tokens", 0)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids)

    def _step(self, token: int) -> Delta:
        self.token_ids.append(token)
        if token in self.job.stop_token_ids:
            return Delta(self._detok.flush(), "stop")
        text = self._detok.push(token)
        if self._detok.stopped:
            return Delta(text, "stop")
        if self.num_completion_tokens >= self.job.max_tokens:
            return Delta(text + self._detok.flush(), "length")
        return Delta(text)
