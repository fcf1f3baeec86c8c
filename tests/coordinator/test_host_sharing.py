"""Agents of one host share its cores and RAM in the planner's fleet, and each device carries the framework
overheads its host measured (coordinator/placement.py fleet_of, cpu_shares)."""

from __future__ import annotations

import pytest

from stratamesh.coordinator.placement import (DEFAULT_SERVING_CPU_PER_TOKEN_S, Hosts, cpu_shares, fleet_of,
                                              serving_cpu_of)
from stratamesh.fleet.boxes import Capabilities, GpuInfo, Speed, Telemetry
from stratamesh.partitioner.cost import StageTables, single_unit
from stratamesh.partitioner.plan import PlanRequest
from stratamesh.partitioner.profile import profile_from_hf_config

GiB = 1 << 30
CPU = Speed("torch-cpu", "float32", 100e9, 20e9, step_overhead_s=2e-4, layer_overhead_s=5e-4)


def cpu_agent(host: str, threads: int, cores: int = 2) -> Capabilities:
    return Capabilities(host, "Xeon", cores, 16 * GiB, 12 * GiB, speeds=(CPU,), num_threads=threads)


def test_agents_whose_threads_outnumber_their_hosts_cores_split_them() -> None:
    agents = {"a": cpu_agent("box", 1), "b": cpu_agent("box", 1), "c": cpu_agent("box", 1), "d": cpu_agent("box", 1),
              "e": cpu_agent("other", 1)}
    assert cpu_shares(agents) == {"a": (0.5, 4), "b": (0.5, 4), "c": (0.5, 4), "d": (0.5, 4), "e": (1.0, 1)}
    assert cpu_shares({"a": cpu_agent("box", 1), "b": cpu_agent("box", 1)}) == {"a": (1.0, 2), "b": (1.0, 2)}
    assert cpu_shares({"a": cpu_agent("box", 0), "b": cpu_agent("box", 2)}) == {"a": (0.5, 2), "b": (0.5, 2)}
    # the coordinator's origin on the same host takes a core's worth too
    two = {"a": cpu_agent("box", 1), "b": cpu_agent("box", 1)}
    assert cpu_shares(two, origin_host="box") == {"a": (2 / 3, 2), "b": (2 / 3, 2)}
    assert cpu_shares(two, origin_host="elsewhere") == {"a": (1.0, 2), "b": (1.0, 2)}


def test_a_gpu_agent_takes_no_share_of_its_hosts_cores() -> None:
    gpu = GpuInfo(0, "H100", "GPU-1", 80 * GiB, 79 * GiB, "9.0")
    cuda = Speed("torch-cuda", "bfloat16", 700e12, 3e12)
    agents = {"g": Capabilities("box", "EPYC", 2, 16 * GiB, 12 * GiB, (gpu,), speeds=(CPU, cuda), num_threads=2),
              "c": cpu_agent("box", 2)}
    assert cpu_shares(agents) == {"c": (1.0, 1)}


def test_a_shared_hosts_devices_compute_at_their_share_with_their_share_of_the_ram_and_its_overheads() -> None:
    alone = {d.id: d for d in fleet_of({"a": cpu_agent("box", 1)}).devices}["a"]
    crowd = {d.id: d for d in fleet_of({k: cpu_agent("box", 1) for k in "abcd"}).devices}["a"]
    assert (alone.step_overhead_s, alone.layer_overhead_s) == (2e-4, 5e-4)
    assert (crowd.step_overhead_s, crowd.layer_overhead_s) == (4e-4, 1e-3)        # each gets half a core
    assert crowd.speeds[0].flops == alone.speeds[0].flops / 2
    assert crowd.speeds[0].mem_bandwidth == alone.speeds[0].mem_bandwidth / 2
    assert crowd.memory_bytes == alone.memory_bytes // 4


def test_a_stages_step_counts_the_step_and_layer_overheads() -> None:
    config = {"model_type": "llama", "num_hidden_layers": 6, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 128}
    profile = profile_from_hf_config(config, dtype="float32", name="m")
    tables = StageTables(profile, PlanRequest(context_len=128, concurrency=8))
    measured = {d.id: d for d in fleet_of({"a": cpu_agent("box", 2)}).devices}["a"]
    unit = single_unit(measured, profile)
    bare = single_unit(fleet_of({"a": Capabilities("box", "Xeon", 2, 16 * GiB, 12 * GiB, num_threads=2,
                                                   speeds=(Speed("torch-cpu", "float32", 100e9, 20e9),))}
                                ).devices[0], profile)
    for start, end in ((0, 1), (0, 3), (2, 6)):
        extra = tables.time_of(unit, start, end) - tables.time_of(bare, start, end)
        assert extra == pytest.approx(2e-4 + (end - start) * 5e-4)


def test_a_hosts_serving_cost_is_the_median_its_agents_measured() -> None:
    agents = {k: cpu_agent("box", 1) for k in "abcd"} | {"e": cpu_agent("other", 1), "f": cpu_agent("idle", 1)}
    telemetry = {"a": Telemetry(1.0, serving_cpu_per_token_s=1e-4), "b": Telemetry(1.0, serving_cpu_per_token_s=3e-4),
                 "c": Telemetry(1.0, serving_cpu_per_token_s=2e-4), "d": Telemetry(1.0),   # d has not served yet
                 "e": Telemetry(1.0, serving_cpu_per_token_s=5e-5)}
    assert serving_cpu_of(agents, telemetry) == {"box": 2e-4, "other": 5e-5}      # f never reported


def test_each_device_pays_its_hosts_serving_cost_at_its_share_of_the_cores() -> None:
    four = {k: cpu_agent("box", 1) for k in "abcd"} | {"e": cpu_agent("other", 1)}
    devices = {d.id: d for d in fleet_of(four, hosts=Hosts(serving_cpu={"box": 2e-4})).devices}
    assert devices["a"].token_overhead_s == pytest.approx(4e-4)                   # half a core each
    assert devices["e"].token_overhead_s == DEFAULT_SERVING_CPU_PER_TOKEN_S       # measured nothing: the default
    gpu = GpuInfo(0, "H100", "GPU-1", 80 * GiB, 79 * GiB, "9.0")
    cuda = Speed("torch-cuda", "bfloat16", 700e12, 3e12)
    g = Capabilities("box", "EPYC", 2, 16 * GiB, 12 * GiB, (gpu,), speeds=(CPU, cuda), num_threads=2)
    (device,) = fleet_of({"g": g}, hosts=Hosts(serving_cpu={"box": 2e-4})).devices
    assert device.token_overhead_s == 2e-4        # a GPU agent's serving path has the cores it needs


def test_a_stages_step_pays_the_serving_cost_for_each_of_its_tokens() -> None:
    config = {"model_type": "llama", "num_hidden_layers": 6, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 128}
    profile = profile_from_hf_config(config, dtype="float32", name="m")
    agents = {"a": cpu_agent("box", 2)}
    cheap, dear = (single_unit(fleet_of(agents, hosts=Hosts(serving_cpu={"box": cost})).devices[0], profile)
                   for cost in (1e-4, 3e-4))
    for concurrency in (1, 8, 32):
        tables = StageTables(profile, PlanRequest(context_len=128, concurrency=concurrency))
        for start, end in ((0, 1), (2, 6)):
            extra = tables.time_of(dear, start, end) - tables.time_of(cheap, start, end)
            assert extra == pytest.approx(concurrency * 2e-4)
