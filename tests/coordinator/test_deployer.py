"""The placement driver with a real (in-memory) registry and agents reduced to message lists."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.control.plans import JOINS_SETTLE_MAX_S, JOINS_SETTLE_S
from stratamesh.coordinator.control.probes import AgentLink
from stratamesh.coordinator.control.roster import AgentNotConnected
from stratamesh.coordinator.control.sessions import NoSessions, Sessions
from stratamesh.coordinator.liveness import LivenessConfig
from stratamesh.coordinator.placement import DEFAULT_SERVING_CPU_PER_TOKEN_S, SitePins
from stratamesh.coordinator.registry import Registry
from stratamesh.coordinator.registry_store import RegistryStore
from stratamesh.coordinator.serving.origin import Origin
from stratamesh.coordinator.serving.records import RequestLog
from stratamesh.coordinator.serving.router import Router
from stratamesh.coordinator.serving.sessions import SessionTable
from stratamesh.fleet.sessions import Hop
from stratamesh.fleet.errors import CheckpointError, ModelNotFound, ModelNotReady, PlacementError
from stratamesh.fleet.boxes import Capabilities, Registration, Speed, Telemetry
from stratamesh.fleet.control_messages import ControlMessage, LinkMeasurement, Release, Shutdown
from stratamesh.fleet.stages import Assignment, StageStatus

GiB = 1 << 30


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    config = {"model_type": "llama", "num_hidden_layers": 6, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


class Agent:
    def __init__(self, agent_id: str, mem_gib: int):
        self.sent: list[ControlMessage] = []
        self.caps = Capabilities(f"box-{agent_id}", "cpu", 2, mem_gib * GiB, mem_gib * GiB,
                                 speeds=(Speed("torch-cpu", "float32", mem_gib * 1e10, mem_gib * 1e9),))
        self.link = AgentLink(agent_id, f"127.0.0.1:{5000 + int(agent_id[-1])}", self.caps, self.sent.append)

    def registration(self, held: tuple[Assignment, ...] = ()) -> Registration:
        return Registration(self.link.agent_id, self.link.agent_id, self.link.stage_address, self.caps, held)

    def assignments(self) -> list[Assignment]:
        return [Assignment(m.assignment_id, None) for m in self.sent if isinstance(m, Assignment)]


@dataclass
class OriginSessions:
    """The origin's sessions as the deployer sees them: the addresses it was told are lost, the stages in use."""

    lost: list[str] = field(default_factory=list)
    in_use: set[str] = field(default_factory=set)

    def route_lost(self, address: str) -> None:
        self.lost.append(address)

    def assignments_in_use(self) -> set[str]:
        return self.in_use

    def move_off(self, address: str) -> int:
        return 0

    def sessions_through(self, address: str) -> int:
        return 0


def route_of(deployer: Deployer, model_id: str = "m", avoid: frozenset[str] = frozenset()) -> tuple[list[Hop], int]:
    """The router's pick (the first ready replica in turn) and its block size."""
    return Router(deployer.routes).route(model_id, avoid)


def connect_all(deployer: Deployer, agents: list[Agent]) -> None:
    for agent in agents:
        deployer.agent_connected(agent.link, agent.registration())


def report_ready(deployer: Deployer, agents: list[Agent]) -> None:
    for agent in agents:
        for assignment in agent.assignments():
            deployer.stage_status(agent.link.agent_id, StageStatus(assignment.assignment_id, "ready"))


def test_plans_once_enough_agents_join_then_serves_a_route(model_dir: Path) -> None:
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: 100.0)
    agents = [Agent("a1", 8), Agent("a2", 8), Agent("a3", 16)]
    deployer.plans.add_model("m", str(model_dir), num_stages=3)
    connect_all(deployer, agents[:2])
    assert registry.active_plan("m") is None
    connect_all(deployer, agents[2:])
    plan = registry.active_plan("m")
    spans = {s.agent_id: (s.spec.start_layer, s.spec.end_layer) for s in plan.stages}
    sizes = {agent: end - start for agent, (start, end) in spans.items()}
    assert sizes["a3"] >= 3 and sizes["a3"] > max(sizes["a1"], sizes["a2"])   # twice as fast: the most layers
    assert sorted(spans.values())[0][0] == 0 and sorted(spans.values())[-1][1] == 6
    assert all(a[1] == b[0] for a, b in zip(sorted(spans.values()), sorted(spans.values())[1:]))
    with pytest.raises(ModelNotReady):
        route_of(deployer, "m")
    report_ready(deployer, agents)
    route, block_size = route_of(deployer, "m")
    assert block_size == 16
    assert [hop.assignment_id for hop in route] == [s.assignment_id for s in plan.stages]
    assert deployer.routes.is_ready("m")
    with pytest.raises(ModelNotFound):
        route_of(deployer, "other")


