"""Tensor-parallel stages in placement: an agent's ranks as planner devices, TP groups of one agent, repairs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.control.probes import AgentLink
from stratamesh.coordinator.placement import DEFAULT_SERVING_CPU_PER_TOKEN_S, fleet_of, plan_stages, repair_stages
from stratamesh.coordinator.registry import Registry
from stratamesh.fleet.errors import PlacementError
from stratamesh.fleet.boxes import Capabilities, GpuInfo, Registration, Speed
from stratamesh.fleet.control_messages import ControlMessage, LinkMeasurement
from stratamesh.fleet.stages import Assignment, StageSpec
from stratamesh.partitioner.fleet_snapshot import NODE_LINK, SITE_LINK, Device, Link

GiB = 1 << 30
CONFIG = {"model_type": "llama", "num_hidden_layers": 6, "hidden_size": 256, "intermediate_size": 512,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 2048}
CPU_SPEED = Speed("torch-cpu", "float32", 1e11, 1e10)
CUDA_SPEED = Speed("torch-cuda", "float32", 5e13, 2e12)


def cpu_box(ranks: int = 1, tier: str = "edge", host: str = "box", mem_gib: int = 8) -> Capabilities:
    return Capabilities(host, "cpu", 4, mem_gib * GiB, mem_gib * GiB, speeds=(CPU_SPEED,), tier=tier,
                        num_ranks=ranks)


def gpu_box(free_gib: tuple[int, ...], ranks: int) -> Capabilities:
    gpus = tuple(GpuInfo(i, "L4", 24 * GiB, free * GiB) for i, free in enumerate(free_gib))
    return Capabilities("gpu-box", "EPYC", 32, 64 * GiB, 60 * GiB, gpus, ("torch-cpu", "torch-cuda"),
                        (CUDA_SPEED,), tier="cloud", num_ranks=ranks)


def edge_cloud_edge() -> dict[str, Capabilities]:
    """Three agents on one host (loopback), equal speeds; the cloud one may run a stage on 2 ranks."""
    return {"edge1": cpu_box(), "cloud": cpu_box(2, "cloud"), "edge2": cpu_box()}


# ------------------------------------------------------------------ the fleet
def test_a_cpu_agent_with_two_ranks_is_two_devices_sharing_its_memory_and_speed() -> None:
    fleet = fleet_of({"a": cpu_box(2)})
    half = Speed("torch-cpu", "float32", CPU_SPEED.flops / 2, CPU_SPEED.mem_bandwidth / 2)
    # each rank says the dtype it computes in (float32 on a CPU) and pays the default serving cost (none measured)
    serving = DEFAULT_SERVING_CPU_PER_TOKEN_S
    assert fleet.devices == (
        Device("a#0", 4 * GiB, (half,), "edge", "", node="a", dtype="float32", token_overhead_s=serving),
        Device("a#1", 4 * GiB, (half,), "edge", "", node="a", dtype="float32", token_overhead_s=serving))


def test_a_gpu_agent_rank_has_its_gpus_free_memory_and_the_measured_speed() -> None:
    fleet = fleet_of({"g": gpu_box((20, 16), ranks=2)})
    full = Speed(*(getattr(CUDA_SPEED, f) for f in ("backend", "dtype", "flops", "mem_bandwidth")))
    assert [(d.id, d.memory_bytes, d.speeds, d.node, d.tier) for d in fleet.devices] == [
        ("g#0", 20 * GiB, (full,), "g", "cloud"), ("g#1", 16 * GiB, (full,), "g", "cloud")]


def test_a_gpu_agent_has_no_more_ranks_than_gpus() -> None:
    assert [d.id for d in fleet_of({"g": gpu_box((20, 16), ranks=4)}).devices] == ["g#0", "g#1"]


def test_a_single_rank_agent_is_one_device_named_after_it() -> None:
    fleet = fleet_of({"a": cpu_box(), "g": gpu_box((20, 16), ranks=1)})
    # one rank runs on GPU 0 alone: its memory, not both GPUs' (what the agent loads onto cuda:0)
    assert [(d.id, d.memory_bytes, d.speeds[0].flops, d.node) for d in fleet.devices] == [
        ("a", 8 * GiB, CPU_SPEED.flops, "a"), ("g", 20 * GiB, CUDA_SPEED.flops, "g")]


def test_measured_links_reach_every_rank_and_agents_of_one_host_default_to_loopback() -> None:
    agents = {"a": cpu_box(2, host="h1"), "b": cpu_box(host="h2"), "c": cpu_box(host="h2"), "d": cpu_box(host="h1")}
    fleet = fleet_of(agents, [LinkMeasurement("b", 0.01, 1e8, "", "a", 1.0)])
    device = fleet.device
    assert fleet.link(device("a#1"), device("b")) == Link("a#1", "b", 1e8, 0.01)
    assert fleet.link(device("a#0"), device("b")) == Link("a#0", "b", 1e8, 0.01)
    assert fleet.link(device("a#0"), device("a#1")) == NODE_LINK    # ranks of one agent: the node default
    assert fleet.link(device("b"), device("c")).bandwidth == NODE_LINK.bandwidth    # one host, not measured
    assert fleet.link(device("a#1"), device("d")).bandwidth == NODE_LINK.bandwidth
    assert fleet.link(device("a#0"), device("c")) == SITE_LINK    # two hosts, not measured


# ------------------------------------------------------------------ planning
def tiles(specs: list[StageSpec], num_layers: int) -> bool:
    """Whether the stages cover [0, num_layers) once, in order."""
    ends = [0] + [s.end_layer for s in specs]
    return [s.start_layer for s in specs] == ends[:-1] and ends[-1] == num_layers


def test_the_cloud_agent_serves_the_middle_layers_as_a_tp_group_between_the_edges() -> None:
    plan, specs = plan_stages("m", "/models/m", CONFIG, edge_cloud_edge(), num_stages=3)
    assert sorted(agent for agent, _ in specs) == ["cloud", "edge1", "edge2"]
    assert {agent: spec.tp_degree for agent, spec in specs} == {"cloud": 2, "edge1": 1, "edge2": 1}
    assert tiles([s for _, s in specs], 6)
    devices = {agent: stage.devices for (agent, _), stage in zip(specs, plan.pipelines[0].stages, strict=True)}
    assert devices == {"cloud": ("cloud#0", "cloud#1"), "edge1": ("edge1",), "edge2": ("edge2",)}


@pytest.mark.parametrize("ranks", [(1, 2, 1), (2, 2, 1), (4, 1, 2), (2, 4, 4), (1, 1, 8)])
def test_a_stage_never_mixes_agents_and_its_degree_is_its_ranks(ranks: tuple[int, ...]) -> None:
    agents = {f"a{i}": cpu_box(n, mem_gib=2 + i) for i, n in enumerate(ranks)}
    fleet = fleet_of(agents)
    plan, specs = plan_stages("m", "/models/m", CONFIG, agents, num_stages=3)
    for stage, (agent, spec) in zip(plan.pipelines[0].stages, specs, strict=True):
        assert {fleet.device(d).node for d in stage.devices} == {agent}
        assert spec.tp_degree == len(stage.devices) <= agents[agent].num_ranks
    assert tiles([s for _, s in specs], 6)


def test_a_previous_tp_placement_is_kept_as_the_group_it_is() -> None:
    agents = edge_cloud_edge()
    _, specs = plan_stages("m", "/models/m", CONFIG, agents, num_stages=3)
    previous = [(a, s.start_layer, s.end_layer, s.tp_degree) for a, s in specs]
    plan, again = plan_stages("m", "/models/m", CONFIG, agents, 3, previous=previous)
    assert plan.search == "kept" and again == specs


# ------------------------------------------------------------------ repairs
def test_a_tp_stage_whose_agent_left_goes_to_a_spare_with_enough_ranks() -> None:
    agents = edge_cloud_edge()
    _, specs = plan_stages("m", "/models/m", CONFIG, agents, num_stages=3)
    placement = [(a, s.start_layer, s.end_layer, s.tp_degree) for a, s in specs]
    del agents["cloud"]
    agents |= {"small": cpu_box(), "big": cpu_box(2)}
    assert [a for a, _ in repair_stages("m", "/m", CONFIG, agents, placement)] == [
        ("big" if a == "cloud" else a) for a, _ in specs]
    del agents["big"]
    with pytest.raises(PlacementError, match=r"no spare agent can take the stages \[2, 4\) of m"):
        repair_stages("m", "/m", CONFIG, agents, placement)     # one rank is not a group of two


def test_a_single_rank_stage_may_go_to_one_rank_of_a_multi_rank_spare() -> None:
    placement = [("e1", 0, 3, 1), ("e2", 3, 6, 1)]
    assert [a for a, _ in repair_stages("m", "/m", CONFIG, {"e1": cpu_box(), "big": cpu_box(2)}, placement)] == [
        "e1", "big"]


def test_a_drain_moves_a_tp_stage_to_a_spare_as_a_group_of_the_same_degree(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: 100.0)
    for port, (agent_id, caps) in enumerate(edge_cloud_edge().items()):
        link = AgentLink(agent_id, f"127.0.0.1:{5000 + port}", caps, lambda message: None)
        deployer.agent_connected(link, Registration(agent_id, agent_id, link.stage_address, caps))
    deployer.plans.add_model("m", str(tmp_path), num_stages=3)
    stages = registry.active_plan("m").stages
    assert {s.agent_id: s.spec.tp_degree for s in stages} == {"cloud": 2, "edge1": 1, "edge2": 1}
    sent: list[ControlMessage] = []
    spare = AgentLink("spare", "127.0.0.1:5009", cpu_box(2), sent.append)
    deployer.agent_connected(spare, Registration("spare", "spare", spare.stage_address, spare.capabilities))
    ((old, new),) = deployer.drain("cloud")
    assert (new.agent_id, new.spec, old.agent_id) == ("spare", old.spec, "cloud")
    assert [m.stage.tp_degree for m in sent if isinstance(m, Assignment)] == [2]
