"""What the origin remembers of its requests: a record of each (for the admin API), counters, spans."""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from dataclasses import dataclass

from stratamesh.fleet.states import RequestState
from stratamesh.fleet.tracing import SpanStore, new_trace_id
from stratamesh.fleet.sessions import Hop

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
    revision: str = ""          # the model's revision its route served (a request keeps it through failover)

    @property
    def state(self) -> RequestState:
        if not self.end_unix_ns:
            return RequestState.RUNNING
        return RequestState.FAILED if self.error else RequestState.FINISHED

    @property
    def num_attempts(self) -> int:
        """Attempts begun before the current one: each opens a session of its own."""
        return self.num_preemptions + self.num_failovers + self.num_moves + self.num_handoffs


@dataclass(slots=True)
class OriginStats:
    """What the origin's generations went through, since it started (exported as counters)."""

    num_moves: int = 0
    num_failovers: int = 0
    num_replayed_tokens: int = 0
    kv_moved_bytes: int = 0         # by moves and hand-offs
    num_handoffs: int = 0           # prefills whose KV moved to the route that decodes them
    handoff_kv_bytes: int = 0


class RequestLog:
    """The records of the newest MAX_RECENT_REQUESTS requests, the counters of all, and the spans of those traced
    (a trace_sample_rate of them)."""

    def __init__(self, spans: SpanStore | None = None, trace_sample_rate: float = 1.0) -> None:
        self.spans = spans or SpanStore("stratamesh-origin")
        self.stats = OriginStats()
        self.recent: OrderedDict[str, RequestRecord] = OrderedDict()
        self._trace_sample_rate = trace_sample_rate

    def begin(self, request_id: str, num_prompt_tokens: int) -> RequestRecord:
        """The record of a request starting now (traced or not, by the sample rate), remembered."""
        trace_id = new_trace_id() if random.random() < self._trace_sample_rate else ""
        record = RequestRecord(request_id, trace_id, (), time.time_ns(), num_prompt_tokens)
        self.recent[request_id] = record
        self.recent.move_to_end(request_id)
        while len(self.recent) > MAX_RECENT_REQUESTS:
            self.recent.popitem(last=False)
        return record

    def end(self, record: RequestRecord, num_tokens: int, cached_tokens: int, span_id: str) -> None:
        """Records the end of a request, and its root span (span_id) if it was traced."""
        record.end_unix_ns, record.num_tokens, record.cached_tokens = time.time_ns(), num_tokens, cached_tokens
        if record.trace_id:
            self.spans.record("request", record.trace_id, "", record.start_unix_ns, record.end_unix_ns,
                              {"stratamesh.request": record.request_id, "stratamesh.tokens": str(num_tokens)},
                              span_id=span_id)

    def replayed(self, record: RequestRecord, num_tokens: int) -> None:
        """Counts tokens computed again on a new route."""
        record.num_replayed_tokens += num_tokens
        self.stats.num_replayed_tokens += num_tokens