def test_a_lost_agent_makes_the_model_unready_and_is_readopted_with_its_stage(model_dir: Path) -> None:
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: 100.0)
    agents = [Agent("a1", 8), Agent("a2", 8)]
    deployer.plans.add_model("m", str(model_dir), num_stages=2)
    connect_all(deployer, agents)
    report_ready(deployer, agents)
    held = registry.active_plan("m").stages[1]
    second = next(a for a in agents if a.link.agent_id == held.agent_id)
    deployer.agent_disconnected(second.link)
    assert not deployer.routes.is_ready("m")
    second.sent.clear()
    deployer.agent_connected(second.link, second.registration((Assignment(held.assignment_id, held.spec),)))
    assert deployer.routes.is_ready("m")
    assert second.assignments() == []     # adopted as it is: no reload


def test_a_restarted_coordinator_adopts_held_stages_and_releases_unknown_ones(model_dir: Path) -> None:
    registry = Registry(":memory:")
    agents = [Agent("a1", 8), Agent("a2", 8)]
    first = Deployer(registry, clock=lambda: 1.0)
    first.plans.add_model("m", str(model_dir), num_stages=2)
    connect_all(first, agents)
    stages = registry.active_plan("m").stages
    restarted = Deployer(registry, clock=lambda: 2.0)
    restarted.start()
    for agent in agents:
        agent.sent.clear()
        held = tuple(Assignment(s.assignment_id, s.spec) for s in stages if s.agent_id == agent.link.agent_id)
        stale = (Assignment("old-0", stages[0].spec),)
        restarted.agent_connected(agent.link, agent.registration(held + stale))
        assert [m.assignment_id for m in agent.sent if isinstance(m, Release)] == ["old-0"]
    assert restarted.routes.is_ready("m")


def test_a_model_still_waiting_for_agents_is_planned_after_a_restart_with_the_stages_it_asked_for(
        model_dir: Path, tmp_path: Path) -> None:
    registry = Registry(str(tmp_path / "registry.db"))
    first = Deployer(registry, clock=lambda: 1.0)
    first.plans.add_model("m", str(model_dir), num_stages=3)
    connect_all(first, [Agent("a1", 8)])                # too few for 3 stages: it waits
    assert registry.active_plan("m") is None
    registry.close()
    registry = Registry(str(tmp_path / "registry.db"))
    restarted = Deployer(registry, clock=lambda: 2.0)
    restarted.start()
    assert restarted.plans.num_stages("m") == 3
    connect_all(restarted, [Agent(f"a{i}", 8) for i in range(1, 4)])
    assert len(registry.active_plan("m").stages) == 3


def test_a_model_folder_without_a_usable_config_is_refused(tmp_path: Path) -> None:
    deployer = Deployer(Registry(":memory:"), clock=lambda: 0.0)
    with pytest.raises(CheckpointError, match="config.json"):
        deployer.plans.add_model("m", str(tmp_path), 1)
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 0, "hidden_size": 8,
                                                      "max_position_embeddings": 8}))
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        deployer.plans.add_model("m", str(tmp_path), 1)


def ready_pair(model_dir: Path, now: list[float], sessions: Sessions = NoSessions(),
               registry: RegistryStore | None = None) -> tuple[RegistryStore, Deployer, list[Agent]]:
    """A 2-stage model served by a1 and a2, with a3 connected as a spare; the clock reads now[0]; the registry is
    an SQLite one in memory unless given."""
    registry = registry if registry is not None else Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: now[0], liveness=LivenessConfig(lease_s=2.0), sessions=sessions)
    agents = [Agent("a1", 8), Agent("a2", 8)]
    deployer.plans.add_model("m", str(model_dir), num_stages=2)
    connect_all(deployer, agents)
    report_ready(deployer, agents)
    spare = Agent("a3", 8)
    connect_all(deployer, [spare])
    return registry, deployer, [*agents, spare]


