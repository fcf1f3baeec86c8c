"""int8 weights (StageSpec.quantize = "int8") against float32 on this CPU, in torch and in ONNX Runtime (the stage's
runtime): memory, quality, speed.

    python benchmarks/int8_weights.py [--prompts 20] [--tokens 64] [--batches 1 32] [--rounds 5]
                                      [--runtimes torch onnxruntime] [--held-out-tokens N]

Quality is measured on the demo model (kernels/demo_model.py), whose held-out chapter the model never saw:
  - memory per stage: the weights each stage of a 3-stage split holds (StageModel.param_bytes: for ONNX Runtime,
    its export's initializers and the embedding and LM head torch keeps);
  - held-out perplexity, float32 and int8 (the served computation: kernels.models.decoder, or the export);
  - greedy agreement: `--prompts` prompts (the first six words of sentences of the held-out chapter), each
    continued greedily for `--tokens` tokens by the float32 and the int8 model of one runtime (EOS ignored).
Speed is the stage engine's decode step (scheduler, paged KV, runner) over every layer, per token, float32
and int8 taking turns round by round, for the demo model and a wider random-weight Llama (hidden 1024) where the
weights dominate a step (--wide-hidden). Ratio = float32 / int8 of the same runtime: above 1, int8 is faster.
Last, whether int4 weights would pay in torch here: one product of each of that model's MLP shapes, float32, int8
and int4 (torch's CPU int4 kernel, groups of 128).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from stage_step import decode_times, prefilled
from tokenizers import Tokenizer

from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels.demo_model import DEMO_DIR, read_book, served_perplexity
from stratamesh.kernels.models.config import read_config
from stratamesh.kernels.models.decoder import StageModel, greedy_tokens
from stratamesh.kernels.models.onnx_stage import export_stages, load_runtime_stage
from stratamesh.kernels.ops.quant import exact_products, linear, quantize_int8
from stratamesh.kernels.tiny_model import write_tiny_model

KINDS = {"float32": "", "int8": "int8"}      # column -> StageSpec.quantize
RUNTIMES = ("torch", "onnxruntime")
STAGES = ((0, 2), (2, 4), (4, 6))


def spec(model_dir: Path, quantize: str, runtime: str = "torch", start: int = 0, end: int | None = None) -> StageSpec:
    n = read_config(model_dir).num_layers
    return StageSpec("m", str(model_dir), start, n if end is None else end, n, quantize=quantize, runtime=runtime)


def stage(stage_spec: StageSpec) -> StageModel:
    """The stage as an agent loads it (ONNX Runtime's export kept in the cache folder: main sets it)."""
    return load_runtime_stage(stage_spec, os.environ["STRATAMESH_CACHE_DIR"])


def onnx_specs(wide: Path) -> list[StageSpec]:
    """Every ONNX Runtime stage the runs load, the largest first: the demo model's and the wide model's whole, and
    each memory row's."""
    ranges = [(DEMO_DIR, 0, None), (wide, 0, None), *((DEMO_DIR, start, end) for start, end in STAGES)]
    return [spec(model_dir, q, "onnxruntime", start, end) for model_dir, start, end in ranges for q in KINDS.values()]


def memory_rows(runtime: str) -> list[tuple[str, int, int]]:
    rows = []
    for start, end in STAGES:
        sizes = [stage(spec(DEMO_DIR, q, runtime, start, end)).param_bytes for q in KINDS.values()]
        rows.append((f"[{start}, {end})", *sizes))
    return rows


def prompts(count: int) -> list[str]:
    """The first six words of sentences spread over the held-out chapter."""
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", read_book().held_out) if len(s.split()) >= 8]
    step = max(1, len(sentences) // count)
    return [" ".join(s.split()[:6]) for s in sentences[::step][:count]]


def agreement(num_prompts: int, num_tokens: int, runtime: str) -> tuple[int, float, float, list[str]]:
    """(prompts identical over all tokens, mean tokens before the first difference, tokens equal position by
    position as a fraction, the prompts)."""
    tokenizer = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    stages = {kind: stage(spec(DEMO_DIR, q, runtime)) for kind, q in KINDS.items()}
    texts = prompts(num_prompts)
    identical, prefixes, equal = 0, [], 0
    for text in texts:
        ids = tokenizer.encode(text).ids
        a, b = (greedy_tokens(stages[kind], ids, num_tokens) for kind in KINDS)
        first_diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), num_tokens)
        identical += first_diff == num_tokens
        prefixes.append(first_diff)
        equal += sum(x == y for x, y in zip(a, b))
    return identical, statistics.mean(prefixes), equal / (num_tokens * len(texts)), texts


def quality(num_prompts: int, num_tokens: int, runtime: str, held_out_tokens: int = 0) -> None:
    """Prints the held-out perplexities (over its first held_out_tokens tokens; 0: all) and the greedy agreement of
    int8 with float32."""
    held_out = read_book().held_out
    onnx_cache = os.environ["STRATAMESH_CACHE_DIR"] if runtime == "onnxruntime" else None
    ppl = {kind: served_perplexity(DEMO_DIR, held_out, quantize=q, onnx_cache=onnx_cache, max_tokens=held_out_tokens)
           for kind, q in KINDS.items()}
    print(f"held-out perplexity: float32 {ppl['float32']:.3f}, int8 {ppl['int8']:.3f} "
          f"(delta {ppl['int8'] - ppl['float32']:+.3f}, {100 * (ppl['int8'] / ppl['float32'] - 1):+.2f}%)")
    identical, mean_prefix, equal, texts = agreement(num_prompts, num_tokens, runtime)
    print(f"greedy agreement over {num_tokens} tokens on {len(texts)} prompts: {identical}/{len(texts)} identical, "
          f"{mean_prefix:.1f} tokens before the first difference on average, {100 * equal:.1f}% of tokens equal "
          f"position by position")


