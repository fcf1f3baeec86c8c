"""The router: which of a model's ready replicas takes each request (round-robin, least-load, kv), and where a long
prompt prefills apart (disaggregation); over a real deployer's routes (an in-memory registry, agents reduced to
message lists), with the origin's work in hand given as a value."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.control.prefix_index import EXPECTED_FOR_S
from stratamesh.coordinator.records import CANARY_REPLICA
from stratamesh.coordinator.registry import Registry
from stratamesh.coordinator.serving.router import DECODE_WORK_TOKENS, Disaggregation, Router, RouteWork
from stratamesh.fleet.errors import InvalidInput, ModelNotReady
from stratamesh.fleet.prefix import block_hashes
from stratamesh.fleet.boxes import StageLoad, Telemetry
from stratamesh.fleet.kv import KvEvents
from tests.coordinator.test_deployer import Agent, connect_all, model_dir, report_ready  # noqa: F401 (a fixture)
from tests.coordinator.test_replicas import two_replicas


def test_the_router_takes_ready_replicas_in_turn_and_avoids_a_lost_one(model_dir: Path) -> None:
    registry, deployer, agents = two_replicas(model_dir)
    router = Router(deployer.routes)
    first, second = registry.active_plans("m")
    # only the first replica's stages are loaded: every request goes there
    report_ready(deployer, [a for a in agents if a.link.agent_id in {s.agent_id for s in first.stages}])
    assert len(deployer.routes.ready_plans("m")) == 1
    assert {tuple(hop.assignment_id for hop in router.route("m")[0]) for _ in range(4)} == {
        tuple(s.assignment_id for s in first.stages)}
    report_ready(deployer, agents)
    routes = [router.route("m")[0] for _ in range(4)]
    assert [[hop.assignment_id for hop in route] for route in routes] == [
        [s.assignment_id for s in plan.stages] for plan in (first, second, first, second)]   # in turn
    # a stage found unreachable: requests avoiding it take the other replica
    lost = routes[1][1].address
    assert all(router.route("m", avoid={lost})[0][1].address != lost for _ in range(3))
    with pytest.raises(ModelNotReady):
        router.route("m", avoid={routes[0][0].address, lost})


def test_least_load_routes_to_the_replica_whose_busiest_stage_is_least_busy(model_dir: Path) -> None:
    registry, deployer, agents = two_replicas(model_dir)
    router = Router(deployer.routes, "least-load")
    report_ready(deployer, agents)
    first, second = registry.active_plans("m")

    def load(stage, running: int) -> None:      # the stage's agent's heartbeat says how busy it is
        deployer.heartbeat(stage.agent_id, Telemetry(100.0, running, 0.0, (StageLoad(stage.assignment_id, running, 0, 1,
                                                                                     64),)))

    load(first.stages[0], 1)
    load(first.stages[1], 9)       # the first replica's bottleneck: 9 sequences
    load(second.stages[0], 5)
    load(second.stages[1], 5)
    assert {router.route("m")[0][0].assignment_id for _ in range(3)} == {second.stages[0].assignment_id}
    load(second.stages[1], 12)
    assert router.route("m")[0][0].assignment_id == first.stages[0].assignment_id
    with pytest.raises(InvalidInput, match="router mode"):
        Router(deployer.routes, "random")


# ------------------------------------------------------------------ kv: by what the replicas' prefix caches hold
def kv_replicas(model_dir: Path) -> tuple[Registry, Deployer, Router, list[Agent], list[float]]:
    """two_replicas, loaded, routing by prefix; the deployer's clock is the returned list's first item."""
    now = [100.0]
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: now[0])
    agents = [Agent(f"a{i}", 8) for i in range(1, 5)]
    deployer.plans.add_model("m", str(model_dir), num_stages=2, num_replicas=2)
    connect_all(deployer, agents)
    report_ready(deployer, agents)
    return registry, deployer, Router(deployer.routes, "kv"), agents, now


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
    registry, deployer, router, _, _ = kv_replicas(model_dir)
    first, second = registry.active_plans("m")
    system = list(range(1, 65))                       # 4 blocks of 16
    cached(deployer, second, system)
    for suffix in ([100, 101], [200] * 20, [300] * 7):
        assert replica_of(registry, router.route("m", token_ids=system + suffix)[0]) == 1
    assert deployer.routes.prefixes.num_cached(second.stages[0].assignment_id) == 4
    # a prefix only one stage of a replica holds is not cached there: the pipeline would prefill it anyway
    other = list(range(500, 564))
    stage = first.stages[0]
    deployer.kv_events(stage.agent_id, [KvEvents(stage.assignment_id, 16, False, tuple(block_hashes(other, 16)))])
    turns = {replica_of(registry, router.route("m", token_ids=list(range(900 + 64 * i, 964 + 64 * i)))[0])
             for i in range(2)}
    assert turns == {0, 1}                            # unrelated prompts: nothing cached, in turn
    # evicted blocks count no more; a cleared report starts a stage over
    size = second.stages[0].spec.kv_block_size
    for s in second.stages:
        deployer.kv_events(s.agent_id, [KvEvents(s.assignment_id, size, False, (), tuple(block_hashes(system, size)))])
    assert deployer.routes.prefixes.num_cached(second.stages[0].assignment_id) == 0
    cached(deployer, first, system, cleared=True)
    assert deployer.routes.prefixes.num_cached(first.stages[0].assignment_id) == 4
    assert replica_of(registry, router.route("m", token_ids=system + [7])[0]) == 0


def test_kv_sends_a_prompt_after_the_one_routed_just_before_it_with_the_same_prefix(model_dir: Path) -> None:
    """Before any stage reports a prompt's blocks, the replica it was routed to counts as holding them, for
    EXPECTED_FOR_S: a burst of one prefix stays together."""
    registry, deployer, router, _, now = kv_replicas(model_dir)
    system = list(range(1, 129))
    first = replica_of(registry, router.route("m", token_ids=system + [1])[0])
    assert [replica_of(registry, router.route("m", token_ids=system + [i])[0]) for i in range(2, 6)] == [first] * 4
    assert first == 0                                 # the first in turn; the fifth route's turn is replica 1's
    now[0] += EXPECTED_FOR_S + 1                      # never reported: forgotten, and the turn decides again
    assert replica_of(registry, router.route("m", token_ids=system + [6])[0]) == 1


def test_kv_weighs_the_prefix_against_the_work_already_routed_to_each_replica(model_dir: Path) -> None:
    registry, deployer, router, _, _ = kv_replicas(model_dir)
    first, second = registry.active_plans("m")
    system = list(range(1, 65))
    cached(deployer, second, system)
    prompt = system + [7] * 16                         # 80 tokens, 64 of them cached on replica 1
    # replica 1 is busier, but by less than the prefill its cache saves
    work = {second.stages[0].assignment_id: RouteWork(prefill_tokens=40, num_decoding=0)}
    assert replica_of(registry, router.route("m", token_ids=prompt, work=work)[0]) == 1
    # decoding generations weigh DECODE_WORK_TOKENS each: replica 1's work is 16 + 4 of them, replica 0's 80 + 1
    work = {second.stages[0].assignment_id: RouteWork(0, 4), first.stages[0].assignment_id: RouteWork(0, 1)}
    assert 16 + 4 * DECODE_WORK_TOKENS > 80 + DECODE_WORK_TOKENS
    assert replica_of(registry, router.route("m", token_ids=prompt, work=work)[0]) == 0


def test_kv_events_of_a_stage_the_agent_does_not_hold_are_ignored(model_dir: Path) -> None:
    registry, deployer, _, agents, _ = kv_replicas(model_dir)
    first, second = registry.active_plans("m")
    stranger = next(a for a in agents if a.link.agent_id not in {s.agent_id for s in second.stages})
    deployer.kv_events(stranger.link.agent_id, [KvEvents(second.stages[0].assignment_id, 16, False,
                                                         tuple(block_hashes(list(range(32)), 16)))])
    assert deployer.routes.prefixes.num_cached(second.stages[0].assignment_id) == 0


def test_kv_without_token_ids_takes_replicas_in_turn(model_dir: Path) -> None:
    registry, deployer, router, _, _ = kv_replicas(model_dir)
    assert [replica_of(registry, router.route("m")[0]) for _ in range(4)] == [0, 1, 0, 1]


# ------------------------------------------------------------------ prefill/decode disaggregation
def disaggregated(model_dir: Path, num_replicas: int = 3, min_prompt_tokens: int = 64,
                  max_queue_tokens: int = 100) -> tuple[Registry, Deployer, Router]:
    """num_replicas of 1 stage, the first prefilling long prompts for the others."""
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: 100.0)
    agents = [Agent(f"a{i}", 8) for i in range(1, num_replicas + 1)]
    deployer.plans.add_model("m", str(model_dir), num_stages=1, num_replicas=num_replicas)
    connect_all(deployer, agents)
    report_ready(deployer, agents)
    return registry, deployer, Router(deployer.routes, "kv", Disaggregation(1, min_prompt_tokens, max_queue_tokens))


def test_whole_requests_go_to_decode_replicas_and_long_prompts_prefill_on_the_prefill_one(model_dir: Path) -> None:
    registry, deployer, router = disaggregated(model_dir)
    prefill_plan = next(p for p in registry.active_plans("m") if p.replica == 0)
    decodes = [router.route("m", token_ids=[i] * 8)[0] for i in range(6)]
    assert {replica_of(registry, r) for r in decodes} == {1, 2}            # never the prefill replica
    long_prompt = list(range(1, 101))
    route, _ = router.route("m", token_ids=long_prompt)
    prefill = router.prefill_route("m", route, long_prompt)
    assert [hop.assignment_id for hop in prefill] == [s.assignment_id for s in prefill_plan.stages]
    assert router.prefill_route("m", route, long_prompt[:63]) is None       # too short to be worth a move
    assert router.prefill_route("m", prefill, long_prompt) is None          # it decodes there: nothing to split
    assert router.prefill_route("m", route, long_prompt, avoid={prefill[0].address}) is None


def test_a_prompt_cached_on_its_decode_replica_or_a_long_prefill_queue_keeps_it_whole(model_dir: Path) -> None:
    registry, deployer, router = disaggregated(model_dir)
    long_prompt = list(range(1, 101))
    route, _ = router.route("m", token_ids=long_prompt)
    decode_plan = next(p for p in registry.active_plans("m") if p.stages[0].assignment_id == route[0].assignment_id)
    cached(deployer, decode_plan, long_prompt[:48])        # 3 blocks of 16 there: 52 uncached tokens < 64
    assert router.prefill_route("m", route, long_prompt) is None
    other, _ = router.route("m", token_ids=[7] * 100)
    prefill_first = next(p for p in registry.active_plans("m") if p.replica == 0).stages[0].assignment_id
    work = {prefill_first: RouteWork(prefill_tokens=101)}                     # past max_queue_tokens
    assert router.prefill_route("m", other, [7] * 100, work=work) is None
    work = {prefill_first: RouteWork(prefill_tokens=100)}
    assert router.prefill_route("m", other, [7] * 100, work=work) is not None


def test_disaggregation_thresholds_must_be_sane() -> None:
    for bad in ((-1, 512, 10), (1, 0, 10), (1, 512, -1)):
        with pytest.raises(InvalidInput, match="disaggregation"):
            Disaggregation(*bad)


def test_a_rollouts_canary_takes_its_share_of_new_requests_and_a_request_keeps_its_revision(
        model_dir: Path) -> None:
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: 100.0)
    agents = [Agent(f"a{i}", 8) for i in range(1, 5)]
    deployer.plans.add_model("m", str(model_dir), num_stages=2)
    connect_all(deployer, agents)
    following = model_dir.parent / f"{model_dir.name}-next"       # the next revision: another folder
    following.mkdir()
    shutil.copy(model_dir / "config.json", following / "config.json")
    rollout = deployer.plans.start_rollout("m", str(following), steps=(100,))
    serving, canary = registry.active_plan("m"), registry.active_plan("m", CANARY_REPLICA)
    assert canary is not None and {s.spec.revision for s in canary.stages} == {rollout.revision}
    assert {s.spec.model_path for s in canary.stages} == {str(following.resolve())}
    assert not {s.agent_id for s in canary.stages} & {s.agent_id for s in serving.stages}
    report_ready(deployer, agents)
    router = Router(deployer.routes)
    first_of = lambda route: route[0][0].assignment_id      # noqa: E731
    assert {first_of(router.route("m")) for _ in range(5)} == {canary.stages[0].assignment_id}    # 100%: all new
    old = registry.model("m").revision
    assert first_of(router.route("m", revision=old)) == serving.stages[0].assignment_id     # kept through failover
    registry.set_rollout("m", replace(rollout, steps=(5, 100)))
    router._rng.seed(1)
    taken = sum(first_of(router.route("m")) == canary.stages[0].assignment_id for _ in range(400))
    assert 5 <= taken <= 40                                                                 # about 5% of 400
    deployer.plans.roll_back("m", "a test")
    assert registry.model("m").rollout.state == "rolled_back"
    # its revision is gone: a request that started on the canary goes on with the serving revision
    assert first_of(router.route("m", revision=rollout.revision)) == serving.stages[0].assignment_id


def test_a_prompt_prefills_apart_only_on_a_replica_of_its_decode_replicas_revision(model_dir: Path) -> None:
    """KV one revision computed means nothing to another's weights: no hand-off between revisions."""
    registry, deployer, router = disaggregated(model_dir)
    long_prompt = list(range(1, 101))
    route, _ = router.route("m", token_ids=long_prompt)
    assert router.prefill_route("m", route, long_prompt) is not None
    prefill_plan = next(p for p in registry.active_plans("m") if p.replica == 0)
    for stage in prefill_plan.stages:        # its stages serve another revision now
        registry.replace_stage(stage.assignment_id, replace(stage, spec=replace(stage.spec, revision="other")))
    assert router.prefill_route("m", route, long_prompt) is None
