"""The first placement: contiguous layer ranges in proportion to each device's usable memory."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from fractions import Fraction

from stratamesh.fleet.errors import PlacementError
from stratamesh.fleet.types import StageSpec

log = logging.getLogger(__name__)


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


def plan_proportional(model_id: str, model_path: str, num_layers: int,
                      devices: Sequence[tuple[str, int]],
                      num_stages: int | None = None) -> list[tuple[str, StageSpec]]:
    """Pipeline stages on the num_stages largest devices (agent_id order), sized by memory."""
    chosen = _pick_devices(devices, len(devices) if num_stages is None else num_stages)
    ranges = split_layers(num_layers, [mem for _, mem in chosen])
    return [(agent_id, StageSpec(model_id, model_path, start, end, num_layers))
            for (agent_id, _), (start, end) in zip(chosen, ranges, strict=True)]


def _pick_devices(devices: Sequence[tuple[str, int]], num_stages: int) -> list[tuple[str, int]]:
    """The num_stages devices with the most memory (ties by agent_id), in agent_id order."""
    ids = [agent_id for agent_id, _ in devices]
    if len(set(ids)) != len(ids):
        raise PlacementError(f"device list repeats an agent_id: {sorted(ids)}")
    if not 1 <= num_stages <= len(devices):
        raise PlacementError(f"num_stages must be in 1..{len(devices)} (the number of "
                             f"devices), got {num_stages}")
    largest = sorted(devices, key=lambda d: (-d[1], d[0]))[:num_stages]
    if empty := sorted(agent_id for agent_id, mem in largest if mem <= 0):
        raise PlacementError(f"devices {empty} have no usable memory")
    return sorted(largest, key=lambda d: d[0])
