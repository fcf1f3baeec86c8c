"""A model's demand as the autoscaler weighs it (coordinator/demand.py): arrivals over the window, the tokens a
request generates, p90 latencies, and the requests waiting and running."""

from __future__ import annotations

import pytest

from stratamesh.coordinator.demand import TOKENS_PER_REQUEST_PRIOR, DemandMeter


def test_arrivals_latencies_and_requests_in_flight_over_the_window() -> None:
    meter = DemandMeter(window_s=10.0)
    for i in range(20):                       # 2 requests a second for 10 s
        meter.arrived("m", 100.0 + i * 0.5)
    meter.arrived("other", 105.0)
    for i in range(10):
        meter.first_token("m", 101.0 + i, ttft_s=0.01 * (i + 1))
        meter.token("m", 101.0 + i, gap_s=0.001 * (i + 1))
    demand = meter.demand("m", now=109.9)
    assert demand.arrivals_per_s == pytest.approx(2.0)
    assert (demand.waiting, demand.running, demand.in_flight) == (10, 10, 20)
    assert demand.ttft_p90_s == pytest.approx(0.09) and demand.itl_p90_s == pytest.approx(0.009)
    assert demand.tokens_per_request == TOKENS_PER_REQUEST_PRIOR
    later = meter.demand("m", now=125.0)      # the window moved past them all
    assert later.arrivals_per_s == 0 and later.ttft_p90_s is None and later.itl_p90_s is None
    assert meter.demand("other", 105.0).arrivals_per_s == pytest.approx(0.1)
    assert meter.demand("unknown", 0.0).in_flight == 0


def test_the_tokens_a_request_generates_are_learned_from_those_that_finish() -> None:
    meter = DemandMeter()
    for _ in range(50):
        meter.arrived("m", 0.0)
        meter.first_token("m", 0.1, 0.1)
        meter.ended("m", num_tokens=16, had_first_token=True)
    meter.arrived("m", 0.0)
    meter.ended("m", num_tokens=0, had_first_token=False)        # abandoned before a token: teaches nothing
    demand = meter.demand("m", 1.0)
    assert demand.tokens_per_request == pytest.approx(16, abs=1.0) and demand.in_flight == 0
    assert demand.tokens_per_s == pytest.approx(demand.arrivals_per_s * demand.tokens_per_request)
