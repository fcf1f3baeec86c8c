"""Who measures which link when: agents each other's (on a join, and every period), the origin its own to each."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from stratamesh.fleet.links import measure_peers
from stratamesh.fleet.types import LinkMeasurement, Peer, ProbeLinks
from stratamesh.partitioner.fleet_snapshot import ORIGIN

if TYPE_CHECKING:   # the roster uses PeerProbes: import the control types for hints only
    from stratamesh.coordinator.control.deployer import Deployer
    from stratamesh.coordinator.control.roster import AgentLink

log = logging.getLogger(__name__)

# Every connected agent measures its links to all the others this often (and when one of them connects).
LINK_PROBE_EVERY_S = 300.0


def dials(nat: str, target: AgentLink) -> bool:
    """Whether a prober behind nat ("": behind none) can dial target: not if target is behind another NAT (its link
    is a data channel's, which these gRPC probes do not measure)."""
    return not target.nat or target.nat == nat


def peers_of(links: Mapping[str, AgentLink], seen_from: str | None = None) -> list[Peer]:
    """Every connected agent and the address of its Stage and Link services, by agent id; with seen_from, only those
    a prober behind that NAT can dial."""
    return [Peer(link.agent_id, link.stage_address) for _, link in sorted(links.items())
            if seen_from is None or dials(seen_from, link)]


class PeerProbes:
    """Asks connected agents (over their control streams) to measure their links to one another."""

    def __init__(self, clock: Callable[[], float], every_s: float = LINK_PROBE_EVERY_S):
        self._clock = clock
        self._every_s = every_s
        self._probed_at = clock()

    def joined(self, newcomer: AgentLink, links: Mapping[str, AgentLink]) -> None:
        """Asks the newcomer to measure its links to every other agent, and each of them its link to it."""
        others = [p for p in peers_of(links, newcomer.nat) if p.agent_id != newcomer.agent_id]
        if others:
            newcomer.send(ProbeLinks(tuple(others)))
        itself = Peer(newcomer.agent_id, newcomer.stage_address)
        for other in links.values():
            if other.agent_id != newcomer.agent_id and dials(other.nat, newcomer):
                other.send(ProbeLinks((itself,)))

    def tick(self, links: Mapping[str, AgentLink]) -> None:
        """Once a period is up, asks every connected agent to measure its links to all the others again."""
        now = self._clock()
        if now < self._probed_at + self._every_s:
            return
        self._probed_at = now
        for link in links.values():
            others = [p for p in peers_of(links, link.nat) if p.agent_id != link.agent_id]
            if others:
                link.send(ProbeLinks(tuple(others)))

POLL_S = 1.0    # how soon a newly connected agent gets its link to the origin measured

MeasurePeers = Callable[[Sequence[Peer]], Awaitable[list[LinkMeasurement]]]


def due_peers(peers: Sequence[Peer], probed_at: Mapping[Peer, float], now: float, every_s: float) -> list[Peer]:
    """The peers never probed at their current address, or last probed every_s ago or more."""
    return [p for p in peers if p not in probed_at or now >= probed_at[p] + every_s]


class OriginLinkProber:
    """Measures the origin's link to each agent when it connects and every every_s; records them as ORIGIN's."""

    def __init__(self, deployer: Deployer, clock: Callable[[], float], every_s: float = LINK_PROBE_EVERY_S,
                 measure: MeasurePeers = measure_peers):
        self._deployer = deployer
        self._clock = clock
        self._every_s = every_s
        self._measure = measure
        self._probed_at: dict[Peer, float] = {}

    async def probe_due(self) -> list[Peer]:
        """Measures and records the links that are due; returns the peers it probed."""
        peers = self._deployer.peers()
        # An agent that left is forgotten, so its reconnection counts as new.
        self._probed_at = {p: t for p, t in self._probed_at.items() if p in peers}
        now = self._clock()
        due = due_peers(peers, self._probed_at, now, self._every_s)
        if due:
            self._probed_at.update((p, now) for p in due)
            self._deployer.links_reported(ORIGIN, await self._measure(due))
        return due

    async def run(self, poll_s: float = POLL_S) -> None:
        """Probes whatever is due every poll_s until cancelled."""
        while True:
            try:
                await self.probe_due()
            except Exception:  # the registry or the planner failing must not end the probing for good
                log.exception("origin link probe failed")
            await asyncio.sleep(poll_s)
