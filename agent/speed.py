"""Measured speed of this box for the planner: FLOP/s of a large matmul and bytes/s of a large copy, cached per box."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch

from stratamesh.fleet.state import cache_home
from stratamesh.fleet.boxes import GpuInfo, Speed
from stratamesh.fleet.stages import StageSpec

log = logging.getLogger(__name__)

CPU_MATMUL_N = 1024                 # fp32: 2 GFLOP a product; large enough for the BLAS to reach steady state
CPU_READ_BYTES = 256 << 20          # a streaming read: larger than the last-level caches of the CPUs here
# Large enough to keep an H100's tensor cores busy; fp32 runs at a fraction of their rate, so a smaller n.
CUDA_MATMUL_N = {torch.float32: 4096, torch.bfloat16: 8192, torch.float16: 8192}
CUDA_COPY_MAX_BYTES = 1 << 30       # and at most 1/8 of free GPU memory (source and destination)
DEFAULT_MAX_AGE_S = 7 * 86400.0
MEASURES_VERSION = 7                # bumped when measure_speeds or measure_onnx_speeds measure more (2: CPU bfloat16,
                                    # 3: overheads, 4: int8, 5: decode bandwidth, 6: ONNX Runtime's int8, 7: int4,
                                    # a CPU's bandwidth as a streaming read)
# The weight formats a CPU backend measures beside its float32 (StageSpec.quantize)
CPU_FORMATS = ("int8", "int4")
# The overhead probe: decode steps of OVERHEAD_BATCH sequences through a model too small for its FLOPs or bytes to
# count, with 1 and OVERHEAD_LAYERS layers; what a step costs then is the framework's own cost.
OVERHEAD_BATCH = 8
OVERHEAD_LAYERS = 4
OVERHEAD_STEPS = 15
PROBE_VOCAB = 512
ONNX_CACHE_NAME = "speeds-onnxruntime.json"   # measured only for agents that may run it: a cache of its own


def measure_speeds(reps: int = 3, cpu_bf16: bool = False, cuda: bool = True) -> tuple[Speed, ...]:
    """float32 on the CPU (and bfloat16 where it computes it natively: cpu_bf16), quantized weights on the CPU (dtype
    "int8" and "int4": float32 activations, StageSpec.quantize), and float32, bfloat16 and float16 on the first CUDA
    device if there is one (and cuda: the agent uses its GPUs). A CPU's mem_bandwidth is a streaming read's
    (measure_read_bandwidth: what a batch-1 product can read its weights at), a GPU's a large copy's; a CPU's
    decode_bandwidth is what its batch-1 products read each format's weights at (kernels.ops.gemv)."""
    from stratamesh.kernels.ops.gemv import gemv_bandwidth    # (imports the kernels)

    read_bandwidth = measure_read_bandwidth(reps)
    cpu_dtypes = (torch.float32, torch.bfloat16) if cpu_bf16 else (torch.float32,)
    speeds = [_measure("torch-cpu", "cpu", dtype, CPU_MATMUL_N, 0, reps, read_bandwidth) for dtype in cpu_dtypes]
    speeds += [_measure_quantized(speeds[0], quantize, CPU_MATMUL_N, reps) for quantize in CPU_FORMATS]
    if cuda and torch.cuda.is_available():
        free_bytes, _ = torch.cuda.mem_get_info()
        copy_bytes = min(CUDA_COPY_MAX_BYTES, free_bytes // 8)
        speeds += [_measure("torch-cuda", "cuda", dtype, n, copy_bytes, reps) for dtype, n in CUDA_MATMUL_N.items()]
        torch.cuda.empty_cache()   # hand the buffers back before stages load
    cpu = {quantize: {**measure_decode("cpu", step_s=partial(_decode_step_s, quantize=quantize)),
                      "decode_bandwidth": gemv_bandwidth("torch-cpu", quantize)} for quantize in ("", *CPU_FORMATS)}
    cuda = measure_decode("cuda:0") if any(s.backend == "torch-cuda" for s in speeds) else {}

    def decode(s: Speed) -> dict[str, float]:
        return cuda if s.backend == "torch-cuda" else cpu.get(s.dtype, cpu[""])

    return tuple(replace(s, **decode(s)) for s in speeds)


def measure_read_bandwidth(reps: int = 3, num_bytes: int = CPU_READ_BYTES) -> float:
    """Bytes/s this process reads memory at with its threads: a sum over a buffer larger than the caches (the
    roofline of a batch-1 decode step, which reads every weight once)."""
    buffer = torch.ones(num_bytes // 4)
    seconds = _best_time(buffer.sum, "cpu", reps)
    del buffer
    return num_bytes / seconds


def measure_onnx_speeds(torch_cpu: Speed) -> tuple[Speed, ...]:
    """ONNX Runtime's CPU provider ("onnxruntime-cpu") in float32 and with quantized weights (dtype "int8", "int4"):
    what a decode step of the real engine costs with ONNX Runtime computing the layers (measure_decode over exports
    of the probe models, made first in a temporary folder, one a core: about 16 s on 2 cores), in float32 and the
    first quantized format (the others are the same MatMulNBits graph at other bits: they take its step costs), and
    the bytes/s each format's batch-1 products read (kernels.ops.gemv). Its large matmul and read are torch_cpu's:
    the planner prices decode steps at the decode rates where they are lower (coordinator.placement.decode_rate), as
    they are here."""
    from stratamesh.kernels.models.onnx_stage import export_stages   # (imports the kernels)
    from stratamesh.kernels.ops.gemv import gemv_bandwidth

    stepped = ("", *CPU_FORMATS[:1])       # the formats whose steps are timed
    decode: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="stratamesh-probe-onnx-") as exports:
        # every export the steps below load, made first, one a core (exporting is most of the time), the largest first
        export_stages([_probe_spec(exports, "cpu", shape, layers, quantize, "onnxruntime")
                       for shape, layers in reversed(PROBE_STAGES) for quantize in stepped], exports)
        for quantize in stepped:
            step_s = partial(_decode_step_s, runtime="onnxruntime", onnx_cache=exports, quantize=quantize)
            decode[quantize] = measure_decode("cpu", step_s=step_s)
    return tuple(replace(torch_cpu, backend="onnxruntime-cpu", dtype=quantize or "float32",
                         **decode.get(quantize, decode[stepped[-1]]),
                         decode_bandwidth=gemv_bandwidth("onnxruntime-cpu", quantize))
                 for quantize in ("", *CPU_FORMATS))


@dataclass(frozen=True, slots=True)
class _ProbeModel:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int

    def layer_flops_per_token(self) -> float:
        """2 FLOPs per weight of a layer's matmuls (q, k, v, o; gate, up, down), at a short context."""
        head_dim = self.hidden // self.heads
        attention = self.hidden * (self.hidden + 2 * self.kv_heads * head_dim) + self.hidden * self.hidden
        return 2.0 * (attention + 3 * self.hidden * self.intermediate)


# The framework's own cost shows in a model too narrow for its matmuls to count; the decode FLOP/s in one wide
# enough for them to dominate (a 1B model's layers are wider still: this is a floor on what they reach).
NARROW = _ProbeModel(64, 128, 2, 1)
WIDE = _ProbeModel(512, 1408, 8, 2)
PROBE_STAGES = ((NARROW, 1), (NARROW, OVERHEAD_LAYERS), (WIDE, OVERHEAD_LAYERS))   # what measure_decode steps through


def measure_decode(device: str = "cpu", steps: int = OVERHEAD_STEPS,
                   step_s: Callable[..., float] | None = None) -> dict[str, float]:
    """What a decode step of the stage engine costs on device beyond the roofline of a large matmul and read:
    - step_overhead_s and layer_overhead_s: the narrow model's step with 1 and OVERHEAD_LAYERS layers, split into a
      fixed part and a part per layer;
    - decode_flops: the wide model's extra time per layer over the narrow one's, for its extra FLOPs.
    Steps are of OVERHEAD_BATCH sequences. step_s(device, shape, layers, steps, batch) times the steps (default:
    _decode_step_s, the real engine's). (The bytes/s a CPU's decode step reads its weights at is measured apart,
    over more weights than the caches hold: kernels.ops.gemv.)"""
    step_s = step_s or _decode_step_s
    narrow = [step_s(device, NARROW, layers, steps, OVERHEAD_BATCH) for layers in (1, OVERHEAD_LAYERS)]
    per_layer = max(0.0, (narrow[1] - narrow[0]) / (OVERHEAD_LAYERS - 1))
    fixed = max(0.0, narrow[0] - per_layer)
    wide = step_s(device, WIDE, OVERHEAD_LAYERS, steps, OVERHEAD_BATCH)
    wide_per_layer = (wide - narrow[0] + per_layer) / OVERHEAD_LAYERS
    extra_flops = OVERHEAD_BATCH * (WIDE.layer_flops_per_token() - NARROW.layer_flops_per_token())
    return {"step_overhead_s": fixed, "layer_overhead_s": per_layer,
            "decode_flops": extra_flops / max(wide_per_layer - per_layer, 1e-7)}


def _decode_step_s(device: str, shape: _ProbeModel, layers: int, steps: int, batch: int = OVERHEAD_BATCH,
                   quantize: str = "", runtime: str = "torch", onnx_cache: str | Path | None = None) -> float:
    """The median of `steps` decode steps of `batch` sequences through a random Llama of that shape (its weights
    quantized: StageSpec.quantize; its layers computed by runtime, an ONNX Runtime export kept in onnx_cache)."""
    from stratamesh.agent.engine.stage_engine import EngineConfig, Outbox, StageEngine   # (imports the kernels)
    from stratamesh.agent.engine.stage_runner import StageRunner
    from stratamesh.fleet.sessions import SamplingParams, SessionOpen, StepChunk
    from stratamesh.fleet.stages import Assignment

    # beside the exports, one model of each shape: their export serves every batch size
    with nullcontext(onnx_cache) if onnx_cache else tempfile.TemporaryDirectory(prefix="stratamesh-probe-") as folder:
        spec = _probe_spec(folder, device, shape, layers, quantize, runtime)
        runner = StageRunner.load(spec, 16 << 20, onnx_cache=onnx_cache)
    engine = StageEngine(Assignment("probe", spec), runner, EngineConfig(enable_prefix_cache=False,
                                                                         cuda_graphs=False))
    prompt = tuple(range(1, 17))
    for i in range(batch):
        engine.open(SessionOpen(f"s{i}", "probe", (), "", SamplingParams(), prompt_token_ids=prompt), Outbox())
        engine.add(StepChunk(f"s{i}", 0, 0, prompt, True), None)
    while (step := engine.schedule()) is not None:
        engine.postprocess(step, engine.run(step), Outbox())
    times = []
    for n in range(steps):
        for i in range(batch):
            engine.add(StepChunk(f"s{i}", n + 1, len(prompt) + n, (5,), True), None)
        start = time.perf_counter()
        step = engine.schedule()
        engine.postprocess(step, engine.run(step), Outbox())
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    runner.close()
    return sorted(times)[len(times) // 2]


def _probe_spec(folder: str | Path, device: str, shape: _ProbeModel, layers: int, quantize: str = "",
                runtime: str = "torch") -> StageSpec:
    """The whole of a random Llama of that shape in folder (written there unless it is already), as one stage."""
    from stratamesh.kernels.tiny_model import write_tiny_model

    model_dir = Path(folder, f"probe-{shape.hidden}-{layers}")
    if not model_dir.exists():
        write_tiny_model(model_dir, num_layers=layers, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_heads=shape.heads, num_kv_heads=shape.kv_heads, vocab_size=PROBE_VOCAB)
    return StageSpec("speed-probe", str(model_dir), 0, layers, layers, device=device, quantize=quantize,
                     runtime=runtime)


def _measure_quantized(float32: Speed, quantize: str, n: int, reps: int) -> Speed:
    """A large matmul with quantized weights (float32 activations) on the CPU, in the kernel a stage runs them in;
    its bytes/s are float32's read's."""
    from stratamesh.kernels.ops.quant import for_cpu_kernel, linear, quantize_int4, quantize_int8   # (the kernels)

    quantized = quantize_int8 if quantize == "int8" else quantize_int4
    a, b = torch.randn(n, n), for_cpu_kernel(quantized(torch.randn(n, n)))
    matmul_s = _best_time(lambda: linear(a, b), "cpu", reps)
    return Speed("torch-cpu", quantize, 2 * n ** 3 / matmul_s, float32.mem_bandwidth)


def _measure(backend: str, device: str, dtype: torch.dtype, n: int, copy_bytes: int, reps: int,
             mem_bandwidth: float = 0.0) -> Speed:
    """A large matmul in dtype, and a large copy's bytes/s unless the caller measured the memory otherwise
    (mem_bandwidth: a CPU's streaming read)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    matmul_s = _best_time(lambda: torch.mm(a, b), device, reps)
    if not mem_bandwidth:
        src = torch.rand(copy_bytes // a.element_size(), device=device, dtype=dtype)   # rand: faster than randn
        dst = torch.empty_like(src)
        copy_s = _best_time(lambda: dst.copy_(src), device, reps)
        mem_bandwidth = 2 * src.numel() * src.element_size() / copy_s   # read the source, write the destination
    return Speed(backend, str(dtype).removeprefix("torch."), 2 * n ** 3 / matmul_s, mem_bandwidth)


def _best_time(work: Callable[[], object], device: str, reps: int) -> float:
    """The fastest of reps runs after one warm-up, in seconds (the least disturbed by other processes)."""
    _time_once(work, device)   # warm-up: first-call setup (BLAS threads, cuBLAS handles) is not speed
    return min(_time_once(work, device) for _ in range(max(reps, 1)))


def _time_once(work: Callable[[], object], device: str) -> float:
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start_s = time.perf_counter()
    work()
    return time.perf_counter() - start_s


def default_cache_path(name: str = "speeds.json") -> Path:
    """name in the cache folder (fleet.state.cache_home): speeds.json, or ONNX_CACHE_NAME for ONNX Runtime's."""
    return cache_home(os.environ) / name


def box_fingerprint(hostname: str, cpu_model: str, gpus: Sequence[GpuInfo], *builds: str) -> str:
    """Changes when what was measured may have: the host, its CPU, its GPUs, the torch build (and any other builds
    measured: onnxruntime's version) or what is measured."""
    box = [hostname, cpu_model, [[g.name, g.uuid] for g in gpus], torch.__version__, *builds, MEASURES_VERSION]
    return hashlib.sha256(json.dumps(box).encode()).hexdigest()[:16]


def cached_speeds(cache_path: Path | None = None, max_age_s: float = DEFAULT_MAX_AGE_S,
                  measure: Callable[[], tuple[Speed, ...]] = measure_speeds, *,
                  fingerprint: str, now: float | None = None) -> tuple[Speed, ...]:
    """The cached speeds if the box with this fingerprint (box_fingerprint) measured them less than max_age_s
    ago, else measure() stored in the cache."""
    path = cache_path or default_cache_path()
    now = time.time() if now is None else now
    with _one_at_a_time(path):     # agents starting together on one box: one measures, the others read it
        speeds = _load(path, fingerprint, now, max_age_s)
        if speeds is None:
            speeds = tuple(measure())
            _store(path, {"fingerprint": fingerprint, "measured_at": now, "speeds": [asdict(s) for s in speeds]})
    return speeds


@contextmanager
def _one_at_a_time(path: Path) -> Iterator[None]:
    """An exclusive lock beside the cache file (flock: released if the holder dies), so that probes on one box do
    not run at once: each would measure the others' load, and all but one would measure for nothing."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a")   # noqa: SIM115 (closed below)
    except OSError as exc:      # a cache folder it cannot write: it measures without the lock (and the cache)
        log.warning("no lock beside the speed cache %s: %s", path, exc)
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)    # (released when the file closes)
        yield


def _load(path: Path, fingerprint: str, now: float, max_age_s: float) -> tuple[Speed, ...] | None:
    """The cached speeds if they fit this box and are fresh; None (measure again) otherwise."""
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
        speeds = tuple(_speed(s) for s in entry["speeds"])
        measured_at = float(entry["measured_at"])
        cached_fingerprint = entry["fingerprint"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:   # JSONDecodeError is a ValueError
        log.warning("ignoring the unreadable speed cache %s: %s", path, exc)
        return None
    if cached_fingerprint != fingerprint or not speeds:
        log.info("speed cache %s is for another box or torch build: measuring", path)
        return None
    if not 0 <= now - measured_at < max_age_s:
        log.info("speed cache %s is stale: measuring", path)
        return None
    return speeds


def _speed(entry: dict) -> Speed:
    speed = Speed(str(entry["backend"]), str(entry["dtype"]), float(entry["flops"]),
                  float(entry["mem_bandwidth"]), _seconds(entry.get("step_overhead_s", 0.0)),
                  _seconds(entry.get("layer_overhead_s", 0.0)), float(entry.get("decode_flops", 0.0)),
                  float(entry.get("decode_bandwidth", 0.0)))
    if not (0 < speed.flops < math.inf and 0 < speed.mem_bandwidth < math.inf):
        raise ValueError(f"speed {speed} is not positive and finite")
    return speed


def _seconds(value: object) -> float | None:
    """A cached overhead: a number of seconds, or None where it was not measured apart."""
    return None if value is None else float(value)


def _store(path: Path, entry: dict) -> None:
    """Writes the cache atomically (agents on one box may probe at once); a failure only costs a re-measure."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, prefix=path.name,
                                         suffix=".tmp", delete=False) as f:
            json.dump(entry, f, indent=1)
        os.replace(f.name, path)
    except OSError as exc:
        log.warning("could not write the speed cache %s: %s", path, exc)
