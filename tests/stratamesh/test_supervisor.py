"""The supervisor's policy over real processes: which exits are repaired, after how long, and when it gives up.

Plain `python -c` processes stand in for the daemons (the e2e tests in tests/e2e/test_supervision.py run it over
a real mesh); a hand-driven clock and Supervisor.check() make every step deterministic."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from stratamesh.fleet.errors import EXIT_REFUSED
from stratamesh.launcher import LaunchError
from stratamesh.supervisor import Backoff, Supervisor
from tests.patience import patient

SLEEP = "import time; time.sleep(600)"


def spawn(code: str = SLEEP) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


class Processes:
    """The part of a LocalMesh a supervisor uses, over stand-in processes."""

    def __init__(self, agent_codes: list[str]) -> None:
        self.agent_ids = [f"mesh-a{i}" for i in range(len(agent_codes))]
        self.agents = [spawn(code) for code in agent_codes]
        self.coordinator: subprocess.Popen | None = spawn()
        self.url = "http://127.0.0.1:8000"
        self.started: list[int] = []           # agent indexes started again, in order
        self.coordinator_restarts = 0
        self.coordinator_fails = False

    def start_agent(self, index: int) -> subprocess.Popen:
        self.agents[index] = spawn()
        self.started.append(index)
        return self.agents[index]

    def restart_coordinator(self) -> None:
        if self.coordinator_fails:
            raise LaunchError("coordinator exited with 1; see /tmp/logs")
        self.coordinator = spawn()
        self.coordinator_restarts += 1

    def kill(self, process: subprocess.Popen) -> None:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()

    def stop(self) -> None:
        for process in [self.coordinator, *self.agents]:
            if process is not None and process.poll() is None:
                self.kill(process)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def said() -> list[str]:
    return []


def supervised(processes: Processes, said: list[str], clock: Clock) -> Supervisor:
    return Supervisor(processes, said.append, Backoff(first_s=1.0, max_s=30.0, stable_s=60.0), clock).start(
        thread=False)


def test_the_backoff_doubles_up_to_its_cap() -> None:
    assert [Backoff().delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def test_a_killed_agent_is_started_again_under_its_index_once_its_backoff_has_passed(said: list[str]) -> None:
    processes, clock = Processes([SLEEP] * 3), Clock()
    try:
        supervisor = supervised(processes, said, clock)
        assert supervisor.check() and processes.started == [] and said == []
        processes.kill(processes.agents[1])
        assert supervisor.check()
        assert said == ["agent1 (mesh-a1) exited with status -9; restarting it in 1 s"]
        clock.now = 0.5
        supervisor.check()
        assert processes.started == []              # not before its backoff
        clock.now = 1.0
        supervisor.check()
        assert processes.started == [1] and supervisor.restarts == {1: 1}
        assert processes.agents[1].poll() is None and said[-1] == "agent1 (mesh-a1) is back (restart 1)"
        clock.now = 5.0
        supervisor.check()
        assert processes.started == [1]             # the others were never touched
    finally:
        processes.stop()


def test_an_agent_that_keeps_dying_waits_longer_each_time_and_one_that_ran_a_while_starts_over(
        said: list[str]) -> None:
    processes, clock = Processes([SLEEP]), Clock()
    try:
        supervisor = supervised(processes, said, clock)
        for died_at, wait in ((0.0, 1), (2.0, 2), (5.0, 4), (10.0, 8)):   # each ran 1 s, less than stable_s
            clock.now = died_at
            processes.kill(processes.agents[0])
            supervisor.check()
            assert said[-1] == f"agent0 (mesh-a0) exited with status -9; restarting it in {wait} s"
            clock.now = died_at + wait
            supervisor.check()
            assert processes.agents[0].poll() is None
        assert len(processes.started) == 4
        clock.now += 60.0                              # it has run for stable_s: its next failure starts over
        processes.kill(processes.agents[0])
        supervisor.check()
        assert said[-1] == "agent0 (mesh-a0) exited with status -9; restarting it in 1 s"
    finally:
        processes.stop()


@pytest.mark.parametrize(("code", "what"), [("0", "exited cleanly (drained); it stays down"),
                                            (str(EXIT_REFUSED), "was refused by the mesh (revoked?); it stays down")])
def test_a_drained_or_refused_agent_stays_down(said: list[str], code: str, what: str) -> None:
    processes, clock = Processes([SLEEP, f"import sys; sys.exit({code})"]), Clock()
    try:
        processes.agents[1].wait()
        supervisor = supervised(processes, said, clock)
        for clock.now in (0.0, 10.0, 100.0):
            assert supervisor.check()
        assert processes.started == [] and said == [f"agent1 (mesh-a1) {what}"]
    finally:
        processes.stop()


def test_a_dead_coordinator_is_started_again_and_one_that_cannot_start_ends_the_mesh(said: list[str]) -> None:
    processes, clock = Processes([SLEEP]), Clock()
    try:
        supervisor = supervised(processes, said, clock)
        processes.kill(processes.coordinator)
        assert supervisor.check() and processes.coordinator_restarts == 1 and not supervisor.ended.is_set()
        assert said == ["the coordinator exited with status -9; starting it again from its registry",
                        "the coordinator is back at http://127.0.0.1:8000"]
        processes.coordinator_fails = True
        processes.kill(processes.coordinator)
        assert not supervisor.check()
        assert supervisor.ended.is_set()
        assert supervisor.reason == ("the coordinator exited with status -9 and could not be started again: "
                                     "coordinator exited with 1; see /tmp/logs")
    finally:
        processes.stop()


def test_from_its_own_thread_it_repairs_what_dies_until_stopped(said: list[str]) -> None:
    processes = Processes([SLEEP, SLEEP])
    supervisor = Supervisor(processes, said.append, Backoff(first_s=0.0)).start()
    try:
        processes.kill(processes.agents[0])
        deadline = time.monotonic() + patient(60)
        while supervisor.restarts.get(0) != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert supervisor.restarts == {0: 1} and processes.agents[0].poll() is None
    finally:
        supervisor.stop()
    assert not supervisor.running
    processes.kill(processes.agents[1])            # stopped: nothing is repaired any more
    assert processes.started == [0] and processes.agents[1].poll() is not None
    processes.stop()
