"""Probe parsing is pure: tables of what /proc and NVML may say; a stand-in NVML module drives the reader."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from stratamesh.agent import probe as probe_module
from stratamesh.agent.probe import (
    RawGpu, backends_for, check_dtype, check_runtime, onnx_backend, parse_cpu_bf16, parse_cpu_model, parse_gpu, parse_meminfo,
    probe, ranks_for, read_cpuinfo, read_nvml, read_onnx_providers, visible_gpus,
)
from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.boxes import GpuInfo

MEMINFO = "MemTotal:       24576000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"


@pytest.fixture(autouse=True)
def speed_cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATAMESH_CACHE_DIR", str(tmp_path / "cache"))


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


@pytest.mark.parametrize("raw, expected", [
    (RawGpu(0, b"NVIDIA H100 80GB HBM3", 85 << 30, 80 << 30, b"GPU-1", (9, 0), 37, 41, 123_456, 700_000),
     GpuInfo(0, "NVIDIA H100 80GB HBM3", 85 << 30, 80 << 30, "GPU-1", "9.0", 37.0, 41.0, 123.456, 700.0)),
    (RawGpu(1, "NVIDIA L4", 24 << 30, 20 << 30, "GPU-2", (8, 9), 0, 30, 16_000, 72_000),
     GpuInfo(1, "NVIDIA L4", 24 << 30, 20 << 30, "GPU-2", "8.9", 0.0, 30.0, 16.0, 72.0)),
    (RawGpu(2, "Jetson", 8 << 30, 4 << 30, None),   # every optional reading failed
     GpuInfo(2, "Jetson", 8 << 30, 4 << 30, "", "", None, None, None, None)),
])
def test_parse_gpu(raw: RawGpu, expected: GpuInfo) -> None:
    assert parse_gpu(raw) == expected


class NVMLError(Exception):
    """What the stand-in NVML raises, as pynvml raises its NVMLError subclasses."""


class FakeNvml:
    """The pynvml functions read_nvml calls, over a list of GPUs; `failing` names functions that raise."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(self, gpus: list[dict], failing: tuple[str, ...] = ()) -> None:
        self.gpus, self.failing, self.shut_down = gpus, failing, False

    def _check(self, name: str) -> None:
        if name in self.failing:
            raise NVMLError(f"{name}: Not Supported")

    def nvmlInit(self) -> None:
        self._check("nvmlInit")

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict:
        self._check("nvmlDeviceGetHandleByIndex")
        return self.gpus[index]

    def nvmlDeviceGetName(self, handle: dict) -> bytes:
        return handle["name"]

    def nvmlDeviceGetUUID(self, handle: dict) -> bytes:
        self._check("nvmlDeviceGetUUID")
        return handle["uuid"]

    def nvmlDeviceGetMemoryInfo(self, handle: dict) -> SimpleNamespace:
        return SimpleNamespace(total=handle["total"], free=handle["free"], used=handle["total"] - handle["free"])

    def nvmlDeviceGetCudaComputeCapability(self, handle: dict) -> tuple[int, int]:
        self._check("nvmlDeviceGetCudaComputeCapability")
        return handle["cc"]

    def nvmlDeviceGetUtilizationRates(self, handle: dict) -> SimpleNamespace:
        self._check("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=handle["util"], memory=3)

    def nvmlDeviceGetTemperature(self, handle: dict, sensor: int) -> int:
        self._check("nvmlDeviceGetTemperature")
        assert sensor == self.NVML_TEMPERATURE_GPU
        return handle["temp"]

    def nvmlDeviceGetPowerUsage(self, handle: dict) -> int:
        self._check("nvmlDeviceGetPowerUsage")
        return handle["power_mw"]

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: dict) -> int:
        self._check("nvmlDeviceGetEnforcedPowerLimit")
        return handle["limit_mw"]


H100 = {"name": b"NVIDIA H100", "uuid": b"GPU-a", "total": 80 << 30, "free": 79 << 30, "cc": (9, 0),
        "util": 12, "temp": 45, "power_mw": 98_000, "limit_mw": 700_000}
L4 = {"name": "NVIDIA L4", "uuid": "GPU-b", "total": 24 << 30, "free": 23 << 30, "cc": (8, 9),
      "util": 0, "temp": 33, "power_mw": 16_000, "limit_mw": 72_000}


