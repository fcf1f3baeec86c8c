"""A canary's verdict (coordinator/control/rollout.py): rolled back when it fails more or is slower than the serving
revision, stepped up once it held its share long enough with requests enough, held otherwise."""

from __future__ import annotations

import pytest

from stratamesh.coordinator.control.rollout import MIN_REQUESTS, Action, RevisionFigures, judge
from stratamesh.coordinator.records import Rollout
from stratamesh.fleet.errors import InvalidInput

ROLLOUT = Rollout("/models/next", "abc123", (5, 25, 100), step_s=30, step_since_s=1000.0)


def figures(requests: int, failed: int = 0, p90_ms: float | None = 20.0) -> RevisionFigures:
    return RevisionFigures(requests, failed, None if p90_ms is None else p90_ms / 1e3)


def test_a_canary_that_fails_more_or_is_slower_rolls_back() -> None:
    verdict = judge(ROLLOUT, figures(4, failed=1), figures(100, failed=1), now=1001.0)
    assert verdict.action == Action.ROLL_BACK and "the canary failed 25% of its requests" in verdict.reason
    assert judge(ROLLOUT, figures(100, failed=2), figures(100, failed=1), now=1031.0).action == Action.STEP
    slow = judge(ROLLOUT, figures(10, p90_ms=50.0), figures(10, p90_ms=20.0), now=1001.0)
    assert slow.action == Action.ROLL_BACK and "slower than 1.5x" in slow.reason
    # too few requests to say it is slow: it holds
    assert judge(ROLLOUT, figures(2, p90_ms=90.0), figures(10), now=1001.0).action == Action.HOLD


def test_a_canary_steps_up_once_it_held_its_share_long_enough_with_requests_enough() -> None:
    assert judge(ROLLOUT, figures(MIN_REQUESTS), figures(50), now=1029.0).action == Action.HOLD
    assert judge(ROLLOUT, figures(MIN_REQUESTS - 1), figures(50), now=1100.0).action == Action.HOLD
    verdict = judge(ROLLOUT, figures(MIN_REQUESTS), figures(50), now=1030.0)
    assert verdict.action == Action.STEP and "at 5% for 30 s" in verdict.reason
    assert str(figures(3, 1, 12.5)) == "3 requests, 1 failed, p90 12.5 ms a token"


def test_figures_come_from_each_request_that_ended() -> None:
    f = RevisionFigures.of([(False, 0.010), (False, 0.030), (True, 5.0), (False, 0.020)])
    assert (f.requests, f.failed, f.p90_s_per_token) == (4, 1, 0.030) and f.error_rate == 0.25


@pytest.mark.parametrize("steps", [(), (5, 25), (25, 5, 100), (0, 100), (5, 5, 100)])
def test_bad_steps_are_refused(steps: tuple[int, ...]) -> None:
    with pytest.raises(InvalidInput, match="steps"):
        Rollout("/p", "r", steps)
