"""A model served by several replicas: each a pipeline on agents of its own, planned as the fleet allows, and
re-planned alone when one of its agents dies (the router that picks among them: test_router.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.liveness import LivenessConfig
from stratamesh.coordinator.records import Autoscale
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


def test_an_autoscaled_model_gives_back_a_replica_whose_stages_finish_their_generations_first(
        model_dir: Path) -> None:
    registry = Registry(":memory:")
    in_use: set[str] = set()
    deployer = Deployer(registry, clock=lambda: 100.0, sessions=OriginSessions(in_use=in_use))
    agents = [Agent(f"a{i}", 8) for i in range(1, 7)]
    deployer.plans.add_model("m", str(model_dir), num_stages=2, autoscale=Autoscale(1, 3))
    connect_all(deployer, agents)
    assert len(registry.active_plans("m")) == 1              # it starts at its minimum
    deployer.plans.scale("m", 3)
    report_ready(deployer, agents)
    plans = registry.active_plans("m")
    assert [p.replica for p in plans] == [0, 1, 2] and len(deployer.routes.ready_plans("m")) == 3
    middle, last = plans[1], plans[2]
    in_use.add(middle.stages[0].assignment_id)               # a generation still runs on the middle one
    given_back = deployer.plans.scale("m", 2, give_back=[1])
    assert given_back == [s.assignment_id for s in middle.stages]
    assert [(p.replica, p.plan_id) for p in registry.active_plans("m")] == [(0, plans[0].plan_id), (1, last.plan_id)]
    assert registry.model("m").num_replicas == 2
    released = {m.assignment_id for a in agents for m in a.sent if type(m).__name__ == "Release"}
    assert released == {middle.stages[1].assignment_id}       # the stage in use stays until its generation ends
    in_use.clear()
    deployer.tick()
    released = {m.assignment_id for a in agents for m in a.sent if type(m).__name__ == "Release"}
    assert released == {s.assignment_id for s in middle.stages}
    with pytest.raises(InvalidInput, match="autoscaling bounds"):
        deployer.plans.scale("m", 4)


def test_an_autoscaled_model_scales_to_zero_and_back_with_a_first_plan(model_dir: Path) -> None:
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: 100.0)
    agents = [Agent(f"a{i}", 8) for i in range(1, 3)]
    deployer.plans.add_model("m", str(model_dir), num_stages=2, autoscale=Autoscale(0, 1))
    connect_all(deployer, agents)
    report_ready(deployer, agents)
    assert deployer.routes.is_ready("m") and not deployer.routes.cold("m")
    deployer.plans.scale("m", 0)
    assert registry.active_plans("m") == [] and deployer.plans.scaled_to_zero("m")
    assert deployer.plans.num_stages("m") == 2                   # what its plans were asked for, still
    assert deployer.routes.cold("m") and deployer.routes.accepts("m")     # a request waits for a cold start
    deployer.tick()
    assert registry.active_plans("m") == []                  # nothing plans a model scaled to zero
    deployer.plans.scale("m", 1)
    plan = registry.active_plan("m")
    assert plan is not None and len(plan.stages) == 2 and not deployer.plans.scaled_to_zero("m")
    report_ready(deployer, agents)
    assert deployer.routes.is_ready("m") and not deployer.routes.cold("m")


def test_an_agent_id_that_comes_back_as_another_box_replaces_its_old_record(model_dir: Path) -> None:
    """A stale identity (an id that reconnects with other capabilities: a reinstalled box, a disk moved to new
    hardware) replaces what the registry and the roster knew of it; nothing of the old box lingers."""
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: 100.0)
    old = Agent("a1", 8)
    deployer.agent_connected(old.link, old.registration())
    deployer.agent_disconnected(old.link)
    new = Agent("a1", 32)
    new.caps = replace(new.caps, hostname="box-a1-reinstalled", num_cpus=16)
    new.link = replace(new.link, stage_address="127.0.0.1:6001", capabilities=new.caps)
    deployer.agent_connected(new.link, new.registration())
    (record,) = [a for a in registry.agents() if a.agent_id == "a1"]
    assert record.capabilities == new.caps and record.address == "127.0.0.1:6001"
    assert deployer.plans.plannable()["a1"] == new.caps
    assert deployer.roster.stage_address("a1") == "127.0.0.1:6001"
    # its old stream, still open when the new one came, ending later leaves the new one connected
    deployer.agent_connected(old.link, old.registration())
    deployer.agent_connected(new.link, new.registration())
    deployer.agent_disconnected(old.link)
    assert deployer.roster.is_connected("a1") and deployer.plans.plannable()["a1"] == new.caps


def test_every_stage_of_a_plan_serves_its_models_revision_and_a_changed_folder_loads_beside(
        model_dir: Path) -> None:
    registry, deployer, agents = two_replicas(model_dir)
    report_ready(deployer, agents)
    revision = registry.model("m").revision
    assert len(revision) == 12
    assert {s.spec.revision for p in registry.active_plans("m") for s in p.stages} == {revision}
    assert deployer.plans.replan("m")[0] == "unchanged"
    (model_dir / "model.safetensors").write_bytes(b"new weights")          # the same folder, changed
    deployer.plans.add_model("m", str(model_dir), num_stages=2, num_replicas=2)
    changed = registry.model("m").revision
    assert changed != revision
    assert deployer.plans.replan("m")[0] == "standby"                       # the new revision loads beside the old
    standbys = [registry.standby_plan("m", r) for r in (0, 1)]
    assert all(p is not None and {s.spec.revision for s in p.stages} == {changed} for p in standbys)
