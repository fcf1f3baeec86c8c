"""An edge CPU box's decode speed: a stage of the whole model in each runtime and weight format, against llama.cpp
and transformers on the same model and against the box's bandwidth roofline; and each format's quality.

    python benchmarks/edge_cpu.py [--models edge demo] [--batches 1 8] [--formats float32 int8 int4]
                                  [--runtimes torch onnxruntime] [--threads 1 2] [--context 64] [--steps 32]
                                  [--llama-cpp DIR] [--quick]

Models: "edge", a random Llama of about 200M parameters (12 layers of 1024, intermediate 2816, 16 heads, 4 KV heads,
vocab 32000: what an edge box runs, scaled down; written once into the cache folder), and "demo", the built-in demo
model (kernels/demo_model.py). What is measured, in one run on this machine:
  - the limit: the box's streaming read (agent.speed.measure_read_bandwidth) and the bytes/s batch-1 products read
    each format's weights at in each runtime (kernels.ops.gemv), as an agent's probe measures them;
  - decode: the stage engine's step (scheduler, paged KV, runner: what an agent runs) over every layer, `--steps`
    steps of `batch` sequences holding `--context` tokens, median; tok/s = batch / step; the roofline is the bytes
    the step reads (the stage's weights once, each sequence's KV) at the streaming read, as a fraction of the step;
  - baselines: transformers' own forward with its KV cache (float32, in process), and with --llama-cpp DIR (a
    llama.cpp build: DIR/build/bin/llama-bench and llama-batched-bench, DIR/convert_hf_to_gguf.py), llama.cpp on
    the same checkpoint converted to GGUF f32, q8_0 and q4_0 (llama-quantize), the same threads;
  - two cores: the batch-1 step at each --threads count, and what the last gives over the first;
  - quality (the demo model): held-out perplexity per format and runtime, and greedy agreement with float32.
Ratios: "x llama.cpp" is against llama.cpp's same format (int8 against q8_0, int4 against q4_0); the issue's targets
(int8 >= 1.0x q8_0, int4 >= 1.5x q8_0, float32 >= 0.8x f32, quantized >= 60% of the roofline) are checked at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from stage_step import decode_times, prefilled, transformers_times

from stratamesh.agent.speed import measure_read_bandwidth
from stratamesh.bench.llama_cpp import convert, quantize
from stratamesh.fleet.stages import StageSpec
from stratamesh.fleet.state import cache_home
from stratamesh.kernels.demo_model import DEMO_DIR, read_book, served_perplexity
from stratamesh.kernels.models.config import read_config
from stratamesh.kernels.models.decoder import greedy_tokens
from stratamesh.kernels.models.onnx_stage import export_stages, load_runtime_stage
from stratamesh.kernels.ops.gemv import gemv_bandwidth
from stratamesh.kernels.tiny_model import write_tiny_model

FORMATS = {"float32": "", "int8": "int8", "int4": "int4"}       # column -> StageSpec.quantize
RUNTIMES = ("torch", "onnxruntime")
GGUF_OF = {"float32": "f32", "int8": "q8_0", "int4": "q4_0"}    # llama.cpp's format for each of ours
EDGE = dict(num_layers=12, hidden_size=1024, intermediate_size=2816, num_heads=16, num_kv_heads=4, vocab_size=32000)
QUICK = dict(num_layers=2, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, vocab_size=1024)
TARGETS = (("int8", "int8", 1.0), ("int4", "int8", 1.5), ("float32", "float32", 0.8))   # ours, llama.cpp's, ratio
ROOFLINE_TARGET = 0.6


@dataclass(frozen=True)
class Row:
    model: str
    batch: int
    runtime: str
    fmt: str
    step_s: float
    roofline: float          # bytes read at the streaming read over the step

    @property
    def tok_s(self) -> float:
        return self.batch / self.step_s


def model_dir(name: str, quick: bool) -> Path:
    if name == "demo":
        return DEMO_DIR
    shape = QUICK if quick else EDGE
    folder = cache_home(os.environ) / "benchmarks" / ("edge-quick" if quick else "edge-llama-200m")
    if not (folder / "model.safetensors").exists():
        write_tiny_model(folder, **shape)
    return folder


def spec(path: Path, fmt: str, runtime: str) -> StageSpec:
    n = read_config(path).num_layers
    return StageSpec(path.name, str(path), 0, n, n, quantize=FORMATS[fmt], runtime=runtime)


def decode_row(name: str, path: Path, runtime: str, fmt: str, batch: int, args: argparse.Namespace,
               read_bw: float, threads: int) -> Row:
    """The stage's decode step as an agent with `threads` threads runs it: an ONNX Runtime stage's sessions on them,
    torch's glue on one (agent.daemon)."""
    onnx = runtime == "onnxruntime"
    engine, _ = prefilled(spec(path, fmt, runtime), batch, args.context, onnx_threads=threads if onnx else 0)
    torch.set_num_threads(1 if onnx else threads)
    decode_times(engine, batch, args.context, 2)                     # warm-up: first-call setup is not speed
    step_s = statistics.median(decode_times(engine, batch, args.context + 2, args.steps, first_step=2))
    read = engine.runner.model.decode_read_bytes(batch * (args.context + 2 + args.steps // 2))   # (the median step's)
    engine.runner.close()
    torch.set_num_threads(threads)
    return Row(name, batch, runtime, fmt, step_s, read / read_bw / step_s)


def llama_cpp_speeds(llama_dir: Path, path: Path, args: argparse.Namespace,
                     threads: int) -> dict[tuple[str, int], float]:
    """llama.cpp's decode tok/s by (our format, batch) on the checkpoint converted to GGUF (kept beside it)."""
    bin_dir, out = llama_dir / "build" / "bin", {}
    folder = cache_home(os.environ) / "benchmarks" / f"gguf-{path.name}"
    folder.mkdir(parents=True, exist_ok=True)
    f32 = folder / "f32.gguf"
    if not f32.exists():
        convert(llama_dir, path, f32, "f32")
    for fmt, gguf_type in GGUF_OF.items():
        gguf = folder / f"{gguf_type}.gguf"
        if not gguf.exists():
            quantize(llama_dir, f32, gguf, gguf_type)
        bench = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(args.steps),
                                "-t", str(threads), "-r", "3", "-o", "json"], check=True, capture_output=True,
                               text=True)
        out[fmt, 1] = float(json.loads(bench.stdout)[0]["avg_ts"])
        batched = bin_dir / "llama-batched-bench"
        for batch in (b for b in args.batches if b > 1 and batched.exists()):
            run = subprocess.run([str(batched), "-m", str(gguf), "-c", str(batch * (args.context + args.steps + 8)),
                                  "-npp", str(args.context), "-ntg", str(args.steps), "-npl", str(batch),
                                  "-t", str(threads), "--output-format", "jsonl"], check=True, capture_output=True,
                                 text=True)
            out[fmt, batch] = float(json.loads(run.stdout.strip().splitlines()[-1])["speed_tg"])
    return out


