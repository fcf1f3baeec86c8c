"""Probe parsing is pure: tables of what /proc and NVML may say."""

from __future__ import annotations

import pytest

from stratamesh.agent.probe import RawGpu, backends_for, parse_cpu_model, parse_gpu, parse_meminfo, probe

MEMINFO = "MemTotal:       24576000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"


@pytest.mark.parametrize("text, expected", [
    (MEMINFO, (24576000 * 1024, 20000000 * 1024)),
    ("MemTotal: 2048 kB\nMemFree: 1024 kB\n", (2048 * 1024, 1024 * 1024)),   # old kernels: no MemAvailable
    ("", (0, 0)),
    ("garbage\nMemTotal: lots\n", (0, 0)),
])
def test_parse_meminfo(text: str, expected: tuple[int, int]) -> None:
    assert parse_meminfo(text) == expected


def test_parse_cpu_model() -> None:
    assert parse_cpu_model("processor\t: 0\nmodel name\t: AMD EPYC 9654\n") == "AMD EPYC 9654"


@pytest.mark.parametrize("raw, name, uuid", [
    (RawGpu(0, b"NVIDIA H100 80GB HBM3", 85 << 30, 80 << 30, b"GPU-1"), "NVIDIA H100 80GB HBM3", "GPU-1"),
    (RawGpu(1, "NVIDIA L4", 24 << 30, 20 << 30, "GPU-2"), "NVIDIA L4", "GPU-2"),
])
def test_parse_gpu_accepts_bytes_or_str(raw: RawGpu, name: str, uuid: str) -> None:
    gpu = parse_gpu(raw)
    assert (gpu.name, gpu.uuid, gpu.mem_free_bytes) == (name, uuid, raw.mem_free_bytes)


def test_backends() -> None:
    gpu = parse_gpu(RawGpu(0, "L4", 1, 1, "u"))
    assert backends_for([], cuda_available=True) == ("torch-cpu",)
    assert backends_for([gpu], cuda_available=False) == ("torch-cpu",)
    assert backends_for([gpu], cuda_available=True) == ("torch-cpu", "torch-cuda")


def test_probe_on_this_box() -> None:
    caps = probe()   # no NVIDIA here: NVML fails and the probe reports no GPU rather than raising
    assert caps.num_cpus >= 1 and caps.ram_total_bytes > 0
    assert caps.usable_mem_bytes == (caps.ram_available_bytes if not caps.gpus
                                     else sum(g.mem_free_bytes for g in caps.gpus))
