"""A model served by several replicas: each a pipeline on agents of its own, planned as the fleet allows, and
re-planned alone when one of its agents dies (the router that picks among them: test_router.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.liveness import LivenessConfig
from stratamesh.coordinator.registry import Registry
from stratamesh.fleet.errors import InvalidInput
from tests.coordinator.test_deployer import (Agent, OriginSessions, connect_all, heartbeats, model_dir,  # noqa: F401
                                            report_ready, route_of)


def two_replicas(model_dir: Path) -> tuple[Registry, Deployer, list[Agent]]:
    """Model m in two replicas of two stages on four agents, planned (not yet loaded)."""
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: 100.0)
    agents = [Agent(f"a{i}", 8) for i in range(1, 5)]
    deployer.plans.add_model("m", str(model_dir), num_stages=2, num_replicas=2)
    connect_all(deployer, agents)
    return registry, deployer, agents


def test_replicas_are_planned_on_agents_of_their_own_as_the_fleet_grows(model_dir: Path) -> None:
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: 100.0)
    agents = [Agent(f"a{i}", 8) for i in range(1, 6)]
    deployer.plans.add_model("m", str(model_dir), num_stages=2, num_replicas=2)
    connect_all(deployer, agents[:3])                  # room for one replica, and a spare
    assert registry.active_plan("m") is not None and registry.active_plan("m", 1) is None
    connect_all(deployer, agents[3:4])                 # now the agents the first leaves hold a second
    first, second = registry.active_plans("m")
    assert (first.replica, second.replica) == (0, 1) and len(second.stages) == 2
    assert not {s.agent_id for s in first.stages} & {s.agent_id for s in second.stages}
    assert second.reason.startswith("replica 1: ")
    connect_all(deployer, agents[4:])                  # a third is not asked for
    assert len(registry.active_plans("m")) == 2
    report_ready(deployer, agents)
    assert len(deployer.routes.ready_plans("m")) == 2


def test_a_dead_agent_re_plans_its_replica_alone_while_the_other_serves(model_dir: Path) -> None:
    now, lost = [100.0], []
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: now[0], liveness=LivenessConfig(lease_s=2.0),
                        sessions=OriginSessions(lost=lost))
    agents = {f"a{i}": Agent(f"a{i}", 8) for i in range(1, 6)}
    deployer.plans.add_model("m", str(model_dir), num_stages=2, num_replicas=2)
    connect_all(deployer, list(agents.values()))
    report_ready(deployer, list(agents.values()))
    first, second = registry.active_plans("m")
    spare = (set(agents) - {s.agent_id for p in (first, second) for s in p.stages}).pop()
    victim = second.stages[0].agent_id
    deployer.agent_disconnected(agents[victim].link)
    now[0] += 1.0
    heartbeats(deployer, [agent for agent_id, agent in agents.items() if agent_id != victim])
    now[0] += 1.1                                        # its lease runs out, the others' do not
    deployer.check_liveness()
    assert lost == [agents[victim].link.stage_address]
    assert registry.active_plan("m").plan_id == first.plan_id          # the first replica is untouched
    replanned = registry.active_plan("m", 1)
    assert replanned.plan_id != second.plan_id and spare in {s.agent_id for s in replanned.stages}
    assert victim not in {s.agent_id for s in replanned.stages}
    assert {s.agent_id for s in first.stages}.isdisjoint(s.agent_id for s in replanned.stages)
    assert deployer.routes.is_ready("m") and len(deployer.routes.ready_plans("m")) == 1     # the first serves meanwhile
    route = route_of(deployer, "m")[0]
    assert [hop.assignment_id for hop in route] == [s.assignment_id for s in first.stages]


def test_asking_for_fewer_replicas_retires_the_others(model_dir: Path) -> None:
    registry, deployer, agents = two_replicas(model_dir)
    report_ready(deployer, agents)
    second = registry.active_plan("m", 1)
    deployer.plans.add_model("m", str(model_dir), num_stages=2, num_replicas=1)
    assert [p.replica for p in registry.active_plans("m")] == [0]
    released = {m.assignment_id for a in agents for m in a.sent if type(m).__name__ == "Release"}
    assert released == {s.assignment_id for s in second.stages}
    with pytest.raises(InvalidInput, match="num_replicas"):
        deployer.plans.add_model("m", str(model_dir), num_stages=2, num_replicas=0)
