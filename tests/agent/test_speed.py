"""The speed probe measures this box for real; the cache keeps one measurement per box and torch build."""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path
from threading import Event, Thread

import pytest
import torch

from stratamesh.agent import speed as speed_module
from stratamesh.agent.speed import (box_fingerprint, cached_speeds, default_cache_path, measure_read_bandwidth,
                                    measure_speeds)
from stratamesh.kernels.ops import gemv
from stratamesh.kernels.ops.gemv import gemv_bandwidth
from stratamesh.fleet.boxes import GpuInfo, Speed

DAY_S = 86400.0
T0 = 1.8e9


def test_measures_cpu_float32_and_quantized_weights_matmul_read_and_batch_1_products(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemv, "GEMV_BYTES", 16 << 20)       # (the figures' form is checked, not their size)
    (cpu, int8, int4, *gpu) = measure_speeds(reps=1)
    assert (cpu.backend, cpu.dtype) == ("torch-cpu", "float32")
    assert 1e8 < cpu.flops < 1e14            # between a slow core and far beyond any CPU here
    assert 1e8 < cpu.mem_bandwidth < 1e13    # a streaming read
    # quantized weights (StageSpec.quantize) on the CPU: a matmul, a decode step of the real engine and batch-1
    # products of their own
    for quantized, name in ((int8, "int8"), (int4, "int4")):
        assert (quantized.backend, quantized.dtype, quantized.mem_bandwidth) == ("torch-cpu", name, cpu.mem_bandwidth)
        assert 1e8 < quantized.flops < 1e14 and quantized.decode_flops > 0
        assert 1e8 < quantized.decode_bandwidth < 1e13
    assert all(s.backend == "torch-cuda" for s in gpu)


def test_a_read_of_more_than_the_caches_hold_measures_the_memorys_bandwidth() -> None:
    assert 1e8 < measure_read_bandwidth(reps=1, num_bytes=64 << 20) < 1e13


@pytest.mark.parametrize("backend", ["torch-cpu", "onnxruntime-cpu"])
@pytest.mark.parametrize("quantize", ["", "int8", "int4"])
def test_batch_1_products_are_measured_in_each_backend_and_format(backend: str, quantize: str) -> None:
    assert 1e8 < gemv_bandwidth(backend, quantize, num_bytes=16 << 20, reps=1) < 1e13


def test_measures_cpu_bfloat16_where_the_cpu_computes_it_natively(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemv, "GEMV_BYTES", 16 << 20)
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
    """A measure function that returns fixed, real Speed values and counts its calls."""

    def __init__(self, flops: float = 1e11) -> None:
        self.calls = 0
        self.speeds = (Speed("torch-cpu", "float32", flops, 2e10), Speed("torch-cuda", "bfloat16", 8e14, 3e12))

    def __call__(self) -> tuple[Speed, ...]:
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