def test_read_nvml_reads_every_field_of_every_gpu() -> None:
    nvml = FakeNvml([H100, L4])
    assert read_nvml(nvml) == [
        RawGpu(0, b"NVIDIA H100", 80 << 30, 79 << 30, b"GPU-a", (9, 0), 12, 45, 98_000, 700_000),
        RawGpu(1, "NVIDIA L4", 24 << 30, 23 << 30, "GPU-b", (8, 9), 0, 33, 16_000, 72_000)]
    assert nvml.shut_down


def test_read_nvml_reports_the_gpus_cuda_shows_this_process_under_the_indices_cuda_gives_them() -> None:
    nvml = FakeNvml([H100, L4])
    assert [(g.index, g.uuid) for g in read_nvml(nvml, {"CUDA_VISIBLE_DEVICES": "1"})] == [(0, "GPU-b")]
    assert [(g.index, g.uuid) for g in read_nvml(nvml, {"CUDA_VISIBLE_DEVICES": "1,0"})] == [(0, "GPU-b"),
                                                                                           (1, b"GPU-a")]
    assert read_nvml(nvml, {}) == read_nvml(nvml)


RAW = [RawGpu(i, "NVIDIA H100", 80 << 30, 79 << 30, f"GPU-{u}") for i, u in enumerate(["8a1f-00", "8a2c-01",
                                                                                        "b7e0-02", "b7e1-03"])]


@pytest.mark.parametrize(("setting", "expected"), [
    (None, ["8a1f-00", "8a2c-01", "b7e0-02", "b7e1-03"]),       # unset: every GPU, as NVML lists them
    ("", []),                                                    # set and empty: none
    ("2,3", ["b7e0-02", "b7e1-03"]),                             # cuda:0 is NVML's GPU 2
    ("3, 1", ["b7e1-03", "8a2c-01"]),                            # in the order named, spaces allowed
    ("GPU-b7e1-03,GPU-8a1f", ["b7e1-03", "8a1f-00"]),            # whole UUIDs, and unique prefixes
    ("GPU-8a,2", []),                                            # a prefix of two GPUs names none: the list ends
    ("1,7,2", ["8a2c-01"]),                                      # no GPU 7: the list ends there, as in CUDA
    ("0,0,1", ["8a1f-00"]),                                      # named twice: ends there
    ("-1", []),                                                  # the usual way to hide every GPU
    ("MIG-5f1e,0", []),                                          # a MIG instance is not a whole GPU
])
def test_visible_gpus_follows_cuda_visible_devices(setting: str | None, expected: list[str]) -> None:
    visible = visible_gpus(RAW, setting)
    assert [g.uuid.removeprefix("GPU-") for g in visible] == expected
    assert [g.index for g in visible] == list(range(len(expected)))       # torch's cuda:N, not NVML's


@pytest.mark.parametrize("failing", [("nvmlInit",), ("nvmlDeviceGetCount",), ("nvmlDeviceGetHandleByIndex",)])
def test_read_nvml_reports_no_gpu_when_init_count_or_handle_fails(failing: tuple[str, ...]) -> None:
    assert read_nvml(FakeNvml([H100], failing)) == []


def test_read_nvml_warns_only_after_a_successful_init(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="stratamesh.agent.probe"):
        read_nvml(FakeNvml([H100], ("nvmlInit",)))
        assert [r.levelno for r in caplog.records] == [logging.DEBUG]
        caplog.clear()
        read_nvml(FakeNvml([H100], ("nvmlDeviceGetCount",)))
        assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_read_nvml_keeps_a_gpu_whose_sensors_fail(caplog: pytest.LogCaptureFixture) -> None:
    failing = ("nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetEnforcedPowerLimit")
    with caplog.at_level(logging.DEBUG, logger="stratamesh.agent.probe"):
        (raw,) = read_nvml(FakeNvml([H100], failing))
    assert (raw.temperature_c, raw.power_mw, raw.power_limit_mw) == (None, None, None)
    assert (raw.utilization_pct, raw.compute_capability, raw.uuid) == (12, (9, 0), b"GPU-a")
    assert len(caplog.records) == 3 and all(r.levelno == logging.DEBUG for r in caplog.records)
    gpu = parse_gpu(raw)
    assert (gpu.name, gpu.compute_capability, gpu.temperature_c, gpu.power_w) == ("NVIDIA H100", "9.0", None, None)


