"""Re-planning: keep the old placement when it is nearly as good, move layers when it is not, count moves."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from stratamesh.fleet.errors import PlacementError
from stratamesh.partitioner.fleet_snapshot import Device, FleetSnapshot, Link
from stratamesh.fleet.boxes import Speed
from stratamesh.partitioner.plan import Pipeline, Plan, PlannedStage, PlanRequest
from stratamesh.partitioner.planner import evaluate, plan_pipeline
from stratamesh.partitioner.profile import profile_from_hf_config
from stratamesh.partitioner.replan import KEEP_WITHIN, layers_moved
from tests.partitioner.random_fleets import random_case

CONFIG = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 8,
          "intermediate_size": 1024, "vocab_size": 1000, "torch_dtype": "bfloat16"}
PROFILE = profile_from_hf_config(CONFIG)
NUM_LAYERS = PROFILE.num_layers


def _need(request: PlanRequest) -> int:
    return PROFILE.total_bytes + request.concurrency * request.context_len * sum(PROFILE.layer_kv_bytes_per_token)


def _box(device_id: str, memory: int, speedup: float = 1.0, site: str = "dc") -> Device:
    return Device(device_id, memory, (Speed("torch-cuda", "bfloat16", 1e12 * speedup, 1e10 * speedup),),
                  "cloud", site)


def _placement(plan: Plan) -> list[tuple[tuple[str, ...], int, int]]:
    return [(s.devices, s.start_layer, s.end_layer) for s in plan.pipelines[0].stages]


def _one_box_then_another(speedup: float, objective: str) -> tuple[Plan, FleetSnapshot, PlanRequest]:
    """The old plan: all layers on box a. Then box b, speedup times as fast, joins over a link too slow to
    split the model across both: the best plan moves everything to b."""
    request = PlanRequest(objective=objective)
    a = _box("a", 2 * _need(request))
    old = plan_pipeline(PROFILE, FleetSnapshot((a,)), request)
    b = _box("b", 2 * _need(request), speedup)
    return old, FleetSnapshot((a, b), (Link("a", "b", 1e4, 0.01),)), request


@pytest.mark.parametrize("objective", ["throughput", "latency"])
def test_a_slightly_better_device_keeps_the_old_placement(objective: str) -> None:
    old, fleet, request = _one_box_then_another(1.03, objective)
    best = plan_pipeline(PROFILE, fleet, request)
    assert _placement(best) == [(("b",), 0, NUM_LAYERS)]                       # moving would help a little
    old_now = evaluate(PROFILE, fleet, request, _placement(old))
    old_value = old_now.objective_s(objective)
    assert best.objective_s < old_value <= best.objective_s * (1 + KEEP_WITHIN)

    plan = plan_pipeline(PROFILE, fleet, request, previous=old)
    assert plan.search == "kept" and plan.layers_moved == 0
    assert _placement(plan) == _placement(old) == [(("a",), 0, NUM_LAYERS)]
    assert plan.pipelines == (old_now,)
    assert plan.tokens_per_s == pytest.approx(old_now.tokens_per_s) and old_now.tokens_per_s > 0
    assert "Kept the previous placement" in plan.reason


@pytest.mark.parametrize("objective", ["throughput", "latency"])
def test_a_much_better_device_moves_every_layer(objective: str) -> None:
    old, fleet, request = _one_box_then_another(1.5, objective)
    best = plan_pipeline(PROFILE, fleet, request)
    plan = plan_pipeline(PROFILE, fleet, request, previous=old)
    assert plan.pipelines == best.pipelines and plan.search == best.search == "exact"
    assert plan.layers_moved == layers_moved(old, best) == NUM_LAYERS
    assert f"Re-planned: {NUM_LAYERS} layer(s) move." in plan.reason


def _two_stage_plan() -> tuple[Plan, FleetSnapshot, PlanRequest]:
    """Three boxes that each hold 60% of the model; the old latency plan uses two of them (c is slower)."""
    request = PlanRequest(objective="latency")
    memory = int(0.6 * _need(request))
    fleet = FleetSnapshot((_box("a", memory), _box("b", memory), _box("c", memory, 0.9)))
    old = plan_pipeline(PROFILE, fleet, request)
    assert len(old.pipelines[0].stages) == 2
    return old, fleet, request


@pytest.mark.parametrize("change", ["removed", "excluded", "shrunk"])
def test_losing_a_device_of_the_old_plan_replans(change: str) -> None:
    old, fleet, request = _two_stage_plan()
    gone = old.pipelines[0].stages[1].devices[0]
    if change == "removed":
        fleet = fleet.without({gone})
    elif change == "excluded":
        request = replace(request, exclude=frozenset({gone}))
    else:   # its memory no longer holds its layers
        fleet = FleetSnapshot(tuple(replace(d, memory_bytes=d.memory_bytes // 2) if d.id == gone else d
                                    for d in fleet.devices))
    best = plan_pipeline(PROFILE, fleet, request)
    plan = plan_pipeline(PROFILE, fleet, request, previous=old)
    assert plan.pipelines == best.pipelines and plan.search == "exact"
    assert change == "shrunk" or gone not in plan.pipelines[0].devices
    assert plan.layers_moved == layers_moved(old, plan) > 0
    assert f"Re-planned: {plan.layers_moved} layer(s) move." in plan.reason


def test_the_same_fleet_keeps_the_same_plan() -> None:
    old, fleet, request = _two_stage_plan()
    plan = plan_pipeline(PROFILE, fleet, request, previous=old)
    assert plan.pipelines == old.pipelines and plan.layers_moved == 0 and plan.search == "kept"


def test_nothing_fits_any_more_is_still_an_error() -> None:
    old, fleet, request = _two_stage_plan()
    tiny = FleetSnapshot(tuple(replace(d, memory_bytes=1000) for d in fleet.devices))
    with pytest.raises(PlacementError, match="more memory"):
        plan_pipeline(PROFILE, tiny, request, previous=old)


@pytest.mark.parametrize("seed", range(40))
def test_random_fleet_changes(seed: int) -> None:
    """A device leaves, another is slower: either the old placement is kept (then it is still valid and within
    KEEP_WITHIN of the best) or the answer is the fresh plan with its moves counted."""
    case = random_case(seed, constrained=False)
    try:
        old = plan_pipeline(case.profile, case.fleet, case.request)
    except PlacementError:
        return
    rng = random.Random(seed)
    ids = sorted(d.id for d in case.fleet.devices)
    slower, gone = rng.choice(ids), rng.choice([*ids, ""])      # now and then nobody leaves
    devices = tuple(replace(d, speeds=tuple(replace(s, flops=s.flops / 2, mem_bandwidth=s.mem_bandwidth / 2)
                                            for s in d.speeds)) if d.id == slower else d
                    for d in case.fleet.devices if d.id != gone)
    fleet = FleetSnapshot(devices, case.fleet.links, case.fleet.origin_site)
    try:
        best = plan_pipeline(case.profile, fleet, case.request)
    except PlacementError:
        return
    plan = plan_pipeline(case.profile, fleet, case.request, previous=old)
    if plan.search == "kept":
        assert plan.layers_moved == 0 and _placement(plan) == _placement(old)
        assert plan.pipelines[0] == evaluate(case.profile, fleet, case.request, _placement(old))
        assert plan.objective_s <= best.objective_s * (1 + KEEP_WITHIN)
    else:       # the same placement would have been kept
        assert plan.pipelines == best.pipelines
        assert plan.layers_moved == layers_moved(old, best) > 0


# ------------------------------------------------------------------ the kept plan and the new request
@pytest.mark.parametrize("new_request", [
    PlanRequest(objective="latency", exclude=frozenset({"a"})),
    PlanRequest(objective="latency", first_site="s2"),
    PlanRequest(objective="latency", last_site="s2"),
    PlanRequest(objective="throughput", max_stages=1),
])
def test_a_kept_plan_honours_the_new_request(new_request: PlanRequest) -> None:
    """Boxes a (s1, 1% faster) and b (s2) each hold the model: the old latency plan is a alone, the old
    throughput plan splits over both. The new request rules the old plan out."""
    need = _need(new_request)
    fleet = FleetSnapshot((_box("a", need, 1.01, site="s1"), _box("b", need, site="s2")))
    old = plan_pipeline(PROFILE, fleet, replace(new_request, first_site=None, last_site=None, max_stages=None,
                                                exclude=frozenset()))
    if new_request.objective == "latency":
        assert _placement(old) == [(("a",), 0, NUM_LAYERS)]
    else:
        assert len(old.pipelines[0].stages) == 2
    plan = plan_pipeline(PROFILE, fleet, new_request, previous=old)
    assert plan.search == "exact" and plan.layers_moved > 0
    stages = plan.pipelines[0].stages
    assert new_request.first_site in (None, fleet.device(stages[0].devices[0]).site)
    assert new_request.last_site in (None, fleet.device(stages[-1].devices[0]).site)
    assert len(stages) <= (new_request.max_stages or len(stages))
    assert not set(plan.pipelines[0].devices) & new_request.exclude


def test_a_kept_plan_has_no_groups_when_tp_is_off() -> None:
    gpus = tuple(Device(f"g{k}", _need(PlanRequest()) // 3, (Speed("torch-cuda", "bfloat16", 1e12, 1e10),),
                        "cloud", "dc", "box") for k in range(4))
    cpu = Device("cpu", 10 * _need(PlanRequest()), (Speed("torch-cpu", "bfloat16", 1e11, 1e9),), "cloud", "dc")
    links = tuple(Link(a.id, b.id, 300e9, 5e-6) for a, b in itertools.combinations(gpus, 2))
    fleet = FleetSnapshot((*gpus, cpu), links)
    old = plan_pipeline(PROFILE, fleet, PlanRequest(objective="latency"))
    assert max(s.tp_degree for s in old.pipelines[0].stages) > 1
    request = PlanRequest(objective="latency", tensor_parallel=False)
    plan = plan_pipeline(PROFILE, fleet, request, previous=old)
    assert all(s.tp_degree == 1 for s in plan.pipelines[0].stages)


# ------------------------------------------------------------------ layers_moved
def _plan(*replicas: list[tuple[tuple[str, ...], int, int]]) -> Plan:
    pipelines = tuple(Pipeline(tuple(PlannedStage(devices, a, b, "torch-cuda", "bfloat16", 1.0, 0.0, 0, 0, 0)
                                     for devices, a, b in stages), 1.0, 1.0, "") for stages in replicas)
    return Plan("m", "throughput", pipelines, 1.0, "")


AB = [(("a",), 0, 4), (("b",), 4, 8)]


@pytest.mark.parametrize("before, after, moved", [
    ([AB], [AB], 0),
    ([AB], [[(("a",), 0, 6), (("b",), 6, 8)]], 2),                   # a boundary shifts by two layers
    ([AB], [[(("b",), 0, 4), (("a",), 4, 8)]], 8),                   # the devices swap
    ([AB], [[(("a",), 0, 4), (("c",), 4, 8)]], 4),                   # b is replaced
    ([AB], [[(("a",), 0, 4), (("b", "c"), 4, 8)]], 4),               # b joins a group: its layers change owner
    ([AB], [[(("a",), 0, 2), (("c",), 2, 3), (("b",), 3, 8)]], 2),
    ([AB], [AB, [(("c",), 0, 8)]], 8),                               # a new replica: all its layers move in
    ([AB, [(("c",), 0, 8)]], [AB], 8),                               # a replica goes
])
def test_layers_moved(before, after, moved) -> None:
    assert layers_moved(_plan(*before), _plan(*after)) == moved
    assert layers_moved(_plan(*after), _plan(*before)) == moved