def heartbeats(deployer: Deployer, agents: list[Agent]) -> None:
    for agent in agents:
        deployer.heartbeat(agent.link.agent_id)


def released(agent: Agent) -> list[str]:
    return [m.assignment_id for m in agent.sent if isinstance(m, Release)]


def test_a_disconnected_agent_is_declared_dead_when_its_lease_runs_out_and_its_stages_move(model_dir: Path) -> None:
    now, dead = [100.0], []
    registry, deployer, (a1, a2, a3) = ready_pair(model_dir, now, OriginSessions(lost=dead))
    first_plan = registry.active_plan("m").plan_id
    deployer.agent_disconnected(a2.link)          # a dropped stream alone may be a blip: wait for the lease
    now[0] += 1.9
    heartbeats(deployer, [a1, a3])
    deployer.check_liveness()
    assert registry.active_plan("m").plan_id == first_plan and dead == []
    a1.sent.clear()
    now[0] += 0.2
    deployer.check_liveness()
    plan = registry.active_plan("m")
    assert plan.plan_id != first_plan and {s.agent_id for s in plan.stages} == {"a1", "a3"}
    assert dead == [a2.link.stage_address] and registry.agent("a2").state == "dead"
    assert released(a1) and all(r.startswith(first_plan) for r in released(a1))
    report_ready(deployer, [a1, a3])
    assert deployer.routes.is_ready("m")


def test_a_lost_stream_and_an_unreachable_stage_together_are_death_at_once(model_dir: Path) -> None:
    now = [100.0]
    registry, deployer, (a1, a2, a3) = ready_pair(model_dir, now)
    first_plan = registry.active_plan("m").plan_id
    deployer.report_unreachable(a1.link.stage_address)      # the data plane alone: maybe just a link
    assert not deployer.roster.liveness.is_dead("a1")
    deployer.heartbeat("a1")                                 # ... and it is still heard: suspicion dropped
    deployer.agent_disconnected(a1.link)
    assert not deployer.roster.liveness.is_dead("a1")
    deployer.report_unreachable(a1.link.stage_address)      # both signs, no clock advance: dead now
    assert deployer.roster.liveness.is_dead("a1")
    assert {s.agent_id for s in registry.active_plan("m").stages} == {"a2", "a3"}
    assert registry.active_plan("m").plan_id != first_plan


def test_a_hung_agent_with_an_open_stream_is_cut_off_after_its_lease(model_dir: Path) -> None:
    now = [100.0]
    registry, deployer, (a1, a2, a3) = ready_pair(model_dir, now)
    closed: list[str] = []
    a2.link.close = lambda: closed.append("a2")
    for _ in range(4):
        now[0] += 0.6
        heartbeats(deployer, [a1, a3])
        deployer.check_liveness()
    assert closed == ["a2"] and deployer.roster.liveness.is_dead("a2") and not deployer.roster.liveness.is_dead("a1")
    deployer.heartbeat("a2")            # the stream it had is being closed: its heartbeats no longer count
    assert deployer.roster.liveness.is_dead("a2")
    assert "a2" not in {s.agent_id for s in registry.active_plan("m").stages}


def test_a_model_that_cannot_be_replaced_keeps_its_plan_until_an_agent_joins(model_dir: Path) -> None:
    now = [100.0]
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: now[0])
    a1, a2 = Agent("a1", 8), Agent("a2", 8)
    deployer.plans.add_model("m", str(model_dir), num_stages=2)
    connect_all(deployer, [a1, a2])
    first_plan = registry.active_plan("m").plan_id
    deployer.agent_disconnected(a2.link)
    now[0] += 3
    heartbeats(deployer, [a1])
    deployer.check_liveness()
    deployer.tick()
    assert registry.active_plan("m").plan_id == first_plan      # one agent cannot hold two stages
    a4 = Agent("a4", 8)
    connect_all(deployer, [a4])
    deployer.tick()
    assert {s.agent_id for s in registry.active_plan("m").stages} == {"a1", "a4"}


