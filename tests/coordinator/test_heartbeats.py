"""Heartbeats cost memory, not transactions: the registry gets them in one commit per flush, and telemetry history
at most once per TELEMETRY_RECORD_EVERY_S per agent, while the newest telemetry is always at hand."""

from __future__ import annotations

from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.control.roster import TELEMETRY_RECORD_EVERY_S
from stratamesh.coordinator.fleet_view import AgentQuery
from stratamesh.coordinator.mesh_admin import MeshAdmin
from stratamesh.coordinator.registry import Registry
from stratamesh.fleet.boxes import Telemetry
from tests.coordinator.test_deployer import Agent, connect_all


def test_a_thousand_heartbeats_are_one_commit_with_each_agents_newest() -> None:
    registry, now = Registry(":memory:"), [100.0]      # the clock, as test_deployer keeps it
    deployer = Deployer(registry, clock=lambda: now[0])
    agents = [Agent(f"a{i}", 1) for i in range(4)]
    connect_all(deployer, agents)
    deployer.tick()                 # what a tick writes besides heartbeats (a first prune) is behind us
    commits = registry.commits
    for beat in range(250):
        now[0] = 100.0 + beat * 0.01
        for agent in agents:
            deployer.heartbeat(agent.link.agent_id, Telemetry(now[0], queue_depth=beat))
    assert registry.commits == commits             # nothing written yet: all in memory
    assert deployer.roster.telemetry["a1"].queue_depth == 249
    deployer.tick()
    assert registry.commits == commits + 1
    assert {a.agent_id: a.last_seen for a in registry.agents()} == {f"a{i}": 102.49 for i in range(4)}
    # history: one row per period, the newest telemetry the flush found
    assert [(ts, t.queue_depth) for ts, t in registry.telemetry("a1")] == [(102.49, 249)]


async def test_telemetry_history_gets_a_row_per_period_and_the_admin_view_the_newest() -> None:
    registry, now = Registry(":memory:"), [100.0]      # the clock, as test_deployer keeps it
    deployer = Deployer(registry, clock=lambda: now[0])
    agent = Agent("a1", 1)
    connect_all(deployer, [agent])
    admin = MeshAdmin(registry, None, {}, None, deployer, clock=lambda: now[0])
    for step in range(int(3 * TELEMETRY_RECORD_EVERY_S)):
        now[0] = 100.0 + step
        deployer.heartbeat("a1", Telemetry(now[0], queue_depth=step))
        deployer.tick()
    history = [ts for ts, _ in registry.telemetry("a1")]
    assert history == [100.0 + TELEMETRY_RECORD_EVERY_S * k for k in range(3)]
    (view,) = (await admin.agents_page(AgentQuery(limit=10)))["agents"]
    assert view["telemetry"]["queue_depth"] == int(3 * TELEMETRY_RECORD_EVERY_S) - 1
    assert view["telemetry"]["received"] == now[0]
