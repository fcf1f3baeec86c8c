"""The split searches against literal enumeration: every subsequence or ordered subset, every composition."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence

import numpy as np
import pytest

from stratamesh.partitioner.search import Costs, Split, every_order, fixed_order

INF = math.inf


def _random_costs(seed: int) -> Costs:
    """1..4 units over 1..8 layers, max or +, with some stages, links and ends forbidden (inf)."""
    rng = random.Random(seed)
    n, num_layers = rng.randint(1, 4), rng.randint(1, 8)
    gap = lambda p: INF if rng.random() < p else rng.choice([rng.uniform(0, 3), float(rng.randint(0, 3))])
    stage = []
    for _ in range(n):
        t = np.full((num_layers + 1, num_layers + 1), INF)
        for a in range(num_layers):
            for b in range(a + 1, num_layers + 1):
                t[a, b] = gap(0.15)
        stage.append(t)
    link = np.array([[gap(0.15) for _ in range(n)] for _ in range(n)]).reshape(n, n)
    enter = np.array([gap(0.2) for _ in range(n)])
    leave = np.array([gap(0.2) for _ in range(n)])
    return Costs(rng.choice([np.maximum, np.add]), stage, enter, leave, link)


def _value(costs: Costs, units: Sequence[int], ranges: Sequence[tuple[int, int]]) -> float:
    """enter, stage, link, stage, ..., leave folded left to right with costs.op."""
    value = costs.enter[units[0]]
    for k, (unit, (a, b)) in enumerate(zip(units, ranges, strict=True)):
        if k:
            value = costs.op(value, costs.link[units[k - 1], unit])
        value = costs.op(value, costs.stage[unit][a, b])
    return float(costs.op(value, costs.leave[units[-1]]))


def _compositions(num_layers: int, parts: int):
    """Every split of [0, num_layers) into parts contiguous non-empty ranges."""
    for cuts in itertools.combinations(range(1, num_layers), parts - 1):
        bounds = (0, *cuts, num_layers)
        yield tuple(itertools.pairwise(bounds))


def _stage_counts(n: int, num_layers: int, max_stages: int | None, exact: bool) -> range:
    if exact:
        return range(max_stages, max_stages + 1) if max_stages <= min(n, num_layers) else range(0)
    return range(1, min(n, num_layers, max_stages or n) + 1)


def _literal_fixed(costs: Costs, order: Sequence[int], max_stages: int | None, exact: bool = False) -> float:
    best = INF
    for k in _stage_counts(len(order), costs.num_layers, max_stages, exact):
        for units in itertools.combinations(order, k):             # subsequences keep the order
            for ranges in _compositions(costs.num_layers, k):
                best = min(best, _value(costs, units, ranges))
    return best


def _literal_every(costs: Costs, max_stages: int | None, exact: bool = False) -> float:
    n = len(costs.stage)
    best = INF
    for k in _stage_counts(n, costs.num_layers, max_stages, exact):
        for units in itertools.permutations(range(n), k):
            for ranges in _compositions(costs.num_layers, k):
                best = min(best, _value(costs, units, ranges))
    return best


def _check_split(costs: Costs, split: Split | None, expected: float, max_stages: int | None,
                 order: Sequence[int] | None = None, exact: bool = False) -> None:
    """None exactly when nothing is finite; else the optimum, and a split that tiles and achieves it."""
    if not math.isfinite(expected):
        assert split is None
        return
    assert split is not None
    assert split.value == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert split.ranges[0][0] == 0 and split.ranges[-1][1] == costs.num_layers
    assert all(a < b for a, b in split.ranges)
    assert all(r[1] == s[0] for r, s in zip(split.ranges, split.ranges[1:]))
    assert len(set(split.units)) == len(split.units)
    assert max_stages is None or len(split.units) <= max_stages
    assert not exact or len(split.units) == max_stages
    if order is not None:   # a subsequence of the order
        positions = [list(order).index(u) for u in split.units]
        assert positions == sorted(positions)
    assert _value(costs, split.units, split.ranges) == pytest.approx(split.value, rel=1e-12, abs=1e-12)


def _limits(costs: Costs, order_length: int) -> list[tuple[int | None, bool]]:
    """At most k stages for k in None, 1..3; exactly k where k stages are possible at all."""
    possible = min(order_length, costs.num_layers)
    return [(None, False), *((k, False) for k in (1, 2, 3)), *((k, True) for k in (1, 2, 3) if k <= possible)]


@pytest.mark.parametrize("seed", range(150))
def test_fixed_order_equals_literal_enumeration(seed: int) -> None:
    costs = _random_costs(seed)
    rng = random.Random(seed)
    order = list(range(len(costs.stage)))
    rng.shuffle(order)
    for max_stages, exact in _limits(costs, len(order)):
        split = fixed_order(costs, order, max_stages, exact)
        _check_split(costs, split, _literal_fixed(costs, order, max_stages, exact), max_stages, order, exact)


@pytest.mark.parametrize("seed", range(150))
def test_every_order_equals_best_fixed_order(seed: int) -> None:
    costs = _random_costs(1000 + seed)
    n = len(costs.stage)
    for max_stages, exact in _limits(costs, n):
        split = every_order(costs, max_stages, exact)
        expected = _literal_every(costs, max_stages, exact)
        over_orders = [s.value for perm in itertools.permutations(range(n))
                       if (s := fixed_order(costs, perm, max_stages, exact)) is not None]
        assert min(over_orders, default=INF) == pytest.approx(expected, rel=1e-12, abs=1e-12)
        _check_split(costs, split, expected, max_stages, exact=exact)


@pytest.mark.parametrize("num_units, num_layers, num_stages", [(3, 6, 4), (3, 6, 5), (3, 2, 3), (2, 8, 3)])
@pytest.mark.parametrize("search", ["fixed_order", "every_order"])
def test_exactly_more_stages_than_possible_is_none(num_units, num_layers, num_stages, search) -> None:
    costs = _proportional_costs([1.0] * num_units, num_layers, np.maximum)
    if search == "fixed_order":
        assert fixed_order(costs, range(num_units), num_stages, exact_stages=True) is None
    else:
        assert every_order(costs, num_stages, exact_stages=True) is None


def _proportional_costs(speeds: Sequence[float], num_layers: int, op) -> Costs:
    """Stage time = layers / speed; free links and ends."""
    stage = []
    for speed in speeds:
        t = np.full((num_layers + 1, num_layers + 1), INF)
        for a in range(num_layers):
            for b in range(a + 1, num_layers + 1):
                t[a, b] = (b - a) / speed
        stage.append(t)
    n = len(speeds)
    return Costs(op, stage, np.zeros(n), np.zeros(n), np.zeros((n, n)))


@pytest.mark.parametrize("speeds, num_layers, op, max_stages, value, units, ranges", [
    ([1, 3], 4, np.maximum, None, 1.0, (0, 1), ((0, 1), (1, 4))),   # layers in proportion to speed
    ([1, 3], 4, np.maximum, 1, 4 / 3, (1,), ((0, 4),)),             # one stage: the fast unit alone
    ([1, 3], 4, np.add, None, 4 / 3, (1,), ((0, 4),)),              # latency: never split for free
    ([2, 2, 2], 6, np.maximum, None, 1.0, (0, 1, 2), ((0, 2), (2, 4), (4, 6))),
    ([2, 2, 1], 6, np.maximum, 2, 1.5, (0, 1), ((0, 3), (3, 6))),
])
def test_fixed_order_table(speeds, num_layers, op, max_stages, value, units, ranges) -> None:
    split = fixed_order(_proportional_costs(speeds, num_layers, op), range(len(speeds)), max_stages)
    assert split == Split(pytest.approx(value), units, ranges)


def test_fixed_order_keeps_the_order_every_order_may_reverse_it() -> None:
    costs = _proportional_costs([1, 3], 4, np.maximum)
    costs.link[0, 1] = INF                                    # only unit 1 -> unit 0 may hand over
    assert fixed_order(costs, [0, 1]).units == (1,)           # alone: 4/3
    assert fixed_order(costs, [1, 0]) == Split(pytest.approx(1.0), (1, 0), ((0, 3), (3, 4)))
    assert every_order(costs) == Split(pytest.approx(1.0), (1, 0), ((0, 3), (3, 4)))


def test_nothing_feasible_is_none() -> None:
    costs = _proportional_costs([1, 1], 3, np.add)
    costs.enter[:] = INF
    assert fixed_order(costs, [0, 1]) is None
    assert every_order(costs) is None