async def test_the_origin_waits_for_a_route_through_a_recovery_and_avoids_a_lost_address(model_dir: Path) -> None:
    now = [100.0]
    registry, deployer, (a1, a2, a3) = ready_pair(model_dir, now)
    old_route, _ = route_of(deployer, "m")
    lost = a2.link.stage_address
    origin = Origin("127.0.0.1:9", deployer, Router(deployer.routes), SessionTable(), RequestLog(), route_wait_s=5.0)
    waiting = asyncio.create_task(origin.route("m", avoid={lost}, token_ids=()))
    await asyncio.sleep(0.05)
    assert not waiting.done()            # the route still runs through the lost address
    deployer.agent_disconnected(a2.link)
    deployer.report_unreachable(lost)
    await asyncio.sleep(0.05)
    assert not waiting.done() and deployer.routes.accepts("m") and not deployer.routes.is_ready("m")
    report_ready(deployer, [a1, a3])
    route, _ = await asyncio.wait_for(waiting, 1.0)
    assert lost not in {hop.address for hop in route} and route != old_route
    deployer.agent_disconnected(a3.link)
    origin = Origin("127.0.0.1:9", deployer, Router(deployer.routes), SessionTable(), RequestLog(), route_wait_s=0.1)
    with pytest.raises(ModelNotReady):
        await origin.route("m", avoid=(), token_ids=())


def test_health_names_the_stages_agents_could_not_load_until_they_load_or_leave_the_plan(model_dir: Path) -> None:
    now = [100.0]
    registry, deployer, (a1, a2, a3) = ready_pair(model_dir, now)
    origin = Origin("127.0.0.1:9", deployer, Router(deployer.routes), SessionTable(), RequestLog())
    assert "load_errors" not in origin.health()
    first, second = registry.active_plan("m").stages
    deployer.stage_status(second.agent_id, StageStatus(second.assignment_id, "failed", "out of memory"))
    assert origin.health()["load_errors"] == [{"model_id": "m", "assignment_id": second.assignment_id,
                                               "agent_id": second.agent_id, "error": "out of memory", "at": 100.0}]
    deployer.stage_status(first.agent_id, StageStatus(first.assignment_id, "failed", "not on my plan"))
    deployer.stage_status(first.agent_id, StageStatus(first.assignment_id, "ready"))      # it loaded after all
    assert [e["error"] for e in origin.health()["load_errors"]] == ["out of memory"]
    deployer.load_errors.keep(set())           # the stage left every plan (what tick() does for the re-planned)
    assert "load_errors" not in origin.health()


def test_a_faster_agent_joining_gets_a_standby_plan_that_takes_over_without_cutting_generations(
        model_dir: Path) -> None:
    registry, in_use, now = Registry(":memory:"), set(), [100.0]
    deployer = Deployer(registry, clock=lambda: now[0], sessions=OriginSessions(in_use=in_use))
    a1, a2 = Agent("a1", 8), Agent("a2", 8)
    deployer.plans.add_model("m", str(model_dir), num_stages=2)
    connect_all(deployer, [a1, a2])
    report_ready(deployer, [a1, a2])
    old_route, _ = route_of(deployer, "m")
    in_use.update(hop.assignment_id for hop in old_route)        # a generation runs on the old route
    fast = Agent("a3", 64)                                        # eight times the speed of the others
    connect_all(deployer, [fast])
    deployer.tick()
    assert registry.standby_plan("m") is None                     # weighed once the joins settle
    now[0] += JOINS_SETTLE_S
    deployer.tick()
    standby = registry.standby_plan("m")
    assert standby is not None and "a3" in {s.agent_id for s in standby.stages}
    assert route_of(deployer, "m")[0] == old_route                    # the old plan serves while the new one loads
    report_ready(deployer, [a1, a2, fast])
    assert registry.active_plan("m").plan_id == standby.plan_id and registry.standby_plan("m") is None
    new_route, _ = route_of(deployer, "m")
    assert new_route != old_route
    assert released(a1) + released(a2) == []                     # still in use: not cut
    in_use.clear()
    deployer.tick()
    assert sorted(released(a1) + released(a2)) == sorted(hop.assignment_id for hop in old_route)


def test_an_agent_joining_that_would_not_clearly_help_leaves_the_plan_alone(model_dir: Path) -> None:
    now = [100.0]
    registry, deployer, (a1, a2, twin) = ready_pair(model_dir, now)      # twin: a3, as fast as the others
    plan = registry.active_plan("m").plan_id
    deployer.tick()
    assert registry.standby_plan("m") is None and registry.active_plan("m").plan_id == plan
    assert twin.assignments() == []


