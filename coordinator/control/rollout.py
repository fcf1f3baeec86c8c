"""A canary's verdict: how a model's new revision did against the serving one since it took its share, and what
follows (hold, step up, roll back). Pure: figures and the time in, a Verdict out. coordinator/rollouts.py runs it.

The canary rolls back once it fails a larger share of its requests than the serving revision does (by more than
ERROR_MARGIN), or its p90 seconds a token are over LATENCY_FACTOR times the serving one's (with LATENCY_SLACK_S
beside); it steps up once it has held its share for the rollout's step_s with MIN_REQUESTS requests at least.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from stratamesh.coordinator.live_stats import percentile
from stratamesh.coordinator.records import Rollout

ERROR_MARGIN = 0.02         # the canary may fail this much larger a share of its requests
LATENCY_FACTOR = 1.5        # ... and take this many times the serving revision's p90 seconds a token
LATENCY_SLACK_S = 0.005     # ... plus this (a few ms a token is noise on a shared box)
MIN_REQUESTS = 5            # requests the canary must answer at a share before it steps up


class Action(StrEnum):
    HOLD = "hold"
    STEP = "step"
    ROLL_BACK = "roll_back"


@dataclass(frozen=True, slots=True)
class RevisionFigures:
    """What one revision's requests did over a stretch of time."""

    requests: int = 0
    failed: int = 0
    p90_s_per_token: float | None = None

    @property
    def error_rate(self) -> float:
        return self.failed / self.requests if self.requests else 0.0

    @classmethod
    def of(cls, outcomes: Iterable[tuple[bool, float]]) -> RevisionFigures:
        """From (failed, seconds a token) of each request that ended."""
        done = list(outcomes)
        per_token = sorted(s for failed, s in done if not failed and math.isfinite(s))
        return cls(len(done), sum(failed for failed, _ in done), percentile(per_token, 90))

    def __str__(self) -> str:
        p90 = f"p90 {self.p90_s_per_token * 1e3:.1f} ms a token" if self.p90_s_per_token is not None else "no p90"
        return f"{self.requests} requests, {self.failed} failed, {p90}"


@dataclass(frozen=True, slots=True)
class Verdict:
    action: Action
    reason: str


def judge(rollout: Rollout, canary: RevisionFigures, serving: RevisionFigures, now: float) -> Verdict:
    """What the rollout does next, from the canary's and the serving revision's figures since it took its share."""
    compared = f"canary {canary}; serving {serving}"
    if canary.failed and canary.error_rate > serving.error_rate + ERROR_MARGIN:
        return Verdict(Action.ROLL_BACK, f"the canary failed {canary.error_rate:.0%} of its requests, the serving "
                                         f"revision {serving.error_rate:.0%} ({compared})")
    if canary.p90_s_per_token is not None and serving.p90_s_per_token is not None \
            and canary.requests >= MIN_REQUESTS and serving.requests >= MIN_REQUESTS \
            and canary.p90_s_per_token > LATENCY_FACTOR * serving.p90_s_per_token + LATENCY_SLACK_S:
        return Verdict(Action.ROLL_BACK, f"the canary is slower than {LATENCY_FACTOR:g}x the serving revision "
                                         f"({compared})")
    held_s = now - rollout.step_since_s
    if held_s >= rollout.step_s and canary.requests >= MIN_REQUESTS:
        return Verdict(Action.STEP, f"at {rollout.share}% for {held_s:.0f} s: {compared}")
    return Verdict(Action.HOLD, compared)
