"""How many micro-batches a first stage circulates its decodes in, from its measured steps and round trips."""

from __future__ import annotations

import pytest

from stratamesh.agent.engine.micro_batches import MIN_SAMPLES, MicroBatches


def measured(depth: int, fixed: float, per_seq: float, latency: float, sizes: tuple[int, ...] = (4, 6, 8)
             ) -> MicroBatches:
    """A first stage that saw steps cost fixed + per_seq * b, and tokens come back after the other stages' steps
    (as costly as its own) plus latency."""
    batching = MicroBatches()
    for i in range(2 * MIN_SAMPLES):
        b = sizes[i % len(sizes)]
        batching.stepped(b, fixed + per_seq * b)
        batching.returned(b, (depth - 1) * (fixed + per_seq * b) + latency)
    return batching


def test_it_keeps_one_micro_batch_per_stage_until_it_has_measured_enough() -> None:
    batching = MicroBatches()
    for _ in range(MIN_SAMPLES - 1):
        batching.stepped(8, 0.1)
        batching.returned(8, 0.2)
    assert batching.choose(16, depth=2) == 2
    assert MicroBatches().choose(16, depth=1) == 1
    assert measured(2, 0.03, 0.013, 0.08).choose(1, depth=2) == 2     # one session: nothing to split


def test_it_recovers_the_step_cost_and_the_latency_it_measured() -> None:
    batching = measured(3, 0.030, 0.013, 0.080)
    fixed, per_seq = batching.step_cost()
    assert fixed == pytest.approx(0.030) and per_seq == pytest.approx(0.013)
    assert batching.latency_s(depth=3) == pytest.approx(0.080)


@pytest.mark.parametrize("fixed, per_seq, latency, expected", [
    (0.015, 0.0, 0.080, 2),       # a step costs the same for any batch: more, smaller ones only add steps
    (0.030, 0.013, 0.080, 3),     # steps grow with the batch: a third micro-batch fills the link's gap
    (0.030, 0.013, 0.0, 2),       # ... but on a LAN there is no gap to fill
    (0.002, 0.004, 0.080, 16),    # cheap steps across a long link: each session a micro-batch of its own
])
def test_it_picks_the_count_that_yields_the_most_tokens_per_second(fixed: float, per_seq: float, latency: float,
                                                                   expected: int) -> None:
    assert measured(2, fixed, per_seq, latency).choose(16, depth=2) == expected


def test_steps_that_scale_with_their_sessions_alone_fit_a_line_through_zero() -> None:
    batching = MicroBatches()
    for i in range(MIN_SAMPLES):
        batching.stepped(4 + i % 2, 0.01 * (4 + i % 2) - 0.005)     # a line that would cross below zero
    fixed, per_seq = batching.step_cost()
    assert fixed == 0.0 and per_seq > 0


def test_it_stays_with_the_count_it_has_unless_another_is_clearly_faster() -> None:
    batching = measured(2, 0.030, 0.013, 0.080)        # 3 is best, 2 is about 7% slower, 8 about 38% slower
    assert batching.choose(16, depth=2, current=2) == 2
    assert batching.choose(16, depth=2, current=8) == 3
    assert batching.choose(16, depth=2) == 3


def test_one_slow_step_does_not_tilt_the_cost_line() -> None:
    batching = MicroBatches()
    for i in range(3 * MIN_SAMPLES):
        b = (1, 8)[i % 2]
        batching.stepped(b, 0.010)                      # steps cost the same whatever their size ...
    batching.stepped(1, 0.500)                          # ... but for one that the box's other work delayed
    assert batching.step_cost() == pytest.approx((0.010, 0.0))