def test_after_a_death_the_survivors_keep_their_layers_and_a_spare_takes_the_lost_ones(model_dir: Path) -> None:
    now = [100.0]
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: now[0])
    agents = [Agent(f"a{i}", 8) for i in range(1, 5)]
    deployer.plans.add_model("m", str(model_dir), num_stages=3)
    connect_all(deployer, agents)
    report_ready(deployer, agents)
    before = {s.agent_id: (s.spec.start_layer, s.spec.end_layer) for s in registry.active_plan("m").stages}
    (spare,) = [a for a in agents if a.link.agent_id not in before]
    victim = next(a for a in agents if a.link.agent_id in before and before[a.link.agent_id][0] > 0)
    deployer.agent_disconnected(victim.link)
    deployer.report_unreachable(victim.link.stage_address)
    after = {s.agent_id: (s.spec.start_layer, s.spec.end_layer) for s in registry.active_plan("m").stages}
    assert after == {**{a: r for a, r in before.items() if a != victim.link.agent_id},
                     spare.link.agent_id: before[victim.link.agent_id]}


def shutdowns(agent: Agent) -> list[str]:
    return [m.reason for m in agent.sent if isinstance(m, Shutdown)]


def test_a_drain_loads_the_stage_on_the_spare_switches_once_ready_and_lets_the_agent_go(model_dir: Path) -> None:
    now, in_use = [100.0], set()
    registry, deployer, (a1, a2, spare) = ready_pair(model_dir, now, OriginSessions(in_use=in_use))
    plan = registry.active_plan("m")
    old_route, _ = route_of(deployer, "m")
    drained = next(s for s in plan.stages if s.agent_id == "a2")
    kept = next(s for s in plan.stages if s.agent_id != "a2")
    in_use.add(drained.assignment_id)                       # a generation runs through it
    ((old, new),) = deployer.drain("a2")
    assert (old.assignment_id, new.agent_id, new.spec) == (drained.assignment_id, "a3", drained.spec)
    assert [a.assignment_id for a in spare.assignments()] == [new.assignment_id]
    assert route_of(deployer, "m")[0] == old_route              # the drained stage serves until its replacement loads
    assert [(o.assignment_id, n.assignment_id, n.state) for o, n in deployer.drains.replacing("a2")] == [
        (old.assignment_id, new.assignment_id, "loading")]
    report_ready(deployer, [spare])
    assert deployer.drains.replacing("a2") == []
    i = drained.stage_index
    route, _ = route_of(deployer, "m")
    assert route[1 - i] == old_route[1 - i] and route[i].assignment_id == new.assignment_id
    assert {s.assignment_id for s in registry.active_plan("m").stages} == {kept.assignment_id, new.assignment_id}
    deployer.tick()
    assert released(a2) == [] and shutdowns(a2) == []      # still in use: not cut
    deployer.finish_drain("a2")
    assert released(a2) == [drained.assignment_id] and len(shutdowns(a2)) == 1
    deployer.agent_disconnected(a2.link)                    # it exits, as told
    now[0] += 60
    heartbeats(deployer, [a1, spare])
    deployer.check_liveness()
    assert registry.agent("a2").state == "drained"          # not dead: nothing is re-planned, nobody banned
    assert [e.kind for e in registry.events(20) if e.agent_id == "a2"][0] == "agent_drained"
    deployer.agent_connected(a2.link, a2.registration())    # started again later: an ordinary agent
    assert "a2" in deployer.plans.plannable()


def test_a_drained_agent_is_planned_on_no_more_and_a_drain_without_a_spare_is_refused(model_dir: Path) -> None:
    now = [100.0]
    registry, deployer, (a1, a2, spare) = ready_pair(model_dir, now)
    deployer.drain("a2")
    assert "a2" not in deployer.plans.plannable()
    with pytest.raises(PlacementError, match=r"no spare agent can take the stages \[0, 3\).* of m"):
        deployer.drain("a1")                                # a3 is taken by a2's stage, and a2 is leaving
    assert "a1" in deployer.plans.plannable()                   # a refused drain changes nothing
    with pytest.raises(AgentNotConnected):
        deployer.drain("nobody")
    deployer.cancel_drain("a2")
    assert "a2" in deployer.plans.plannable() and deployer.drains.replacing("a2") == []


