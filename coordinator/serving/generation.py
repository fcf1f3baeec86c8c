"""A request's runs over the mesh: a generation (token ids) or an embedding (a vector), each a loop of attempts
that match on how the last one ended: done, moved, preempted or its route lost."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from contextlib import aclosing

from stratamesh.coordinator.serving.attempt import Attempt, Run
from stratamesh.coordinator.serving.kv_moves import move_kv
from stratamesh.coordinator.serving.outcomes import Done, Moved, Preempted, RouteLost
from stratamesh.coordinator.serving.records import RequestRecord
from stratamesh.coordinator.serving.request import Stops
from stratamesh.fleet.errors import StageFailed
from stratamesh.fleet.sessions import Hop, Logprobs

log = logging.getLogger(__name__)

# A session preempted for want of KV blocks is replayed after this pause, doubling up to 1 s.
REPLAY_BACKOFF_S = 0.05
# A request whose route loses a stage resumes on a new route; after this many losses it fails.
MAX_FAILOVERS = 8

# Where a request gets its route (and KV block size) for each attempt: given the addresses just lost, to avoid,
# and the token ids the route will prefill (the router may pick by what its replicas' prefix caches hold).
RouteSource = Callable[[Collection[str], Sequence[int]], Awaitable[tuple[Sequence[Hop], int]]]
# Where a generation may prefill its prompt apart from the route that will decode it (prefill/decode
# disaggregation): given that route, the prompt's token ids and the addresses to avoid, a route whose stages hold
# the same layers (the session's KV then moves to the decoding route), or None to prefill where it decodes.
PrefillSource = Callable[[Sequence[Hop], Sequence[int], Collection[str]], Sequence[Hop] | None]


class _Request:
    """What a generation and an embedding share: the prompt, the run its attempts share, the addresses its attempts
    lost, and what happens between two attempts."""

    def __init__(self, run: Run, routes: RouteSource, prompt_ids: Sequence[int],
                 on_unreachable: Callable[[str], None]) -> None:
        self._run = run
        self._routes = routes
        self._prompt = list(prompt_ids)
        self._on_unreachable = on_unreachable   # told each Stage address an attempt lost (the coordinator's liveness)
        self._lost: set[str] = set()    # Stage addresses an attempt lost: the next routes avoid them

    @property
    def record(self) -> RequestRecord:
        return self._run.record

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the stages' prefix caches served."""
        return self._run.cached_tokens

    @property
    def num_preemptions(self) -> int:
        return self.record.num_preemptions

    async def _preempted(self) -> None:
        """The pause before a preempted attempt's replay."""
        self.record.num_preemptions += 1
        await asyncio.sleep(min(REPLAY_BACKOFF_S * 2 ** (self.record.num_preemptions - 1), 1.0))

    def _route_lost(self, lost: RouteLost, num_tokens: int) -> None:
        """The next attempt avoids the lost stage, whose address the coordinator hears of; StageFailed after
        MAX_FAILOVERS losses."""
        record = self.record
        record.num_failovers += 1
        self._run.log.stats.num_failovers += 1
        if record.num_failovers > MAX_FAILOVERS:
            raise StageFailed(f"lost {MAX_FAILOVERS + 1} routes in a row; the last: {lost}")
        log.warning("request %s lost a stage (%s) after %d tokens; resuming on a new route",
                    record.request_id, lost, num_tokens)
        self._lost.add(lost.address)
        self._on_unreachable(lost.address)

    def _failed(self, exc: BaseException) -> None:
        """Records why the request failed (a caller that stopped it is no failure)."""
        if not isinstance(exc, GeneratorExit | asyncio.CancelledError):
            self.record.error = str(exc) or type(exc).__name__

    def _finish(self, num_tokens: int) -> None:
        self._run.log.end(self.record, num_tokens, self._run.cached_tokens, self._run.span_id)


