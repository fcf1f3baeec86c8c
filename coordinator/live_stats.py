"""Per-second series of the API's throughput, latency and queue, for the admin UI's live charts.

Prometheus histograms (coordinator/metrics.py) are for dashboards that scrape; they cannot give a p99 of the last
ten seconds. LiveStats keeps one bucket per second for a few minutes instead: tokens, finished requests, TTFT and
inter-token samples, and the requests running and waiting. Time is a parameter (unix seconds): it does no I/O.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

KEEP_S = 600                 # the history kept: ten minutes of one-second buckets
WINDOW_S = 10                # percentiles of a point are taken over this many seconds up to it
SAMPLES_PER_BUCKET = 256     # latency samples kept per second: a uniform sample of them beyond that


@dataclass(slots=True)
class _Reservoir:
    """A uniform sample of at most SAMPLES_PER_BUCKET of the values added (reservoir sampling)."""

    values: list[float] = field(default_factory=list)
    num_seen: int = 0

    def add(self, value: float, rng: random.Random) -> None:
        self.num_seen += 1
        if len(self.values) < SAMPLES_PER_BUCKET:
            self.values.append(value)
        else:
            slot = rng.randrange(self.num_seen)
            if slot < SAMPLES_PER_BUCKET:
                self.values[slot] = value


@dataclass(slots=True)
class _Bucket:
    second: int
    running: int             # the most requests generating at once during the second
    waiting: int             # ... and waiting for their first token
    running_after: int       # ... and the two when its last event left them
    waiting_after: int
    num_tokens: int = 0
    num_requests: int = 0
    ttft_s: _Reservoir = field(default_factory=_Reservoir)
    itl_s: _Reservoir = field(default_factory=_Reservoir)


class LiveStats:
    """One bucket per second; a point per second with tokens/s, requests/s, TTFT/ITL p50/p99 and the queue."""

    def __init__(self, keep_s: int = KEEP_S, window_s: int = WINDOW_S) -> None:
        self._buckets: deque[_Bucket] = deque(maxlen=keep_s)
        self._window_s = window_s
        self._running = 0
        self._waiting = 0
        self._rng = random.Random(0)

    def request_started(self, now: float) -> None:
        self._waiting += 1
        self._gauges(self._bucket(now))

    def first_token(self, now: float, ttft_s: float) -> None:
        """A request's first token: it stops waiting and starts generating."""
        self._waiting = max(0, self._waiting - 1)
        self._running += 1
        bucket = self._bucket(now)
        bucket.num_tokens += 1
        bucket.ttft_s.add(ttft_s, self._rng)
        self._gauges(bucket)

    def token(self, now: float, gap_s: float) -> None:
        """A token after the first, gap_s after the one before."""
        bucket = self._bucket(now)
        bucket.num_tokens += 1
        bucket.itl_s.add(gap_s, self._rng)

    def request_ended(self, now: float, had_first_token: bool) -> None:
        if had_first_token:
            self._running = max(0, self._running - 1)
        else:
            self._waiting = max(0, self._waiting - 1)
        bucket = self._bucket(now)
        bucket.num_requests += 1
        self._gauges(bucket)

    def points(self, now: float, seconds: int) -> list[dict[str, Any]]:
        """One point per second of the last `seconds` before now's (oldest first)."""
        last = int(now) - 1
        first = last - min(seconds, self._buckets.maxlen or seconds) + 1
        by_second = {b.second: b for b in self._buckets}
        queue = (0, 0)     # the queue a quiet second had: what the last event before it left
        for bucket in self._buckets:
            if bucket.second < first:
                queue = (bucket.running_after, bucket.waiting_after)
        out = []
        for second in range(first, last + 1):
            bucket = by_second.get(second)
            if bucket is not None:
                out.append(self._point(second, bucket, by_second, (bucket.running, bucket.waiting)))
                queue = (bucket.running_after, bucket.waiting_after)
            else:
                out.append(self._point(second, None, by_second, queue))
        return out

    def _point(self, second: int, bucket: _Bucket | None, by_second: dict[int, _Bucket],
               queue: tuple[int, int]) -> dict[str, Any]:
        window = [by_second[s] for s in range(second - self._window_s + 1, second + 1) if s in by_second]
        ttft = sorted(x for b in window for x in b.ttft_s.values)
        itl = sorted(x for b in window for x in b.itl_s.values)
        return {"t": float(second), "tokens_per_s": bucket.num_tokens if bucket else 0,
                "requests_per_s": bucket.num_requests if bucket else 0,
                "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
                "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
                "running": queue[0], "waiting": queue[1]}

    def _bucket(self, now: float) -> _Bucket:
        second = int(now)
        if self._buckets and self._buckets[-1].second >= second:
            return self._buckets[-1]      # a clock that steps back lands in the newest bucket
        bucket = _Bucket(second, self._running, self._waiting, self._running, self._waiting)
        self._buckets.append(bucket)
        return bucket

    def _gauges(self, bucket: _Bucket) -> None:
        bucket.running = max(bucket.running, self._running)
        bucket.waiting = max(bucket.waiting, self._waiting)
        bucket.running_after, bucket.waiting_after = self._running, self._waiting


def percentile(sorted_values: list[float], pct: float) -> float | None:
    """The nearest-rank percentile of sorted values; None for none."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(pct / 100 * len(sorted_values)))
    return sorted_values[rank - 1]
