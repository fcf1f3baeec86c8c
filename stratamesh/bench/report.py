"""The result of `bench serve` as vLLM prints it: a 50-column table, or JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from stratamesh.bench.metrics import BenchMetrics, LatencyStats, RequestRecord
from stratamesh.bench.options import ServeOptions

_LATENCIES = (("ttft", "TTFT", "Time to First Token"),
              ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
              ("itl", "ITL", "Inter-token Latency"),
              ("e2el", "E2EL", "End-to-end Latency"))


def _row(label: str, value: float | str) -> str:
    return f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value!s:<10}"


def _latency_rows(name: str, header: str, stats: LatencyStats) -> list[str]:
    return [f"{header:-^50}", _row(f"Mean {name} (ms):", stats.mean_ms),
            _row(f"Median {name} (ms):", stats.median_ms), _row(f"P90 {name} (ms):", stats.p90_ms),
            _row(f"P99 {name} (ms):", stats.p99_ms)]


def format_report(metrics: BenchMetrics, options: ServeOptions, drafts: tuple[int, int] | None = None) -> str:
    """The human-readable table, in vLLM's layout and wording; drafts: (drafted, kept) tokens of speculative
    decoding during the run, where the server said."""
    rows = [f"{' Serving Benchmark Result ':=^50}", _row("Successful requests:", metrics.completed),
            _row("Failed requests:", metrics.failed)]
    if options.max_concurrency is not None:
        rows.append(_row("Maximum request concurrency:", options.max_concurrency))
    if options.rate_schedule:
        rows.append(f"{'Rate schedule (RPS:s):':<40}" + ",".join(f"{r:g}:{t:g}" for r, t in options.rate_schedule))
    elif not math.isinf(options.request_rate):
        rows.append(_row("Request rate configured (RPS):", float(options.request_rate)))
    rows += [_row("Benchmark duration (s):", metrics.duration_s),
             _row("Total input tokens:", metrics.total_input_tokens),
             _row("Total generated tokens:", metrics.total_output_tokens),
             _row("Total cached prompt tokens:", metrics.total_cached_tokens),
             _row("Prefix cache hit rate (%):", 100.0 * metrics.prefix_hit_rate),
             _row("Request throughput (req/s):", metrics.request_throughput)]
    if metrics.request_goodput is not None:
        rows.append(_row("Request goodput (req/s):", metrics.request_goodput))
    rows += [_row("Output token throughput (tok/s):", metrics.output_throughput),
             _row("Total Token throughput (tok/s):", metrics.total_token_throughput)]
    for attr, name, header in _LATENCIES:
        rows += _latency_rows(name, header, getattr(metrics, attr))
    if drafts is not None and drafts[0]:
        rows += [f"{'Speculative Decoding':-^50}", _row("Acceptance rate (%):", 100.0 * drafts[1] / drafts[0]),
                 _row("Draft tokens:", drafts[0]), _row("Accepted tokens:", drafts[1])]
    rows.append("=" * 50)
    rows += [f"error: {error}" for error in metrics.errors[:5]]
    return "\n".join(rows)


def format_json(metrics: BenchMetrics, options: ServeOptions, records: Sequence[RequestRecord] = (),
                drafts: tuple[int, int] | None = None) -> str:
    """The machine-readable result: settings, metrics, speculative decoding's drafted and kept tokens where the
    server said (None otherwise) and, as vLLM's result file, per-request lists (s)."""
    settings = {"model": options.model, "dataset": options.dataset, "num_prompts": options.num_prompts,
                "request_rate": None if math.isinf(options.request_rate) else options.request_rate,
                "rate_schedule": [list(step) for step in options.rate_schedule],
                "max_concurrency": options.max_concurrency, "input_len": options.input_len,
                "output_len": options.output_len, "seed": options.seed, "goodput_ms": options.goodput_ms}
    if options.dataset == "shared-prefix":
        settings["prefix_len"], settings["num_prefixes"] = options.prefix_len, options.num_prefixes
    per_request = {"input_lens": [r.prompt_len for r in records], "output_lens": [r.output_tokens for r in records],
                   "ttfts": [r.ttft_s for r in records], "e2els": [r.latency_s for r in records],
                   "itls": [list(r.itl_s) for r in records], "successes": [r.success for r in records]}
    spec = {"spec_decode_draft_tokens": drafts and drafts[0], "spec_decode_accepted_tokens": drafts and drafts[1],
            "spec_decode_acceptance_rate": drafts[1] / drafts[0] if drafts and drafts[0] else None}
    return json.dumps({**settings, **metrics.to_dict(), **spec, **per_request}, indent=2)

