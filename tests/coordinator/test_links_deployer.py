"""Links in the placement driver: who is asked to probe whom and when, and how measured links steer the plan."""

from __future__ import annotations

import itertools
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.control.probes import LINK_PROBE_EVERY_S
from stratamesh.coordinator.placement import fleet_of
from stratamesh.coordinator.registry import Registry
from stratamesh.fleet.control_messages import LinkMeasurement, ProbeLinks
from stratamesh.partitioner.fleet_snapshot import ORIGIN, SITE_LINK, Link
from tests.coordinator.test_deployer import Agent, connect_all, model_dir  # noqa: F401  (model_dir: a fixture)


def probes(agent: Agent) -> list[list[tuple[str, str]]]:
    """The ProbeLinks messages the agent was sent, each as its (agent id, address) pairs."""
    return [[(p.agent_id, p.address) for p in m.peers] for m in agent.sent if isinstance(m, ProbeLinks)]


def peer(agent: Agent) -> tuple[str, str]:
    return agent.link.agent_id, agent.link.stage_address


def adjacent_pairs(registry: Registry, model_id: str) -> set[frozenset[str]]:
    stages = registry.active_plan(model_id).stages
    return {frozenset((a.agent_id, b.agent_id)) for a, b in itertools.pairwise(stages)}


def test_a_connecting_agent_probes_every_other_and_each_of_them_probes_it() -> None:
    deployer = Deployer(Registry(":memory:"), clock=lambda: 100.0)
    a1, a2, a3 = Agent("a1", 8), Agent("a2", 8), Agent("a3", 8)
    connect_all(deployer, [a1])
    assert probes(a1) == []                       # alone: nobody to measure
    connect_all(deployer, [a2])
    assert probes(a2) == [[peer(a1)]] and probes(a1) == [[peer(a2)]]
    connect_all(deployer, [a3])
    assert probes(a3) == [[peer(a1), peer(a2)]]
    assert probes(a1) == [[peer(a2)], [peer(a3)]] and probes(a2) == [[peer(a1)], [peer(a3)]]
    assert [p.agent_id for p in deployer.roster.peers()] == ["a1", "a2", "a3"]


def test_every_connected_agent_probes_all_the_others_again_once_the_period_is_up() -> None:
    now = [100.0]
    deployer = Deployer(Registry(":memory:"), clock=lambda: now[0])
    agents = [Agent("a1", 8), Agent("a2", 8), Agent("a3", 8)]
    connect_all(deployer, agents)
    deployer.agent_disconnected(agents[2].link)
    for agent in agents:
        agent.sent.clear()
    now[0] += LINK_PROBE_EVERY_S - 1
    deployer.tick()
    assert all(probes(a) == [] for a in agents)
    now[0] += 1
    deployer.tick()
    assert probes(agents[0]) == [[peer(agents[1])]] and probes(agents[1]) == [[peer(agents[0])]]
    assert probes(agents[2]) == []                # gone: neither probes nor is probed
    now[0] += 1
    deployer.tick()
    assert len(probes(agents[0])) == 1            # not again until the next period


def test_reported_links_reach_the_registry() -> None:
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: 7.0)
    deployer.roster.links_reported("a1", [LinkMeasurement("a2", 0.002, 5e8), LinkMeasurement("a3", error="timed out")])
    assert registry.links() == [LinkMeasurement("a2", 0.002, 5e8, "", "a1", 7.0)]


def test_fleet_of_takes_measured_links_between_its_agents_and_the_origin_only() -> None:
    agents = {a.link.agent_id: a.caps for a in (Agent("a1", 8), Agent("a2", 8))}
    records = [LinkMeasurement("a2", 0.5, 1e6, "", "a1", 1.0), LinkMeasurement("a1", 0.01, 2e7, "", ORIGIN, 1.0),
               LinkMeasurement("gone", 0.001, 1e9, "", "a1", 1.0), LinkMeasurement("a2", 0.001, 1e9, "", "gone", 1.0)]
    fleet = fleet_of(agents, records)
    assert set(fleet.links) == {Link("a1", "a2", 1e6, 0.5), Link(ORIGIN, "a1", 2e7, 0.01)}
    a1, a2 = fleet.device("a1"), fleet.device("a2")
    assert fleet.link(a2, a1) == Link("a1", "a2", 1e6, 0.5)
    assert fleet.link(None, a1).bandwidth == 2e7
    assert fleet.link(None, a2) == SITE_LINK      # never measured: the default
    assert fleet_of(agents).links == ()


