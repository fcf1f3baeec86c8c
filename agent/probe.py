"""What this box offers: CPU, RAM, NVIDIA GPUs and backends. Reading (I/O) is split from parsing (pure)."""

from __future__ import annotations

import logging
import os
import platform
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.states import Runtime
from stratamesh.fleet.boxes import Capabilities, GpuInfo, Speed
from stratamesh.fleet.stages import AGENT_RUNTIMES, AUTO_RUNTIME, DTYPES, MAX_TP_DEGREE, ORT_DTYPES

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RawGpu:
    """One GPU as NVML reports it, before any interpretation; None where a reading failed."""

    index: int
    name: str | bytes
    mem_total_bytes: int
    mem_free_bytes: int
    uuid: str | bytes | None
    compute_capability: tuple[int, int] | None = None   # (major, minor)
    utilization_pct: int | None = None
    temperature_c: int | None = None
    power_mw: int | None = None
    power_limit_mw: int | None = None


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


def read_nvml(nvml: Any = None, environ: Mapping[str, str] = os.environ) -> list[RawGpu]:
    """The NVIDIA GPUs this process may use, through nvml (default: pynvml), each with the index CUDA gives it here
    (environ's CUDA_VISIBLE_DEVICES: see visible_gpus); [] where there is no driver or NVML fails."""
    gpus = _read_every_nvml_gpu(nvml)
    return visible_gpus(gpus, environ.get("CUDA_VISIBLE_DEVICES")) if gpus else gpus


def visible_gpus(gpus: Sequence[RawGpu], cuda_visible_devices: str | None) -> list[RawGpu]:
    """The GPUs of NVML's list (every GPU, in PCI bus order) that CUDA shows this process, indexed as CUDA and torch
    index them: "cuda:0" is the first one CUDA_VISIBLE_DEVICES names. None: every GPU. Entries are NVML indices or
    (prefixes of) UUIDs; as CUDA does, the list ends at the first entry that names no GPU, or one named already
    ("-1" hides every GPU). A MIG instance is not a GPU NVML lists here: the list ends there too, with a warning.
    (CUDA numbers GPUs in PCI bus order only with CUDA_DEVICE_ORDER=PCI_BUS_ID, which probe() sets.)"""
    if cuda_visible_devices is None:
        return list(gpus)

    def named(entry: str) -> RawGpu | None:
        if entry.lstrip("+-").isdigit():
            index = int(entry)
            return gpus[index] if 0 <= index < len(gpus) else None
        matches = [g for g in gpus if _text(g.uuid).startswith(entry)]
        if entry.startswith("MIG-"):
            log.warning("CUDA_VISIBLE_DEVICES names MIG instance %s: the agent serves on whole GPUs only", entry)
        return matches[0] if len(matches) == 1 and entry.startswith("GPU-") else None

    out: list[RawGpu] = []
    named_already: set[int] = set()     # NVML indices
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        gpu = named(entry) if entry else None
        if gpu is None or gpu.index in named_already:
            break
        named_already.add(gpu.index)
        out.append(replace(gpu, index=len(out)))
    return out


def _read_every_nvml_gpu(nvml: Any) -> list[RawGpu]:
    try:
        if nvml is None:
            import pynvml as nvml
        nvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001  NVMLError_LibraryNotFound on boxes without NVIDIA: no GPU
        log.debug("no NVML: %s", exc)
        return []
    try:
        return [_read_one_gpu(nvml, index, nvml.nvmlDeviceGetHandleByIndex(index))
                for index in range(nvml.nvmlDeviceGetCount())]
    except Exception as exc:  # noqa: BLE001  any failure here means no usable GPU list
        log.warning("NVML query failed, reporting no GPUs: %s", exc)
        return []
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception as exc:  # noqa: BLE001
            log.debug("nvmlShutdown failed: %s", exc)


def _read_one_gpu(nvml: Any, index: int, handle: Any) -> RawGpu:
    """Name and memory must read; each other reading is None if it fails (not every GPU has every sensor)."""
    def optional(what: str, read: Callable[[], Any]) -> Any:
        try:
            return read()
        except Exception as exc:  # noqa: BLE001  NVMLError_NotSupported, or a binding too old
            log.debug("GPU %d: no %s: %s", index, what, exc)
            return None

    mem = nvml.nvmlDeviceGetMemoryInfo(handle)
    utilization = optional("utilization", lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
    return RawGpu(
        index, nvml.nvmlDeviceGetName(handle), int(mem.total), int(mem.free),
        optional("uuid", lambda: nvml.nvmlDeviceGetUUID(handle)),
        optional("compute capability", lambda: tuple(nvml.nvmlDeviceGetCudaComputeCapability(handle))),
        None if utilization is None else utilization.gpu,
        optional("temperature", lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
        optional("power draw", lambda: nvml.nvmlDeviceGetPowerUsage(handle)),
        optional("power limit", lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle)))


def read_onnx_providers() -> list[str]:
    """onnxruntime's execution providers; [] where onnxruntime is not installed or fails to load."""
    try:
        import onnxruntime
        return list(onnxruntime.get_available_providers())
    except Exception as exc:  # noqa: BLE001  ImportError, or a broken install (a missing library)
        log.debug("no onnxruntime: %s", exc)
        return []


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


CPU_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})   # /proc/cpuinfo flags of native bfloat16 matmuls


