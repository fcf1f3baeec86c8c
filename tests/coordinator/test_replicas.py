"""A model served by several replicas: each a pipeline on agents of its own, planned as the fleet allows, re-planned
alone when one of its agents dies, and a router that picks a ready replica for each request."""

from __future__ import annotations

from pathlib import Path

import pytest

from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.control.events import RouteWork
from stratamesh.coordinator.control.prefix_index import EXPECTED_FOR_S
from stratamesh.coordinator.control.routes import DECODE_WORK_TOKENS, Disaggregation
from stratamesh.coordinator.liveness import LivenessConfig
from stratamesh.coordinator.registry import Registry
from stratamesh.fleet.errors import InvalidInput, ModelNotReady
from stratamesh.fleet.prefix import block_hashes
from stratamesh.fleet.types import KvEvents, StageLoad, Telemetry
from tests.coordinator.test_deployer import (Agent, OriginSessions, connect_all, heartbeats, model_dir,  # noqa: F401
                                            report_ready)


def two_replicas(model_dir: Path, **deployer_options) -> tuple[Registry, Deployer, list[Agent]]:
    """Model m in two replicas of two stages on four agents, planned (not yet loaded)."""
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: 100.0, **deployer_options)
    agents = [Agent(f"a{i}", 8) for i in range(1, 5)]
    deployer.add_model("m", str(model_dir), num_stages=2, num_replicas=2)
    connect_all(deployer, agents)
    return registry, deployer, agents


def test_replicas_are_planned_on_agents_of_their_own_as_the_fleet_grows(model_dir: Path) -> None:
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: 100.0)
    agents = [Agent(f"a{i}", 8) for i in range(1, 6)]
    deployer.add_model("m", str(model_dir), num_stages=2, num_replicas=2)
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
    assert deployer.ready_replicas("m") == 2


def test_the_router_takes_ready_replicas_in_turn_and_avoids_a_lost_one(model_dir: Path) -> None:
    registry, deployer, agents = two_replicas(model_dir)
    first, second = registry.active_plans("m")
    # only the first replica's stages are loaded: every request goes there
    report_ready(deployer, [a for a in agents if a.link.agent_id in {s.agent_id for s in first.stages}])
    assert deployer.ready_replicas("m") == 1
    assert {tuple(hop.assignment_id for hop in deployer.route("m")[0]) for _ in range(4)} == {
        tuple(s.assignment_id for s in first.stages)}
    report_ready(deployer, agents)
    routes = [deployer.route("m")[0] for _ in range(4)]
    assert [[hop.assignment_id for hop in route] for route in routes] == [
        [s.assignment_id for s in plan.stages] for plan in (first, second, first, second)]   # in turn
    # a stage found unreachable: requests avoiding it take the other replica
    lost = routes[1][1].address
    assert all(deployer.route("m", avoid={lost})[0][1].address != lost for _ in range(3))
    with pytest.raises(ModelNotReady):
        deployer.route("m", avoid={routes[0][0].address, lost})


def test_least_load_routes_to_the_replica_whose_busiest_stage_is_least_busy(model_dir: Path) -> None:
    registry, deployer, agents = two_replicas(model_dir, router_mode="least-load")
    report_ready(deployer, agents)
    first, second = registry.active_plans("m")

    def load(stage, running: int) -> None:      # the stage's agent's heartbeat says how busy it is
        deployer.heartbeat(stage.agent_id, Telemetry(100.0, running, 0.0, (StageLoad(stage.assignment_id, running, 0, 1,
                                                                                     64),)))

    load(first.stages[0], 1)
    load(first.stages[1], 9)       # the first replica's bottleneck: 9 sequences
    load(second.stages[0], 5)
    load(second.stages[1], 5)
    assert {deployer.route("m")[0][0].assignment_id for _ in range(3)} == {second.stages[0].assignment_id}
    load(second.stages[1], 12)
    assert deployer.route("m")[0][0].assignment_id == first.stages[0].assignment_id
    with pytest.raises(InvalidInput, match="router mode"):
        Deployer(Registry(":memory:"), clock=lambda: 0.0, router_mode="random")


def test_a_dead_agent_re_plans_its_replica_alone_while_the_other_serves(model_dir: Path) -> None:
    now, lost = [100.0], []
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: now[0], liveness=LivenessConfig(lease_s=2.0),
                        sessions=OriginSessions(lost=lost))
    agents = {f"a{i}": Agent(f"a{i}", 8) for i in range(1, 6)}
    deployer.add_model("m", str(model_dir), num_stages=2, num_replicas=2)
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
    assert deployer.is_ready("m") and deployer.ready_replicas("m") == 1     # the first serves meanwhile
    route = deployer.route("m")[0]
    assert [hop.assignment_id for hop in route] == [s.assignment_id for s in first.stages]