def test_a_terrible_measured_link_keeps_consecutive_stages_off_it(model_dir: Path) -> None:
    def plan(measured: list[LinkMeasurement]) -> set[frozenset[str]]:
        registry = Registry(":memory:")
        deployer = Deployer(registry, clock=lambda: 100.0)
        connect_all(deployer, [Agent("a1", 8), Agent("a2", 8), Agent("a3", 8)])
        deployer.roster.links_reported("a1", measured)
        deployer.plans.add_model("m", str(model_dir), num_stages=3)
        return adjacent_pairs(registry, "m")

    bad = frozenset(("a1", "a2"))
    assert bad in plan([])                        # three equal boxes: a1 and a2 end up next to each other
    fine = [LinkMeasurement("a3", 0.3e-3, 1.25e9)]
    assert bad in plan(fine)
    assert bad not in plan(fine + [LinkMeasurement("a2", 0.5, 1e6)])     # 1 MB/s and 500 ms: avoided


def test_one_slow_reading_moves_no_stage_off_a_link_and_a_confirmed_one_does(model_dir: Path) -> None:
    """The planner prices a link as routes do (Roster.bandwidth): at the better of its two newest readings."""
    def plan(*readings: LinkMeasurement) -> set[frozenset[str]]:
        registry = Registry(":memory:")
        deployer = Deployer(registry, clock=lambda: 100.0)
        connect_all(deployer, [Agent("a1", 8), Agent("a2", 8), Agent("a3", 8)])
        for reading in readings:
            deployer.roster.links_reported("a1", [LinkMeasurement("a3", 0.3e-3, 1.25e9), reading])
        deployer.plans.add_model("m", str(model_dir), num_stages=3)
        return adjacent_pairs(registry, "m")

    link = frozenset(("a1", "a2"))
    fast, terrible = LinkMeasurement("a2", 0.3e-3, 1.25e9), LinkMeasurement("a2", 0.5, 1e6)
    assert link in plan(fast)
    assert link in plan(fast, terrible)                   # one slow reading: a busy moment, not believed
    assert link not in plan(fast, terrible, terrible)     # confirmed: avoided
    assert link in plan(fast, terrible, terrible, fast)   # faster again: believed at once


def on(agent: Agent, hostname: str, ip: str) -> Agent:
    """The agent as if it ran on the box of that hostname, its Stage service on that IP address."""
    agent.caps = replace(agent.caps, hostname=hostname)
    agent.link.capabilities = agent.caps
    agent.link.stage_address = f"{ip}:{agent.link.stage_address.rpartition(':')[2]}"
    return agent


def two_stages(model_dir: Path, codec_policy: str = "auto",
               boxes: tuple[tuple[str, str], tuple[str, str]] = (("box-a1", "10.0.0.1"), ("box-a2", "10.0.0.2")),
               ) -> tuple[Deployer, Registry]:
    """A model on two agents, each on the box (hostname, Stage IP address) boxes gives it."""
    deployer, registry, _ = two_stage_agents(model_dir, codec_policy, boxes)
    return deployer, registry


def two_stage_agents(model_dir: Path, codec_policy: str = "auto",
                     boxes: tuple[tuple[str, str], tuple[str, str]] = (("box-a1", "10.0.0.1"), ("box-a2", "10.0.0.2")),
                     ) -> tuple[Deployer, Registry, dict[str, Agent]]:
    """two_stages(), and its agents by id."""
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: 100.0, codec_policy=codec_policy)
    agents = {f"a{i + 1}": on(Agent(f"a{i + 1}", 8), *box) for i, box in enumerate(boxes)}
    connect_all(deployer, list(agents.values()))
    deployer.plans.add_model("m", str(model_dir), num_stages=2)
    return deployer, registry, agents


def test_each_link_takes_its_codec_from_its_newest_measured_bandwidth(model_dir: Path) -> None:
    deployer, registry = two_stages(model_dir)
    plan = registry.active_plan("m")
    sender, receiver = (s.agent_id for s in plan.stages)
    first = deployer.routes.link_codecs(plan)
    assert first == ["", plan.prediction["stage_codecs"][0]]     # unmeasured: what the planner chose
    deployer.roster.links_reported(sender, [LinkMeasurement(receiver, 0.08, 2.5e5)])     # 2 Mbit/s: milliseconds a step
    assert deployer.routes.link_codecs(plan) == ["", "int8"]
    assert deployer.codec_links() == [("m", sender, receiver, "int8")]
    deployer.roster.links_reported(receiver, [LinkMeasurement(sender, 1e-4, 1e10)])      # the other way, but measured
    assert deployer.routes.link_codecs(plan) == ["", "int8"]                              # ... the sender's own counts
    deployer.roster.links_reported(sender, [LinkMeasurement(receiver, 1e-4, 1e10)])
    assert deployer.routes.link_codecs(plan) == ["", ""]                                  # a fast link: raw, exact


