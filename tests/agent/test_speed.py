"""The speed probe measures this box for real; the cache keeps one measurement per box and torch build."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

from stratamesh.agent import speed as speed_module
from stratamesh.agent.speed import box_fingerprint, cached_speeds, default_cache_path, measure_speeds
from stratamesh.fleet.types import GpuInfo, SpeedInfo

DAY_S = 86400.0
T0 = 1.8e9


def test_measures_cpu_float32_matmul_and_copy() -> None:
    (cpu, *gpu) = measure_speeds(reps=1)
    assert (cpu.backend, cpu.dtype) == ("torch-cpu", "float32")
    assert 1e8 < cpu.flops < 1e14            # between a slow core and far beyond any CPU here
    assert 1e8 < cpu.mem_bandwidth < 1e13
    assert all(s.backend == "torch-cuda" for s in gpu)


def test_measures_cpu_bfloat16_where_the_cpu_computes_it_natively() -> None:
    speeds = {(s.backend, s.dtype): s for s in measure_speeds(reps=1, cpu_bf16=True)}
    assert {("torch-cpu", "float32"), ("torch-cpu", "bfloat16")} <= set(speeds)
    assert 1e8 < speeds["torch-cpu", "bfloat16"].flops < 1e15
    assert speeds["torch-cpu", "bfloat16"].mem_bandwidth > 1e8


def test_what_is_measured_is_part_of_the_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache from before the CPU's bfloat16 was measured does not hide that measurement."""
    before = box_fingerprint("host", "EPYC", [])
    monkeypatch.setattr(speed_module, "MEASURES_VERSION", speed_module.MEASURES_VERSION + 1)
    assert box_fingerprint("host", "EPYC", []) != before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measures_cuda_in_three_dtypes() -> None:
    speeds = {(s.backend, s.dtype): s for s in measure_speeds(reps=3)}
    assert set(speeds) == {("torch-cpu", "float32"), ("torch-cuda", "float32"), ("torch-cuda", "bfloat16"),
                           ("torch-cuda", "float16")}
    assert 1e11 < speeds["torch-cuda", "float32"].flops < speeds["torch-cuda", "bfloat16"].flops < 1e16
    assert 1e11 < speeds["torch-cuda", "float16"].mem_bandwidth < 1e14


class CountingMeasure:
    """A measure function that returns fixed, real SpeedInfo values and counts its calls."""

    def __init__(self, flops: float = 1e11) -> None:
        self.calls = 0
        self.speeds = (SpeedInfo("torch-cpu", "float32", flops, 2e10), SpeedInfo("torch-cuda", "bfloat16", 8e14, 3e12))

    def __call__(self) -> tuple[SpeedInfo, ...]:
        self.calls += 1
        return self.speeds


def test_the_second_call_reads_the_cache(tmp_path: Path) -> None:
    path, measure = tmp_path / "speeds.json", CountingMeasure()
    first = cached_speeds(path, measure=measure, fingerprint="box-a", now=T0)
    second = cached_speeds(path, measure=measure, fingerprint="box-a", now=T0 + 6 * DAY_S)
    assert measure.calls == 1 and first == second == measure.speeds


@pytest.mark.parametrize("fingerprint, age_s, max_age_s", [
    ("box-b", 60.0, 7 * DAY_S),        # another box, or another torch build
    ("box-a", 8 * DAY_S, 7 * DAY_S),   # stale
    ("box-a", -DAY_S, 7 * DAY_S),      # measured "in the future": the clock moved, do not trust it
    ("box-a", 0.0, 0.0),               # max age 0: always measure (--remeasure)
])
def test_a_mismatched_or_stale_cache_is_measured_again(fingerprint: str, age_s: float, max_age_s: float,
                                                       tmp_path: Path) -> None:
    path = tmp_path / "speeds.json"
    cached_speeds(path, measure=CountingMeasure(1e11), fingerprint="box-a", now=T0)
    fresh = CountingMeasure(2e11)
    speeds = cached_speeds(path, max_age_s, fresh, fingerprint=fingerprint, now=T0 + age_s)
    assert fresh.calls == 1 and speeds[0].flops == 2e11
    assert cached_speeds(path, measure=fresh, fingerprint=fingerprint, now=T0 + age_s)[0].flops == 2e11
    assert fresh.calls == 1   # the new measurement replaced the old one


@pytest.mark.parametrize("content", [
    "{not json", "", "[]", '{"fingerprint": "box-a"}',
    json.dumps({"fingerprint": "box-a", "measured_at": T0, "speeds": [{"backend": "torch-cpu"}]}),
    json.dumps({"fingerprint": "box-a", "measured_at": T0,
                "speeds": [{"backend": "torch-cpu", "dtype": "float32", "flops": 0, "mem_bandwidth": 1e9}]}),
    json.dumps({"fingerprint": "box-a", "measured_at": T0, "speeds": []}),
])
def test_a_corrupt_cache_is_measured_again_and_overwritten(content: str, tmp_path: Path) -> None:
    path, measure = tmp_path / "speeds.json", CountingMeasure()
    path.write_text(content)
    assert cached_speeds(path, measure=measure, fingerprint="box-a", now=T0) == measure.speeds
    assert cached_speeds(path, measure=measure, fingerprint="box-a", now=T0 + 1) == measure.speeds
    assert measure.calls == 1   # the second call read what the first wrote over the corrupt file


def test_an_unwritable_cache_still_returns_measured_speeds(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    measure = CountingMeasure()
    assert cached_speeds(blocker / "speeds.json", measure=measure, fingerprint="a", now=T0)[0].flops == 1e11


def test_default_path_and_this_box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATAMESH_CACHE_DIR", str(tmp_path))
    assert default_cache_path() == tmp_path / "speeds.json"
    measure = CountingMeasure()
    box = box_fingerprint(socket.gethostname(), "cpu", [])
    cached_speeds(measure=measure, fingerprint=box)   # the default path, twice
    cached_speeds(measure=measure, fingerprint=box)
    assert measure.calls == 1 and (tmp_path / "speeds.json").exists()


def test_fingerprint_follows_host_cpu_and_gpus() -> None:
    gpu = GpuInfo(0, "H100", 80 << 30, 79 << 30, "GPU-a", "9.0", 10.0)
    base = box_fingerprint("host", "EPYC", [gpu])
    assert box_fingerprint("host", "EPYC", [GpuInfo(0, "H100", 80 << 30, 1 << 30, "GPU-a", "9.0", 99.0)]) == base
    assert len({base, box_fingerprint("other", "EPYC", [gpu]), box_fingerprint("host", "Xeon", [gpu]),
                box_fingerprint("host", "EPYC", []),
                box_fingerprint("host", "EPYC", [GpuInfo(0, "H100", 80 << 30, 79 << 30, "GPU-b")])}) == 5


def test_a_decode_steps_overheads_and_flops_are_measured_on_the_real_engine() -> None:
    from stratamesh.agent.speed import measure_decode

    measured = measure_decode("cpu", steps=5)
    assert 0 <= measured["step_overhead_s"] < 0.1 and 0 < measured["layer_overhead_s"] < 0.1
    peak = measure_speeds(reps=1)[0].flops
    assert 0 < measured["decode_flops"] < 2 * peak      # small matmuls reach no more than a large one (and noise)
