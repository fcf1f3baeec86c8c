"""The speed probe measures this CPU for real: plausible, positive numbers for float32."""

from __future__ import annotations

from stratamesh.agent.speed import measure_speeds


def test_measures_cpu_float32_matmul_and_copy() -> None:
    (cpu, *gpu) = measure_speeds(reps=1)
    assert (cpu.backend, cpu.dtype) == ("torch-cpu", "float32")
    assert 1e8 < cpu.flops < 1e14            # between a slow core and far beyond any CPU here
    assert 1e8 < cpu.mem_bandwidth < 1e13
    assert all(s.backend == "torch-cuda" for s in gpu)
