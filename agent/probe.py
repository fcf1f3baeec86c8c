"""What this box offers: CPU, RAM and NVIDIA GPUs. Reading (I/O) is split from parsing (pure)."""

from __future__ import annotations

import logging
import os
import platform
import socket
from dataclasses import dataclass

from stratamesh.fleet.types import Capabilities, GpuInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RawGpu:
    """One GPU as NVML reports it, before any interpretation."""

    index: int
    name: str | bytes
    mem_total_bytes: int
    mem_free_bytes: int
    uuid: str | bytes


def read_meminfo(path: str = "/proc/meminfo") -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except OSError:
        return ""


def read_cpuinfo(path: str = "/proc/cpuinfo") -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def read_nvml() -> list[RawGpu]:
    """Every NVIDIA GPU through nvidia-ml-py; an empty list where there is no driver or NVML fails."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound on boxes without NVIDIA: no GPU
        log.debug("no NVML: %s", exc)
        return []
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(RawGpu(index, pynvml.nvmlDeviceGetName(handle), int(mem.total),
                               int(mem.free), pynvml.nvmlDeviceGetUUID(handle)))
        return gpus
    except Exception as exc:
        log.warning("NVML query failed, reporting no GPUs: %s", exc)
        return []
    finally:
        pynvml.nvmlShutdown()


def parse_meminfo(text: str) -> tuple[int, int]:
    """(total, available) bytes from /proc/meminfo text; (0, 0) if absent."""
    fields = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[key.strip()] = int(parts[0]) * 1024
    total = fields.get("MemTotal", 0)
    return total, fields.get("MemAvailable", fields.get("MemFree", total))


def parse_cpu_model(text: str) -> str:
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return platform.processor() or platform.machine()


def parse_gpu(raw: RawGpu) -> GpuInfo:
    def text(value: str | bytes) -> str:
        return value.decode(errors="replace") if isinstance(value, bytes) else value

    return GpuInfo(raw.index, text(raw.name), raw.mem_total_bytes, raw.mem_free_bytes, text(raw.uuid))


def backends_for(gpus: list[GpuInfo], cuda_available: bool) -> tuple[str, ...]:
    return ("torch-cpu", "torch-cuda") if gpus and cuda_available else ("torch-cpu",)


def probe(site: str = "", tier: str = "edge", measure: bool = True) -> Capabilities:
    """Reads and parses this box's capabilities; measure: time a matmul and a copy for the planner."""
    total, available = parse_meminfo(read_meminfo())
    gpus = [parse_gpu(raw) for raw in read_nvml()]
    import torch

    from stratamesh.agent.speed import measure_speeds

    return Capabilities(
        hostname=socket.gethostname(), cpu_model=parse_cpu_model(read_cpuinfo()),
        num_cpus=os.cpu_count() or 1, ram_total_bytes=total, ram_available_bytes=available,
        gpus=tuple(gpus), backends=backends_for(gpus, torch.cuda.is_available()),
        speeds=measure_speeds() if measure else (), site=site, tier=tier)
