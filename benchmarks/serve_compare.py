"""Output tokens/s of transformers and stratamesh side by side, at concurrency 1, 8 and 32.

    python benchmarks/serve_compare.py [--concurrency 1 8 32] [--input-len 128] [--output-len 64] [--rounds 3]
                                       [--range-ratio R] [--shared-prefix] [--quick] [--baseline-keeps-freed-memory]

One random-weight Llama (8 layers, hidden 512 by default) and the same token-id prompts for:
  (a) transformers generate, one request at a time (greedy);
  (b) transformers generate on left-padded batches of C prompts (a batch runs until its longest request
      is done; each request counts only its own output tokens);
  (c) stratamesh, 1 stage, driven by `bench serve`'s client at max-concurrency C;
  (d) stratamesh, 3 stages.
Both meshes are up from the start and every round measures every configuration at every concurrency in turn, so a
slow minute of this shared machine hits them alike; each cell is the median over the rounds. Then the targets,
PASS/FAIL (printed, never asserted): issue 20's at C=1 and at the largest concurrency, and the batching issue's.
--range-ratio draws each prompt's input and output length from [len*(1-R), len*(1+R)] (vLLM's
--random-range-ratio): the workload where continuous batching pulls ahead of padded batches.
--shared-prefix adds TTFT p50 of requests sharing a long prefix, prefix cache on vs off.
The agents keep freed memory in malloc's heap (agent/heap.py); transformers runs with glibc's defaults, as a
user's script does, unless --baseline-keeps-freed-memory gives it the agents' settings too.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from stratamesh.agent.heap import keep_freed_memory
from stratamesh.launcher import LaunchError, LocalMesh

from stratamesh.bench.datasets import (
    BenchRequest,
    random_requests,
    regular_token_ids,
    shared_prefix_requests,
)
from stratamesh.bench.metrics import BenchMetrics, compute_metrics
from stratamesh.bench.serve import run_requests
from stratamesh.kernels.tiny_model import write_tiny_model

log = logging.getLogger("serve_compare")
CONFIGS = ("(a) transformers, sequential", "(b) transformers, batched", "(c) stratamesh, 1 stage",
           "(d) stratamesh, 3 stages")
# (numerator row, denominator row, concurrency: 0 for the largest, at least, whose target)
TARGETS = ((2, 0, 1, 0.9, "issue 20"), (2, 1, 0, 0.9, "issue 20"), (3, 0, 1, 0.85, "issue 20"),
           (2, 0, 0, 5.0, "batching"), (2, 1, 0, 1.5, "batching"), (3, 2, 0, 0.8, "batching"))
FULL = {"num_layers": 8, "hidden_size": 512, "intermediate_size": 1376, "num_heads": 8, "num_kv_heads": 4}
QUICK = {"num_layers": 3, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2}


def write_model(root: Path, quick: bool) -> Path:
    """The benchmark's random-weight Llama (vocab 1024) in root."""
    return write_tiny_model(root / ("quick-llama" if quick else "llama-8x512"), arch="llama", vocab_size=1024,
                            **(QUICK if quick else FULL))


def prompt_sets(vocab: list[int], args: argparse.Namespace) -> dict[int, list[BenchRequest]]:
    """For each concurrency C: max(2C, min_prompts) random prompts (the same ones for every config)."""
    return {c: random_requests(vocab, max(2 * c, args.min_prompts), args.input_len, args.output_len, args.seed + c,
                               args.range_ratio)
            for c in args.concurrency}


