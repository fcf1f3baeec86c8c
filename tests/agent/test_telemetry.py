"""Heartbeat telemetry from real schedulers, GPU readings through the probe's parser, and its Prometheus view."""

from __future__ import annotations


import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stratamesh.agent.engine.block_manager import BlockManager
from stratamesh.agent.engine.scheduler import Scheduler
from stratamesh.agent.engine.sequence import WorkItem
from stratamesh.agent.engine.stage_engine import EngineConfig
from stratamesh.agent.metrics import AgentMetrics
from stratamesh.agent.probe import RawGpu
from stratamesh.agent.stages import StageHost
from stratamesh.agent.telemetry import SERVING_WINDOW_TOKENS, ServingCpu, TelemetrySampler, stage_load, tokens_per_s
from stratamesh.fleet.boxes import StageLoad, Telemetry
from stratamesh.fleet.stages import Assignment, StageSpec


def test_stage_load_counts_running_waiting_blocks_and_prefix_lookups() -> None:
    scheduler = Scheduler(BlockManager(num_blocks=10, block_size=4), max_batch_tokens=64)
    scheduler.open("a", list(range(9)), max_cached_tokens=8)
    scheduler.open("b", list(range(20, 25)), max_cached_tokens=0)
    scheduler.add(WorkItem("a", 0, tuple(range(9)), sample=True))
    # a is queued, nothing is computed yet; both prompts (9 + 5 tokens) were looked up in the prefix cache
    assert stage_load("p", scheduler) == StageLoad("p", 0, 1, 0, 10, 14, 0)
    batch = scheduler.schedule()
    scheduler.postprocess(batch)
    load = stage_load("p", scheduler)
    assert (load.num_running, load.num_waiting, load.kv_blocks_used) == (1, 0, 3)   # 9 tokens: 3 blocks of 4
    assert load.kv_usage == 0.3


@pytest.mark.parametrize("now, then, elapsed_s, expected", [
    (1000, 400, 2.0, 300.0), (5, 5, 1.0, 0.0), (7, 3, 0.0, 0.0), (3, 7, 1.0, 0.0)])
def test_tokens_per_s(now: int, then: int, elapsed_s: float, expected: float) -> None:
    assert tokens_per_s(now, then, elapsed_s) == expected


async def test_sampler_reports_each_stage_the_gpus_and_the_rate_since_the_last_sample(tiny_model) -> None:
    spec = StageSpec("m", str(tiny_model("llama", num_layers=2, hidden_size=64, intermediate_size=128)), 0, 2, 2)
    host = StageHost(EngineConfig(kv_cache_bytes=1 << 20))
    await host.load(Assignment("p-0", spec))
    clock = iter([100.0, 102.0, 103.0])
    gpus = [RawGpu(0, b"NVIDIA L4", 24 << 30, 20 << 30, b"GPU-1", (8, 9), 55, 61, 40_000, 72_000)]
    sampler = TelemetrySampler(host, inbox_depth=lambda: 2, has_gpus=True, read_gpus=lambda: gpus,
                               clock=lambda: next(clock))
    host.num_computed_tokens += 500
    first = await sampler.sample()
    host.num_computed_tokens += 100
    second = await sampler.sample()
    assert (first.unix_s, first.tokens_per_s, second.tokens_per_s) == (102.0, 250.0, 100.0)
    (load,) = second.stages
    assert load.assignment_id == "p-0" and load.kv_blocks_total == host.engines["p-0"].runner.num_blocks
    assert second.queue_depth == 2
    (gpu,) = second.gpus
    assert (gpu.name, gpu.utilization_pct, gpu.temperature_c, gpu.power_w) == ("NVIDIA L4", 55, 61, 40.0)
    silent = TelemetrySampler(host, lambda: 0, has_gpus=False, read_gpus=lambda: pytest.fail("read NVML"))
    assert (await silent.sample()).gpus == ()


def test_load_collector_exposes_vllm_gauges_per_stage() -> None:
    metrics = AgentMetrics()
    text = generate_latest(metrics.registry).decode()
    assert "vllm:kv_cache_usage_perc" in text   # present, empty, before the first sample
    telemetry = Telemetry(1.0, 3, 42.0, (StageLoad("p-0", 2, 1, 16, 64, 100, 40), StageLoad("p-1", 0, 0, 0, 8)))
    metrics.load.update(telemetry, {"p-0": ("m", "0-3"), "p-1": ("m", "3-6")})
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}

    def value(name: str, stage: str) -> float:
        (sample,) = [s for s in families[name].samples if s.labels.get("stage") == stage]
        return sample.value

    assert value("vllm:kv_cache_usage_perc", "0-3") == 0.25 and value("vllm:kv_cache_usage_perc", "3-6") == 0
    assert value("vllm:num_requests_running", "0-3") == 2 and value("vllm:num_requests_waiting", "0-3") == 1
    assert value("vllm:prefix_cache_queries", "0-3") == 100 and value("vllm:prefix_cache_hits", "0-3") == 40
    assert families["vllm:prefix_cache_hits"].type == "counter"
    assert families["stratamesh:queue_depth"].samples[0].value == 3


def test_the_serving_paths_cpu_per_token_is_the_processes_cpu_beyond_the_layers_over_a_full_window() -> None:
    host = StageHost(EngineConfig(kv_cache_bytes=1 << 20))
    process_cpu = [10.0]
    serving = ServingCpu(host, process_cpu=lambda: process_cpu[0])

    def served(tokens: int, cpu_s: float, layers_s: float) -> float:
        host.num_step_tokens += tokens
        host.layers_cpu_s += layers_s
        process_cpu[0] += cpu_s
        return serving.update()

    assert served(0, 0.0, 0.0) == 0.0                               # nothing measured yet
    half = SERVING_WINDOW_TOKENS // 2
    assert served(half, 0.30, 0.20) == 0.0                          # the window is not full
    # full: (0.30 + 0.30 CPU) - (0.20 + 0.20 in the layers) over 2 x half tokens
    assert served(half, 0.30, 0.20) == pytest.approx(0.2 / SERVING_WINDOW_TOKENS)
    assert served(0, 5.0, 0.0) == pytest.approx(0.2 / SERVING_WINDOW_TOKENS)   # idle: the figure stands ...
    # ... and the idle spell's CPU (heartbeats, zeroconf) is not charged to the next window's tokens
    assert served(SERVING_WINDOW_TOKENS, 0.5, 0.1) == pytest.approx(0.4 / SERVING_WINDOW_TOKENS)
    assert served(SERVING_WINDOW_TOKENS, 0.1, 0.2) == 0.0           # layers' CPU above the process's: never < 0


async def test_a_steps_layers_add_their_cpu_to_the_hosts() -> None:
    from stratamesh.agent.dataplane import _between_layers

    host = StageHost(EngineConfig(kv_cache_bytes=1 << 20))

    def layers():
        for _ in range(3):
            sum(range(20_000))          # CPU work a layer would do
            yield
        return "out"

    assert await _between_layers(layers(), host) == "out"
    assert host.layers_cpu_s > 0
