"""Where a request's time goes in a 3-stage mesh, from its trace, and what tracing costs.

    python benchmarks/trace_report.py [--tokens 32] [--requests 5] [--model DIR]

Two meshes serve the same 6-layer tiny Llama (one agent per stage): one tracing every request, one
tracing none (--trace-sample-rate 0). For the traced mesh the table splits each decode step into the
spans every stage recorded (queue, compute, send) and compares their sum with the end-to-end latency
the client measured; the second table compares the client latency of both meshes (tracing's cost).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx

from stratamesh.launcher import LocalMesh
from stratamesh.kernels.tiny_model import write_tiny_model

PROMPT = "The mesh"   # shorter than a KV block: no prefix-cache round trip before the first step


def run_requests(mesh: LocalMesh, model: str, num_tokens: int, num_requests: int) -> list[tuple[str, float]]:
    """(response id, client latency in s) of sequential greedy completions, after a warm-up."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": num_tokens, "temperature": 0, "ignore_eos": True}
    out = []
    with httpx.Client(timeout=120, headers=mesh.headers) as client:
        client.post(f"{mesh.url}/v1/completions", json=body).raise_for_status()
        for _ in range(num_requests):
            start = time.perf_counter()
            response = client.post(f"{mesh.url}/v1/completions", json=body)
            latency_s = time.perf_counter() - start
            response.raise_for_status()
            out.append((response.json()["id"], latency_s))
    return out


def span_totals(mesh: LocalMesh, request_id: str, num_tokens: int) -> tuple[dict[tuple, float], float]:
    """Seconds per (stage, span name) over the steps that produced the request's tokens, and the seconds of its
    path: every stage's spans, and the last token's trip to the origin (the decode loop is a ring: the other tokens
    reach the origin while the next step is on its way from the last stage to the first)."""
    trace = httpx.get(f"{mesh.url}/admin/api/requests/{request_id}/trace", headers=mesh.headers, timeout=30).json()
    totals: dict[tuple, float] = defaultdict(float)
    last_to_origin = 0.0
    for span in trace["spans"]:
        if span["step"] is not None and span["step"] < num_tokens:
            totals[(span["stage"], span["name"])] += span["duration_s"]
            if span["stage"] == "origin" and span["step"] == num_tokens - 1:
                last_to_origin = span["duration_s"]
    path = sum(seconds for (stage, _), seconds in totals.items() if stage != "origin") + last_to_origin
    return totals, path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--model", help="a Hugging Face folder; default: a 6-layer tiny Llama")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(write_tiny_model(Path(tmp, "tiny-llama"), num_layers=6))
        model = Path(model_dir).name
        results = {}
        for rate in ("1", "0"):
            with LocalMesh(model_dir, num_agents=3, threads_per_agent=1, log_dir=str(Path(tmp, f"logs-{rate}")),
                           coordinator_args=["--trace-sample-rate", rate]).start() as mesh:
                runs = run_requests(mesh, model, args.tokens, args.requests)
                spans = [span_totals(mesh, rid, args.tokens) for rid, _ in runs] if rate == "1" else []
                results[rate] = (runs, spans)
    report(results, args.tokens)


def report(results: dict, num_tokens: int) -> None:
    runs, spans = results["1"]
    print(f"## Where the time goes: 3 stages, {num_tokens} tokens, {len(runs)} requests (medians)\n")
    print("| stage | queue (ms) | compute (ms) | send (ms) |")
    print("|---|--:|--:|--:|")
    for stage in ("origin", 0, 1, 2):
        cells = [statistics.median(s.get((stage, name), 0.0) for s, _ in spans) * 1e3
                 for name in ("queue", "compute", "send")]
        print(f"| {stage} | " + " | ".join(f"{c:.1f}" if c else "-" for c in cells) + " |")
    traced = [path for _, path in spans]
    latency = [lat for _, lat in runs]
    coverage = [t / lat for t, lat in zip(traced, latency, strict=True)]
    print(f"\nspans on the request's path {statistics.median(traced) * 1e3:.1f} ms, client end-to-end "
          f"{statistics.median(latency) * 1e3:.1f} ms: spans cover {statistics.median(coverage):.1%} "
          f"(min {min(coverage):.1%}, max {max(coverage):.1%}; target: within 10%)\n")
    untraced = [lat for _, lat in results["0"][0]]
    print("## What tracing costs (client end-to-end latency, median of the requests)\n")
    print("| mesh | latency (ms) | per token (ms) |")
    print("|---|--:|--:|")
    for name, values in (("tracing every request", latency), ("tracing off", untraced)):
        print(f"| {name} | {statistics.median(values) * 1e3:.1f} | {statistics.median(values) * 1e3 / num_tokens:.2f} |")
    print(f"\nratio traced / untraced: {statistics.median(latency) / statistics.median(untraced):.3f}")


if __name__ == "__main__":
    main()
