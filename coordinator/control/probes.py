"""Which links the agents measure when: each its links to a few others on its join and every period, so that a
fleet of N agents costs O(N) probes; and the connected agent as the control plane holds it (AgentLink)."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from stratamesh.fleet.boxes import Capabilities, Peer
from stratamesh.fleet.control_messages import ControlMessage, ProbeLinks


@dataclass(slots=True)
class AgentLink:
    """A connected agent: where its stages listen and how to send it control messages."""

    agent_id: str
    stage_address: str
    capabilities: Capabilities
    send: Callable[[ControlMessage], None]      # the control service puts it on the agent's stream
    close: Callable[[], None] = lambda: None     # ends the control stream (an agent declared dead)
    nat: str = ""       # the address its connections come from, when it is behind NAT ("": it can be dialed)


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
