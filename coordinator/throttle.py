"""Slows down guessing: after a few failures in a window, a key (a user name, a peer address) waits. Pure."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class FailureThrottle:
    """Counts failures per key; once a key has max_failures within window_s, it is refused until the oldest
    of them leaves the window. A success clears the key. Time is a parameter; at most max_keys are kept."""

    max_failures: int = 5
    window_s: float = 300.0
    max_keys: int = 10_000
    _failures: dict[str, deque[float]] = field(default_factory=dict)

    def wait_s(self, key: str, now: float) -> float:
        """Seconds key must wait before its next attempt counts; 0 if it may try now."""
        failures = self._recent(key, now)
        if len(failures) < self.max_failures:
            return 0.0
        return failures[0] + self.window_s - now

    def failed(self, key: str, now: float) -> None:
        if key not in self._failures and len(self._failures) >= self.max_keys:
            self._evict(now)
        self._failures.setdefault(key, deque(maxlen=self.max_failures)).append(now)

    def succeeded(self, key: str) -> None:
        self._failures.pop(key, None)

    def _recent(self, key: str, now: float) -> deque[float]:
        failures = self._failures.get(key, deque())
        while failures and failures[0] <= now - self.window_s:
            failures.popleft()
        return failures

    def _evict(self, now: float) -> None:
        """Drops keys with no failure in the window; if all are recent, the oldest-failing half."""
        for key in [k for k in self._failures if not self._recent(k, now)]:
            del self._failures[key]
        if len(self._failures) >= self.max_keys:
            by_age = sorted(self._failures, key=lambda k: self._failures[k][-1])
            for key in by_age[: len(by_age) // 2]:
                del self._failures[key]
