"""What this box's agent reports: the capability probe (NVML, backends) and its measured speeds, as a table.

    python benchmarks/probe_report.py [--remeasure]

Prints each GPU as NVML reports it and each (backend, dtype) speed the planner will use: matmul FLOP/s
and copy bandwidth (bytes read + written per second). With GPUs, it then takes a heartbeat's telemetry
while matmuls keep the first GPU busy, and prints the agent's GPU gauges as Prometheus scrapes them.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import torch
from prometheus_client import generate_latest

from stratamesh.agent.engine.stage_engine import EngineConfig
from stratamesh.agent.metrics import AgentMetrics
from stratamesh.agent.probe import probe
from stratamesh.agent.stages import StageHost
from stratamesh.agent.telemetry import TelemetrySampler


def busy_telemetry(busy_s: float = 2.0) -> None:
    """A telemetry sample taken while GPU 0 runs matmuls, and the gauges an agent would serve from it."""
    stop = threading.Event()

    def load() -> None:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        while not stop.is_set():
            a @ a
            torch.cuda.synchronize()

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    time.sleep(busy_s)
    sampler = TelemetrySampler(StageHost(EngineConfig()), lambda: 0, has_gpus=True)
    telemetry = asyncio.run(sampler.sample())
    stop.set()
    worker.join()
    metrics = AgentMetrics()
    metrics.load.update(telemetry, {})
    print(f"\nheartbeat telemetry after {busy_s:.0f} s of bf16 matmuls on GPU 0:")
    for g in telemetry.gpus:
        print(f"  GPU {g.index}: utilization {g.utilization_pct}%, {(g.mem_total_bytes - g.mem_free_bytes) / 1e9:.1f} GB "
              f"used, {g.temperature_c} C, {g.power_w} W")
    print("\nthe agent's /metrics, GPU lines:")
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith("stratamesh:gpu_"):
            print("  " + line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--remeasure", action="store_true", help="ignore the box's cached speeds")
    args = parser.parse_args()
    caps = probe(remeasure=args.remeasure)
    print(f"{caps.hostname}: {caps.cpu_model}, {caps.num_cpus} CPUs, {caps.ram_total_bytes / 1e9:.1f} GB RAM; "
          f"backends {', '.join(caps.backends)}\n")
    if caps.gpus:
        print("| GPU | name | CC | memory total (GB) | free (GB) | util % | temp C | power W | limit W |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|")
        for g in caps.gpus:
            cells = [g.utilization_pct, g.temperature_c, g.power_w, g.power_limit_w]
            print(f"| {g.index} | {g.name} | {g.compute_capability} | {g.mem_total_bytes / 1e9:.1f} | "
                  f"{g.mem_free_bytes / 1e9:.1f} | " + " | ".join("-" if c is None else f"{c:.0f}" for c in cells) + " |")
        print()
    print("| backend | dtype | matmul TFLOP/s | copy GB/s |\n|---|---|---:|---:|")
    for s in caps.speeds:
        print(f"| {s.backend} | {s.dtype} | {s.flops / 1e12:.2f} | {s.mem_bandwidth / 1e9:.0f} |")
    if caps.gpus and torch.cuda.is_available():
        busy_telemetry()


if __name__ == "__main__":
    main()
