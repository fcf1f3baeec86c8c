"""Graceful drain of an agent: its stages move to spares, its live sessions follow with their KV, then it exits."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from stratamesh.coordinator.deployer import AgentNotConnected, Deployer
from stratamesh.coordinator.origin import Origin
from stratamesh.fleet.errors import MeshError

log = logging.getLogger(__name__)

# How long the replacements may take to load, and the live sessions to move, before the drain gives up
# (stages) or lets the agent go anyway (sessions: those left fail over by replay, nothing is lost).
STAGES_TIMEOUT_S = 300.0
SESSIONS_TIMEOUT_S = 60.0
POLL_S = 0.05


class DrainRefused(MeshError):
    """The agent cannot be drained now (no spare can take a stage, or it is being drained already)."""


@dataclass(slots=True)
class DrainStatus:
    """One drain as the admin API shows it."""

    agent_id: str
    started_unix_s: float
    state: str = "moving_stages"    # -> moving_sessions -> drained, or failed
    stages: list[dict[str, Any]] = field(default_factory=list)    # model, layers, from and to agent
    sessions_asked: int = 0         # live sessions asked to move (a few may finish first)
    finished_unix_s: float = 0.0
    error: str = ""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class Drainer:
    """Runs drains: one task per agent, driving the deployer (stages) and the origin (sessions)."""

    def __init__(self, deployer: Deployer, origin: Origin):
        self._deployer = deployer
        self._origin = origin
        self._drains: dict[str, DrainStatus] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, agent_id: str) -> DrainStatus:
        """Starts draining the agent (AgentNotConnected, DrainRefused); its progress is in status()."""
        current = self._drains.get(agent_id)
        if current is not None and current.state in ("moving_stages", "moving_sessions"):
            raise DrainRefused(f"agent {agent_id!r} is being drained already")
        address = self._deployer.stage_address(agent_id)
        try:
            pairs = self._deployer.drain(agent_id)
        except AgentNotConnected:
            raise
        except MeshError as exc:    # no spare can take a stage
            raise DrainRefused(f"cannot drain agent {agent_id!r}: {exc}") from None
        status = self._drains[agent_id] = DrainStatus(agent_id, time.time(), stages=[
            {"model": old.spec.model_id, "layers": [old.spec.start_layer, old.spec.end_layer],
             "from": old.agent_id, "to": new.agent_id} for old, new in pairs])
        task = asyncio.get_running_loop().create_task(self._run(status, address))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return status

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
            if not await self._until(lambda: not self._deployer.replacing(agent_id)
                                     or agent_id in self._deployer.drain_failures, STAGES_TIMEOUT_S):
                raise DrainRefused(f"the replacements did not load in {STAGES_TIMEOUT_S:.0f} s")
            if agent_id in self._deployer.drain_failures:
                raise DrainRefused(self._deployer.drain_failures[agent_id])
            status.state = "moving_sessions"

            def moved() -> bool:    # asks again each time: a session may have opened just before the switch
                status.sessions_asked += self._origin.move_off(address)
                return self._origin.sessions_through(address) == 0

            if not await self._until(moved, SESSIONS_TIMEOUT_S):
                log.warning("drain of %s: %d sessions did not move in %.0f s; they fail over when it exits",
                            agent_id, self._origin.sessions_through(address), SESSIONS_TIMEOUT_S)
            self._deployer.finish_drain(agent_id)
            status.state = "drained"
        except DrainRefused as exc:
            self._deployer.cancel_drain(agent_id)
            status.state, status.error = "failed", str(exc)
            log.warning("drain of %s failed: %s", agent_id, exc)
        finally:
            status.finished_unix_s = time.time()

    @staticmethod
    async def _until(done, timeout_s: float) -> bool:
        """Polls done() until it is true (True) or timeout_s passes (False)."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True
