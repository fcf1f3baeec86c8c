"""One stage's step in process, next to transformers' forward on the same batch: is the kernel the bottleneck?

    python benchmarks/stage_step.py [--families llama qwen3 ...] [--batches 1 32] [--prompt-len 128] [--layers 8]
                                    [--hidden 512] [--steps 20] [--dtype float32|bfloat16]

Times, on this machine and with the same torch threads, a batched decode step (every session one token)
and the prefill of batch x prompt-len tokens, for the stratamesh stage engine (scheduler + paged KV
cache + runner, all layers in one stage) and for transformers with its own KV cache, for each model family (a
random-weight checkpoint of the family, kernels.tiny_model) and batch. The ratio column is stratamesh /
transformers per decode step: lower is better.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from stratamesh.agent.engine.stage_engine import EngineConfig, Outbox, StageEngine
from stratamesh.agent.engine.stage_runner import StageRunner
from stratamesh.fleet.sessions import SamplingParams, SessionOpen, StepChunk
from stratamesh.fleet.stages import Assignment, StageSpec
from stratamesh.kernels.tiny_model import TINY_ARCHS, write_tiny_model


def stratamesh_times(model_dir: Path, layers: int, batch: int, prompt_len: int, steps: int,
                     dtype: str) -> tuple[float, float]:
    """(prefill seconds, median decode step seconds) of one stage serving every layer."""
    engine, prefill_s = prefilled(StageSpec("m", str(model_dir), 0, layers, layers, dtype=dtype), batch, prompt_len)
    return prefill_s, statistics.median(decode_times(engine, batch, prompt_len, steps))


def prefilled(spec: StageSpec, batch: int, prompt_len: int, onnx_threads: int = 0) -> tuple[StageEngine, float]:
    """A stage engine of spec with sessions s0..s{batch-1} prefilled with prompt_len tokens; the prefill's seconds
    (onnx_threads: an ONNX Runtime stage's threads, 0: torch's)."""
    engine = StageEngine(Assignment("a", spec), StageRunner.load(spec, 512 << 20, onnx_threads=onnx_threads),
                         EngineConfig(max_batch_tokens=batch * prompt_len, enable_prefix_cache=False))
    prompt = tuple(range(1, prompt_len + 1))
    for i in range(batch):
        engine.open(SessionOpen(f"s{i}", "a", (), "o:1", SamplingParams(), prompt_token_ids=prompt), Outbox())
        engine.add(StepChunk(f"s{i}", 0, 0, prompt, True), None)
    start = time.perf_counter()
    while (step := engine.schedule()) is not None:
        engine.postprocess(step, engine.run(step), Outbox())
    return engine, time.perf_counter() - start


def decode_times(engine: StageEngine, batch: int, prompt_len: int, steps: int, first_step: int = 0) -> list[float]:
    """Seconds of each of `steps` batched decode steps of sessions s0..s{batch-1}, holding prompt_len tokens
    (first_step: the steps they took before)."""
    times = []
    for n in range(steps):
        for i in range(batch):
            engine.add(StepChunk(f"s{i}", first_step + n + 1, prompt_len + n, (5,), True), None)
        start = time.perf_counter()
        step = engine.schedule()
        engine.postprocess(step, engine.run(step), Outbox())
        times.append(time.perf_counter() - start)
    return times


def transformers_times(model_dir: Path, batch: int, prompt_len: int, steps: int,
                       dtype: str) -> tuple[float, float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    with torch.inference_mode():
        start = time.perf_counter()
        past = model(torch.randint(1, 700, (batch, prompt_len)), use_cache=True).past_key_values
        prefill_s, times = time.perf_counter() - start, []
        for _ in range(steps):
            start = time.perf_counter()
            past = model(torch.randint(1, 700, (batch, 1)), past_key_values=past, use_cache=True).past_key_values
            times.append(time.perf_counter() - start)
    return prefill_s, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=TINY_ARCHS, default=list(TINY_ARCHS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"{args.layers} layers x hidden {args.hidden}, {args.dtype}, prompt {args.prompt_len}, "
          f"{torch.get_num_threads()} threads\n")
    print(f"| {'family':<11} | {'batch':>5} | {'':<23} | {'prefill s':>9} | {'decode step ms':>14} | {'ratio':>6} |")
    print(f"|{'-' * 13}|{'-' * 7}|{'-' * 25}|{'-' * 11}|{'-' * 16}|{'-' * 8}|")
    ratios = []
    for family in args.families:
        model_dir = write_tiny_model(Path(tempfile.mkdtemp()) / family, arch=family, num_layers=args.layers,
                                     hidden_size=args.hidden, intermediate_size=args.hidden * 43 // 16,
                                     num_heads=max(1, args.hidden // 64), num_kv_heads=max(1, args.hidden // 128))
        for batch in args.batches:
            ours = stratamesh_times(model_dir, args.layers, batch, args.prompt_len, args.steps, args.dtype)
            theirs = transformers_times(model_dir, batch, args.prompt_len, args.steps, args.dtype)
            ratios.append(ours[1] / theirs[1])
            for name, (prefill_s, step_s), ratio in (("stratamesh stage engine", ours, f"{ratios[-1]:.2f}x"),
                                                     ("transformers", theirs, "")):
                print(f"| {family:<11} | {batch:>5} | {name:<23} | {prefill_s:9.3f} | {step_s * 1e3:14.2f} | "
                      f"{ratio:>6} |")
    print(f"\ndecode step ratio stratamesh / transformers: {min(ratios):.2f}x to {max(ratios):.2f}x "
          f"(median {statistics.median(ratios):.2f}x); lower is better")


if __name__ == "__main__":
    main()
