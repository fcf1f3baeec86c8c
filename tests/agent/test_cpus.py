"""Agents' CPUs: the CPU list form, each agent's share of a box's cores, and pinning a process's threads."""

from __future__ import annotations

import os
import threading

import pytest

from stratamesh.agent.cpus import cpu_shares, format_cpus, parse_cpus, pin_process
from stratamesh.fleet.errors import InvalidInput


@pytest.mark.parametrize(("text", "cpus"), [("0", (0,)), ("0-3,6", (0, 1, 2, 3, 6)), ("8-9, 2", (2, 8, 9)),
                                            ("1,1", (1,))])
def test_a_cpu_list_reads_as_taskset_writes_it_and_back(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpus(text) == cpus
    assert parse_cpus(format_cpus(cpus)) == cpus
    assert format_cpus((0, 1, 2, 3, 6, 8, 9)) == "0-3,6,8-9"


@pytest.mark.parametrize("text", ["", "a", "3-1", "1-", "-2", "0,,x"])
def test_a_malformed_cpu_list_is_refused(text: str) -> None:
    with pytest.raises(InvalidInput, match="--cpus"):
        parse_cpus(text)


def test_agents_get_shares_of_their_own_or_all_where_there_are_fewer_cores_than_agents() -> None:
    assert cpu_shares((0, 1, 2, 3), 2) == [(0, 1), (2, 3)]
    assert cpu_shares((0, 1, 2, 3, 4), 2) == [(0, 1, 2), (3, 4)]
    assert cpu_shares((0, 1), 1) == [(0, 1)]
    assert cpu_shares((0, 1), 3) == [(0, 1)] * 3
    shares = cpu_shares(tuple(range(16)), 3)
    assert sorted(c for share in shares for c in share) == list(range(16))      # every core, each once


def test_pinning_moves_every_thread_of_the_process_and_those_started_later() -> None:
    before = os.sched_getaffinity(0)
    one = min(before)
    started, stop = threading.Event(), threading.Event()
    tids: list[int] = []

    def idle() -> None:
        tids.append(threading.get_native_id())
        started.set()
        stop.wait()

    thread = threading.Thread(target=idle)
    thread.start()
    started.wait()
    try:
        pin_process((one,))
        assert os.sched_getaffinity(0) == {one} and os.sched_getaffinity(tids[0]) == {one}
        later = []
        thread2 = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0)))
        thread2.start()
        thread2.join()
        assert later == [{one}]
    finally:
        stop.set()
        thread.join()
        pin_process(sorted(before))      # every thread back where it was


def test_cpus_the_process_may_not_use_are_refused() -> None:
    with pytest.raises(InvalidInput, match="may not run there"):
        pin_process((max(os.sched_getaffinity(0)) + 1000,))
