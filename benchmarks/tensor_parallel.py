"""One stage served by one process (TP=1) against the same stage as a tensor-parallel group (TP=2, 4, ...).

    python benchmarks/tensor_parallel.py [--tp 2] [--layers 4] [--hidden 2048] [--batch 8] [--prompt-len 256]
                                         [--steps 20]

Both run the stage engine (scheduler, paged KV cache, runner) over the same Llama-shaped checkpoint, on this
machine, one after the other. TP=1 gets every core as torch threads; a group of N ranks gets cores / N threads
per rank, so both use the same cores. Reported: the prefill of one prompt, the median batched decode step,
and the time the group's all-reduces took per layer (two per layer: after attention and after the MLP),
measured around the collective on rank 0. The baseline is TP=1; speed-up = TP=1 time / TP=N time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from stratamesh.agent.engine.stage_engine import EngineConfig, Outbox, StageEngine
from stratamesh.agent.engine.stage_runner import StageRunner
from stratamesh.fleet.sessions import SamplingParams, SessionOpen, StepChunk
from stratamesh.fleet.stages import Assignment, StageSpec
from stratamesh.kernels.tiny_model import write_tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from stage_step import decode_times  # noqa: E402  (a sibling script, not a package)


@dataclass(frozen=True, slots=True)
class Timing:
    prefill_s: float
    decode_step_s: float
    all_reduce_per_layer_s: float = 0.0     # decode steps only; 0 for TP=1
    all_reduce_share: float = 0.0           # of the decode step


def run(spec: StageSpec, batch: int, prompt_len: int, steps: int, cores: int) -> Timing:
    torch.set_num_threads(cores)            # a group's other ranks get cores / N threads each (StageRunner.load)
    runner = StageRunner.load(spec, 256 << 20)
    torch.set_num_threads(max(1, cores // spec.tp_degree))
    try:
        engine = StageEngine(Assignment("a", spec), runner,
                             EngineConfig(max_batch_tokens=max(prompt_len, batch), enable_prefix_cache=False))
        prompt = tuple(range(1, prompt_len + 1))
        for i in range(batch):
            engine.open(SessionOpen(f"s{i}", "a", (), "o:1", SamplingParams(), prompt_token_ids=prompt), Outbox())
            engine.add(StepChunk(f"s{i}", 0, 0, prompt, True), None)
        start = time.perf_counter()
        step = engine.schedule()                # the first prompt alone: max_batch_tokens is one prompt
        engine.postprocess(step, engine.run(step), Outbox())
        prefill_s = time.perf_counter() - start
        while (step := engine.schedule()) is not None:
            engine.postprocess(step, engine.run(step), Outbox())
        collectives = runner.ranks.collectives if runner.ranks else None
        reduce_before = collectives.all_reduce_s if collectives else 0.0
        times = decode_times(engine, batch, prompt_len, steps)
        decode_s = statistics.median(times)
        if collectives is None:
            return Timing(prefill_s, decode_s)
        reduce_per_step = (collectives.all_reduce_s - reduce_before) / steps
        num_layers = spec.end_layer - spec.start_layer
        return Timing(prefill_s, decode_s, reduce_per_step / num_layers, reduce_per_step / (sum(times) / steps))
    finally:
        runner.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    heads = args.hidden // 128
    model_dir = write_tiny_model(Path(tempfile.mkdtemp()) / "llama", num_layers=args.layers,
                                 hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                 num_heads=heads, num_kv_heads=max(args.tp, heads // 4))
    spec = StageSpec("m", str(model_dir), 0, args.layers, args.layers)
    params = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 1e9
    one = run(spec, args.batch, args.prompt_len, args.steps, args.cores)
    group = run(replace(spec, tp_degree=args.tp), args.batch, args.prompt_len, args.steps, args.cores)
    print(f"Llama stage: {args.layers} layers x hidden {args.hidden} ({heads} heads, head dim 128), "
          f"{params:.2f} GB float32; {args.cores} cores; batch {args.batch}, prompt {args.prompt_len}\n")
    print("| stage | prefill of one prompt s | decode step ms (batch) | all-reduce per layer ms | "
          "all-reduce share of the step |")
    print("|---|--:|--:|--:|--:|")
    for name, t in (("TP=1 (one process)", one), (f"TP={args.tp} (gloo)", group)):
        reduce_ms = f"{t.all_reduce_per_layer_s * 1e3:.2f}" if t.all_reduce_per_layer_s else "-"
        share = f"{t.all_reduce_share * 100:.0f}%" if t.all_reduce_share else "-"
        print(f"| {name} | {t.prefill_s:.3f} | {t.decode_step_s * 1e3:.1f} | {reduce_ms} | {share} |")
    print(f"\nspeed-up TP={args.tp} over TP=1: decode {one.decode_step_s / group.decode_step_s:.2f}x, "
          f"prefill {one.prefill_s / group.prefill_s:.2f}x (higher is better)")


if __name__ == "__main__":
    main()