def test_a_replacement_that_fails_to_load_fails_the_drain(model_dir: Path) -> None:
    now = [100.0]
    registry, deployer, (a1, a2, spare) = ready_pair(model_dir, now)
    ((old, new),) = deployer.drain("a1")
    deployer.stage_status("a3", StageStatus(new.assignment_id, "failed", "out of memory"))
    assert "out of memory" in deployer.drains.failures["a1"] and deployer.drains.replacing("a1") == []
    assert old.assignment_id in {s.assignment_id for s in registry.active_plan("m").stages}


def placed_on(agent: Agent, *, mem_gib: float, site: str, tier: str = "edge") -> Agent:
    """The agent with mem_gib of memory and mem_gib times a base speed, at a site."""
    agent.caps = replace(agent.caps, site=site, tier=tier, ram_total_bytes=int(mem_gib * GiB),
                         ram_available_bytes=int(mem_gib * GiB),
                         speeds=(Speed("torch-cpu", "float32", mem_gib * 1e10, mem_gib * 1e9),))
    agent.link.capabilities = agent.caps
    return agent


def test_an_operators_replan_loads_the_best_plan_beside_the_serving_one_or_says_it_is_unchanged(
        model_dir: Path) -> None:
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: 100.0)
    a1, a2 = Agent("a1", 8), Agent("a2", 8)
    deployer.plans.add_model("m", str(model_dir), num_stages=2)
    connect_all(deployer, [a1, a2])
    report_ready(deployer, [a1, a2])
    serving = registry.active_plan("m").plan_id
    assert deployer.plans.replan("m")[0] == "unchanged"
    slightly_faster = placed_on(Agent("a3", 8), mem_gib=8.2, site="")    # 2.5%: no re-plan of its own
    connect_all(deployer, [slightly_faster])
    deployer.tick()
    assert registry.standby_plan("m") is None
    outcome, reason = deployer.plans.replan("m")
    standby = registry.standby_plan("m")
    assert outcome == "standby" and reason == standby.reason and "a3" in {s.agent_id for s in standby.stages}
    assert registry.active_plan("m").plan_id == serving             # it serves on while the new plan loads
    report_ready(deployer, [a1, a2, slightly_faster])
    assert registry.active_plan("m").plan_id == standby.plan_id
    assert deployer.plans.replan("m")[0] == "unchanged"
    assert deployer.plans.replan("m", num_stages=3)[0] == "standby"
    assert len(registry.standby_plan("m").stages) == 3 and deployer.plans.num_stages("m") == 2
    with pytest.raises(PlacementError, match="3 of 4 agents"):
        deployer.plans.replan("m", num_stages=4)
    with pytest.raises(ModelNotFound):
        deployer.plans.replan("other")


def test_a_model_waiting_for_agents_replans_to_fewer_stages(model_dir: Path) -> None:
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: 100.0)
    deployer.plans.add_model("m", str(model_dir), num_stages=3)
    connect_all(deployer, [Agent("a1", 8)])
    assert deployer.plans.replan("m")[0] == "waiting" and deployer.plans.num_stages("m") == 3
    assert deployer.plans.replan("m", num_stages=1)[0] == "planned"
    assert len(registry.active_plan("m").stages) == 1


def test_pinned_sites_keep_the_first_and_last_stages_at_the_edge_also_through_a_drain(model_dir: Path) -> None:
    edge = [placed_on(Agent(f"a{i}", 8), mem_gib=4, site="factory") for i in (1, 2, 3, 4)]
    cloud = [placed_on(Agent(f"a{i}", 8), mem_gib=64, site="cloud-eu", tier="cloud") for i in (5, 6)]
    sites = {a.link.agent_id: a.caps.site for a in [*edge, *cloud]}

    def deploy(pins: SitePins) -> tuple[Registry, Deployer]:
        registry = Registry(":memory:")
        deployer = Deployer(registry, clock=lambda: 100.0)
        connect_all(deployer, [*edge, *cloud])
        for a in sites:                 # fast links everywhere: crossing sites costs little
            deployer.roster.links_reported(a, [LinkMeasurement(b, 1e-4, 1e9) for b in sites if b != a])
        deployer.plans.add_model("m", str(model_dir), num_stages=3, pins=pins)
        report_ready(deployer, [*edge, *cloud])
        return registry, deployer

    free, _ = deploy(SitePins())
    assert [sites[s.agent_id] for s in free.active_plan("m").stages].count("cloud-eu") == 2
    registry, deployer = deploy(SitePins("factory", "factory"))
    stages = registry.active_plan("m").stages
    assert [sites[s.agent_id] for s in stages] == ["factory", "cloud-eu", "factory"]
    ((old, new),) = deployer.drain(stages[0].agent_id)      # the fast cloud spare may not take the first stage
    assert old.stage_index == 0 and sites[new.agent_id] == "factory"