def speed_rows(model_dir: Path, runtime: str, batches: list[int], prompt_len: int, steps: int,
               rounds: int) -> list[tuple[int, float, float]]:
    """Per batch: (batch, float32 ms per step, int8 ms per step), medians over interleaved rounds."""
    rows = []
    for batch in batches:
        engines = {kind: prefilled(spec(model_dir, q, runtime), batch, prompt_len)[0] for kind, q in KINDS.items()}
        times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for n in range(rounds):
            for kind, engine in engines.items():
                times[kind] += decode_times(engine, batch, prompt_len + n * steps, steps, first_step=n * steps)
        rows.append((batch, *(1e3 * statistics.median(times[kind]) for kind in KINDS)))
    return rows


def int4_pack(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] as asymmetric int4 in groups of `group` along K, packed for torch's CPU int4 kernel: (packed
    weights, scales and zeros [K / group, N, 2])."""
    n, k = w.shape
    wg = w.reshape(n, k // group, group)
    low, high = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = (high - low).clamp(min=1e-8) / 15
    q = torch.clamp(torch.round((wg - low) / scale), 0, 15).to(torch.int32).reshape(n, k)
    zero = low + 8 * scale                       # the kernel computes (q - 8) * scale + zero
    scales_zeros = torch.cat([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scales_zeros


def int4_rows(hidden: int, batches: list[int], reps: int = 50) -> list[tuple[str, int, float, float, float]]:
    """Does int4 pay here? One product of each of a layer's MLP shapes, float32 vs int8 vs int4 (groups of 128, or
    the largest of 64 and 32 that divides the inputs): (shape, batch, float32 us, int8 us, int4 us)."""
    rows = []
    for out_features, in_features in ((hidden * 11 // 4, hidden), (hidden, hidden * 11 // 4)):
        w = torch.randn(out_features, in_features) * 0.02
        group = next(g for g in (128, 64, 32) if in_features % g == 0)
        int8, (int4, scales_zeros) = quantize_int8(w), int4_pack(w, group)
        for batch in batches:
            x = torch.randn(batch, in_features)
            kinds = (lambda: F.linear(x, w), lambda: linear(x, int8),
                     lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), int4, group, scales_zeros).float())
            rows.append((f"{out_features} x {in_features}", batch, *(1e6 * _best_of(f, reps) for f in kinds)))
    return rows


def _best_of(work, reps: int) -> float:
    work()
    start = time.perf_counter()
    for _ in range(reps):
        work()
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--wide-hidden", type=int, default=1024, help="the random Llama's width (4 layers)")
    parser.add_argument("--runtimes", nargs="+", choices=RUNTIMES, default=list(RUNTIMES))
    parser.add_argument("--held-out-tokens", type=int, default=0,
                        help="the perplexities over the held-out chapter's first so many tokens (default: all of it)")
    args = parser.parse_args()
    os.environ.setdefault("STRATAMESH_CACHE_DIR", tempfile.mkdtemp())     # where ONNX Runtime's exports go
    torch.set_num_threads(os.cpu_count() or 1)
    hidden = args.wide_hidden
    wide = write_tiny_model(Path(tempfile.mkdtemp()) / "wide", num_layers=4, hidden_size=hidden,
                            intermediate_size=hidden * 11 // 4, num_heads=hidden // 64, num_kv_heads=hidden // 256)
    if "onnxruntime" in args.runtimes:     # its exports made first: a layer traced per model and weights, one a core
        export_stages(onnx_specs(wide), os.environ["STRATAMESH_CACHE_DIR"])
    print(f"demo model ({DEMO_DIR.name}), {torch.get_num_threads()} threads")
    for runtime in args.runtimes:
        print(f"\n## {runtime}\n")
        print("| stage | float32 weights MB | int8 weights MB | ratio |\n|---|---|---|---|")
        for name, full, int8 in memory_rows(runtime):
            print(f"| {name} | {full / 1e6:.2f} | {int8 / 1e6:.2f} | {full / int8:.2f}x |")
        print()
        quality(args.prompts, args.tokens, runtime, args.held_out_tokens)
        if runtime == "torch":
            with exact_products():
                print("\nthe same with float32 activations in the int8 products (no bfloat16 kernel; slower):")
                quality(args.prompts, args.tokens, runtime, args.held_out_tokens)
        for name, model_dir in (("demo model (6 x 256)", DEMO_DIR), (f"random Llama (4 x {hidden})", wide)):
            print(f"\n{runtime}, {name}: decode step, prompt {args.prompt_len}, {args.rounds} rounds x {args.steps} "
                  f"steps\n")
            print("| batch | float32 ms/step | int8 ms/step | float32 ms/token | int8 ms/token | ratio |")
            print("|---|---|---|---|---|---|")
            for batch, full, int8 in speed_rows(model_dir, runtime, args.batches, args.prompt_len, args.steps,
                                                args.rounds):
                print(f"| {batch} | {full:.2f} | {int8:.2f} | {full / batch:.3f} | {int8 / batch:.3f} | "
                      f"{full / int8:.2f}x |")
    print("\ndoes int4 pay? one product, torch's CPU kernels (int4: groups of 128, bfloat16 activations)\n")
    print("| shape | batch | float32 us | int8 us | int4 us | int4 / int8 time |\n|---|---|---|---|---|---|")
    for shape, batch, full, int8, int4 in int4_rows(hidden, args.batches):
        print(f"| {shape} | {batch} | {full:.0f} | {int8:.0f} | {int4:.0f} | {int4 / int8:.2f} |")


if __name__ == "__main__":
    main()