def parse_cpu_bf16(cpuinfo_text: str) -> bool:
    """Whether /proc/cpuinfo's flags line names a native bfloat16 instruction set (AMX-BF16 or AVX512-BF16)."""
    for line in cpuinfo_text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return not CPU_BF16_FLAGS.isdisjoint(value.split())
    return False


def check_dtype(dtype: str, gpus: Sequence[GpuInfo]) -> None:
    """InvalidInput unless dtype is "" (the planner picks) or one a stage computes in, and bfloat16 only where
    some GPU computes it (every GPU's compute capability known and below 8.0 refuses it)."""
    if dtype and dtype not in DTYPES:
        raise InvalidInput(f"--dtype {dtype!r} is not one of {DTYPES} (or auto)")
    if dtype == "bfloat16" and gpus and all(_before_ampere(g) for g in gpus):
        names = ", ".join(f"{g.name} ({g.compute_capability})" for g in gpus)
        raise InvalidInput(f"--dtype bfloat16: this box's GPUs predate bfloat16 (compute capability 8.0): {names}; "
                           f"use --dtype float16 or auto")


def _before_ampere(gpu: GpuInfo) -> bool:
    """Whether the GPU's compute capability is known and below 8.0."""
    major, _, minor = gpu.compute_capability.partition(".")
    try:
        return (int(major), int(minor or 0)) < (8, 0)
    except ValueError:
        return False


def _text(value: str | bytes | None) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value or ""


def parse_gpu(raw: RawGpu) -> GpuInfo:
    """NVML's raw values in our units: str names, "major.minor", watts."""
    def number(value: int | None, scale: float = 1.0) -> float | None:
        return None if value is None else value * scale

    cc = raw.compute_capability
    return GpuInfo(
        raw.index, _text(raw.name), raw.mem_total_bytes, raw.mem_free_bytes, _text(raw.uuid),
        compute_capability=f"{cc[0]}.{cc[1]}" if cc else "",
        utilization_pct=number(raw.utilization_pct), temperature_c=number(raw.temperature_c),
        power_w=number(raw.power_mw, 1e-3), power_limit_w=number(raw.power_limit_mw, 1e-3))


# onnxruntime providers that run on an NVIDIA GPU: reported only where the probe saw one.
ONNX_GPU_PROVIDERS = frozenset({"CUDAExecutionProvider", "TensorrtExecutionProvider"})
# Listed by the plain CPU wheel, but it calls a remote endpoint: nothing a stage can run on.
ONNX_REMOTE_PROVIDERS = frozenset({"AzureExecutionProvider"})


def onnx_backend(provider: str) -> str:
    """"CUDAExecutionProvider" -> "onnxruntime-cuda"."""
    return "onnxruntime-" + provider.lower().removesuffix("executionprovider")


def backends_for(gpus: Sequence[GpuInfo], cuda_available: bool, onnx_providers: Iterable[str] = ()) -> tuple[str, ...]:
    """What this box can run stages on: torch first, then onnxruntime's providers by name."""
    torch_backends = ("torch-cpu", "torch-cuda") if gpus and cuda_available else ("torch-cpu",)
    onnx = {onnx_backend(p) for p in onnx_providers
            if p not in ONNX_REMOTE_PROVIDERS and (gpus or p not in ONNX_GPU_PROVIDERS)}
    return torch_backends + tuple(sorted(onnx))


def ranks_for(num_ranks: int, num_gpus: int) -> int:
    """The ranks a tensor-parallel stage here may have: num_ranks (0: one per GPU, else 1), at most one per GPU."""
    ranks = num_ranks or min(num_gpus, MAX_TP_DEGREE) or 1
    if num_gpus and ranks > num_gpus:
        log.warning("%d ranks asked for but this box has %d GPUs: %d ranks", ranks, num_gpus, num_gpus)
        return num_gpus
    return ranks


def check_runtime(runtime: str, dtype: str, onnx_providers: Iterable[str]) -> str:
    """The runtime an agent reports: runtime, where it is "" (torch), torch, AUTO_RUNTIME (the planner picks, which
    is torch alone where onnxruntime's CPU provider does not load), or onnxruntime where that provider loads and the
    dtype is one its stages compute in; InvalidInput otherwise."""
    if runtime and runtime not in AGENT_RUNTIMES:
        raise InvalidInput(f"--runtime {runtime!r} is not one of {AGENT_RUNTIMES}")
    has_ort = "CPUExecutionProvider" in onnx_providers
    if runtime == AUTO_RUNTIME and not has_ort:
        log.warning("--runtime auto: onnxruntime's CPU provider does not load on this box: stages run in torch")
        return Runtime.TORCH
    if runtime != Runtime.ONNXRUNTIME:
        return runtime
    if not has_ort:
        raise InvalidInput("--runtime onnxruntime: onnxruntime's CPU provider does not load on this box")
    if dtype and dtype not in ORT_DTYPES:
        raise InvalidInput(f"--runtime onnxruntime computes in {', '.join(ORT_DTYPES)}, not --dtype {dtype}")
    return runtime


