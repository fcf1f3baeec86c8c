"""The autoscaler's decision (coordinator/control/autoscale.py): up before the targets are missed, one more after
they are, down one at a time after a cool-down, the replica nearest its owners' limits first, to zero and back."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stratamesh.coordinator.control.autoscale import BACKOFF_S, UTILIZATION, ReplicaLoad, Scaling, decide
from stratamesh.coordinator.demand import Demand
from stratamesh.coordinator.records import Autoscale
from stratamesh.fleet.errors import InvalidInput

POLICY = Autoscale(min_replicas=1, max_replicas=3, slo_ttft_ms=500, slo_itl_ms=100, scale_down_after_s=30)


def ready(*speeds: float, near: tuple[float, ...] = ()) -> list[ReplicaLoad]:
    return [ReplicaLoad(i, True, speed, near[i] if near else 0.0) for i, speed in enumerate(speeds)]


def test_the_arrivals_tokens_want_replicas_before_any_target_is_missed() -> None:
    # 2 requests/s of 60 tokens = 120 tokens/s; a replica carries 100 predicted, asked for 75 of them: two
    demand = Demand(arrivals_per_s=2.0, tokens_per_request=60, running=3, ttft_p90_s=0.1, itl_p90_s=0.05)
    decision = decide(POLICY, demand, ready(100.0), 1, Scaling(), now=1000.0)
    assert decision is not None and (decision.replicas, decision.give_back) == (2, ())
    assert "120 tokens/s want 2 replica(s)" in decision.reason and f"{UTILIZATION:.0%}" in decision.reason
    # more than the bounds allow: the most
    busy = Demand(arrivals_per_s=20.0, tokens_per_request=60, running=3)
    assert decide(POLICY, busy, ready(100.0), 1, Scaling(), now=1000.0).replicas == 3
    # what one carries: nothing to do
    assert decide(POLICY, Demand(arrivals_per_s=1.0, tokens_per_request=60, running=1), ready(100.0), 1,
                  Scaling(), now=1000.0) is None


def test_a_missed_target_adds_one_replica_once_every_replica_serves_and_the_window_saw_it() -> None:
    slow = Demand(arrivals_per_s=0.5, tokens_per_request=10, running=4, itl_p90_s=0.25)
    state = Scaling()
    decision = decide(POLICY, slow, ready(1000.0), 1, state, now=1000.0)
    assert decision.replicas == 2 and "inter-token latency 250 ms is above its target 100 ms" in decision.reason
    # the new replica loads: no further one yet; nor once it serves, until the window has seen it serve
    loading = [ReplicaLoad(0, True, 1000.0), ReplicaLoad(1, False)]
    assert decide(POLICY, slow, loading, 2, state, now=1001.0) is None
    assert decide(POLICY, slow, ready(1000.0, 1000.0), 2, state, now=1000.0 + slow.window_s - 1) is None
    better = replace(slow, itl_p90_s=0.15)          # it helped (the miss shrank), and the target is still missed
    assert decide(POLICY, better, ready(1000.0, 1000.0), 2, state, now=1000.0 + slow.window_s).replicas == 3


def test_a_replica_added_for_a_missed_target_that_did_not_help_is_given_back_and_none_added_for_a_while() -> None:
    """Replicas on boxes that share their cores make every step slower: the autoscaler finds it out and stops."""
    slow = Demand(arrivals_per_s=4.0, tokens_per_request=32, running=9, itl_p90_s=0.115)
    state = Scaling()
    assert decide(POLICY, slow, ready(1000.0), 1, state, now=1000.0).replicas == 2
    worse = replace(slow, itl_p90_s=0.178)
    decision = decide(POLICY, worse, ready(1000.0, 1000.0), 2, state, now=1000.0 + slow.window_s)
    assert (decision.replicas, decision.give_back) == (1, (1,))
    assert "replica 1, added for a missed target, did not help: the worst p90 was 1.15x its target then and is " \
           "1.78x now" in decision.reason
    assert decide(POLICY, worse, ready(1000.0), 1, state, now=1000.0 + 2 * slow.window_s) is None    # backs off
    later = 1000.0 + slow.window_s + BACKOFF_S
    assert decide(POLICY, worse, ready(1000.0), 1, state, now=later).replicas == 2                  # tries again
    # arrivals that grew meanwhile say nothing of the replica: it stays
    state = Scaling()
    decide(POLICY, slow, ready(1000.0), 1, state, now=1000.0)
    busier = replace(worse, arrivals_per_s=6.0)
    assert decide(POLICY, busier, ready(1000.0, 1000.0), 2, state, now=1000.0 + slow.window_s).replicas == 3
    # a missed target with nothing in flight is history, not load
    assert decide(POLICY, Demand(ttft_p90_s=2.0), ready(1000.0), 1, Scaling(), now=1000.0) is None


def test_a_replica_is_given_back_after_the_cool_down_nearest_its_owners_limits_first() -> None:
    light = Demand(arrivals_per_s=0.2, tokens_per_request=50, running=1, itl_p90_s=0.02)
    state, replicas = Scaling(), ready(100.0, 100.0, 100.0, near=(0.2, 0.95, 0.1))
    assert decide(POLICY, light, replicas, 3, state, now=1000.0) is None         # the cool-down starts
    assert decide(POLICY, light, replicas, 3, state, now=1029.0) is None
    decision = decide(POLICY, light, replicas, 3, state, now=1030.0)
    assert (decision.replicas, decision.give_back) == (2, (1,))
    assert "replica 1 goes first: its boxes are at 95% of their owners' limits" in decision.reason
    # the next step down waits a cool-down of its own; a missed target resets it
    two = ready(100.0, 100.0)
    assert decide(POLICY, light, two, 2, state, now=1040.0) is None
    missed = Demand(arrivals_per_s=0.2, tokens_per_request=50, itl_p90_s=0.5)
    assert decide(POLICY, missed, two, 2, state, now=1061.0) is None
    assert decide(POLICY, light, two, 2, state, now=1062.0) is None
    decision = decide(POLICY, light, two, 2, state, now=1092.0)
    assert (decision.replicas, decision.give_back) == (1, (1,))                  # evenly far: the last goes
    assert decide(POLICY, light, ready(100.0), 1, state, now=2000.0) is None     # never below the minimum


def test_an_idle_model_scales_to_zero_and_a_waiting_request_starts_one() -> None:
    policy = Autoscale(min_replicas=0, max_replicas=2, scale_down_after_s=10)
    state = Scaling()
    # requests still generate: one stays
    assert decide(policy, Demand(running=1), ready(100.0), 1, state, now=1000.0) is None
    assert decide(policy, Demand(), ready(100.0), 1, state, now=1001.0) is None
    decision = decide(policy, Demand(), ready(100.0), 1, state, now=1011.0)
    assert (decision.replicas, decision.give_back) == (0, (0,)) and "no request for 10 s" in decision.reason
    assert decide(policy, Demand(), [], 0, state, now=1100.0) is None
    decision = decide(policy, Demand(arrivals_per_s=0.05, waiting=1), [], 0, state, now=1200.0)
    assert decision.replicas == 1 and "cold start: 1 request(s) wait" in decision.reason
    # the speed predicted before is remembered through zero: the arrivals size the start
    many = Demand(arrivals_per_s=3.0, tokens_per_request=50, waiting=3)
    assert decide(policy, many, [], 0, state, now=1200.0).replicas == 2


def test_bounds_the_operator_moves_apply_at_once() -> None:
    assert decide(Autoscale(1, 2), Demand(), ready(1.0, 1.0, 1.0), 3, Scaling(), now=0.0).give_back == (2,)
    assert decide(Autoscale(2, 3), Demand(), ready(1.0), 1, Scaling(), now=0.0).replicas == 2


@pytest.mark.parametrize("bad", [dict(min_replicas=2, max_replicas=1), dict(min_replicas=0, max_replicas=0),
                                 dict(max_replicas=99), dict(slo_itl_ms=0), dict(slo_ttft_ms=float("nan")),
                                 dict(scale_down_after_s=-1)])
def test_bad_bounds_and_targets_are_refused(bad: dict) -> None:
    with pytest.raises(InvalidInput):
        Autoscale(**{"max_replicas": 2, **bad})
