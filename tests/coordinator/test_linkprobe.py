"""The origin's link probe: which agents are due when, and its measurements stored as the origin's links."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.control.probes import AgentLink
from stratamesh.coordinator.control.probes import PROBE_PEERS, PeerProbes, peers_of
from stratamesh.coordinator.linkprobe import OriginLinkProber, due_peers
from stratamesh.coordinator.registry import Registry
from stratamesh.fleet.boxes import Capabilities, Peer
from stratamesh.fleet.control_messages import LinkMeasurement
from stratamesh.partitioner.fleet_snapshot import ORIGIN
from tests.coordinator.test_deployer import Agent, connect_all


class FakeMeasure:
    """measure_peers with plain values: each peer 1 ms and 100 MB/s, except the ones listed as failing."""

    def __init__(self, failing: Sequence[str] = ()) -> None:
        self.asked: list[list[str]] = []
        self.failing = set(failing)

    async def __call__(self, peers: Sequence[Peer]) -> list[LinkMeasurement]:
        self.asked.append([p.agent_id for p in peers])
        return [LinkMeasurement(p.agent_id, error="UNAVAILABLE") if p.agent_id in self.failing
                else LinkMeasurement(p.agent_id, 1e-3, 1e8) for p in peers]


@dataclass
class Probing:
    """A deployer over an in-memory registry, the origin's prober of it (every 300 s, FakeMeasure), and their clock."""

    registry: Registry
    deployer: Deployer
    measure: FakeMeasure
    prober: OriginLinkProber
    now: list[float]


def origin_probing(failing: Sequence[str] = ()) -> Probing:
    registry, now = Registry(":memory:"), [100.0]
    deployer = Deployer(registry, clock=lambda: now[0])
    measure = FakeMeasure(failing)
    return Probing(registry, deployer, measure, OriginLinkProber(deployer.roster, clock=lambda: now[0], every_s=300,
                                                                 measure=measure), now)


def test_due_peers_are_the_new_ones_and_those_probed_a_period_ago() -> None:
    a, b, b_moved = Peer("a", "h:1"), Peer("b", "h:2"), Peer("b", "h:3")
    probed_at = {a: 100.0, b: 50.0}
    assert due_peers([a, b], probed_at, now=109.0, every_s=60) == []
    assert due_peers([a, b], probed_at, now=110.0, every_s=60) == [b]
    assert due_peers([a, b_moved], probed_at, now=100.0, every_s=60) == [b_moved]     # a new address: new
    assert due_peers([a, b], probed_at, now=160.0, every_s=60) == [a, b]


async def test_the_origin_measures_each_agent_on_connect_and_again_when_due() -> None:
    p = origin_probing(failing=["a2"])
    registry, deployer, measure, prober, now = p.registry, p.deployer, p.measure, p.prober, p.now
    a1, a2 = Agent("a1", 8), Agent("a2", 8)
    assert await prober.probe_due() == [] and measure.asked == []
    connect_all(deployer, [a1, a2])
    await prober.probe_due()
    assert measure.asked == [["a1", "a2"]]
    assert [(r.agent_id, r.peer_agent_id, r.rtt_s, r.bandwidth_bytes_per_s) for r in registry.links()] == \
        [(ORIGIN, "a1", 1e-3, 1e8)]                # a2 failed: no figures
    now[0] += 299
    await prober.probe_due()
    assert measure.asked == [["a1", "a2"]]
    now[0] += 1
    await prober.probe_due()
    assert measure.asked[-1] == ["a1", "a2"]


async def test_an_agent_that_reconnects_is_measured_again_at_once() -> None:
    p = origin_probing()
    deployer, measure, prober, now = p.deployer, p.measure, p.prober, p.now
    a1, a2 = Agent("a1", 8), Agent("a2", 8)
    connect_all(deployer, [a1, a2])
    await prober.probe_due()
    deployer.agent_disconnected(a2.link)
    await prober.probe_due()
    connect_all(deployer, [a2])
    now[0] += 5
    await prober.probe_due()
    assert measure.asked == [["a1", "a2"], ["a2"]]


