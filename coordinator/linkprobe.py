"""Who measures which link when: agents each other's (on a join, and every period), the origin its own to each."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from stratamesh.fleet.links import measure_peers
from stratamesh.fleet.types import LinkMeasurement, Peer, ProbeLinks
from stratamesh.partitioner.fleet_snapshot import ORIGIN

if TYPE_CHECKING:   # the roster uses PeerProbes: import the control types for hints only
    from stratamesh.coordinator.control.deployer import Deployer
    from stratamesh.coordinator.control.roster import AgentLink

log = logging.getLogger(__name__)

# Every connected agent measures its links to others this often (and when it connects): to at most PROBE_PEERS.
LINK_PROBE_EVERY_S = 300.0
PROBE_PEERS = 8


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
    """Asks connected agents (over their control streams) to measure their links to one another: each agent (on its
    join, and every period) the links to at most `fanout` others, those of its own site first, then others picked
    at random; so a fleet of N agents costs O(N) probes, not O(N^2), and a small fleet measures every link."""

    def __init__(self, clock: Callable[[], float], every_s: float = LINK_PROBE_EVERY_S, fanout: int = PROBE_PEERS,
                 rng: random.Random | None = None):
        self._clock = clock
        self._every_s = every_s
        self._fanout = fanout
        self._rng = rng or random.Random(0)
        self._probed_at = clock()
        self._ids: list[str] = []                   # agents that joined, to pick from (pruned every period)
        self._sites: dict[str, set[str]] = {}       # site -> agents that joined there (pruned every period)

    def joined(self, newcomer: AgentLink, links: Mapping[str, AgentLink]) -> None:
        """Asks the newcomer to measure its links to those of its partners it can dial, and each partner that can
        dial it its link to it."""
        self._ids.append(newcomer.agent_id)
        self._sites.setdefault(newcomer.capabilities.site, set()).add(newcomer.agent_id)
        partners = self._partners(newcomer, links)
        probe(newcomer, partners)
        for partner in partners:
            probe(partner, [newcomer])

    def tick(self, links: Mapping[str, AgentLink]) -> None:
        """Once a period is up, asks every connected agent to measure its links to its partners again."""
        now = self._clock()
        if now < self._probed_at + self._every_s:
            return
        self._probed_at = now
        self._ids = [a for a in dict.fromkeys(self._ids) if a in links]
        self._sites = {site: kept for site, ids in self._sites.items() if (kept := {a for a in ids if a in links})}
        for link in links.values():
            probe(link, self._partners(link, links))

    def _partners(self, prober: AgentLink, links: Mapping[str, AgentLink]) -> list[AgentLink]:
        """Up to fanout other connected agents: prober's site's first, then others at random (all in a small fleet)."""
        def wanted(agent_id: str) -> bool:
            return agent_id in links and agent_id != prober.agent_id

        if len(links) <= self._fanout + 1:      # a small fleet: every link
            return [link for agent_id, link in sorted(links.items()) if wanted(agent_id)]
        site = list(self._sites.get(prober.capabilities.site, ()))
        near = site if len(site) <= 2 * self._fanout else self._rng.sample(site, 2 * self._fanout)
        chosen = [a for a in near if wanted(a)][:self._fanout]
        picked = set(chosen)
        for _ in range(4 * self._fanout):       # a few tries: some picks are gone, or taken already
            if len(chosen) >= self._fanout or not self._ids:
                break
            agent_id = self._rng.choice(self._ids)
            if agent_id not in picked and wanted(agent_id):
                picked.add(agent_id)
                chosen.append(agent_id)
        return [links[a] for a in chosen]


def probe(prober: AgentLink, peers: Sequence[AgentLink]) -> None:
    """Asks prober to measure its links to those of peers it can dial."""
    reachable = tuple(Peer(p.agent_id, p.stage_address) for p in peers if dials(prober.nat, p))
    if reachable:
        prober.send(ProbeLinks(reachable))


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
        self._peers: list[Peer] = []
        self._membership = -1       # the deployer's membership count self._peers was read at

    async def probe_due(self) -> list[Peer]:
        """Measures and records the links that are due; returns the peers it probed."""
        if self._deployer.membership != self._membership:   # read again only when agents came or went: it lists
            self._membership = self._deployer.membership     # every agent, and this runs every second
            self._peers = self._deployer.peers()
            # An agent that left is forgotten, so its reconnection counts as new.
            connected = set(self._peers)
            self._probed_at = {p: t for p, t in self._probed_at.items() if p in connected}
        now = self._clock()
        due = due_peers(self._peers, self._probed_at, now, self._every_s)
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