def test_asking_for_fewer_replicas_retires_the_others(model_dir: Path) -> None:
    registry, deployer, agents = two_replicas(model_dir)
    report_ready(deployer, agents)
    second = registry.active_plan("m", 1)
    deployer.add_model("m", str(model_dir), num_stages=2, num_replicas=1)
    assert [p.replica for p in registry.active_plans("m")] == [0]
    released = {m.assignment_id for a in agents for m in a.sent if type(m).__name__ == "Release"}
    assert released == {s.assignment_id for s in second.stages}
    with pytest.raises(InvalidInput, match="num_replicas"):
        deployer.add_model("m", str(model_dir), num_stages=2, num_replicas=0)


# ------------------------------------------------------------------ kv: by what the replicas' prefix caches hold
def kv_replicas(model_dir: Path) -> tuple[Registry, Deployer, list[Agent], OriginSessions, list[float]]:
    """two_replicas, loaded, routing by prefix; the deployer's clock is the returned list's first item."""
    sessions, now = OriginSessions(), [100.0]
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: now[0], sessions=sessions, router_mode="kv")
    agents = [Agent(f"a{i}", 8) for i in range(1, 5)]
    deployer.add_model("m", str(model_dir), num_stages=2, num_replicas=2)
    connect_all(deployer, agents)
    report_ready(deployer, agents)
    return registry, deployer, agents, sessions, now


def cached(deployer: Deployer, plan, token_ids: list[int], cleared: bool = False) -> None:
    """Every stage of the plan reports the prompt's full blocks stored, as its agent's KV events would."""
    size = plan.stages[0].spec.kv_block_size
    for stage in plan.stages:
        deployer.kv_events(stage.agent_id, [KvEvents(stage.assignment_id, size, cleared,
                                                     tuple(block_hashes(token_ids, size)))])


def replica_of(registry: Registry, route) -> int:
    first = route[0].assignment_id
    return next(p.replica for p in registry.active_plans("m") if p.stages[0].assignment_id == first)


def test_kv_routes_a_prompt_to_the_replica_whose_stages_hold_its_prefix(model_dir: Path) -> None:
    registry, deployer, _, _, _ = kv_replicas(model_dir)
    first, second = registry.active_plans("m")
    system = list(range(1, 65))                       # 4 blocks of 16
    cached(deployer, second, system)
    for suffix in ([100, 101], [200] * 20, [300] * 7):
        assert replica_of(registry, deployer.route("m", token_ids=system + suffix)[0]) == 1
    assert deployer.cached_blocks(second.stages[0].assignment_id) == 4
    # a prefix only one stage of a replica holds is not cached there: the pipeline would prefill it anyway
    other = list(range(500, 564))
    stage = first.stages[0]
    deployer.kv_events(stage.agent_id, [KvEvents(stage.assignment_id, 16, False, tuple(block_hashes(other, 16)))])
    turns = {replica_of(registry, deployer.route("m", token_ids=list(range(900 + 64 * i, 964 + 64 * i)))[0])
             for i in range(2)}
    assert turns == {0, 1}                            # unrelated prompts: nothing cached, in turn
    # evicted blocks count no more; a cleared report starts a stage over
    size = second.stages[0].spec.kv_block_size
    for s in second.stages:
        deployer.kv_events(s.agent_id, [KvEvents(s.assignment_id, size, False, (), tuple(block_hashes(system, size)))])
    assert deployer.cached_blocks(second.stages[0].assignment_id) == 0
    cached(deployer, first, system, cleared=True)
    assert deployer.cached_blocks(first.stages[0].assignment_id) == 4
    assert replica_of(registry, deployer.route("m", token_ids=system + [7])[0]) == 0


def test_kv_sends_a_prompt_after_the_one_routed_just_before_it_with_the_same_prefix(model_dir: Path) -> None:
    """Before any stage reports a prompt's blocks, the replica it was routed to counts as holding them, for
    EXPECTED_FOR_S: a burst of one prefix stays together."""
    registry, deployer, _, _, now = kv_replicas(model_dir)
    system = list(range(1, 129))
    first = replica_of(registry, deployer.route("m", token_ids=system + [1])[0])
    assert [replica_of(registry, deployer.route("m", token_ids=system + [i])[0]) for i in range(2, 6)] == [first] * 4
    assert first == 0                                 # the first in turn; the fifth route's turn is replica 1's
    now[0] += EXPECTED_FOR_S + 1                      # never reported: forgotten, and the turn decides again
    assert replica_of(registry, deployer.route("m", token_ids=system + [6])[0]) == 1


