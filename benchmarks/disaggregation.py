"""Prefill/decode disaggregation against whole requests on the same replicas, side by side.

    python benchmarks/disaggregation.py [--num-long 24] [--long-len 768] [--long-output 64] [--num-short 24]
                                        [--short-len 32] [--short-output 64] [--request-rate 1.2]
                                        [--max-concurrency 12] [--min-prompt 256] [--quick]

One random-weight Llama (8 layers, hidden 512, 4 KV heads of 64) served as 2 replicas of 1 stage, each agent on
one CPU thread, twice in turn on the same box: whole requests (kv router) and then `--prefill-replicas 1` (replica 0
prefills every prompt of at least --min-prompt uncached tokens and hands its KV to replica 1, which decodes it;
short prompts run whole on replica 1). Both get the same mixed load on the same seeded Poisson schedule: long
prompts with few output tokens, short prompts with many, shuffled together.

Printed: TTFT and ITL p50 / p99 (all requests, and the short ones' ITL: the decodes a long prefill interrupts),
the gap before a long prompt's second token (where a hand-off waits for its KV to move), output tokens/s, the
ratios disaggregated / whole; the KV bytes each hand-off moved against
2 x layers x kv_heads x head_dim x 4 bytes (float32) x prompt tokens; and whether every request's greedy output
is the same token for token in both runs.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kv_routing import FULL, QUICK, serve, start_replicas
from stratamesh.bench.datasets import BenchRequest, regular_token_ids
from stratamesh.bench.metrics import BenchMetrics, compute_metrics, latency_stats
from stratamesh.bench.serve import run_requests
from stratamesh.launcher import LocalMesh
from stratamesh.kernels.models.config import read_config
from stratamesh.kernels.tiny_model import write_tiny_model

RUNS = ("whole", "disaggregated")


def mixed_requests(vocab: list[int], args: argparse.Namespace) -> list[BenchRequest]:
    """Long and short prompts of random regular tokens (none sharing a prefix), shuffled; seeded."""
    rng = random.Random(args.seed)
    requests = [BenchRequest(tuple(rng.choices(vocab, k=args.long_len)), args.long_output)
                for _ in range(args.num_long)]
    requests += [BenchRequest(tuple(rng.choices(vocab, k=args.short_len)), args.short_output)
                 for _ in range(args.num_short)]
    rng.shuffle(requests)
    return requests


def start_mesh(model_dir: Path, run: str, args: argparse.Namespace) -> LocalMesh:
    """The run's mesh, once both replicas are ready: whole requests, or replica 0 prefilling for replica 1."""
    split = ["--prefill-replicas", "1", "--disagg-min-prompt", str(args.min_prompt)] if run == "disaggregated" else []
    return start_replicas(model_dir, run, split, ["--kv-cache-gib", str(args.kv_cache_gib)], threads_per_agent=1)


