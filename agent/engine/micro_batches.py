"""How many micro-batches a first stage splits its decoding sessions into, from what it measured of its pipeline.

A pipeline of depth D keeps every stage busy only with at least D micro-batches circulating. Across a long link
each micro-batch also spends the link's latency L away, during which a stage has nothing to do unless more,
smaller micro-batches fill the gap; but smaller ones cost more steps, each with its fixed cost. With N sessions
in K micro-batches of b = ceil(N / K), a stage's step taking s(b), one round of all of them takes

    max(K * s(b), D * s(b) + L)         (the first stage busy all along, or one micro-batch's trip around)

and yields N tokens. The first stage measures s(b) = fixed + per_seq * b from its own decode steps (a line through
the median step of each batch size, so that one slow step on a shared box does not tilt it; the others are assumed
as fast: it is the planner's job to balance them) and L from how long each session's token is away between leaving
its step and coming back, less the other stages' share. It moves to the K that makes the most tokens per second
only when that is predicted SWITCH_GAIN faster than the K it has: noise must not make it flap, and the step time it
measures leaves out each step's messages and scheduling, which more micro-batches multiply (with a 10% margin, a
LAN pipeline on this project's 2-core VM split into 4 micro-batches and lost a quarter of its throughput).
Pure: the caller passes the times it measured.
"""

from __future__ import annotations

import collections
import math
import statistics

MAX_MICRO_BATCHES = 16
WINDOW = 64                 # measurements remembered: a few seconds of decoding
MIN_SAMPLES = 8             # fewer than this of either kind: one micro-batch per stage, as before measuring
SWITCH_GAIN = 0.25          # a new count must promise rounds this much shorter than the current one's


class MicroBatches:
    """The first stage's measurements of its pipeline and the number of micro-batches they call for; the pipeline's
    depth (stages in the route) is the caller's, as its scheduler holds it."""

    def __init__(self) -> None:
        self._steps: collections.deque[tuple[int, float]] = collections.deque(maxlen=WINDOW)    # (b, s)
        self._away: collections.deque[tuple[int, float]] = collections.deque(maxlen=WINDOW)     # (b, seconds)
        self._cost: tuple[float, float] | None = None     # step_cost() of the measurements so far

    def stepped(self, batch_size: int, seconds: float) -> None:
        """A decode step of batch_size sessions took seconds here."""
        self._steps.append((batch_size, seconds))
        self._cost = None

    def returned(self, batch_size: int, seconds: float) -> None:
        """A session's next token came back seconds after it left a step of batch_size sessions here."""
        self._away.append((batch_size, seconds))

    def step_cost(self) -> tuple[float, float]:
        """(fixed s, per-session s) of a decode step here: a least-squares line through the median step time of
        each batch size measured (flat while only one size was); fitted once per new step measured."""
        if self._cost is None:
            self._cost = self._fit_steps()
        return self._cost

    def _fit_steps(self) -> tuple[float, float]:
        by_size: dict[int, list[float]] = {}
        for b, s in self._steps:
            by_size.setdefault(b, []).append(s)
        points = [(b, statistics.median(times)) for b, times in by_size.items()]
        mean_b, mean_s = statistics.fmean(b for b, _ in points), statistics.fmean(s for _, s in points)
        spread = sum((b - mean_b) ** 2 for b, _ in points)
        per_seq = sum((b - mean_b) * (s - mean_s) for b, s in points) / spread if spread else 0.0
        per_seq = max(0.0, per_seq)
        fixed = mean_s - per_seq * mean_b
        if fixed < 0:       # the line crosses below zero: the steps scale with their sessions, all of it
            return 0.0, mean_s / mean_b
        return fixed, per_seq

    def latency_s(self, depth: int) -> float:
        """The time a micro-batch spends on links and waiting, beyond the other depth - 1 stages' steps (median)."""
        fixed, per_seq = self.step_cost()
        return max(0.0, statistics.median(
            seconds - (depth - 1) * (fixed + per_seq * b) for b, seconds in self._away))

    def choose(self, num_decoding: int, depth: int, current: int = 0) -> int:
        """How many micro-batches num_decoding sessions of a pipeline of depth stages should circulate in: depth
        until enough is measured, then the count that yields the most tokens per second (the fewest, of those that
        tie), unless current (the count in use; 0: none) is within SWITCH_GAIN of it."""
        if depth <= 1:
            return 1
        if num_decoding <= 1 or len(self._steps) < MIN_SAMPLES or len(self._away) < MIN_SAMPLES:
            return depth
        fixed, per_seq = self.step_cost()
        latency = self.latency_s(depth)

        def round_s(k: int) -> float:
            step = fixed + per_seq * math.ceil(num_decoding / k)
            return max(k * step, depth * step + latency)

        candidates = range(min(depth, num_decoding), min(num_decoding, MAX_MICRO_BATCHES) + 1)
        best = min(candidates, key=lambda k: (round(round_s(k), 9), k))     # every round yields num_decoding tokens
        if current in candidates and round_s(best) > (1 - SWITCH_GAIN) * round_s(current):
            return current
        return best