def test_read_nvml_without_any_optional_reading() -> None:
    failing = ("nvmlDeviceGetUUID", "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetUtilizationRates",
               "nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetEnforcedPowerLimit")
    assert read_nvml(FakeNvml([L4], failing)) == [RawGpu(0, "NVIDIA L4", 24 << 30, 23 << 30, None)]


GPU = GpuInfo(0, "L4", 1, 1, "u")


@pytest.mark.parametrize("gpus, cuda, providers, expected", [
    ([], True, (), ("torch-cpu",)),
    ([GPU], False, (), ("torch-cpu",)),
    ([GPU], True, (), ("torch-cpu", "torch-cuda")),
    ([], False, ["AzureExecutionProvider", "CPUExecutionProvider"], ("torch-cpu", "onnxruntime-cpu")),
    ([GPU], True, ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
     ("torch-cpu", "torch-cuda", "onnxruntime-cpu", "onnxruntime-cuda", "onnxruntime-tensorrt")),
    # onnxruntime-gpu lists CUDA even without a GPU: only what can run is reported
    ([], False, ["CUDAExecutionProvider", "CPUExecutionProvider"], ("torch-cpu", "onnxruntime-cpu")),
    ([], False, ["OpenVINOExecutionProvider", "CPUExecutionProvider", "CPUExecutionProvider"],
     ("torch-cpu", "onnxruntime-cpu", "onnxruntime-openvino")),
])
def test_backends(gpus: list[GpuInfo], cuda: bool, providers: list[str], expected: tuple[str, ...]) -> None:
    assert backends_for(gpus, cuda, providers) == expected
    assert backends_for(gpus, cuda, list(reversed(providers))) == expected


@pytest.mark.parametrize("provider, backend", [
    ("CUDAExecutionProvider", "onnxruntime-cuda"), ("TensorrtExecutionProvider", "onnxruntime-tensorrt"),
    ("CPUExecutionProvider", "onnxruntime-cpu"), ("CoreMLExecutionProvider", "onnxruntime-coreml"),
])
def test_onnx_backend_names(provider: str, backend: str) -> None:
    assert onnx_backend(provider) == backend


def test_probe_on_this_box() -> None:
    caps = probe()   # no NVIDIA here: NVML fails and the probe reports no GPU rather than raising
    assert caps.num_cpus >= 1 and caps.ram_total_bytes > 0
    assert caps.usable_mem_bytes == (caps.ram_available_bytes if not caps.gpus
                                     else sum(g.mem_free_bytes for g in caps.gpus))
    assert caps.backends == ("torch-cpu",)     # a torch agent does not load onnxruntime, nor offers it
    assert caps.speeds and caps.speeds[0].backend == "torch-cpu"
    assert probe().speeds == caps.speeds   # the second probe reads the cache


def test_an_agent_that_may_run_onnx_runtime_offers_its_providers() -> None:
    caps = probe(measure=False, runtime="auto")
    assert caps.backends[0] == "torch-cpu"
    assert ("onnxruntime-cpu" in caps.backends) == ("CPUExecutionProvider" in read_onnx_providers())


@pytest.mark.parametrize("asked, num_gpus, ranks", [
    (0, 0, 1),      # a CPU box: one rank unless the operator says more
    (4, 0, 4),      # ... who may: the ranks then share its cores
    (0, 2, 2),      # a GPU box: one rank per GPU
    (0, 16, 8),     # ... at most a group's largest size
    (4, 2, 2),      # never more ranks than GPUs
    (1, 4, 1),      # fewer GPUs for a group than it has: the operator's call
])
def test_the_ranks_an_agent_offers(asked: int, num_gpus: int, ranks: int) -> None:
    assert ranks_for(asked, num_gpus) == ranks


SAPPHIRE_RAPIDS = ("processor\t: 0\nmodel name\t: Intel Xeon Platinum 8480+\n"
                   "flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
                   "vmx flags\t: vnmi preemption_timer\n")