def probe(site: str = "", tier: str = "edge", measure: bool = True, remeasure: bool = False,
          num_ranks: int = 0, dtype: str = "", use_gpus: bool = True, runtime: str = "") -> Capabilities:
    """Reads and parses this box's capabilities; measure: speeds from the cache or timed now (remeasure: always timed);
    num_ranks: the most ranks of a tensor-parallel stage here (0: one per GPU, else 1; see ranks_for); dtype: the
    operator's choice for every stage here ("" lets the planner pick; InvalidInput where check_dtype refuses it);
    use_gpus=False: the agent serves on the CPU alone, and reports no GPU (`stratamesh agent --no-gpu`); runtime:
    the operator's choice of what computes every stage here (see check_runtime). An agent that may run ONNX Runtime
    stages (runtime onnxruntime or auto) measures them too, in a cache of their own (ONNX_CACHE_NAME).

    Sets CUDA_DEVICE_ORDER=PCI_BUS_ID in this process, unless set already, before CUDA starts: CUDA then numbers the
    GPUs as NVML does, so that the index each GPU is reported with is the "cuda:N" a stage placed on it runs on."""
    if os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID") != "PCI_BUS_ID":
        log.warning("CUDA_DEVICE_ORDER=%s: CUDA may number this box's GPUs otherwise than NVML, and a stage placed "
                    "on one GPU run on another", os.environ["CUDA_DEVICE_ORDER"])
    total, available = parse_meminfo(read_meminfo())
    gpus = [parse_gpu(raw) for raw in read_nvml()] if use_gpus else []
    check_dtype(dtype, gpus)
    # onnxruntime is loaded only by an agent that may run it: a torch agent's start does without it
    onnx_providers = read_onnx_providers() if runtime in (Runtime.ONNXRUNTIME, Runtime.AUTO) else []
    runtime = check_runtime(runtime, dtype, onnx_providers)
    cpuinfo = read_cpuinfo()
    hostname, cpu_model, cpu_bf16 = socket.gethostname(), parse_cpu_model(cpuinfo), parse_cpu_bf16(cpuinfo)
    import torch

    speeds: tuple[Speed, ...] = ()
    if measure:
        speeds = _measured_speeds(hostname, cpu_model, gpus, cpu_bf16, remeasure,
                                  onnx=runtime in (Runtime.ONNXRUNTIME, Runtime.AUTO))
    return Capabilities(
        hostname=hostname, cpu_model=cpu_model, num_cpus=os.cpu_count() or 1,
        ram_total_bytes=total, ram_available_bytes=available, gpus=tuple(gpus),
        backends=backends_for(gpus, use_gpus and torch.cuda.is_available(), onnx_providers),
        speeds=speeds, site=site, tier=tier, num_ranks=ranks_for(num_ranks, len(gpus)), dtype=dtype,
        cpu_bf16=cpu_bf16, num_threads=torch.get_num_threads(), runtime=runtime)


def _measured_speeds(hostname: str, cpu_model: str, gpus: list[GpuInfo], cpu_bf16: bool, remeasure: bool,
                     onnx: bool) -> tuple[Speed, ...]:
    """torch's speeds (agent.speed.measure_speeds), and ONNX Runtime's CPU provider's where onnx, each from its cache
    or timed now (remeasure: always timed)."""
    from stratamesh.agent.speed import (DEFAULT_MAX_AGE_S, ONNX_CACHE_NAME, box_fingerprint, cached_speeds,
                                        default_cache_path, measure_onnx_speeds, measure_speeds)

    max_age_s = 0.0 if remeasure else DEFAULT_MAX_AGE_S
    speeds = cached_speeds(max_age_s=max_age_s, measure=lambda: measure_speeds(cpu_bf16=cpu_bf16, cuda=bool(gpus)),
                           fingerprint=box_fingerprint(hostname, cpu_model, gpus))
    if not onnx:
        return speeds
    import onnxruntime

    torch_cpu = next(s for s in speeds if (s.backend, s.dtype) == ("torch-cpu", "float32"))
    return speeds + cached_speeds(default_cache_path(ONNX_CACHE_NAME), max_age_s,
                                  measure=lambda: measure_onnx_speeds(torch_cpu),
                                  fingerprint=box_fingerprint(hostname, cpu_model, gpus, onnxruntime.__version__))
