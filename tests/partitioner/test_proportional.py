"""Proportional splits (exo's baseline): tables for known splits, seeded random properties, and errors."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from stratamesh.fleet.errors import PlacementError
from stratamesh.partitioner.proportional import split_layers

GiB = 1 << 30


@pytest.mark.parametrize("num_layers, weights, expected", [
    (8, [1], [(0, 8)]),
    (8, [1, 1], [(0, 4), (4, 8)]),
    (8, [1, 3], [(0, 2), (2, 8)]),
    (8, [3, 1], [(0, 6), (6, 8)]),
    (10, [1, 1, 1], [(0, 4), (4, 7), (7, 10)]),      # tie on remainders: earlier part wins
    (32, [16, 8, 8], [(0, 16), (16, 24), (24, 32)]),
    (7, [0.5, 0.25, 0.25], [(0, 3), (3, 5), (5, 7)]),   # remainders .5 < .75 = .75
    (4, [1, 1, 1, 1], [(0, 1), (1, 2), (2, 3), (3, 4)]),
    (10, [1000, 1], [(0, 9), (9, 10)]),               # the tiny one still gets a layer
    (10, [1, 1000, 1], [(0, 1), (1, 9), (9, 10)]),
    (80, [80, 24, 12, 8], [(0, 52), (52, 67), (67, 75), (75, 80)]),
])
def test_split_layers_table(num_layers, weights, expected) -> None:
    assert split_layers(num_layers, weights) == expected


@pytest.mark.parametrize("num_layers, weights, match", [
    (4, [], "no weights"),
    (2, [1, 1, 1], "3 stages"),
    (0, [1], "1 stages"),
    (4, [1, 0], "> 0"),
    (4, [1, -2], "> 0"),
    (4, [1, float("nan")], "finite"),
    (4, [1, float("inf")], "finite"),
])
def test_split_layers_errors(num_layers, weights, match) -> None:
    with pytest.raises(PlacementError, match=match):
        split_layers(num_layers, weights)


def _random_cases(seed: int, count: int) -> list[tuple[int, list[float]]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        num_layers = rng.randint(1, 120)
        k = rng.randint(1, min(num_layers, 12))
        weights = [rng.choice([rng.uniform(0.01, 1.0), float(rng.randint(1, 96) * GiB)])
                   for _ in range(k)]
        cases.append((num_layers, weights))
    return cases


@pytest.mark.parametrize("num_layers, weights", _random_cases(seed=7, count=300))
def test_split_layers_properties(num_layers: int, weights: list[float]) -> None:
    ranges = split_layers(num_layers, weights)
    assert len(ranges) == len(weights)
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(end == nxt for (_, end), (nxt, _) in zip(ranges, ranges[1:]))  # contiguous
    sizes = [end - start for start, end in ranges]
    assert all(s >= 1 for s in sizes)
    assert sorted(layer for s, e in ranges for layer in range(s, e)) == list(range(num_layers))
    total = sum(Fraction(w) for w in weights)
    quotas = [num_layers * Fraction(w) / total for w in weights]
    # Never more than one layer off its quota, except where the >= 1 floor lifted tiny parts.
    num_lifted = sum(1 for q in quotas if q < 1)
    assert all(abs(s - q) < 1 + num_lifted for s, q in zip(sizes, quotas))
    assert split_layers(num_layers, weights) == ranges  # deterministic


def test_split_layers_bigger_weight_never_fewer_layers() -> None:
    for num_layers, weights in _random_cases(seed=11, count=200):
        sizes = [e - s for s, e in split_layers(num_layers, weights)]
        for i in range(len(weights)):
            for j in range(len(weights)):
                if weights[i] > weights[j]:
                    assert sizes[i] >= sizes[j], (num_layers, weights, sizes)