def print_limit(formats: list[str], runtimes: list[str], quick: bool) -> float:
    num_bytes = (16 if quick else 256) << 20
    read_bw = measure_read_bandwidth(num_bytes=num_bytes)
    print(f"streaming read: {read_bw / 1e9:.1f} GB/s ({torch.get_num_threads()} threads)")
    print("batch-1 products over more weights than the caches hold, GB/s (fraction of the streaming read):")
    for runtime in runtimes:
        cells = []
        for fmt in formats:
            bw = gemv_bandwidth(f"{runtime}-cpu", FORMATS[fmt], num_bytes=num_bytes)
            cells.append(f"{fmt} {bw / 1e9:.1f} ({bw / read_bw:.0%})")
        print(f"  {runtime:<12} " + ", ".join(cells))
    return read_bw


def print_quality(formats: list[str], runtimes: list[str], quick: bool) -> None:
    held_out = read_book().held_out
    max_tokens = 512 if quick else 0
    prompts = [list(range(40 + 7 * i, 52 + 7 * i)) for i in range(2 if quick else 8)]
    tokens = 8 if quick else 32
    print(f"\nquality on the demo model: held-out perplexity, greedy agreement with float32 over {tokens} tokens "
          f"of {len(prompts)} prompts")
    print("| runtime | format | perplexity | x float32 | greedy identical |")
    print("|---|---|---|---|---|")
    for runtime in runtimes:
        cache = cache_home(os.environ) if runtime == "onnxruntime" else None
        stages = {fmt: load_runtime_stage(spec(DEMO_DIR, fmt, runtime), cache_home(os.environ)) for fmt in formats}
        reference = {tuple(p): greedy_tokens(stages[formats[0]], p, tokens) for p in prompts}
        float32 = None
        for fmt in formats:
            ppl = served_perplexity(DEMO_DIR, held_out, quantize=FORMATS[fmt], onnx_cache=cache,
                                    max_tokens=max_tokens)
            float32 = float32 or ppl
            same = sum(greedy_tokens(stages[fmt], p, tokens) == reference[tuple(p)] for p in prompts)
            print(f"| {runtime} | {fmt} | {ppl:.3f} | {ppl / float32:.4f} | {same}/{len(prompts)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=("edge", "demo"), default=["edge", "demo"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    parser.add_argument("--runtimes", nargs="+", choices=RUNTIMES, default=list(RUNTIMES))
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}),
                        help="the batch-1 step at each (the decode table uses the last)")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--llama-cpp", type=Path, help="a llama.cpp build to measure side by side")
    parser.add_argument("--quick", action="store_true", help="a small edge model and short runs (a smoke test)")
    args = parser.parse_args()
    if args.formats[0] != "float32":
        parser.error("--formats must start with float32 (the others are measured against it)")
    os.environ.setdefault("STRATAMESH_CACHE_DIR", tempfile.mkdtemp(prefix="stratamesh-edge-"))
    threads = args.threads[-1]
    torch.set_num_threads(threads)
    read_bw = print_limit(args.formats, args.runtimes, args.quick)
    paths = {name: model_dir(name, args.quick) for name in args.models}
    if "onnxruntime" in args.runtimes:      # every export first, one a core
        export_stages([spec(path, fmt, "onnxruntime") for path in paths.values() for fmt in args.formats],
                      cache_home(os.environ))
    llama = {name: llama_cpp_speeds(args.llama_cpp, path, args, threads) if args.llama_cpp else {}
             for name, path in paths.items()}
    rows = [decode_row(name, path, runtime, fmt, batch, args, read_bw, threads)
            for name, path in paths.items() for batch in args.batches for runtime in args.runtimes
            for fmt in args.formats]
    baseline = {(name, batch): batch / transformers_times(path, batch, args.context, args.steps, "float32")[1]
                for name, path in paths.items() for batch in args.batches}
    torch.set_num_threads(threads)
    print(f"\ndecode, {threads} threads, {args.context} tokens of context")
    print("| model | batch | runtime | format | tok/s | x float32 | x transformers f32 | x llama.cpp | roofline |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        for batch in args.batches:
            for runtime in args.runtimes:
                theirs = {r.fmt: r for r in rows if (r.model, r.batch, r.runtime) == (name, batch, runtime)}
                for fmt, row in theirs.items():
                    ours_f32 = theirs[args.formats[0]].tok_s
                    llama_same = llama[name].get((fmt, batch))
                    vs_llama = f"{row.tok_s / llama_same:.2f}x" if llama_same else "-"
                    print(f"| {name} | {batch} | {runtime} | {fmt} | {row.tok_s:.1f} | {row.tok_s / ours_f32:.2f}x "
                          f"| {row.tok_s / baseline[name, batch]:.2f}x | {vs_llama} | {row.roofline:.0%} |")
            print(f"| {name} | {batch} | transformers | float32 | {baseline[name, batch]:.1f} | | 1.00x | | |")
            for fmt in args.formats:
                if (fmt, batch) in llama[name]:
                    print(f"| {name} | {batch} | llama.cpp | {GGUF_OF[fmt]} | {llama[name][fmt, batch]:.1f} | | | | |")
    if len(args.threads) > 1:
        print_scaling(paths, args, llama)
    print_targets(rows, llama, args)
    if "demo" in args.models:
        print_quality(args.formats, args.runtimes, args.quick)


def print_scaling(paths: dict[str, Path], args: argparse.Namespace, llama: dict) -> None:
    first, last = args.threads[0], args.threads[-1]
    print(f"\ntwo cores: batch-1 tok/s at {first} and {last} threads")
    print(f"| model | runtime | format | {first} | {last} | gain |")
    print("|---|---|---|---|---|---|")
    for name, path in paths.items():
        for runtime in args.runtimes:
            for fmt in args.formats[1:] or args.formats:
                speeds = [decode_row(name, path, runtime, fmt, 1, args, 1.0, t).tok_s for t in (first, last)]
                print(f"| {name} | {runtime} | {fmt} | {speeds[0]:.1f} | {speeds[1]:.1f} | "
                      f"{speeds[1] / speeds[0]:.2f}x |")
        if args.llama_cpp:
            for fmt in args.formats[1:]:
                speeds = [llama_cpp_speeds(args.llama_cpp, path, argparse.Namespace(**{**vars(args), "batches": [1]}),
                                           t)[fmt, 1] for t in (first, last)]
                print(f"| {name} | llama.cpp | {GGUF_OF[fmt]} | {speeds[0]:.1f} | {speeds[1]:.1f} | "
                      f"{speeds[1] / speeds[0]:.2f}x |")
    torch.set_num_threads(last)


def print_targets(rows: list[Row], llama: dict, args: argparse.Namespace) -> None:
    print("\ntargets (batch 1, the best runtime of each format)")
    for name in args.models:
        best = {}
        for r in rows:
            if (r.model, r.batch) == (name, 1) and r.tok_s > best.get(r.fmt, (0.0,))[0]:
                best[r.fmt] = (r.tok_s, r.runtime, r.roofline)
        for ours, theirs, target in TARGETS:
            llama_speed = llama[name].get((theirs, 1))
            if ours in best and llama_speed:
                ratio = best[ours][0] / llama_speed
                print(f"  {name}: {ours} ({best[ours][1]}) {best[ours][0]:.1f} tok/s = {ratio:.2f}x llama.cpp "
                      f"{GGUF_OF[theirs]} (target {target}x): {'met' if ratio >= target else 'NOT met'}")
        for fmt in args.formats[1:]:
            if fmt in best:
                fraction = best[fmt][2]
                print(f"  {name}: {fmt} at {fraction:.0%} of its bandwidth roofline (target "
                      f"{ROOFLINE_TARGET:.0%}): {'met' if fraction >= ROOFLINE_TARGET else 'NOT met'}")


if __name__ == "__main__":
    main()
