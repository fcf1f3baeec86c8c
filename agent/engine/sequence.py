"""What the scheduler tracks per session: the work items that arrive and the session's progress."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b have in common."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One chunk of a session as it arrives: tokens at [start_pos, start_pos + len(token_ids))."""

    session_id: str
    start_pos: int
    token_ids: tuple[int, ...]
    sample: bool
    step: int = 0
    payload: object = None      # the upstream hidden states; only the runner looks inside
    arrived_ns: int = 0         # when the chunk reached this stage (Unix ns; 0 when nobody said)
    trace_id: str = ""          # the request's trace, if it is traced
    num_draft: int = 0          # its last num_draft tokens are drafted, for the last stage to verify
    pending_from: int = 0       # a run following an unverified one: where the unverified tokens start (else 0)

    @property
    def draft_start(self) -> int:
        """The position of its first drafted token (end_pos when it has none)."""
        return self.end_pos - self.num_draft

    @property
    def unverified_from(self) -> int | None:
        """Where the session's tokens the last stage has not verified start, once this item is in; None: nowhere."""
        if self.pending_from:
            return self.pending_from
        return self.draft_start if self.num_draft else None

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True)
class Session:
    """A live session on this stage: its known token ids, queued items and computed count."""

    session_id: str
    token_ids: list[int]            # prompt first, then every later token as items bring them
    prompt_len: int
    open_order: int                 # victim choice: the most recently opened goes first
    num_computed: int               # positions < num_computed have their KV (at open: the pinned prefix)
    next_pos: int | None = None     # where the next item must start; None before the first
    queue: deque[WorkItem] = field(default_factory=deque)
    arrivals: deque[int] = field(default_factory=deque)   # global arrival number of each queued item
    offset: int = 0                 # tokens of queue[0] already computed (a split prefill)
    # Where its unverified drafted tokens start (speculative decoding), None when it has none: the next item may
    # start anywhere from here to next_pos, and the positions from there on are forgotten; the prefix cache takes
    # only the blocks before it.
    drafted_from: int | None = None

    def is_decode(self, item: WorkItem) -> bool:
        """Whether the item extends past the prompt (so it may preempt others to get a block)."""
        return item.start_pos >= self.prompt_len