def test_plans_price_the_serving_cost_the_agents_measured_in_their_telemetry(model_dir: Path) -> None:
    def planned_steps(serving_cpu_s: float | None) -> list[float]:
        deployer = Deployer(registry := Registry(":memory:"), clock=lambda: 100.0)
        agents = [Agent("a1", 8), Agent("a2", 8)]
        connect_all(deployer, agents)
        if serving_cpu_s is not None:     # what their heartbeats said after serving a while
            for agent in agents:
                deployer.heartbeat(agent.link.agent_id, Telemetry(100.0, serving_cpu_per_token_s=serving_cpu_s))
        deployer.plans.add_model("m", str(model_dir), num_stages=2)
        return registry.active_plan("m").prediction["stage_step_s"]

    unmeasured, measured = planned_steps(None), planned_steps(2e-3)
    # each stage's step of 8 tokens pays 8 x the measured serving cost instead of the default's (one box each: no
    # share of the cores to divide it by)
    for before, after in zip(unmeasured, measured, strict=True):
        assert after - before == pytest.approx(8 * (2e-3 - DEFAULT_SERVING_CPU_PER_TOKEN_S))


def test_boxes_too_small_for_any_stage_join_without_a_plan_being_computed(model_dir: Path) -> None:
    registry, now = Registry(":memory:"), [100.0]
    deployer = Deployer(registry, clock=lambda: now[0])
    agents = [Agent("a1", 8), Agent("a2", 8), Agent("a3", 8)]
    deployer.plans.add_model("m", str(model_dir), num_stages=3)
    connect_all(deployer, agents)
    report_ready(deployer, agents)
    computed = deployer.plans.num_computed
    now[0] += JOINS_SETTLE_MAX_S
    deployer.tick()                 # the serving plan is not weighed again against the agents it was made with
    assert deployer.plans.num_computed == computed
    connect_all(deployer, [Agent(f"tiny{i}", 0) for i in range(200)])     # no memory for even one layer
    now[0] += JOINS_SETTLE_MAX_S
    deployer.tick()
    assert deployer.plans.num_computed == computed
    connect_all(deployer, [Agent("a4", 16)])        # one that could take a stage is weighed, once
    now[0] += JOINS_SETTLE_MAX_S
    deployer.tick()
    deployer.tick()
    assert deployer.plans.num_computed == computed + 1


def test_a_burst_of_joins_is_weighed_once_it_settles_and_steady_joins_every_few_seconds(model_dir: Path) -> None:
    registry, now = Registry(":memory:"), [100.0]
    deployer = Deployer(registry, clock=lambda: now[0])
    agents = [Agent("a1", 8), Agent("a2", 8)]
    deployer.plans.add_model("m", str(model_dir), num_stages=2)
    connect_all(deployer, agents)
    report_ready(deployer, agents)
    now[0] += JOINS_SETTLE_MAX_S
    deployer.tick()
    computed, plan = deployer.plans.num_computed, registry.active_plan("m").plan_id
    # 300 boxes that could each hold a stage but are slower than the serving ones join within half a second
    for i in range(300):
        connect_all(deployer, [Agent(f"slow{i}", 1)])
        if i % 100 == 99:
            now[0] += 0.25
            deployer.tick()
    assert deployer.plans.num_computed == computed          # still joining: nothing weighed yet
    now[0] += JOINS_SETTLE_S
    deployer.tick()
    assert deployer.plans.num_computed == computed          # paused, but the last weighing was under 5 s ago
    now[0] += JOINS_SETTLE_MAX_S
    deployer.tick()
    assert deployer.plans.num_computed == computed + 1      # the burst, weighed once
    assert registry.active_plan("m").plan_id == plan and registry.standby_plan("m") is None    # and left alone
    # then one joins every second for a minute: weighed every JOINS_SETTLE_MAX_S, not on each join
    computed = deployer.plans.num_computed
    for i in range(60):
        connect_all(deployer, [Agent(f"late{i}", 1)])
        now[0] += 1.0
        deployer.tick()
    assert 1 <= deployer.plans.num_computed - computed <= 60 / JOINS_SETTLE_MAX_S + 1
