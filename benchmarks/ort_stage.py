"""A stage's step with ONNX Runtime computing its layers, next to the same stage in torch, on this CPU.

    python benchmarks/ort_stage.py [--batches 1 32] [--prompt-len 128] [--layers 8] [--hidden 512] [--steps 10]
                                   [--rounds 5]

Both are the stratamesh stage engine (scheduler, paged KV cache, runner) over every layer of a random-weight
Llama in float32, with the same torch threads (ONNX Runtime gets as many intra-op threads); they differ only in
what runs the layers (StageSpec.runtime). Per batch size: the prefill of batch x prompt-len tokens, then decode
steps (every session one token), the two engines taking turns round by round so that the machine's drift hits
both; medians over every round's steps. Ratio = torch / onnxruntime: above 1, ONNX Runtime is faster.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch
from stage_step import decode_times, prefilled

from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels.tiny_model import write_tiny_model

RUNTIMES = ("torch", "onnxruntime")


def measure(model_dir: Path, layers: int, batch: int, prompt_len: int, steps: int,
            rounds: int) -> dict[str, tuple[float, float]]:
    """runtime -> (prefill seconds, median decode step seconds)."""
    engines = {r: prefilled(StageSpec("m", str(model_dir), 0, layers, layers, runtime=r), batch, prompt_len)
               for r in RUNTIMES}
    times: dict[str, list[float]] = {r: [] for r in RUNTIMES}
    for n in range(rounds):
        for runtime, (engine, _) in engines.items():
            times[runtime] += decode_times(engine, batch, prompt_len + n * steps, steps, first_step=n * steps)
    return {r: (engines[r][1], statistics.median(times[r])) for r in RUNTIMES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("STRATAMESH_CACHE_DIR", tempfile.mkdtemp())     # where the export goes
    torch.set_num_threads(os.cpu_count() or 1)
    model_dir = write_tiny_model(Path(tempfile.mkdtemp()) / "llama", num_layers=args.layers,
                                 hidden_size=args.hidden, intermediate_size=args.hidden * 43 // 16,
                                 num_heads=max(1, args.hidden // 64), num_kv_heads=max(1, args.hidden // 128))
    print(f"Llama {args.layers} layers x hidden {args.hidden}, float32, prompt {args.prompt_len}, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds x {args.steps} decode steps\n")
    print(f"| batch | {'torch step ms':>13} | {'onnxruntime step ms':>19} | {'ratio':>6} | {'torch prefill s':>15} | "
          f"{'onnxruntime prefill s':>21} |")
    print(f"|-------|{'-' * 15}|{'-' * 21}|{'-' * 8}|{'-' * 17}|{'-' * 23}|")
    for batch in args.batches:
        got = measure(model_dir, args.layers, batch, args.prompt_len, args.steps, args.rounds)
        (tp, ts), (op, os_) = got["torch"], got["onnxruntime"]
        print(f"| {batch:>5} | {ts * 1e3:13.2f} | {os_ * 1e3:19.2f} | {ts / os_:5.2f}x | {tp:15.3f} | {op:21.3f} |",
              flush=True)
    print("\nratio = torch / onnxruntime decode step: above 1, ONNX Runtime is faster")


if __name__ == "__main__":
    main()