def test_a_link_narrows_only_once_a_second_reading_confirms_its_drop(model_dir: Path) -> None:
    """One slow reading between two boxes (a busy moment) leaves a LAN link raw and asks for another at once; a drop
    that the second reading confirms narrows it; a fast reading widens it at once."""
    deployer, registry, agents = two_stage_agents(model_dir)
    plan = registry.active_plan("m")
    sender, receiver = (s.agent_id for s in plan.stages)
    fast, slow = LinkMeasurement(receiver, 1e-4, 1e10), LinkMeasurement(receiver, 0.08, 2.5e5)
    deployer.roster.links_reported(sender, [fast])
    agent = agents[sender]
    agent.sent.clear()
    deployer.roster.links_reported(sender, [slow])
    assert deployer.routes.link_codecs(plan) == ["", ""]                  # not believed yet: still raw, exact
    assert probes(agent) == [[peer(agents[receiver])]]             # ... and measured again at once
    deployer.roster.links_reported(sender, [slow])
    assert deployer.routes.link_codecs(plan) == ["", "int8"]              # confirmed
    assert len(probes(agent)) == 1                                 # no drop from the reading before: no new probe
    deployer.roster.links_reported(sender, [fast])
    assert deployer.routes.link_codecs(plan) == ["", ""]                  # faster: believed at once
    deployer.roster.links_reported(sender, [replace(fast, bandwidth_bytes_per_s=0.6e10)])
    assert len(probes(agent)) == 1                                 # a drop to 60%: the next period's probe will do


def test_a_codec_policy_puts_one_codec_on_every_link(model_dir: Path) -> None:
    deployer, registry = two_stages(model_dir, codec_policy="float16")
    plan = registry.active_plan("m")
    deployer.roster.links_reported(plan.stages[0].agent_id, [LinkMeasurement(plan.stages[1].agent_id, 1e-4, 1e10)])
    assert deployer.routes.link_codecs(plan) == ["", "float16"]


@pytest.mark.parametrize("boxes, on_one_box", [
    ((("box", "127.0.0.1"), ("box", "127.0.0.1")), True),       # `stratamesh up`: every agent on loopback
    ((("box", "10.0.0.5"), ("box", "10.0.0.5")), True),         # two agents of one box on its LAN address
    ((("box", "10.0.0.1"), ("box", "10.0.0.2")), False),        # network namespaces of one box (the WAN test bed)
    ((("edge-1", "192.168.1.10"), ("edge-2", "192.168.1.10")), False),    # two sites' NAT'd boxes, one address
], ids=["loopback", "one-box-lan-address", "namespaces", "reused-private-address"])
def test_a_link_between_two_agents_of_one_box_stays_raw_however_slow_its_probe(
        model_dir: Path, boxes: tuple[tuple[str, str], tuple[str, str]], on_one_box: bool) -> None:
    """A loopback probe measures how busy the box is: it must not make the mesh lossy (and its output another)."""
    deployer, registry = two_stages(model_dir, boxes=boxes)
    plan = registry.active_plan("m")
    sender, receiver = (s.agent_id for s in plan.stages)
    deployer.roster.links_reported(sender, [LinkMeasurement(receiver, 0.014, 5e4)])     # 50 KB/s: int8 anywhere else
    assert deployer.routes.link_codecs(plan) == ["", "" if on_one_box else "int8"]
    forced, registry = two_stages(model_dir, codec_policy="float16", boxes=boxes)
    assert forced.routes.link_codecs(registry.active_plan("m")) == ["", "float16"]      # a policy still applies to every link


def test_a_link_that_changes_codec_is_logged_once_per_change(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    deployer, registry = two_stages(model_dir)
    plan = registry.active_plan("m")
    sender, receiver = (s.agent_id for s in plan.stages)
    caplog.set_level(logging.INFO, logger="stratamesh.coordinator.control.routes")

    def changes() -> list[str]:
        deployer.routes.link_codecs(plan)
        deployer.routes.link_codecs(plan)       # asked again, unchanged: not logged again
        said = [r.getMessage() for r in caplog.records if "carries" in r.getMessage()]
        caplog.clear()
        return said

    assert changes() == []                                                        # raw, as planned
    deployer.roster.links_reported(sender, [LinkMeasurement(receiver, 0.08, 2.5e5)])
    assert changes() == [f"the link {sender} -> {receiver} into stage 1 of m carries int8 now (was raw; its measured "
                         f"bandwidth: 0.25 MB/s)"]
    deployer.roster.links_reported(sender, [LinkMeasurement(receiver, 1e-4, 1e10)])
    assert changes() == [f"the link {sender} -> {receiver} into stage 1 of m carries raw now (was int8; its measured "
                         f"bandwidth: 10000 MB/s)"]