class Generation(_Request):
    """One generation: async-iterate for its token ids; aclose() ends it on every stage.

    It keeps the prompt and every token it emitted. When a stage of its route is lost it prefills them on a new
    route and goes on from there: sampling is keyed by position, so the continuation is the one an uninterrupted run
    gives, and the caller sees no token twice and none missing. It ends by itself as stops says (max_tokens or a
    stop token; with neither it runs until the caller closes it)."""

    def __init__(self, run: Run, routes: RouteSource, prompt_ids: Sequence[int], stops: Stops = Stops(),
                 prefill: PrefillSource | None = None, on_unreachable: Callable[[str], None] = lambda address: None):
        super().__init__(run, routes, prompt_ids, on_unreachable)
        self._stops = stops
        self._prefill = prefill
        self._tokens = self._attempts()
        # where its sampling asks for them: each emitted token's log-probabilities, and its prompt's (the second
        # token's on), as the last stage sent them
        self.logprobs: list[Logprobs | None] = []
        self.prompt_logprobs: tuple[Logprobs, ...] = ()

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> int:
        return await self._tokens.__anext__()

    async def aclose(self) -> None:
        await self._tokens.aclose()

    async def _attempts(self) -> AsyncIterator[int]:
        run, record, emitted = self._run, self.record, []
        moved: Moved | None = None      # the session the last attempt left quiet on its stages: the next resumes it
        decode_on: tuple[Sequence[Hop], int] | None = None     # where a prefill hands its session off to
        try:
            while True:
                route, block_size = await self._next_route(decode_on, emitted)
                prefill = self._prefill_route(route) if not (emitted or moved) else None
                decode_on = (route, block_size) if prefill else None
                if moved is not None:
                    await self._move_kv(moved, route)
                record.route = tuple(prefill or route)
                left = self._stops.left(len(emitted))
                decode = (1 if prefill else left or 0, tuple(sorted(self._stops.token_ids)))
                hand_off_to = route if prefill else None
                attempt = Attempt(run, prefill or route, block_size, self._prompt + emitted,
                                  first=not emitted, resume_from=moved.session_id if moved else "", decode=decode,
                                  output_start=len(self._prompt))
                resuming, moved = moved, None
                try:
                    async with aclosing(attempt.tokens(self._stops, len(emitted), hand_off_to)) as events:
                        async for event in events:
                            emitted.append(event.token_id)
                            self.logprobs.append(event.logprobs)
                            self.prompt_logprobs = self.prompt_logprobs or event.prompt_logprobs
                            yield event.token_id
                finally:
                    if resuming is not None:    # resumed, or given up: no stage holds it for this request any more
                        run.sessions.moved(resuming.session_id)
                match attempt.outcome:
                    case Done():
                        return
                    case Moved() as moved:      # the next attempt resumes it
                        self._count_move(moved)
                        run.sessions.moving(moved.session_id, moved.route)
                    case Preempted():
                        await self._preempted()
                    case RouteLost() as lost:
                        self._route_lost(lost, len(emitted))
        except BaseException as exc:
            self._failed(exc)
            raise
        finally:
            if moved is not None:
                if moved.hand_off is not None:
                    moved.hand_off.move.cancel()
                run.sessions.moved(moved.session_id)
            self._finish(len(emitted))

    async def _next_route(self, decode_on: tuple[Sequence[Hop], int] | None,
                          emitted: list[int]) -> tuple[Sequence[Hop], int]:
        """The route of the next attempt: the one a prefill handed off to, unless it runs through a lost stage."""
        avoid = frozenset(self._lost)
        if decode_on is not None and not any(hop.address in avoid for hop in decode_on[0]):
            return decode_on
        return await self._routes(avoid, self._prompt + emitted)

    def _prefill_route(self, decode: Sequence[Hop]) -> Sequence[Hop] | None:
        """Where the prompt prefills apart from decode, if the prefill source says so and a token will follow."""
        if self._prefill is None or self._stops.max_tokens == 1:
            return None
        return self._prefill(decode, self._prompt, frozenset(self._lost)) or None

    def _count_move(self, moved: Moved) -> None:
        stats = self._run.log.stats
        if moved.hand_off is not None:
            self.record.num_handoffs += 1
            stats.num_handoffs += 1
        else:
            self.record.num_moves += 1
            stats.num_moves += 1

    async def _move_kv(self, moved: Moved, route: Sequence[Hop]) -> None:
        """Has the stages of route pull the moved session's KV from those it left: by the hand-off's move if it
        went to route (else that move is called off), or by a move now."""
        hand_off, stats = moved.hand_off, self._run.log.stats
        if hand_off is not None and hand_off.to == tuple(route):
            moved_bytes = await hand_off.move
        else:
            if hand_off is not None:
                hand_off.move.cancel()
            moved_bytes = await move_kv(moved.session_id, moved.route, route)
        stats.kv_moved_bytes += moved_bytes
        stats.handoff_kv_bytes += moved_bytes if hand_off else 0


class Embedding(_Request):
    """One embedding: await vector() for the prompt's pooled, L2-normalized vector, which the last stage of an
    embedding model returns for the prompt's last chunk. A preempted attempt, or one that lost a stage, is
    replayed: the prompt is prefilled again on the next route."""

    async def vector(self) -> tuple[float, ...]:
        """Runs the request: the embedding; StageFailed (or ModelNotReady from the routes) when it cannot."""
        record = self.record
        try:
            while True:
                route, block_size = await self._routes(frozenset(self._lost), self._prompt)
                record.route = tuple(route)
                first = record.num_preemptions + record.num_failovers == 0
                attempt = Attempt(self._run, route, block_size, self._prompt, first)
                vector = await attempt.vector()
                match attempt.outcome:
                    case Done():
                        assert vector is not None
                        return vector
                    case Preempted():
                        await self._preempted()
                    case RouteLost() as lost:
                        self._route_lost(lost, 0)
        except BaseException as exc:
            self._failed(exc)
            raise
        finally:
            self._finish(0)
