"""Each model's load as the autoscaler weighs it: requests arriving, what they ask for, how long they wait.

The API reports every request of a model (arrival, first token, each token after, end) and DemandMeter keeps the
last WINDOW_S of it per model: the arrival rate, the mean tokens a request generates, the p90 time to first token
and inter-token latency, and the requests waiting for a first token and generating now. Time is a parameter (unix
seconds): it does no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from stratamesh.coordinator.live_stats import percentile

WINDOW_S = 10.0                 # rates and percentiles are taken over this many seconds up to now
MAX_SAMPLES = 4096              # latency samples kept per model (the newest)
TOKENS_PER_REQUEST_PRIOR = 128.0    # what a request is taken to generate before any has finished
TOKENS_DECAY = 0.9              # each finished request's weight against the mean of those before


@dataclass(frozen=True, slots=True)
class Demand:
    """A model's load over the last window_s seconds."""

    arrivals_per_s: float = 0.0
    tokens_per_request: float = TOKENS_PER_REQUEST_PRIOR    # generated, a decayed mean over finished requests
    waiting: int = 0            # accepted and without a first token yet (queued for a route, or in prefill)
    running: int = 0            # generating
    ttft_p90_s: float | None = None
    itl_p90_s: float | None = None
    window_s: float = WINDOW_S

    @property
    def tokens_per_s(self) -> float:
        """The generation rate the arrivals ask for."""
        return self.arrivals_per_s * self.tokens_per_request

    @property
    def in_flight(self) -> int:
        return self.waiting + self.running


@dataclass(slots=True)
class _ModelLoad:
    arrivals: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    ttft: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    itl: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    tokens_per_request: float = TOKENS_PER_REQUEST_PRIOR
    waiting: int = 0
    running: int = 0


class DemandMeter:
    """Per model: arrivals, first tokens and the gaps between tokens, and ends, into a Demand."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self._window_s = window_s
        self._models: dict[str, _ModelLoad] = {}

    def arrived(self, model_id: str, now: float) -> None:
        load = self._load(model_id)
        load.arrivals.append(now)
        load.waiting += 1

    def first_token(self, model_id: str, now: float, ttft_s: float) -> None:
        load = self._load(model_id)
        load.ttft.append((now, ttft_s))
        load.waiting = max(0, load.waiting - 1)
        load.running += 1

    def token(self, model_id: str, now: float, gap_s: float) -> None:
        self._load(model_id).itl.append((now, gap_s))

    def ended(self, model_id: str, num_tokens: int, had_first_token: bool) -> None:
        """A request ended, having generated num_tokens (one that generated none teaches nothing of the mean)."""
        load = self._load(model_id)
        if had_first_token:
            load.running = max(0, load.running - 1)
            load.tokens_per_request = TOKENS_DECAY * load.tokens_per_request + (1 - TOKENS_DECAY) * num_tokens
        else:
            load.waiting = max(0, load.waiting - 1)

    def demand(self, model_id: str, now: float) -> Demand:
        load = self._models.get(model_id)
        if load is None:
            return Demand(window_s=self._window_s)
        since = now - self._window_s
        while load.arrivals and load.arrivals[0] < since:
            load.arrivals.popleft()
        for samples in (load.ttft, load.itl):
            while samples and samples[0][0] < since:
                samples.popleft()
        return Demand(len(load.arrivals) / self._window_s, load.tokens_per_request, load.waiting, load.running,
                      percentile(sorted(v for _, v in load.ttft), 90), percentile(sorted(v for _, v in load.itl), 90),
                      self._window_s)

    def _load(self, model_id: str) -> _ModelLoad:
        load = self._models.get(model_id)
        if load is None:
            load = self._models[model_id] = _ModelLoad()
        return load
