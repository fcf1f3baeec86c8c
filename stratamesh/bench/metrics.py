"""Serving metrics from per-request records, with vLLM's `bench serve` definitions."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from stratamesh.fleet.errors import MeshError

SLO_METRICS = ("ttft", "tpot", "e2el")


class BenchError(MeshError):
    """A benchmark was asked for something it cannot do (a bad flag, an unknown dataset)."""


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What the client saw of one request; times in seconds from the moment it was sent."""

    success: bool
    prompt_len: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0                 # sent -> the last chunk carrying tokens
    itl_s: tuple[float, ...] = ()          # gaps between successive chunks carrying tokens
    cached_tokens: int = 0                 # usage.prompt_tokens_details.cached_tokens
    error: str = ""

    @property
    def tpot_s(self) -> float:
        """(E2E - TTFT) / (output_tokens - 1); 0 for one output token, as vLLM's goodput does."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Mean, median, p90 and p99 of one latency, in milliseconds."""

    mean_ms: float
    median_ms: float
    p90_ms: float
    p99_ms: float


@dataclass(frozen=True, slots=True)
class BenchMetrics:
    """The result of one benchmark run."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    errors: tuple[str, ...] = field(default=())

    @property
    def prefix_hit_rate(self) -> float:
        """The fraction of the completed requests' prompt tokens that the server's prefix cache served."""
        return self.total_cached_tokens / self.total_input_tokens if self.total_input_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; latencies flattened as vLLM's result file names them (mean_ttft_ms, ...)."""
        flat = {k: v for k, v in asdict(self).items() if k not in SLO_METRICS + ("itl", "errors")}
        flat["prefix_hit_rate"] = self.prefix_hit_rate
        for name in ("ttft", "tpot", "itl", "e2el"):
            for stat, value in asdict(getattr(self, name)).items():
                flat[f"{stat.removesuffix('_ms')}_{name}_ms"] = value
        flat["errors"] = list(self.errors)
        return flat


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile with linear interpolation (numpy's default); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = p / 100 * (len(ordered) - 1)
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_stats(values_s: list[float]) -> LatencyStats:
    """Stats of latencies given in seconds, reported in milliseconds."""
    mean = sum(values_s) / len(values_s) if values_s else 0.0
    return LatencyStats(mean * 1e3, percentile(values_s, 50) * 1e3, percentile(values_s, 90) * 1e3,
                        percentile(values_s, 99) * 1e3)


def parse_goodput(specs: list[str]) -> dict[str, float]:
    """["ttft:200", "tpot:50"] -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, _, value = spec.partition(":")
        if name not in SLO_METRICS:
            raise BenchError(f"goodput metric {name!r} is not one of {SLO_METRICS}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise BenchError(f"goodput {spec!r} is not NAME:MILLISECONDS") from None
        if slos[name] < 0:
            raise BenchError(f"goodput {spec!r} must not be negative")
    return slos


def is_good(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """A completed request is good when it meets every given SLO (at or below)."""
    measured_s = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2el": record.latency_s}
    return record.success and all(measured_s[name] * 1e3 <= slo for name, slo in slos_ms.items())


def compute_metrics(records: list[RequestRecord], duration_s: float,
                    slos_ms: dict[str, float] | None = None) -> BenchMetrics:
    """Aggregates records of a run that took duration_s; goodput only when SLOs are given."""
    done = [r for r in records if r.success]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_tokens for r in done)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    goodput = sum(is_good(r, slos_ms) for r in done) * per_s if slos_ms else None
    return BenchMetrics(
        completed=len(done), failed=len(records) - len(done), duration_s=duration_s,
        total_input_tokens=total_input, total_output_tokens=total_output,
        total_cached_tokens=sum(r.cached_tokens for r in done),
        request_throughput=len(done) * per_s, output_throughput=total_output * per_s,
        total_token_throughput=(total_input + total_output) * per_s, request_goodput=goodput,
        ttft=latency_stats([r.ttft_s for r in done]),
        tpot=latency_stats([r.tpot_s for r in done if r.output_tokens > 1]),
        itl=latency_stats([gap for r in done for gap in r.itl_s]),
        e2el=latency_stats([r.latency_s for r in done]),
        errors=tuple(sorted({r.error for r in records if not r.success})))
