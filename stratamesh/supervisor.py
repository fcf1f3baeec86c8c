"""Keeps a local mesh's processes running, as a service manager would.

A dead agent is started again under its agent id (its enrolled credentials and its name stay), after a backoff
that doubles while it keeps dying and resets once it has run for a while; the coordinator replays and re-plans
its sessions meanwhile, as for any dead box. Two exits are final: an agent that exits cleanly was drained, and one
that exits with EXIT_REFUSED was refused by the mesh (a revoked certificate): starting it again cannot help. A dead
coordinator is started again on its ports, from its registry; if it cannot be, the supervisor ends (`ended`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from stratamesh.fleet.errors import EXIT_REFUSED, MeshError

log = logging.getLogger(__name__)

POLL_S = 0.2


@dataclass(frozen=True, slots=True)
class Backoff:
    """How long to wait before the n-th restart in a row of one process."""

    first_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 60.0      # a process that ran this long was healthy: its next failure waits first_s again

    def delay(self, failures: int) -> float:
        return min(self.max_s, self.first_s * 2 ** max(failures - 1, 0))


@dataclass(slots=True)
class _Watched:
    started: float                 # time.monotonic of its (re)start
    failures: int = 0              # exits in a row, each within stable_s of its start
    restart_at: float | None = None
    final: bool = False            # drained or refused: left down


class Exits(Protocol):
    def poll(self) -> int | None: ...   # the exit status, None while it runs


class Supervised(Protocol):
    """A mesh's processes as the supervisor sees them (launcher.LocalMesh is one)."""

    coordinator: Exits | None
    agents: Sequence[Exits]
    agent_ids: Sequence[str]
    url: str

    def restart_coordinator(self) -> None: ...     # MeshError if it cannot start

    def start_agent(self, index: int) -> object: ...     # MeshError if it dies while starting


class Supervisor:
    """Watches a started mesh (a LocalMesh) from a thread of its own; say() tells the operator what it did."""

    def __init__(self, mesh: Supervised, say: Callable[[str], None] | None = None,
                 backoff: Backoff = Backoff(), clock: Callable[[], float] = time.monotonic) -> None:
        self.mesh, self.say, self.backoff, self._clock = mesh, say or log.warning, backoff, clock
        self.ended = threading.Event()     # the coordinator died and could not be started again
        self.reason = ""
        self.restarts: dict[int, int] = {}      # agent index -> restarts so far
        self._agents: dict[int, _Watched] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mesh-supervisor", daemon=True)

    def start(self, thread: bool = True) -> Supervisor:
        """Starts watching: from a thread of its own, or (thread=False) on each call of check()."""
        now = self._clock()
        self._agents = {index: _Watched(now) for index in range(len(self.mesh.agents))}
        if thread:
            self._thread.start()
        return self

    @property
    def running(self) -> bool:
        """Whether its thread watches the mesh."""
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stops watching (before the mesh stops its processes, so that their exits restart nothing)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def check(self) -> bool:
        """One look at every process, acting on what it finds; False once the mesh cannot go on (`ended`)."""
        if not self._check_coordinator():
            return False
        for index in range(len(self.mesh.agents)):
            if self._stop.is_set():
                break
            self._check_agent(index)
        return True

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                if not self.check():
                    return
            except Exception:  # noqa: BLE001  a supervisor that dies silently is worse than one that logs and goes on
                log.exception("the mesh supervisor hit an error; it goes on watching")

    # ------------------------------------------------------------ the coordinator
    def _check_coordinator(self) -> bool:
        process = self.mesh.coordinator
        code = process.poll() if process is not None else None
        if code is None:
            return True
        self.say(f"the coordinator exited with status {code}; starting it again from its registry")
        try:
            self.mesh.restart_coordinator()
        except MeshError as exc:
            self.reason = f"the coordinator exited with status {code} and could not be started again: {exc}"
            self.say(self.reason)
            self.ended.set()
            return False
        self.say(f"the coordinator is back at {self.mesh.url}")
        return True

    # ------------------------------------------------------------ agents
    def _check_agent(self, index: int) -> None:
        watched = self._agents.setdefault(index, _Watched(self._clock()))
        if watched.final:
            return
        now = self._clock()
        if watched.restart_at is None:
            code = self.mesh.agents[index].poll()
            if code is None:
                return
            name = self._name(index)
            if code == 0:
                watched.final = True
                self.say(f"{name} exited cleanly (drained); it stays down")
                return
            if code == EXIT_REFUSED:
                watched.final = True
                self.say(f"{name} was refused by the mesh (revoked?); it stays down")
                return
            watched.failures = 1 if now - watched.started >= self.backoff.stable_s else watched.failures + 1
            delay = self.backoff.delay(watched.failures)
            watched.restart_at = now + delay
            self.say(f"{name} exited with status {code}; restarting it in {delay:.0f} s")
        if now < watched.restart_at:
            return
        watched.restart_at = None
        watched.started = now
        try:
            self.mesh.start_agent(index)
        except MeshError as exc:          # it died while starting: the next check sees it dead and backs off more
            self.say(f"{self._name(index)} did not come back: {exc}")
            return
        self.restarts[index] = self.restarts.get(index, 0) + 1
        self.say(f"{self._name(index)} is back (restart {self.restarts[index]})")

    def _name(self, index: int) -> str:
        return f"agent{index} ({self.mesh.agent_ids[index]})"