async def test_the_origin_lists_the_agents_again_only_when_one_came_or_went() -> None:
    p = origin_probing()
    deployer, measure, prober, now = p.deployer, p.measure, p.prober, p.now
    listings, peers = [], deployer.roster.peers

    def counted() -> list[Peer]:            # the roster's every connected agent, listed
        listings.append(1)
        return peers()

    deployer.roster.peers = counted
    a1, a2 = Agent("a1", 8), Agent("a2", 8)
    connect_all(deployer, [a1])
    for _ in range(3):          # a second apart, as it runs: one agent, listed once
        await prober.probe_due()
        now[0] += 1
    assert len(listings) == 1
    connect_all(deployer, [a2])
    await prober.probe_due()
    await prober.probe_due()
    assert len(listings) == 2 and measure.asked == [["a1"], ["a2"]]
    deployer.agent_disconnected(a1.link)
    now[0] += 300               # a1 would be due again, but it has gone
    assert await prober.probe_due() == [Peer("a2", a2.link.stage_address)] and len(listings) == 3


def test_nobody_is_asked_to_probe_an_agent_behind_another_nat() -> None:
    """A gRPC probe cannot reach an agent behind a NAT the prober is not behind: only its own site's agents (and
    nobody outside) measure their links to it; it measures its links out."""
    sent: dict[str, list[tuple[str, ...]]] = {}

    def link(agent_id: str, nat: str = "") -> AgentLink:
        return AgentLink(agent_id, f"{agent_id}:1", Capabilities(agent_id, "cpu", 1, 1, 1),
                         lambda message: sent.setdefault(agent_id, []).append(
                             tuple(p.agent_id for p in message.peers)), nat=nat)

    links = {"cloud": link("cloud"), "edge-1": link("edge-1", "203.0.113.9")}
    probes = PeerProbes(lambda: 0.0, every_s=10.0)
    edge2 = links["edge-2"] = link("edge-2", "203.0.113.9")
    probes.joined(edge2, links)
    assert sent == {"edge-2": [("cloud", "edge-1")], "edge-1": [("edge-2",)]}
    sent.clear()
    cloud2 = links["cloud-2"] = link("cloud-2")
    probes.joined(cloud2, links)
    assert sent == {"cloud-2": [("cloud",)], "cloud": [("cloud-2",)], "edge-1": [("cloud-2",)],
                    "edge-2": [("cloud-2",)]}
    assert peers_of(links, seen_from="") == [Peer("cloud", "cloud:1"), Peer("cloud-2", "cloud-2:1")]


def test_a_large_fleet_probes_a_bounded_number_of_links_per_join_its_site_first() -> None:
    """500 agents on 10 sites join: each newcomer measures at most PROBE_PEERS links, those of its site first, and
    is measured by as many; the fleet's probes grow with N, not N^2."""
    asked: dict[str, list[tuple[str, ...]]] = {}

    def link(agent_id: str, site: str) -> AgentLink:
        return AgentLink(agent_id, f"{agent_id}:1", Capabilities(agent_id, "cpu", 1, 1, 1, site=site),
                         lambda message: asked.setdefault(agent_id, []).append(
                             tuple(p.agent_id for p in message.peers)))

    links: dict[str, AgentLink] = {}
    probes = PeerProbes(lambda: 0.0, every_s=10.0)
    for i in range(500):
        newcomer = links[f"a{i:03d}"] = link(f"a{i:03d}", f"site-{i % 10}")
        probes.joined(newcomer, links)
    total = sum(len(peers) for sent in asked.values() for peers in sent)
    assert total <= 500 * PROBE_PEERS * 2
    own = [asked[f"a{i:03d}"][0] for i in range(100, 500)]       # a newcomer's first request is its own probe
    assert all(len(peers) == PROBE_PEERS for peers in own)
    assert all(all(int(p[1:]) % 10 == i % 10 for p in peers) for i, peers in zip(range(100, 500), own))
