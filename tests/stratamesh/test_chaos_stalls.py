"""The failover figures of bench.chaos from what clients saw: stalls after a kill, on hand-made arrivals."""

from __future__ import annotations

from stratamesh.bench.chaos import FailoverRun, StreamOutcome, stalls_after


def outcome(times: list[float], kept: int) -> StreamOutcome:
    """A held stream that got len(times) tokens and keeps its first `kept` (its max_tokens)."""
    return StreamOutcome(tokens=list(range(kept)), arrivals=list(times))


def test_a_stall_is_the_wait_from_the_kill_to_the_next_token_past_max_tokens_too() -> None:
    before_and_after = outcome([1.0, 2.0, 3.0, 7.5, 8.0], kept=5)
    past_max_tokens = outcome([1.0, 2.0, 3.0, 9.0], kept=2)     # the kill at 5.0 fell after its kept tokens
    ended_before = outcome([1.0, 2.0], kept=2)
    assert stalls_after(5.0, [before_and_after, past_max_tokens, ended_before]) == [2.5, 4.0]
    run = FailoverRun([], [before_and_after, past_max_tokens], kill_s=5.0)
    assert run.stalls == [2.5, 4.0] and run.largest_gaps == [4.5, 6.0]     # the gap across the kill, from 3.0