@pytest.mark.parametrize("text, native", [
    (SAPPHIRE_RAPIDS, True),
    ("flags\t\t: fpu avx2 avx512f avx512_bf16\n", True),                    # Cooper Lake, Zen 4
    ("flags\t\t: fpu avx2 amx_bf16 amx_tile\n", True),
    ("flags\t\t: fpu avx2 avx512f avx512_vnni\n", False),                  # AVX-512 without BF16
    ("flags\t\t: fpu avx2\nvmx flags\t: avx512_bf16\n", False),           # only the flags line counts
    ("flags\t\t: fpu avx2 xavx512_bf16\n", False),                         # whole flags, not substrings
    ("processor\t: 0\nFeatures\t: fp asimd bf16\n", False),               # an Arm box: no flags line
    ("", False),
])
def test_parse_cpu_bf16(text: str, native: bool) -> None:
    assert parse_cpu_bf16(text) is native


def _gpu(capability: str) -> GpuInfo:
    return GpuInfo(0, "GPU", 16 << 30, 15 << 30, "", capability)


@pytest.mark.parametrize("dtype, gpus", [
    ("", [_gpu("7.5")]), ("float16", [_gpu("7.5")]), ("float32", [_gpu("6.1")]),
    ("bfloat16", [_gpu("8.0")]), ("bfloat16", [_gpu("7.5"), _gpu("9.0")]),
    ("bfloat16", [_gpu("7.5"), _gpu("")]),      # a GPU whose capability is unknown may compute it
    ("bfloat16", []),                           # a CPU box: torch computes bfloat16 on any CPU
])
def test_check_dtype_accepts(dtype: str, gpus: list[GpuInfo]) -> None:
    check_dtype(dtype, gpus)


@pytest.mark.parametrize("dtype, gpus, match", [
    ("bfloat16", [_gpu("7.5")], r"--dtype bfloat16: .*predate bfloat16.*GPU \(7.5\)"),
    ("bfloat16", [_gpu("7.0"), _gpu("6.1")], "predate bfloat16"),
    ("int8", [], "'int8' is not one of"),
    ("fp16", [_gpu("9.0")], "'fp16' is not one of"),
])
def test_check_dtype_refuses(dtype: str, gpus: list[GpuInfo], match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        check_dtype(dtype, gpus)


def test_probe_reports_the_operators_dtype_and_native_bf16() -> None:
    caps = probe(measure=False, dtype="float16")
    assert (caps.dtype, caps.cpu_bf16) == ("float16", parse_cpu_bf16(read_cpuinfo()))
    assert probe(measure=False).dtype == ""


def test_probe_refuses_bf16_on_a_box_of_pre_ampere_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    turing = RawGpu(0, "Tesla T4", 16 << 30, 15 << 30, "GPU-t", (7, 5))
    monkeypatch.setattr(probe_module, "read_nvml", lambda: [turing])
    with pytest.raises(InvalidInput, match="predate bfloat16"):
        probe(measure=False, dtype="bfloat16")
    assert probe(measure=False, dtype="float16").gpus[0].compute_capability == "7.5"


@pytest.mark.parametrize("runtime, dtype, providers, match", [
    ("onnxruntime", "", [], "CPU provider does not load"),
    ("onnxruntime", "bfloat16", ["CPUExecutionProvider"], "computes in float32, not --dtype bfloat16"),
    ("tvm", "", ["CPUExecutionProvider"], "'tvm' is not one of"),
])
def test_check_runtime_refuses(runtime: str, dtype: str, providers: list[str], match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        check_runtime(runtime, dtype, providers)


def test_probe_reports_the_operators_runtime() -> None:
    assert check_runtime("", "bfloat16", []) == ""          # torch: nothing to check
    assert check_runtime("torch", "bfloat16", []) == "torch"
    assert check_runtime("auto", "bfloat16", ["CPUExecutionProvider"]) == "auto"   # the planner picks per stage
    assert check_runtime("auto", "", []) == "torch"         # ... between torch and nothing else
    assert probe(measure=False, runtime="onnxruntime").runtime == "onnxruntime"   # onnxruntime is installed
    assert probe(measure=False, runtime="auto").runtime == "auto"
    assert probe(measure=False).runtime == ""
