"""Picks each step's batch across all sessions of a stage: decodes first, chunked prefill, preemption."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stratamesh.agent.engine.block_manager import BlockManager
from stratamesh.agent.engine.sequence import Session, WorkItem, shared_prefix
from stratamesh.fleet.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """item.token_ids[begin:end] at positions [start_pos, start_pos + end - begin) in this step's pass."""

    session_id: str
    item: WorkItem
    begin: int
    end: int
    start_pos: int
    block_table: list[int]
    sample: bool                # True only for the piece that ends an item that asked to sample
    is_decode: bool = False     # past the prompt (prefill otherwise: a replayed session's history is prefill)

    @property
    def num_tokens(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True, slots=True)
class Batch:
    """One forward pass worth of chunks, and the sessions preempted since the last batch."""

    chunks: list[ScheduledChunk]
    preempted: list[str]


class Scheduler:
    """Continuous batching over a stage's sessions; call it from one thread only."""

    def __init__(self, block_manager: BlockManager, max_batch_tokens: int = 1024,
                 max_batch_seqs: int = 64) -> None:
        assert max_batch_tokens > 0 and max_batch_seqs > 0
        self.block_manager = block_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_seqs = max_batch_seqs
        self.pipeline_depth = 1                 # stages in the route; the first stage sets it
        self.micro_batches = 0                  # decodes circulate in this many micro-batches (0: pipeline_depth)
        self.sessions: dict[str, Session] = {}
        self.preempted: set[str] = set()        # until closed: their later items are rejected
        self.unreported: list[str] = []         # preempted since the last batch
        self._num_opened = 0
        self._num_arrived = 0

    # ------------------------------------------------------------ sessions
    def open(self, session_id: str, prompt_token_ids: Sequence[int], max_cached_tokens: int) -> int:
        """Registers a session and pins its cached prefix (at most len(prompt) - 1); returns its tokens."""
        if session_id in self.sessions or session_id in self.preempted:
            raise InvalidInput(f"session_id {session_id!r} is already open")
        if not prompt_token_ids:
            raise InvalidInput(f"prompt_token_ids of session {session_id!r} is empty")
        prompt = list(prompt_token_ids)
        limit = min(max_cached_tokens, len(prompt) - 1)
        num_cached = self.block_manager.open(session_id, prompt, limit)
        self.sessions[session_id] = Session(session_id, prompt, len(prompt), self._num_opened, num_cached)
        self._num_opened += 1
        return num_cached

    def resume(self, session_id: str, new_id: str, prompt_token_ids: Sequence[int],
               max_cached_tokens: int) -> int | None:
        """A quiet session goes on under new_id (its route changed), keeping its KV; returns its cached tokens.

        None when it cannot (unknown, work queued, or its tokens differ from the new prompt); it is then closed
        and the caller opens new_id afresh."""
        session = self.sessions.get(session_id)
        if session is None:
            return None
        self.drop_unverified(session_id)            # runs that followed its last verified one: nothing verifies them
        prompt = list(prompt_token_ids)
        if session.drafted_from is not None and not session.queue:   # its drafts: those the prompt keeps stay
            position = min(shared_prefix(prompt, session.token_ids), len(prompt) - 1, session.num_computed)
            if position >= session.drafted_from:
                self.rewind(session_id, position)
        n = session.num_computed
        if new_id in self.sessions or session.queue or len(prompt) <= n or prompt[:n] != session.token_ids[:n]:
            self.close(session_id)
            return None
        del self.sessions[session_id]
        self.block_manager.rename(session_id, new_id)
        session.session_id, session.token_ids, session.next_pos, session.offset = new_id, prompt, None, 0
        self.sessions[new_id] = session
        return min(n, max_cached_tokens, len(prompt) - 1)

    def import_session(self, session_id: str, token_ids: Sequence[int], prompt_len: int, num_computed: int,
                       write: Callable[[list[int]], None]) -> None:
        """Opens a quiet session whose first num_computed positions come as KV from another stage: reserves
        their blocks, has write(block_table) fill them, then caches the full ones (NoFreeBlocks if they do not fit)."""
        if session_id in self.sessions or session_id in self.preempted:
            raise InvalidInput(f"session_id {session_id!r} is already open")
        if not 0 < prompt_len <= len(token_ids) or not 0 <= num_computed <= len(token_ids):
            raise InvalidInput(f"session {session_id!r}: prompt_len {prompt_len} and num_computed {num_computed} "
                               f"must lie within its {len(token_ids)} tokens")
        bm = self.block_manager
        bm.open(session_id, (), 0)
        try:
            write(bm.reserve(session_id, num_computed))
        except BaseException:
            bm.free(session_id)
            raise
        bm.commit(session_id, token_ids, num_computed)
        self.sessions[session_id] = Session(session_id, list(token_ids), prompt_len, self._num_opened, num_computed)
        self._num_opened += 1

    def quiet(self, session_id: str) -> Session:
        """The session, which must have no work queued (its state can then be exported)."""
        session = self._live(session_id)
        if session.queue:
            raise InvalidInput(f"session {session_id!r} has work queued: it can move only between steps")
        return session

    def add(self, item: WorkItem) -> None:
        """Queues a chunk after checking it continues its session exactly where the last one ended, or (after
        drafted tokens) where the last stage's verification of them ended: the rejected ones are forgotten, and the
        runs queued behind them dropped."""
        session = self._live(item.session_id)
        if (item.token_ids and session.drafted_from is not None
                and session.drafted_from <= item.start_pos < (session.next_pos or 0)):
            self._forget_drafts(session, item.start_pos)
        self._check_start(session, item)
        new_ids = self._new_token_ids(session, item)
        session.drafted_from = item.unverified_from
        if session.next_pos is None and item.start_pos < session.num_computed:
            # The origin settled on fewer cached tokens than this stage pinned: another stage had less.
            self.block_manager.truncate(item.session_id, item.start_pos)
            session.num_computed = item.start_pos
        session.token_ids.extend(new_ids)
        session.next_pos = item.end_pos
        session.queue.append(item)
        session.arrivals.append(self._num_arrived)
        self._num_arrived += 1

    def rewind(self, session_id: str, position: int) -> None:
        """Forgets a session's tokens from position on (it has no work queued): the next item starts there."""
        session = self._live(session_id)
        if not 0 <= position <= len(session.token_ids):
            raise InvalidInput(f"session {session_id!r}: cannot rewind to {position} of its {len(session.token_ids)} "
                               "tokens")
        self._forget_drafts(session, position)
        session.drafted_from = None

    def reject(self, session_id: str, position: int) -> list[WorkItem]:
        """The last stage rejected the session's drafted tokens from position on, and the runs that followed them
        (SessionRewind): the runs queued from there are dropped (and returned), the positions forgotten; the next
        item starts there. InvalidInput if position lies among its verified tokens."""
        session = self._live(session_id)
        if session.next_pos is None or position >= session.next_pos:
            return []                                   # nothing of it here (its runs were dropped on the way)
        if session.drafted_from is None or position < session.drafted_from:
            raise InvalidInput(f"session {session_id!r}: a rewind to {position} would forget verified tokens")
        dropped = self._forget_drafts(session, position)
        session.drafted_from = None
        return dropped

    def drop_unverified(self, session_id: str) -> list[WorkItem]:
        """Drops (and returns) the session's queued runs when each followed another into the pipeline (whose loop
        ended before them: nothing will verify them); their positions are forgotten."""
        session = self._live(session_id)
        if not session.queue or not all(item.pending_from for item in session.queue):
            return []
        return self._forget_drafts(session, session.queue[0].start_pos)

    def _forget_drafts(self, session: Session, position: int) -> list[WorkItem]:
        """Forgets the session's tokens from position on: drafted ones the last stage rejected (their KV, computed,
        is overwritten by the next tokens'; the blocks past them go back), and drops (and returns) the runs queued
        from there on, which followed them into the pipeline."""
        if any(item.start_pos < position for item in session.queue):
            raise InvalidInput(f"session {session.session_id!r}: a chunk at {position} came while its drafted tokens "
                               "were still queued")
        dropped = list(session.queue)
        session.queue.clear()
        session.arrivals.clear()
        session.offset = 0
        del session.token_ids[position:]
        session.num_computed = min(session.num_computed, position)
        session.next_pos = position
        self.block_manager.truncate(session.session_id, position)
        return dropped

    @staticmethod
    def _check_start(session: Session, item: WorkItem) -> None:
        """The first item may start anywhere in the cached prefix; every later one where the last ended."""
        if not item.token_ids:
            raise InvalidInput(f"token_ids of session {item.session_id!r} is empty")
        if session.next_pos is None:
            if not 0 <= item.start_pos <= session.num_computed:
                raise InvalidInput(f"start_pos {item.start_pos} of session {item.session_id!r} is past "
                                   f"its {session.num_computed} cached tokens")
        elif item.start_pos != session.next_pos:
            raise InvalidInput(f"start_pos {item.start_pos} of session {item.session_id!r}, "
                               f"expected {session.next_pos}")

    def _live(self, session_id: str) -> Session:
        if session_id in self.preempted:
            raise InvalidInput(f"session {session_id!r} was preempted")
        session = self.sessions.get(session_id)
        if session is None:
            raise InvalidInput(f"session_id {session_id!r} is not open")
        return session

    @staticmethod
    def _new_token_ids(session: Session, item: WorkItem) -> tuple[int, ...]:
        """The item's ids past the known ones; ids it repeats (the prompt) must match them."""
        overlap = session.token_ids[item.start_pos:item.end_pos]
        if list(item.token_ids[:len(overlap)]) != overlap:
            raise InvalidInput(f"token_ids of session {item.session_id!r} at start_pos {item.start_pos} "
                               f"differ from its prompt")
        return item.token_ids[len(overlap):]

    def close(self, session_id: str) -> None:
        """Frees the session's blocks and forgets it; unknown ids are ignored."""
        self.preempted.discard(session_id)
        if self.sessions.pop(session_id, None) is not None:
            self.block_manager.free(session_id)

    def _preempt(self, session: Session) -> None:
        """Frees the session for recompute: the origin replays it later as a new session."""
        del self.sessions[session.session_id]
        self.block_manager.free(session.session_id)
        self.preempted.add(session.session_id)
        self.unreported.append(session.session_id)

    # ------------------------------------------------------------ counters
    @property
    def has_work(self) -> bool:
        return bool(self.unreported) or any(s.queue for s in self.sessions.values())

    @property
    def num_sessions(self) -> int:
        return len(self.sessions)

    @property
    def num_waiting(self) -> int:
        return sum(1 for s in self.sessions.values() if s.queue)

    @property
    def num_running(self) -> int:
        """Sessions holding KV blocks."""
        return sum(1 for s in self.sessions.values() if self.block_manager.tables[s.session_id])

    # ------------------------------------------------------------ steps
    def schedule(self) -> Batch | None:
        """The next step's chunks, at most one per session; None when there is nothing to do or report."""
        chunks: list[ScheduledChunk] = []
        budget, decodes_left = self.max_batch_tokens, self._decode_share()
        blocked: Session | None = None
        for session in self._candidates():
            if len(chunks) == self.max_batch_seqs or budget == 0:
                break
            if session.session_id not in self.sessions:
                continue    # preempted for a decode earlier in this loop
            item = session.queue[0]
            if session.is_decode(item):
                if decodes_left == 0:
                    continue    # this micro-batch is full: the rest go in the next step
                decodes_left -= 1
            n = min(len(item.token_ids) - session.offset, budget)
            if item.num_draft and n < len(item.token_ids):
                continue    # drafted tokens are verified in one step: next step, whole
            if self._reserve(session, item.start_pos + session.offset + n, chunks):
                chunks.append(self._chunk(session, n))
                budget -= n
            elif session.session_id in self.sessions:
                blocked = session   # a prefill waits for blocks; FCFS: so do the prefills behind it
                break
        if not chunks and blocked is not None:
            self._break_deadlock(blocked)
        if not chunks and not self.unreported:
            return None
        preempted, self.unreported = self.unreported, []
        return Batch(chunks, preempted)

    @property
    def decodes_in_flight(self) -> int:
        """Decoding sessions with nothing queued: their next token is on its way back to this stage."""
        return sum(1 for s in self.sessions.values() if s.num_computed >= s.prompt_len and not s.queue)

    @property
    def decodes_ready(self) -> int:
        return sum(1 for s in self.sessions.values() if s.queue and s.is_decode(s.queue[0]))

    def wants_more_decodes(self) -> bool:
        """Whether sessions still on their way would fill this step's micro-batch more than those here."""
        ready = self.decodes_ready
        return self.decodes_in_flight > 0 and ready < self._decode_share()

    def _decode_share(self) -> int:
        """Decodes per step: with K micro-batches (a pipeline of depth K, or more across long links), a K-th of the
        decoding sessions, so that K micro-batches circulate and every stage has one to work on (vLLM's virtual
        engines)."""
        num_micro_batches = self.micro_batches or self.pipeline_depth
        if num_micro_batches <= 1:
            return self.max_batch_seqs
        return max(1, -(-self.num_decoding // num_micro_batches))

    @property
    def num_decoding(self) -> int:
        """Sessions past their prompt."""
        return sum(1 for s in self.sessions.values() if s.num_computed >= s.prompt_len)

    def _candidates(self) -> list[Session]:
        """Sessions with queued work: decodes first, then prefills, each in arrival order."""
        waiting = [s for s in self.sessions.values() if s.queue]
        return sorted(waiting, key=lambda s: (not s.is_decode(s.queue[0]), s.arrivals[0]))

    def _reserve(self, session: Session, end_pos: int, chunks: list[ScheduledChunk]) -> bool:
        """Reserves slots up to end_pos; a decode preempts the newest other session until it fits."""
        bm = self.block_manager
        while not bm.can_reserve(session.session_id, end_pos):
            if not session.is_decode(session.queue[0]):
                return False
            in_batch = {c.session_id for c in chunks}
            victims = [s for s in self.sessions.values() if s is not session
                       and s.session_id not in in_batch and bm.tables[s.session_id]]
            self._preempt(max(victims, key=lambda s: s.open_order) if victims else session)
            if not victims:
                return False
        bm.reserve(session.session_id, end_pos)
        return True

    def _break_deadlock(self, blocked: Session) -> None:
        """Nothing could run and every session holding blocks waits for more: preempt the newest."""
        holders = [s for s in self.sessions.values() if self.block_manager.tables[s.session_id]]
        if all(s.queue for s in holders):
            self._preempt(max(holders, key=lambda s: s.open_order) if holders else blocked)

    def _chunk(self, session: Session, n: int) -> ScheduledChunk:
        item, begin = session.queue[0], session.offset
        end = begin + n
        return ScheduledChunk(session.session_id, item, begin, end, item.start_pos + begin,
                              self.block_manager.block_table(session.session_id),
                              item.sample and end == len(item.token_ids), session.is_decode(item))

    def postprocess(self, batch: Batch) -> None:
        """Marks the batch's chunks computed, caches full blocks, and drops consumed items."""
        for chunk in batch.chunks:
            session = self.sessions.get(chunk.session_id)
            if session is None or not session.queue or session.queue[0] is not chunk.item:
                continue    # closed (or preempted) while the pass ran
            session.num_computed = chunk.start_pos + chunk.num_tokens
            verified = session.num_computed if session.drafted_from is None else min(session.num_computed,
                                                                                     session.drafted_from)
            self.block_manager.commit(session.session_id, session.token_ids, verified)
            session.offset = chunk.end
            if session.offset == len(chunk.item.token_ids):
                session.queue.popleft()
                session.arrivals.popleft()
                session.offset = 0
