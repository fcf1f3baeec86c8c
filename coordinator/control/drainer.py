"""Graceful drain of an agent: its stages move to spares, its live sessions follow with their KV, then it exits."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.control.roster import AgentNotConnected
from stratamesh.coordinator.control.sessions import Sessions
from stratamesh.coordinator.records import DrainStatus
from stratamesh.coordinator.registry_store import RegistryStore
from stratamesh.fleet.errors import MeshError
from stratamesh.fleet.states import DrainState

log = logging.getLogger(__name__)

# How long the replacements may take to load, and the live sessions to move, before the drain gives up
# (stages) or lets the agent go anyway (sessions: those left fail over by replay, nothing is lost).
STAGES_TIMEOUT_S = 300.0
SESSIONS_TIMEOUT_S = 60.0
RESUME_TIMEOUT_S = 120.0     # for a restarted coordinator to see the agent and spares for its stages again
POLL_S = 0.05
REST_BLOCKED_EVENT_S = 300.0   # while a rest cannot begin, the events list says so at most this often per agent


class DrainRefused(MeshError):
    """The agent cannot be drained now (no spare can take a stage, or it is being drained already)."""


class Drainer:
    """Runs drains: one task per agent, driving the deployer (stages) and the origin's sessions. Every drain and
    its progress is kept in the registry; resume() takes up those a previous coordinator left running. The deployer
    tells it of the rests agents' owners ask for (Deployer.on_rest = Drainer.rest)."""

    def __init__(self, deployer: Deployer, sessions: Sessions, registry: RegistryStore) -> None:
        self._deployer = deployer
        self._sessions = sessions
        self._registry = registry
        self._drains: dict[str, DrainStatus] = {d.agent_id: d for d in registry.drains()}
        self._tasks: set[asyncio.Task[None]] = set()
        self._blocked: dict[str, float] = {}    # agent id -> when the events list last said its rest cannot begin

    def rest(self, agent_id: str, why: str) -> None:
        """The agent's owner's limits want it resting: its stages and sessions move off it as in a drain, and it
        stays connected, planned on no more until it serves again. Where it cannot begin (no spare can take a
        stage, a drain of it runs) the agent serves on, the events list says why (agent_rest_blocked), and the
        deployer asks again (Deployer._owner_says): nobody's request is dropped for want of a spare."""
        try:
            self.start(agent_id, rest=why)
        except (AgentNotConnected, DrainRefused) as exc:
            log.warning("agent %s cannot rest now: %s", agent_id, exc)
            now = time.time()
            if now - self._blocked.get(agent_id, -REST_BLOCKED_EVENT_S) >= REST_BLOCKED_EVENT_S:
                self._blocked[agent_id] = now
                self._registry.log_event(
                    "agent_rest_blocked", f"its owner's limits ask it to rest ({why}), but {exc}; it serves on and "
                    "rests once a spare can take its stages", now, agent_id=agent_id)
            return
        self._blocked.pop(agent_id, None)

    def start(self, agent_id: str, rest: str = "") -> DrainStatus:
        """Starts draining the agent (AgentNotConnected, DrainRefused); its progress is in status(). rest: why its
        owner's limits rest it (then it stays connected at the end; see rest())."""
        current = self._drains.get(agent_id)
        if current is not None and current.running:
            raise DrainRefused(f"agent {agent_id!r} is being drained already")
        address = self._deployer.roster.stage_address(agent_id)
        status = DrainStatus(agent_id, time.time(), rest=rest)
        self._begin(status)
        self._drains[agent_id] = status
        self._save(status)
        self._spawn(self._run(status, address))
        return status

    def resume(self) -> list[DrainStatus]:
        """Takes up every drain left running by a coordinator that stopped or died: each goes on once its agent
        (and a spare for each of its stages) is connected again, and fails after RESUME_TIMEOUT_S without."""
        unfinished = [d for d in self._drains.values() if d.running]
        for status in unfinished:
            status.resumed += 1
            log.info("resuming the drain of %s (it was %s)", status.agent_id, status.state.replace("_", " "))
            self._spawn(self._resume(status))
        return unfinished

    def _begin(self, status: DrainStatus) -> None:
        """Plans the moves of the agent's stages (AgentNotConnected; DrainRefused: no spare can take one)."""
        try:
            pairs = self._deployer.drain(status.agent_id)
        except AgentNotConnected:
            raise
        except MeshError as exc:    # no spare can take a stage
            raise DrainRefused(f"cannot drain agent {status.agent_id!r}: {exc}") from None
        moves = [{"model": old.spec.model_id, "layers": [old.spec.start_layer, old.spec.end_layer],
                  "from": old.agent_id, "to": new.agent_id} for old, new in pairs]
        redone = {(m["model"], tuple(m["layers"])) for m in moves}   # (on a resume: moves begun but not made)
        status.stages = [m for m in status.stages if (m["model"], tuple(m["layers"])) not in redone] + moves
        status.state = DrainState.MOVING_STAGES

    async def _resume(self, status: DrainStatus) -> None:
        deadline = time.monotonic() + RESUME_TIMEOUT_S
        while True:
            try:
                address = self._deployer.roster.stage_address(status.agent_id)
                self._begin(status)         # the stages it still serves: moves the old coordinator made stay made
                break
            except (AgentNotConnected, DrainRefused) as exc:
                if time.monotonic() >= deadline:
                    status.state, status.error = DrainState.FAILED, f"not resumed after a coordinator restart: {exc}"
                    status.finished_unix_s = time.time()
                    self._save(status)
                    log.warning("drain of %s failed: %s", status.agent_id, status.error)
                    return
            await asyncio.sleep(POLL_S)
        self._save(status)
        await self._run(status, address)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _save(self, status: DrainStatus) -> None:
        self._registry.save_drain(status)

    def all(self) -> list[DrainStatus]:
        """Every drain this coordinator ran or runs, oldest first."""
        return sorted(self._drains.values(), key=lambda d: d.started_unix_s)

    def status(self, agent_id: str) -> DrainStatus:
        status = self._drains.get(agent_id)
        if status is None:
            raise AgentNotConnected(f"agent {agent_id!r} has not been drained")
        return status

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(self, status: DrainStatus, address: str) -> None:
        agent_id = status.agent_id
        try:
            if not await self._until(lambda: not self._deployer.drains.replacing(agent_id)
                                     or agent_id in self._deployer.drains.failures, STAGES_TIMEOUT_S):
                raise DrainRefused(f"the replacements did not load in {STAGES_TIMEOUT_S:.0f} s")
            if agent_id in self._deployer.drains.failures:
                raise DrainRefused(self._deployer.drains.failures[agent_id])
            status.state = DrainState.MOVING_SESSIONS
            self._save(status)

            def moved() -> bool:    # asks again each time: a session may have opened just before the switch
                status.sessions_asked += self._sessions.move_off(address)
                return self._sessions.sessions_through(address) == 0

            if not await self._until(moved, SESSIONS_TIMEOUT_S):
                log.warning("drain of %s: %d sessions did not move in %.0f s; they fail over when it exits",
                            agent_id, self._sessions.sessions_through(address), SESSIONS_TIMEOUT_S)
            if status.rest:
                self._deployer.finish_rest(agent_id, status.rest)
            else:
                self._deployer.finish_drain(agent_id)
            status.state = DrainState.DRAINED
        except DrainRefused as exc:
            self._deployer.cancel_drain(agent_id)
            status.state, status.error = DrainState.FAILED, str(exc)
            log.warning("drain of %s failed: %s", agent_id, exc)
        finally:
            if not status.running:          # (a cancelled drain, a coordinator stopping, stays running: resumed)
                status.finished_unix_s = time.time()
            self._save(status)

    @staticmethod
    async def _until(done, timeout_s: float) -> bool:
        """Polls done() until it is true (True) or timeout_s passes (False)."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True
