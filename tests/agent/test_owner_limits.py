"""The owner's limits (agent/owner_limits.py): which readings cross them, and rest and serve decisions with a grace
period and a cool-down, driven by a hand-held clock; the owner's load from real /proc readings."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from stratamesh.agent.owner_limits import (
    Decision, HostLoad, OwnerLimits, OwnerPolicy, OwnerWatch, QuietHours, Reading, Sensors, agent_pids, own_jiffies,
    parse_proc_stat, process_tree,
)
from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.boxes import GpuInfo, Telemetry

NOON = 12 * 60


def gpu(temperature_c: float | None = 60.0, power_w: float | None = 100.0) -> GpuInfo:
    return GpuInfo(0, "L4", 24 << 30, 20 << 30, "GPU-1", "8.9", 50.0, temperature_c, power_w)


@pytest.mark.parametrize("text, start, end, inside, outside", [
    ("22:00-07:00", 22 * 60, 7 * 60, [22 * 60, 23 * 60 + 59, 0, 6 * 60 + 59], [7 * 60, NOON, 21 * 60 + 59]),
    ("9:30-17:00", 9 * 60 + 30, 17 * 60, [9 * 60 + 30, NOON], [9 * 60 + 29, 17 * 60]),
])
def test_quiet_hours_may_cross_midnight(text: str, start: int, end: int, inside: list[int],
                                        outside: list[int]) -> None:
    span = QuietHours.parse(text)
    assert (span.start_min, span.end_min) == (start, end)
    assert all(span.holds(m) for m in inside) and not any(span.holds(m) for m in outside)


@pytest.mark.parametrize("text", ["22-07", "25:00-07:00", "22:00", "07:00-07:00", "22:61-07:00"])
def test_bad_quiet_hours_are_refused(text: str) -> None:
    with pytest.raises(InvalidInput, match="quiet hours"):
        QuietHours.parse(text)


def at(minute: int, temps: tuple[float, ...] = (60.0,), power_w: float = 100.0, load: float = 0.0) -> Reading:
    return Reading(0.0, minute, temps, power_w, load)


def test_each_limit_crossed_is_named() -> None:
    limits = OwnerLimits(max_gpu_temp_c=80, max_power_w=150, max_host_load=1.0,
                         quiet_hours=(QuietHours.parse("22:00-07:00"),))
    assert limits.crossed(at(NOON, load=0.5)) == []
    assert limits.crossed(at(23 * 60, (85, 70), 180, 1.5)) == [
        "at 85 C, above 80 C", "drawing 180 W, above 150 W", "the owner's processes using 1.5 cores, above 1",
        "quiet hours 22:00-07:00"]
    assert limits.crossed(at(NOON, (), 0.0)) == []                       # nothing read: nothing crossed
    assert OwnerLimits().crossed(at(23 * 60, (99,), 999, 64.0)) == [] and not OwnerLimits().any


def test_a_reading_gathers_the_gpus_and_the_owners_sensor_file(tmp_path) -> None:
    sensors = tmp_path / "sensors.json"
    sensors.write_text('{"temperatures_c": [71.5, 64], "power_w": 35}')
    reading = Reading.of(0.0, (gpu(60, 100), gpu(None, 50)), Sensors.read(str(sensors)), owner_load=0.25)
    assert (reading.temperatures_c, reading.power_w, reading.owner_load) == ((60, 71.5, 64), 185, 0.25)
    for broken in ("{not json", '{"power_w": "a lot"}', '{"temperatures_c": [NaN]}', "[1, 2]"):
        sensors.write_text(broken)
        assert Sensors.read(str(sensors)) == Sensors()                    # read as nothing, and said in the log
    assert Sensors.read(str(tmp_path / "missing.json")) == Sensors() == Sensors.read("")


def test_the_agent_rests_after_the_grace_period_and_serves_after_the_cool_down() -> None:
    policy = OwnerPolicy(OwnerLimits(max_gpu_temp_c=80, grace_s=30, cooldown_s=300))

    def read(t: float, temp: float) -> Decision | None:
        return policy.update(Reading(t, NOON, (temp,)))

    assert read(0.0, 90) is None                      # crossed: the grace period starts
    assert read(20.0, 60) is None                     # a break: it starts again
    assert read(25.0, 90) is None
    assert read(54.0, 90) is None                     # 29 s of 30
    assert read(55.0, 90) == Decision(True, "at 90 C, above 80 C")
    assert policy.resting and read(60.0, 90) is None  # said once
    assert read(100.0, 60) is None                    # the cool-down starts
    assert read(300.0, 90) is None                    # crossed again: it starts over
    assert read(310.0, 60) is None
    assert read(609.0, 60) is None
    assert read(610.0, 60) == Decision(False, "no limit crossed for 300 s")
    assert not policy.resting


def test_how_near_a_reading_is_to_the_limits_is_its_nearest_one() -> None:
    limits = OwnerLimits(max_gpu_temp_c=80, max_host_load=2.0, quiet_hours=(QuietHours.parse("13:00-14:00"),))
    assert limits.nearness(Reading(0, NOON - 60, (40.0,), owner_load=0.5)) == pytest.approx(0.5)
    assert limits.nearness(Reading(0, NOON - 60, (40.0,), owner_load=1.8)) == pytest.approx(0.9)
    assert limits.nearness(Reading(0, NOON + 30, (20.0,))) == pytest.approx(0.5)     # half an hour before quiet hours
    assert limits.nearness(Reading(0, 13 * 60 + 10)) == 1.0 and limits.nearness(Reading(0, NOON, (96.0,))) == 1.2
    assert OwnerLimits().nearness(Reading(0, NOON, (99.0,), 500.0, 8.0)) == 0.0


def test_the_watch_says_why_the_agent_rests_in_its_telemetry_while_it_does(tmp_path) -> None:
    sensors, clock = tmp_path / "sensors.json", [1000.0]
    watch = OwnerWatch(OwnerLimits(max_gpu_temp_c=80, grace_s=10, cooldown_s=20), str(sensors),
                       clock=lambda: clock[0])

    def beat(temp: float, after_s: float) -> str:
        sensors.write_text(f'{{"temperatures_c": [{temp}]}}')
        clock[0] += after_s
        return watch.check(Telemetry(clock[0])).resting

    assert beat(90, 0) == "" and beat(90, 5) == ""
    assert beat(90, 5) == "at 90 C, above 80 C" and beat(60, 5) == "at 90 C, above 80 C"   # rests until cooled
    assert beat(60, 19) == "at 90 C, above 80 C" and beat(60, 1) == ""
    sensors.write_text('{"temperatures_c": [72]}')
    assert watch.check(Telemetry(clock[0])).limits_near == pytest.approx(0.9)


def test_quiet_hours_rest_the_agent_and_their_end_lets_it_serve() -> None:
    policy = OwnerPolicy(OwnerLimits(quiet_hours=(QuietHours.parse("22:00-07:00"),), grace_s=0, cooldown_s=0))
    assert policy.update(Reading(0.0, 21 * 60 + 59)) is None
    assert policy.update(Reading(60.0, 22 * 60)) == Decision(True, "quiet hours 22:00-07:00")
    assert policy.update(Reading(9 * 3600.0, 7 * 60)).rest is False


@pytest.mark.parametrize("bad", [dict(max_gpu_temp_c=-1), dict(max_power_w=float("nan")), dict(grace_s=-1),
                                 dict(cooldown_s=float("inf"))])
def test_limits_that_are_no_numbers_are_refused(bad: dict) -> None:
    with pytest.raises(InvalidInput):
        OwnerLimits(**bad)


def test_proc_stat_busy_and_total() -> None:
    text = "cpu  100 5 50 1000 20 3 2 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"
    assert parse_proc_stat(text) == (160, 1180)
    busy, total = parse_proc_stat(open("/proc/stat").read())
    assert 0 < busy <= total
    with pytest.raises(InvalidInput):
        parse_proc_stat("intr 1 2 3\n")


def test_the_owners_load_is_the_hosts_busy_time_less_the_agents_own() -> None:
    tick = os.sysconf("SC_CLK_TCK")
    stats = iter([f"cpu  {1000} 0 0 5000 0 0 0 0\n", f"cpu  {1000 + 3 * tick} 0 0 5000 0 0 0 0\n"])
    own = iter([100, 100 + tick])
    load = HostLoad(own_pids=lambda: [1, 2], read_stat=lambda: next(stats), read_own=lambda pids: next(own))
    # 3 cores' worth of busy time in 1 s, one of them the agent's (and its children's): the owner used 2
    assert load.read(1.0) == pytest.approx(2.0)


def test_the_agents_own_processes_are_it_and_its_descendants() -> None:
    parents = {1: 0, 10: 1, 20: 10, 21: 10, 30: 20, 40: 1, 50: 40}     # 20 and 21: ranks of agent 10; 30: a helper
    assert process_tree(10, parents) == [10, 21, 20, 30]
    assert process_tree(99, parents) == [99]       # gone since: itself alone


def test_a_child_of_the_agent_spinning_is_not_the_owners_load() -> None:
    """A tensor-parallel stage's ranks are the agent's children: their CPU is the agent's, not the owner's."""
    rank = subprocess.Popen([sys.executable, "-c", "while True: pass"])     # as the agent's rank would
    try:
        assert rank.pid in agent_pids() and agent_pids()[0] == os.getpid()
        used = own_jiffies(agent_pids())
        other = own_jiffies([rank.pid])
        while own_jiffies([rank.pid]) < other + os.sysconf("SC_CLK_TCK") // 5:   # a fifth of a second more
            time.sleep(0.01)
        assert own_jiffies(agent_pids()) - used >= os.sysconf("SC_CLK_TCK") // 5   # counted as the agent's own
    finally:
        rank.kill()
        rank.wait()
    # reaped, its time stays the agent's (its children's time), so the own total never drops
    assert own_jiffies(agent_pids()) >= used + os.sysconf("SC_CLK_TCK") // 5


def test_the_owners_load_shows_a_real_process_spinning() -> None:
    owner = subprocess.Popen([sys.executable, "-c", "while True: pass"])     # the owner's job
    try:
        # (this test's process stands for the agent, but its child for the owner's job: not among its own)
        load, start = HostLoad(own_pids=lambda: [os.getpid()]), time.monotonic()
        used_before = own_jiffies([owner.pid])
        while own_jiffies([owner.pid]) < used_before + os.sysconf("SC_CLK_TCK") // 5:   # a fifth of a second more
            time.sleep(0.01)
        assert load.read(time.monotonic() - start) > 0
    finally:
        owner.kill()
        owner.wait()