def test_kv_weighs_the_prefix_against_the_work_already_routed_to_each_replica(model_dir: Path) -> None:
    registry, deployer, _, sessions, _ = kv_replicas(model_dir)
    first, second = registry.active_plans("m")
    system = list(range(1, 65))
    cached(deployer, second, system)
    prompt = system + [7] * 16                         # 80 tokens, 64 of them cached on replica 1
    # replica 1 is busier, but by less than the prefill its cache saves
    sessions.routed = {second.stages[0].assignment_id: RouteWork(prefill_tokens=40, num_decoding=0)}
    assert replica_of(registry, deployer.route("m", token_ids=prompt)[0]) == 1
    # decoding generations weigh DECODE_WORK_TOKENS each: replica 1's work is 16 + 4 of them, replica 0's 80 + 1
    sessions.routed = {second.stages[0].assignment_id: RouteWork(0, 4),
                       first.stages[0].assignment_id: RouteWork(0, 1)}
    assert 16 + 4 * DECODE_WORK_TOKENS > 80 + DECODE_WORK_TOKENS
    assert replica_of(registry, deployer.route("m", token_ids=prompt)[0]) == 0


def test_kv_events_of_a_stage_the_agent_does_not_hold_are_ignored(model_dir: Path) -> None:
    registry, deployer, agents, _, _ = kv_replicas(model_dir)
    first, second = registry.active_plans("m")
    stranger = next(a for a in agents if a.link.agent_id not in {s.agent_id for s in second.stages})
    deployer.kv_events(stranger.link.agent_id, [KvEvents(second.stages[0].assignment_id, 16, False,
                                                         tuple(block_hashes(list(range(32)), 16)))])
    assert deployer.cached_blocks(second.stages[0].assignment_id) == 0


def test_kv_without_token_ids_takes_replicas_in_turn(model_dir: Path) -> None:
    registry, deployer, _, _, _ = kv_replicas(model_dir)
    assert [replica_of(registry, deployer.route("m")[0]) for _ in range(4)] == [0, 1, 0, 1]


# ------------------------------------------------------------------ prefill/decode disaggregation
def disaggregated(model_dir: Path, num_replicas: int = 3, min_prompt_tokens: int = 64,
                  max_queue_tokens: int = 100) -> tuple[Registry, Deployer, OriginSessions]:
    """num_replicas of 1 stage, the first prefilling long prompts for the others."""
    sessions = OriginSessions()
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: 100.0, sessions=sessions, router_mode="kv",
                        disaggregation=Disaggregation(1, min_prompt_tokens, max_queue_tokens))
    agents = [Agent(f"a{i}", 8) for i in range(1, num_replicas + 1)]
    deployer.add_model("m", str(model_dir), num_stages=1, num_replicas=num_replicas)
    connect_all(deployer, agents)
    report_ready(deployer, agents)
    return registry, deployer, sessions


def test_whole_requests_go_to_decode_replicas_and_long_prompts_prefill_on_the_prefill_one(model_dir: Path) -> None:
    registry, deployer, _ = disaggregated(model_dir)
    prefill_plan = next(p for p in registry.active_plans("m") if p.replica == 0)
    decodes = [deployer.route("m", token_ids=[i] * 8)[0] for i in range(6)]
    assert {replica_of(registry, r) for r in decodes} == {1, 2}            # never the prefill replica
    long_prompt = list(range(1, 101))
    route, _ = deployer.route("m", token_ids=long_prompt)
    prefill = deployer.prefill_route("m", route, long_prompt)
    assert [hop.assignment_id for hop in prefill] == [s.assignment_id for s in prefill_plan.stages]
    assert deployer.prefill_route("m", route, long_prompt[:63]) is None       # too short to be worth a move
    assert deployer.prefill_route("m", prefill, long_prompt) is None          # it decodes there: nothing to split
    assert deployer.prefill_route("m", route, long_prompt, avoid={prefill[0].address}) is None


def test_a_prompt_cached_on_its_decode_replica_or_a_long_prefill_queue_keeps_it_whole(model_dir: Path) -> None:
    registry, deployer, sessions = disaggregated(model_dir)
    long_prompt = list(range(1, 101))
    route, _ = deployer.route("m", token_ids=long_prompt)
    decode_plan = next(p for p in registry.active_plans("m") if p.stages[0].assignment_id == route[0].assignment_id)
    cached(deployer, decode_plan, long_prompt[:48])        # 3 blocks of 16 there: 52 uncached tokens < 64
    assert deployer.prefill_route("m", route, long_prompt) is None
    other, _ = deployer.route("m", token_ids=[7] * 100)
    prefill_first = next(p for p in registry.active_plans("m") if p.replica == 0).stages[0].assignment_id
    sessions.routed[prefill_first] = RouteWork(prefill_tokens=101)            # past max_queue_tokens
    assert deployer.prefill_route("m", other, [7] * 100) is None
    sessions.routed[prefill_first] = RouteWork(prefill_tokens=100)
    assert deployer.prefill_route("m", other, [7] * 100) is not None


def test_disaggregation_thresholds_must_be_sane() -> None:
    for bad in ((-1, 512, 10), (1, 0, 10), (1, 512, -1)):
        with pytest.raises(InvalidInput, match="disaggregation"):
            Disaggregation(*bad)
