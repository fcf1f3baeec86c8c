"""What a coordinator serves from while another leads its mesh (docs/registry.md): the mesh as the leader writes it
to the registry they share. Its origin routes requests over the agents the leader has connected and the stages they
loaded, read again every REFRESH_S; it plans nothing and holds no agent's control stream.

Between two reads a standby may route over an agent that just died: the attempt fails over as any does, and the
route after it reads what the leader made of the death."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from stratamesh.coordinator.control.load_errors import LoadErrors
from stratamesh.coordinator.control.roster import AgentNotConnected, on_one_box
from stratamesh.coordinator.control.routes import Routes
from stratamesh.coordinator.liveness import LivenessConfig
from stratamesh.coordinator.records import AgentRecord, StageRecord
from stratamesh.coordinator.registry_store import RegistryStore
from stratamesh.fleet.boxes import Telemetry
from stratamesh.fleet.states import AgentState, StageState

log = logging.getLogger(__name__)

REFRESH_S = 1.0     # how often a standby reads the agents of live plans and their telemetry again
LINKS_EVERY_S = 30.0    # ... and the links measured (agents re-measure theirs every 300 s: LINK_PROBE_EVERY_S)
_SERVING = (AgentState.CONNECTED, AgentState.RESTING)    # agents whose stages serve (a resting one's, until moved)


class RegistryRoster:
    """The agents as the leader last wrote them: the routes' RosterReads, for a standby."""

    def __init__(self, registry: RegistryStore, agent_lease_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._registry = registry
        self._clock = clock
        self.liveness = LivenessConfig(lease_s=agent_lease_s)  # what the origin waits before trusting an address again
        self.telemetry: dict[str, Telemetry] = {}
        self._agents: dict[str, AgentRecord] = {}
        self._bandwidths: dict[tuple[str, str], float] = {}
        self._links_read_at = float("-inf")

    def refresh(self) -> None:
        """Reads the agents of the live plans' stages whose stages serve (a few point reads, not the whole fleet:
        benchmarks/standby_refresh.py), their newest telemetry, and now and then the links measured."""
        registry = self._registry
        ids = sorted({s.agent_id for m in registry.models() for p in registry.live_plans(m.model_id)
                      for s in p.stages})
        self._agents = {a.agent_id: a for a in map(registry.agent, ids) if a is not None and a.state in _SERVING}
        self.telemetry = {agent_id: rows[-1][1] for agent_id in self._agents
                          if (rows := registry.telemetry(agent_id, limit=1))}
        if self._clock() >= self._links_read_at + LINKS_EVERY_S:
            self._links_read_at = self._clock()
            self._bandwidths = {(m.agent_id, m.peer_agent_id): m.bandwidth_bytes_per_s for m in registry.links()}

    @property
    def num_agents(self) -> int:
        return len(self._agents)

    def serving(self, stage: StageRecord) -> bool:
        return stage.state == StageState.READY and stage.agent_id in self._agents

    def stage_address(self, agent_id: str) -> str:
        agent = self._agents.get(agent_id)
        if agent is None:
            raise AgentNotConnected(f"agent {agent_id!r} is not connected")
        return agent.address

    def nat(self, agent_id: str) -> str:
        return ""       # (the registry keeps no NAT address: a stage behind NAT is dialed by the leader only)

    def bandwidth(self, sender: str, receiver: str) -> float | None:
        return self._bandwidths.get((sender, receiver)) or self._bandwidths.get((receiver, sender))

    def same_box(self, a: str, b: str) -> bool:
        x, y = self._agents.get(a), self._agents.get(b)
        return (x is not None and y is not None
                and on_one_box(x.capabilities.hostname, x.address, y.capabilities.hostname, y.address))


class Standby:
    """A standby's serving state (the origin's Serving, as the leader's Deployer is): routes over RegistryRoster."""

    def __init__(self, registry: RegistryStore, agent_lease_s: float, codec_policy: str = "auto") -> None:
        self.registry = registry
        self.roster = RegistryRoster(registry, agent_lease_s)
        self.routes = Routes(registry, self.roster, codec_policy=codec_policy)
        self.load_errors = LoadErrors()     # (the leader's agents report theirs to it)

    def report_unreachable(self, address: str) -> None:
        """The data plane could not reach a stage: the leader finds out for itself whether its agent died."""
        log.info("the stage at %s did not answer; the leader decides whether its agent died", address)

    async def run(self) -> None:
        """Reads the registry again every REFRESH_S, waking the requests that wait for a route, until cancelled; a
        registry that does not answer is read again after."""
        failing = False
        while True:
            try:
                await asyncio.to_thread(self.roster.refresh)
                self.routes.notify()
                failing = False
            except Exception as exc:    # (the store's driver's errors: the database is down or failing over)
                log.log(logging.DEBUG if failing else logging.WARNING, "cannot read the registry: %s", exc)
                failing = True
            await asyncio.sleep(REFRESH_S)
