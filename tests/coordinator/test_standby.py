"""A standby's view of the mesh (coordinator/standby.py): the agents of live plans as the leader wrote them, which of
their stages serve, their telemetry and links; and routes over it."""

from __future__ import annotations

import pytest

from stratamesh.coordinator.control.roster import AgentNotConnected
from stratamesh.coordinator.records import StageRecord
from stratamesh.coordinator.registry import Registry
from stratamesh.coordinator.standby import Standby
from stratamesh.fleet.boxes import Capabilities, StageLoad, Telemetry
from stratamesh.fleet.control_messages import LinkMeasurement
from stratamesh.fleet.stages import StageSpec

T0 = 1_700_000_000.0


def _leader_wrote(registry: Registry) -> None:
    """Three agents on two boxes (a1 and a2 share one), a 2-stage plan on a1 and a2, a3 a spare; a1's stage ready."""
    for agent_id, host, address in (("a1", "box1", "10.0.0.1:7001"), ("a2", "box1", "10.0.0.1:7002"),
                                    ("a3", "box2", "10.0.0.2:7001")):
        registry.upsert_agent(agent_id, agent_id, address, Capabilities(host, "cpu", 8, 16 << 30, 12 << 30), T0)
        registry.set_agent_state(agent_id, "connected", T0)
    registry.add_model("m", "/models/m", 8, {}, T0)
    registry.save_plan("p1", "m", [StageRecord(f"p1-{i}", i, f"a{i + 1}", StageSpec("m", "/models/m", 4 * i,
                                                                                    4 * i + 4, 8)) for i in (0, 1)],
                       "two", T0)
    registry.set_stage_state("p1-0", "ready")
    registry.record_heartbeats({}, [("a1", Telemetry(T0, queue_depth=3, stages=(StageLoad("p1-0", 2, 1, 0, 64),)),
                                     T0)])
    registry.record_links("a1", [LinkMeasurement("a3", 0.002, 5e7)], T0)


def test_a_standby_sees_what_the_leader_wrote_and_routes_once_every_stage_serves() -> None:
    registry = Registry(":memory:")
    _leader_wrote(registry)
    standby = Standby(registry, agent_lease_s=2.0)
    standby.roster.refresh()
    roster = standby.roster
    assert roster.num_agents == 2, "only the agents of live plans are read (a3 is a spare)"
    assert (roster.stage_address("a1"), roster.same_box("a1", "a2"), roster.bandwidth("a3", "a1")) == (
        "10.0.0.1:7001", True, 5e7)       # (a link measured one way counts both ways, as the leader's roster has it)
    assert roster.telemetry["a1"].queue_depth == 3 and "a2" not in roster.telemetry
    with pytest.raises(AgentNotConnected):
        roster.stage_address("a3")
    assert not standby.routes.is_ready("m")         # a2 has not loaded its stage yet
    registry.set_stage_state("p1-1", "ready")
    assert standby.routes.is_ready("m")             # (stages are read with the plans, at each route)
    (plan, hops), = standby.routes.hops(standby.routes.ready_plans("m"))
    assert [h.address for h in hops] == ["10.0.0.1:7001", "10.0.0.1:7002"] and plan.plan_id == "p1"
    registry.set_agent_state("a2", "dead", T0 + 9)  # the leader declared it dead
    standby.roster.refresh()
    assert not standby.routes.is_ready("m") and roster.num_agents == 1
