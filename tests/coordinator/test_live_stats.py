"""LiveStats: per-second points for the admin UI's charts, with time as a parameter."""

from __future__ import annotations

import pytest

from stratamesh.coordinator.live_stats import SAMPLES_PER_BUCKET, LiveStats, percentile

T0 = 1_700_000_000.0


def test_tokens_requests_and_latency_percentiles_per_second() -> None:
    live = LiveStats(window_s=2)
    live.request_started(T0 + 0.1)
    live.first_token(T0 + 0.3, ttft_s=0.2)
    for i in range(1, 5):
        live.token(T0 + 0.3 + 0.1 * i, gap_s=i / 10)       # 0.1 .. 0.4 s apart, all in second T0
    live.token(T0 + 1.5, gap_s=1.0)
    live.request_ended(T0 + 1.6, had_first_token=True)
    first, second = live.points(T0 + 2.0, seconds=2)
    assert (first["t"], first["tokens_per_s"], first["requests_per_s"]) == (T0, 5, 0)
    assert (first["ttft_p50_s"], first["itl_p50_s"], first["itl_p99_s"]) == (0.2, 0.2, 0.4)
    assert (second["t"], second["tokens_per_s"], second["requests_per_s"]) == (T0 + 1, 1, 1)
    assert second["itl_p99_s"] == 1.0 and second["itl_p50_s"] == pytest.approx(0.3)   # the window: both seconds
    assert (first["running"], first["waiting"]) == (1, 1)            # the most at once during the second
    assert (second["running"], second["waiting"]) == (1, 0)


def test_a_quiet_second_keeps_the_queue_and_has_no_percentiles() -> None:
    live = LiveStats(window_s=1)
    for _ in range(3):
        live.request_started(T0)
    live.first_token(T0 + 0.5, ttft_s=0.5)
    points = live.points(T0 + 4.0, seconds=4)
    assert [p["t"] for p in points] == [T0, T0 + 1, T0 + 2, T0 + 3]
    assert [(p["running"], p["waiting"]) for p in points] == [(1, 3), (1, 2), (1, 2), (1, 2)]
    assert points[2]["ttft_p50_s"] is None and points[2]["tokens_per_s"] == 0
    assert live.points(T0 + 0.5, seconds=1)[0]["tokens_per_s"] == 0   # the running second is not reported


def test_latency_samples_per_second_are_bounded_and_uniform() -> None:
    live = LiveStats()
    for i in range(10 * SAMPLES_PER_BUCKET):
        live.token(T0 + 0.5, gap_s=float(i))
    (point,) = live.points(T0 + 1.0, seconds=1)
    assert point["tokens_per_s"] == 10 * SAMPLES_PER_BUCKET
    assert 0.3 * 10 * SAMPLES_PER_BUCKET < point["itl_p50_s"] < 0.7 * 10 * SAMPLES_PER_BUCKET


@pytest.mark.parametrize(("values", "pct", "expected"), [
    ([], 50, None), ([3.0], 99, 3.0), ([1.0, 2.0, 3.0, 4.0], 50, 2.0), ([1.0, 2.0, 3.0, 4.0], 99, 4.0),
    ([float(i) for i in range(1, 101)], 99, 99.0)])
def test_nearest_rank_percentile(values: list[float], pct: float, expected: float | None) -> None:
    assert percentile(values, pct) == expected
