"""The failure throttle: a key waits after too many failures in a window, and only that key."""

from __future__ import annotations

from stratamesh.coordinator.throttle import FailureThrottle


def test_a_key_waits_after_its_failures_until_the_oldest_leaves_the_window() -> None:
    throttle = FailureThrottle(max_failures=3, window_s=60)
    for t in (0, 10, 20):
        assert throttle.wait_s("ada", t) == 0
        throttle.failed("ada", t)
    assert throttle.wait_s("ada", 30) == 30          # the failure at 0 leaves the window at 60
    assert throttle.wait_s("bob", 30) == 0           # nobody else waits
    assert throttle.wait_s("ada", 60) == 0           # two failures left in the window
    throttle.failed("ada", 61)
    assert throttle.wait_s("ada", 61) == 9           # 10, 20, 61: the one at 10 leaves at 70


def test_a_success_clears_the_key() -> None:
    throttle = FailureThrottle(max_failures=2, window_s=60)
    throttle.failed("ada", 0)
    throttle.succeeded("ada")
    throttle.failed("ada", 1)
    assert throttle.wait_s("ada", 2) == 0


def test_it_keeps_at_most_max_keys() -> None:
    throttle = FailureThrottle(max_failures=1, window_s=60, max_keys=100)
    for i in range(1000):
        throttle.failed(f"k{i}", i * 0.01)
    assert len(throttle._failures) <= 100
    assert throttle.wait_s("k999", 10) > 0           # the newest are kept