def counters(mesh: LocalMesh) -> dict[str, float]:
    text = httpx.get(f"{mesh.url}/metrics", headers=mesh.headers, timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


async def outputs(mesh: LocalMesh, model_id: str, requests: list[BenchRequest]) -> list[list[int]]:
    """Every request's greedy token ids, a few at a time."""
    limit = asyncio.Semaphore(4)

    async def one(client: httpx.AsyncClient, request: BenchRequest) -> list[int]:
        body = {"model": model_id, "prompt": list(request.prompt_ids), "max_tokens": request.output_len,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        async with limit:
            response = await client.post(f"{mesh.url}/v1/completions", json=body)
        response.raise_for_status()
        return response.json()["choices"][0]["token_ids"]

    async with httpx.AsyncClient(timeout=600, headers=mesh.headers) as client:
        return list(await asyncio.gather(*(one(client, r) for r in requests)))


def measure(model_dir: Path, run: str, requests: list[BenchRequest], args: argparse.Namespace) -> dict:
    """One timed run of the load, then every request once more for its output, and the hand-off counters."""
    mesh = start_mesh(model_dir, run, args)
    try:
        serve(mesh, model_dir.name, [BenchRequest(r.prompt_ids[:8], 4) for r in requests[:4]], 4)   # warm-up
        before = counters(mesh)
        records, duration_s = asyncio.run(run_requests(mesh.url, model_dir.name, requests, args.request_rate,
                                                       args.max_concurrency, seed=args.seed,
                                                       api_key=mesh.api_key))
        after = counters(mesh)
        metrics = compute_metrics(records, duration_s)
        if metrics.failed:
            raise SystemExit(f"{run}: {metrics.failed} requests failed: {metrics.errors[:3]}")
        short_gaps = [gap for r, rec in zip(requests, records) if r.prompt_len == args.short_len for gap in rec.itl_s]
        # a handed-off generation's second token waits for its KV to move: its first gap, against the same gap whole
        second = [rec.itl_s[0] for r, rec in zip(requests, records) if r.prompt_len == args.long_len and rec.itl_s]
        handoffs = after.get("stratamesh:prefill_handoffs_total", 0) - before.get("stratamesh:prefill_handoffs_total", 0)
        kv_bytes = after.get("stratamesh:handoff_kv_bytes_total", 0) - before.get("stratamesh:handoff_kv_bytes_total", 0)
        return {"metrics": metrics, "short_itl": latency_stats(short_gaps), "second": latency_stats(second),
                "handoffs": handoffs,
                "kv_bytes": kv_bytes, "outputs": asyncio.run(outputs(mesh, model_dir.name, requests))}
    finally:
        mesh.stop()


def report(results: dict[str, dict], model_dir: Path, args: argparse.Namespace) -> None:
    config = read_config(model_dir)
    print(f"2 replicas x 1 stage, 1 CPU thread per agent; {args.num_long} prompts of {args.long_len} tokens "
          f"({args.long_output} out) and {args.num_short} of {args.short_len} ({args.short_output} out), shuffled, "
          f"{args.request_rate} requests/s (Poisson), max-concurrency {args.max_concurrency}; disaggregated: "
          f"--prefill-replicas 1 --disagg-min-prompt {args.min_prompt}\n")
    names = ("TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "short ITL p99", "long 2nd-token gap p50",
             "long 2nd-token gap p99", "output tok/s")
    print("| run | " + " | ".join(f"{n} {'tok/s' if 'tok/s' in n else 'ms'}".replace(" tok/s tok/s", " tok/s")
                                  for n in names) + " |")
    print("|" + "---|" * (len(names) + 1))
    rows = {}
    for run in RUNS:
        m: BenchMetrics = results[run]["metrics"]
        rows[run] = (m.ttft.median_ms, m.ttft.p99_ms, m.itl.median_ms, m.itl.p99_ms, results[run]["short_itl"].p99_ms,
                     results[run]["second"].median_ms, results[run]["second"].p99_ms, m.output_throughput)
        print(f"| {run} | " + " | ".join(f"{v:.1f}" for v in rows[run]) + " |")
    whole, split = rows["whole"], rows["disaggregated"]
    print("\ndisaggregated / whole: " + ", ".join(f"{n} {b / a:.2f}x" for n, a, b in zip(names, whole, split) if a))
    handoffs, kv_bytes = results["disaggregated"]["handoffs"], results["disaggregated"]["kv_bytes"]
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    if handoffs:
        print(f"hand-offs: {handoffs:.0f} (of {args.num_long} long prompts); KV moved per hand-off "
              f"{kv_bytes / handoffs:,.0f} bytes; 2 x {config.num_layers} layers x {config.num_kv_heads} kv heads x "
              f"{config.head_dim} x 4 bytes x {args.long_len} tokens = {per_token * args.long_len:,} bytes "
              f"({kv_bytes / handoffs / (per_token * args.long_len):.3f}x)")
    else:
        print("hand-offs: none")
    same = results["whole"]["outputs"] == results["disaggregated"]["outputs"]
    print(f"outputs identical in both runs ({len(results['whole']['outputs'])} requests, greedy): "
          f"{'yes' if same else 'NO'}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-long", type=int, default=24)
    parser.add_argument("--long-len", type=int, default=768)
    parser.add_argument("--long-output", type=int, default=64)
    parser.add_argument("--num-short", type=int, default=24)
    parser.add_argument("--short-len", type=int, default=32)
    parser.add_argument("--short-output", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=1.2, help="requests/s, Poisson arrivals (seeded)")
    parser.add_argument("--max-concurrency", type=int, default=12)
    parser.add_argument("--min-prompt", type=int, default=256, help="--disagg-min-prompt of the disaggregated run")
    parser.add_argument("--kv-cache-gib", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a small model and few prompts (a smoke run)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.quick:
        args.num_long, args.num_short, args.long_len, args.min_prompt, args.request_rate = 4, 4, 96, 64, 8.0
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp) / ("quick-llama" if args.quick else "llama-8x512"), arch="llama",
                                     vocab_size=1024, **(QUICK if args.quick else FULL))
        requests = mixed_requests(regular_token_ids(model_dir), args)
        results = {run: measure(model_dir, run, requests, args) for run in RUNS}
        report(results, model_dir, args)


if __name__ == "__main__":
    main()