def left_pad(prompts: list[tuple[int, ...]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask of prompts padded on the left to the longest."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def hf_tok_s(model: torch.nn.Module, requests: list[BenchRequest], batch_size: int) -> float:
    """Output tokens/s of greedy generate over requests in batches of batch_size (1: sequential)."""
    num_tokens, start = 0, time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        ids, mask = left_pad([r.prompt_ids for r in batch], pad_id=0)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(r.output_len for r in batch),
                           do_sample=False, pad_token_id=0)
        num_tokens += sum(r.output_len for r in batch)
    return num_tokens / (time.perf_counter() - start)


def load_hf(model_dir: Path) -> torch.nn.Module:
    """The checkpoint in transformers, generating past EOS like ignore_eos (exactly max_new_tokens)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.inference_mode():   # warm-up: the first generate pays one-time setup
        model.generate(input_ids=torch.tensor([[3, 4, 5]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    return model


def run_mesh(mesh: LocalMesh, model_id: str, requests: list[BenchRequest], concurrency: int) -> BenchMetrics:
    """One `bench serve` run: all requests at once, at most concurrency in flight."""
    records, duration_s = asyncio.run(run_requests(mesh.url, model_id, requests, math.inf, concurrency, seed=0,
                                                   api_key=mesh.api_key))
    return compute_metrics(records, duration_s)


def mesh_tok_s(mesh: LocalMesh | None, model_id: str, requests: list[BenchRequest], concurrency: int) -> float:
    """Output tokens/s of one `bench serve` run on a mesh (nan if it did not start or a request failed)."""
    if mesh is None:
        return math.nan
    metrics = run_mesh(mesh, model_id, requests, concurrency)
    return metrics.output_throughput if metrics.failed == 0 else math.nan


def start_mesh(model_dir: Path, num_agents: int) -> LocalMesh | None:
    """A warmed-up mesh of num_agents stages, or None (logged) if it does not start."""
    mesh = LocalMesh(str(model_dir), num_agents=num_agents)
    try:
        mesh.start()
        vocab = regular_token_ids(model_dir)
        run_mesh(mesh, model_dir.name, random_requests(vocab, 2, 16, 4, seed=99), 2)    # warm-up
    except LaunchError as exc:
        log.warning("%d-stage mesh did not start: %s", num_agents, exc)
        mesh.stop()
        return None
    return mesh


def interleaved_rounds(model_dir: Path, sets: dict[int, list[BenchRequest]],
                       rounds: int) -> list[dict[int, float]]:
    """(a)..(d) at every concurrency, round after round, all four configurations in turn; the median per cell."""
    hf = load_hf(model_dir)
    meshes = [start_mesh(model_dir, 1), start_mesh(model_dir, 3)]
    samples: list[dict[int, list[float]]] = [{c: [] for c in sets} for _ in CONFIGS]
    try:
        for r in range(rounds):
            for c, requests in sets.items():
                samples[0][c].append(hf_tok_s(hf, requests, 1))
                samples[1][c].append(hf_tok_s(hf, requests, c))
                for k, mesh in enumerate(meshes):
                    samples[2 + k][c].append(mesh_tok_s(mesh, model_dir.name, requests, c))
            log.warning("round %d of %d done", r + 1, rounds)   # progress on stderr
    finally:
        for mesh in meshes:
            if mesh is not None:
                mesh.stop()
    return [{c: statistics.median(values) for c, values in row.items()} for row in samples]


def prefix_ttft_ms(model_dir: Path, requests: list[BenchRequest], concurrency: int,
                   agent_args: list[str]) -> tuple[float, int] | None:
    """(TTFT p50 ms, cached prompt tokens) of a 1-stage mesh; None if the agents reject agent_args."""
    mesh = LocalMesh(str(model_dir), num_agents=1, agent_args=agent_args)
    try:
        mesh.start()
        vocab = sorted({t for r in requests for t in r.prompt_ids})
        run_mesh(mesh, model_dir.name, random_requests(vocab, 2, 16, 2, seed=99), 2)   # warm-up, no prefix
        metrics = run_mesh(mesh, model_dir.name, requests, concurrency)
    except LaunchError:
        return None
    finally:
        mesh.stop()
    return metrics.ttft.median_ms, metrics.total_cached_tokens


def print_throughput(rows: list[dict[int, float]], concurrency: list[int], rounds: int) -> None:
    """The side-by-side table and the targets."""
    print(f"output tokens/s (higher is better), median of {rounds} interleaved round(s)\n\n"
          f"| {'configuration':<30} |" + "".join(f" {f'C={c}':>9} |" for c in concurrency))
    print(f"|{'-' * 32}|" + f"{'-' * 11}|" * len(concurrency))
    for name, row in zip(CONFIGS, rows):
        print(f"| {name:<30} |" + "".join(f" {row[c]:9.1f} |" for c in concurrency))
    print("\ntargets:")
    for num, den, at, goal, whose in TARGETS:
        c = at if at in concurrency else max(concurrency)
        ratio = rows[num][c] / rows[den][c]
        verdict = "PASS" if ratio >= goal else "FAIL"
        print(f"  {CONFIGS[num][:3]}/{CONFIGS[den][:3]} at C={c:<3} = {ratio:5.2f}x  ({whose}: target >= {goal}x)  "
              f"{verdict}")


def print_prefix(on: tuple[float, int] | None, off: tuple[float, int] | None, args: argparse.Namespace) -> None:
    """TTFT p50 with the prefix cache and without; n/a where the agent has no --no-prefix-cache."""
    def cell(result: tuple[float, int] | None) -> str:
        return "n/a" if result is None else f"{result[0]:9.1f} ms  ({result[1]} cached prompt tokens)"

    print(f"\nshared prefix: {args.prefix_requests} requests, {args.prefix_len}-token prefix + "
          f"{args.suffix_len}-token suffix, 1 stage, max-concurrency {args.prefix_concurrency}")
    print(f"  TTFT p50, prefix cache on:  {cell(on)}\n  TTFT p50, prefix cache off: {cell(off)}")
    if on is not None and off is not None:
        print(f"  speed-up: {off[0] / on[0]:.2f}x")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.0,
                        help="draw lengths from [len*(1-R), len*(1+R)] (vLLM's --random-range-ratio)")
    parser.add_argument("--min-prompts", type=int, default=8, help="prompts per concurrency: max(2C, this)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each cell is their median")
    parser.add_argument("--model", help="a Hugging Face folder; default: the 8-layer random Llama")
    parser.add_argument("--shared-prefix", action="store_true", help="add the prefix-cache TTFT section")
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--prefix-requests", type=int, default=32)
    parser.add_argument("--prefix-concurrency", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="tiny model, C=1 and 4, few short prompts")
    parser.add_argument("--baseline-keeps-freed-memory", action="store_true",
                        help="transformers' rows run with the agents' malloc settings (agent/heap.py), not glibc's "
                             "defaults")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.input_len, args.output_len, args.min_prompts, args.rounds = [1, 4], 16, 8, 4, 1
        args.prefix_len, args.suffix_len, args.prefix_requests, args.prefix_concurrency = 64, 8, 8, 2
    return args


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.baseline_keeps_freed_memory and not keep_freed_memory():
        raise SystemExit("--baseline-keeps-freed-memory: malloc's settings could not be changed here (not glibc)")
    model_dir = Path(args.model) if args.model else write_model(Path(tempfile.mkdtemp()), args.quick)
    vocab = regular_token_ids(model_dir)
    sets = prompt_sets(vocab, args)
    rows = interleaved_rounds(model_dir, sets, args.rounds)
    heap = "the agents' (agent/heap.py)" if args.baseline_keeps_freed_memory else "glibc's defaults"
    print(f"model {model_dir.name}, input {args.input_len} tokens, output {args.output_len} tokens, "
          f"range ratio {args.range_ratio}, "
          f"prompts per column max(2C, {args.min_prompts}), {os.cpu_count()} CPUs; transformers' malloc settings: "
          f"{heap}\n")
    print_throughput(rows, args.concurrency, args.rounds)
    if args.shared_prefix:
        requests = shared_prefix_requests(vocab, args.prefix_requests, args.prefix_len, args.suffix_len,
                                          output_len=4, seed=args.seed)
        on = prefix_ttft_ms(model_dir, requests, args.prefix_concurrency, [])
        off = prefix_ttft_ms(model_dir, requests, args.prefix_concurrency, ["--no-prefix-cache"])
        print_prefix(on, off, args)


if __name__ == "__main__":
    main()
