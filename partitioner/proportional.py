"""Contiguous layer ranges in proportion to weights: exo's memory-weighted ring split, the baseline that
benchmarks/partition_compare.py measures the planner against (the coordinator plans with planner.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

from stratamesh.fleet.errors import PlacementError


def split_layers(num_layers: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """Cut [0, num_layers) into len(weights) contiguous ranges of >= 1 layer, sized by weight."""
    _check_split(num_layers, weights)
    sizes = _largest_remainder(num_layers, [Fraction(w) for w in weights])
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size))
        start += size
    assert start == num_layers, (sizes, num_layers)
    return ranges


def _check_split(num_layers: int, weights: Sequence[float]) -> None:
    """PlacementError unless there are 1..num_layers finite positive weights."""
    if not weights:
        raise PlacementError("no devices to place layers on (no weights)")
    if len(weights) > num_layers:
        raise PlacementError(f"{len(weights)} stages cannot share {num_layers} layers "
                             f"with at least one layer each")
    bad = [w for w in weights if not (math.isfinite(w) and w > 0)]
    if bad:
        raise PlacementError(f"weights must be finite and > 0, got {bad}")


def _largest_remainder(total: int, weights: list[Fraction]) -> list[int]:
    """Integer sizes summing to total, proportional to weights, each >= 1 (needs total >= count)."""
    quotas = [total * w / sum(weights) for w in weights]
    sizes = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(sizes)), key=lambda i: (-(quotas[i] - sizes[i]), i))
    for i in by_remainder[: total - sum(sizes)]:
        sizes[i] += 1
    # A tiny weight can round to 0 layers: take one from the part most above its quota.
    for i in [i for i, s in enumerate(sizes) if s == 0]:
        donor = max((j for j, s in enumerate(sizes) if s >= 2),
                    key=lambda j: (sizes[j] - quotas[j], -j))
        sizes[donor] -= 1
        sizes[i] = 1
    return sizes