def test_probes_on_one_box_take_turns_and_the_second_reads_the_firsts(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path, first_inside, release, second_waits = tmp_path / "speeds.json", Event(), Event(), Event()
    measure = CountingMeasure()

    def slow_measure() -> tuple[Speed, ...]:
        first_inside.set()
        assert release.wait(30)
        return measure()

    real_flock = speed_module.fcntl.flock

    def flock(fd, op):      # says when the second probe is about to wait for the lock
        if first_inside.is_set():
            second_waits.set()
        return real_flock(fd, op)

    monkeypatch.setattr(speed_module.fcntl, "flock", flock)
    results = {}
    first = Thread(target=lambda: results.setdefault(1, cached_speeds(path, measure=slow_measure,
                                                                       fingerprint="box-a", now=T0)))
    first.start()
    assert first_inside.wait(30)
    second = Thread(target=lambda: results.setdefault(2, cached_speeds(path, measure=measure,
                                                                        fingerprint="box-a", now=T0)))
    second.start()
    assert second_waits.wait(30)
    release.set()
    first.join(30)
    second.join(30)
    assert measure.calls == 1 and results[1] == results[2] == measure.speeds


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

    # (timings on a shared box are whatever the box allows: what holds is their form, never their size)
    measured = measure_decode("cpu", steps=3)
    assert set(measured) == {"step_overhead_s", "layer_overhead_s", "decode_flops"}
    assert all(0 <= value < math.inf for value in measured.values())
    assert measured["decode_flops"] > 0


@pytest.mark.parametrize("times, expected", [
    # 1 narrow layer 1.0 ms, 4 narrow layers 1.6 ms: 0.2 ms a layer over 0.8 ms a step; 4 wide layers 3.6 ms:
    # 0.7 ms a wide layer, 0.5 ms of it for the wide model's extra FLOPs
    ((1.0e-3, 1.6e-3, 3.6e-3), (0.8e-3, 0.2e-3, 0.5e-3)),
    # noise made 4 layers no slower than 1: no layer overhead, never a negative one
    ((1.0e-3, 0.9e-3, 3.0e-3), (1.0e-3, 0.0, 0.5e-3)),
])
def test_the_overheads_split_a_step_into_a_fixed_part_and_a_part_per_layer(times, expected) -> None:
    from stratamesh.agent.speed import NARROW, OVERHEAD_BATCH, OVERHEAD_LAYERS, WIDE, measure_decode

    timed = {(NARROW, 1, OVERHEAD_BATCH): times[0], (NARROW, OVERHEAD_LAYERS, OVERHEAD_BATCH): times[1],
             (WIDE, OVERHEAD_LAYERS, OVERHEAD_BATCH): times[2]}
    measured = measure_decode("cpu", step_s=lambda device, shape, layers, steps, batch: timed[(shape, layers, batch)])
    step, layer, extra_layer_s = expected
    assert measured["step_overhead_s"] == pytest.approx(step) and measured["layer_overhead_s"] == pytest.approx(layer)
    extra_flops = OVERHEAD_BATCH * (WIDE.layer_flops_per_token() - NARROW.layer_flops_per_token())
    assert measured["decode_flops"] == pytest.approx(extra_flops / extra_layer_s)


@pytest.mark.slow
def test_onnx_runtime_is_measured_through_its_own_stages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ONNX Runtime's decode costs come from the real engine running exports of the probe models (its large
    matmul and copy are torch's); the exports go with the probe, nothing is left in the cache folder."""
    from stratamesh.agent.speed import measure_onnx_speeds
    from stratamesh.fleet.state import cache_home

    # a cache folder of its own: the test session's is shared by every xdist worker, whose agents write theirs there
    monkeypatch.setenv("STRATAMESH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gemv, "GEMV_BYTES", 16 << 20)       # (the figures' form is checked, not their size)
    (tmp_path / "cache").mkdir()
    torch_cpu = Speed("torch-cpu", "float32", 1e11, 2e10, 1e-4, 1e-5, 5e10, 1e10)
    before = set(cache_home(os.environ).rglob("*"))
    ort, int8, int4 = measure_onnx_speeds(torch_cpu)
    assert (ort.backend, ort.dtype, ort.flops, ort.mem_bandwidth) == ("onnxruntime-cpu", "float32", 1e11, 2e10)
    assert ort.decode_flops > 0 and ort.decode_bandwidth > 0 and 0 <= ort.step_overhead_s < 1
    # quantized weights (StageSpec.quantize) in its MatMulNBits: int8's steps timed, int4 taking their costs
    for quantized, name in ((int8, "int8"), (int4, "int4")):
        assert (quantized.backend, quantized.dtype) == ("onnxruntime-cpu", name) and quantized.decode_flops > 0
        assert quantized.decode_bandwidth > 0 and 0 <= quantized.step_overhead_s < 1
    assert int4.step_overhead_s == int8.step_overhead_s
    assert set(cache_home(os.environ).rglob("*")) == before
