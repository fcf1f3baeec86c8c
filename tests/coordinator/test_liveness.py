"""Leases, suspicions and flap bans, with time as a plain number."""

from __future__ import annotations

import pytest

from stratamesh.coordinator.liveness import (CONTROL, DATA, LEASE_BEATS, MAX_HEARTBEATS_PER_S, Liveness,
                                            LivenessConfig, heartbeat_interval)

CONFIG = LivenessConfig(lease_s=2.0, flap_window_s=60.0, flaps_to_ban=3, ban_s=10.0, ban_max_s=25.0,
                        restart_grace_s=10.0)


def test_an_agent_is_dead_once_its_lease_runs_out_and_only_then() -> None:
    live = Liveness(CONFIG)
    live.heard("a", 0.0)
    live.heard("b", 1.0)
    assert live.expired(2.0) == []
    assert live.expired(2.01) == ["a"] and live.is_dead("a") and not live.is_dead("b")
    assert live.expired(2.5) == []               # declared once
    assert live.expired(3.5) == ["b"]


def test_a_lease_that_ends_sooner_than_those_before_it_is_still_found() -> None:
    """expired() skips its walk over the leases until the earliest can have run out: a lease shortened since (the
    fleet shrank, so agents beat faster), a restarted coordinator's grace and a stall must all move that point."""
    live = Liveness(CONFIG)
    live.interval_s = 8.0                        # a large fleet: leases of 4 beats
    live.heard("a", 0.0)                         # until 32
    assert live.expired(1.0) == []
    live.interval_s = 0.0                        # the fleet shrank: leases of 2 s again
    live.heard("b", 1.0)                         # until 3, before a's
    assert live.expired(3.01) == ["b"]
    live.expect("c", 4.0)                        # until 14 (the restart grace), before a's
    assert live.expired(14.01) == ["c"]
    live.stalled(5.0)                            # a's lease gets the stall back: until 37
    assert live.expired(36.9) == []
    assert live.expired(37.01) == ["a"]


def test_one_sign_waits_for_the_lease_and_two_are_death_at_once() -> None:
    live = Liveness(CONFIG)
    live.heard("a", 0.0)
    assert not live.suspect("a", CONTROL, 0.1)
    assert not live.suspect("a", CONTROL, 0.2)       # the same sign twice is still one sign
    assert live.suspect("a", DATA, 0.3) and live.is_dead("a")
    assert not live.suspect("a", DATA, 0.4)          # already dead: not declared again


def test_a_heartbeat_clears_suspicion_and_revives_a_dead_agent() -> None:
    live = Liveness(CONFIG)
    live.heard("a", 0.0)
    live.suspect("a", DATA, 0.5)
    live.heard("a", 1.0)
    assert not live.suspect("a", CONTROL, 1.1)
    live.expired(10.0)
    assert live.is_dead("a")
    live.heard("a", 11.0)
    assert not live.is_dead("a")
    assert not live.suspect("unknown", CONTROL, 0.0)   # never heard of: nothing to declare


def test_an_agent_that_keeps_dying_is_banned_with_a_doubling_capped_ban() -> None:
    live = Liveness(CONFIG)
    bans, until, t = [], float("-inf"), 0.0
    for _ in range(9):
        live.heard("a", t)
        t += 5.0
        assert live.expired(t) == ["a"]
        bans.append(live.banned_until("a") - t if live.banned_until("a") != until else 0.0)
        until = live.banned_until("a")
    assert bans == [0, 0, 10, 0, 0, 20, 0, 0, 25]


def test_deaths_far_apart_are_not_flapping() -> None:
    live = Liveness(CONFIG)
    for t in (0.0, 100.0, 200.0, 300.0):
        live.heard("a", t)
        live.expired(t + 3.0)
    assert not live.is_banned("a", 303.0) and live.banned_until("a") == float("-inf")


@pytest.mark.parametrize(("reconnect_at", "dead"), [(9.0, False), (None, True)])
def test_after_a_restart_known_agents_get_a_grace_period_to_reconnect(reconnect_at: float | None,
                                                                      dead: bool) -> None:
    live = Liveness(CONFIG)
    live.expect("a", 0.0)
    assert live.expired(9.5) == []
    if reconnect_at is not None:
        live.heard("a", reconnect_at)
    assert (live.expired(10.5) == ["a"]) is dead


def test_the_heartbeat_interval_stretches_in_doublings_as_the_fleet_grows_and_comes_back_with_a_margin() -> None:
    assert heartbeat_interval(0.5, 1) == 0.5
    assert heartbeat_interval(0.5, int(MAX_HEARTBEATS_PER_S * 0.5)) == 0.5            # just at the budget
    assert heartbeat_interval(0.5, int(MAX_HEARTBEATS_PER_S * 0.5) + 1) == 1.0
    assert heartbeat_interval(0.5, 10_000) == 8.0
    assert 10_000 / heartbeat_interval(0.5, 10_000) <= MAX_HEARTBEATS_PER_S
    # shrinking back: not at the first agent below a threshold, only once the fleet is under half the budget
    at_1000 = heartbeat_interval(0.5, 1001)
    assert heartbeat_interval(0.5, 999, at_1000) == at_1000
    assert heartbeat_interval(0.5, 10, at_1000) == 0.5


def test_a_lease_is_at_least_four_heartbeats_long() -> None:
    liveness = Liveness(LivenessConfig(lease_s=2.0))
    assert liveness.lease_s == 2.0
    liveness.interval_s = 8.0
    assert liveness.lease_s == LEASE_BEATS * 8.0
    liveness.heard("a", 100.0)
    assert liveness.expired(100.0 + 31.0) == []
    assert liveness.expired(100.0 + 33.0) == ["a"]


def test_a_mass_lapse_gets_one_more_lease_before_anyone_is_declared_dead() -> None:
    """Twenty of forty leases running out at one check: more likely the coordinator did not hear them than twenty
    boxes dying together. Those that speak again live on; the silent ones die at the end of the extra lease."""
    liveness = Liveness(LivenessConfig(lease_s=2.0))
    for i in range(40):
        liveness.heard(f"a{i}", 100.0)
    for i in range(20, 40):
        liveness.heard(f"a{i}", 105.0)          # the other half stayed in touch
    assert liveness.expired(103.0) == []       # a0..a19 lapsed together: reprieved
    for i in range(10):
        liveness.heard(f"a{i}", 104.0)          # half of them were only unheard
    assert liveness.expired(105.5) == [f"a{i}" for i in range(10, 20)]


def test_a_few_lapses_are_deaths_at_once() -> None:
    liveness = Liveness(LivenessConfig(lease_s=2.0))
    for i in range(40):
        liveness.heard(f"a{i}", 100.0 if i < 2 else 105.0)
    assert liveness.expired(103.0) == ["a0", "a1"]


def test_time_the_coordinator_stalled_is_given_back_to_every_lease() -> None:
    liveness = Liveness(LivenessConfig(lease_s=2.0))
    liveness.heard("a", 100.0)
    liveness.stalled(0.01)                      # a hiccup: nothing changes
    liveness.stalled(3.0)                       # the loop was busy for 3 s: a's silence in it does not count
    assert liveness.expired(104.5) == []
    assert liveness.expired(105.1) == ["a"]
