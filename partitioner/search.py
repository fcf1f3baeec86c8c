"""Dynamic programmes over layer splits: exact for a fixed order of units, and exact over every order of few.

Costs are combined with max (throughput: the bottleneck) or + (latency: the step). A state is "the layers
[0, l) are placed and the last stage is on unit j"; its value is a vector over l, so each extension is one
numpy reduction over (start, end) pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

INF = np.inf


@dataclass(frozen=True, slots=True)
class Costs:
    """One objective's costs over candidate units 0..n-1 (inf = not allowed)."""

    op: Callable[[np.ndarray, np.ndarray], np.ndarray]   # np.maximum or np.add
    stage: Sequence[np.ndarray]       # per unit: [L+1, L+1] time of serving [a, b)
    enter: np.ndarray                 # per unit: origin -> unit as the first stage (inf: may not be first)
    leave: np.ndarray                 # per unit: unit -> origin as the last stage (inf: may not be last)
    link: np.ndarray                  # [n, n]: unit i -> unit j

    @property
    def num_layers(self) -> int:
        return self.stage[0].shape[0] - 1 if self.stage else 0


@dataclass(frozen=True, slots=True)
class Split:
    """A solution: units in pipeline order with their layer ranges, and its value."""

    value: float
    units: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]


def _enter(costs: Costs, values: np.ndarray, prev_units: Sequence[int], j: int) -> tuple[np.ndarray, np.ndarray]:
    """For each start layer a, the best predecessor of a stage on j and the value on arrival: (value, which).

    values [P, L+1] of partial pipelines ending on prev_units at layer a. The stage's own cost does not depend
    on the predecessor and op is monotone, so the minimum over predecessors is taken first."""
    entered = costs.op(values, costs.link[list(prev_units), j][:, None])     # [P, L+1]
    which = np.argmin(entered, axis=0)                                       # [L+1]
    return entered[which, np.arange(entered.shape[1])], which


def _stage(costs: Costs, arrived: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
    """Best value of a stage on j ending at each layer b, given arrival values over start a: (value, best a)."""
    cand = costs.op(arrived[:, None], costs.stage[j])                        # [L+1 (a), L+1 (b)]
    best_a = np.argmin(cand, axis=0)
    return cand[best_a, np.arange(cand.shape[1])], best_a


def _start(costs: Costs, j: int) -> np.ndarray:
    """A first stage on j, over its end layer."""
    return costs.op(np.full(costs.num_layers + 1, costs.enter[j]), costs.stage[j][0])


def fixed_order(costs: Costs, order: Sequence[int], max_stages: int | None = None,
                exact_stages: bool = False) -> Split | None:
    """Exact over every subsequence of order and every integer split; None if nothing is feasible.

    Without a binding max_stages one value vector per position suffices; with one, a vector per stage count.
    exact_stages: exactly max_stages stages, not at most."""
    num_layers, n = costs.num_layers, len(order)
    limited = max_stages is not None and (exact_stages or max_stages < min(n, num_layers))
    depth = max_stages if limited else 1
    value = np.full((n, depth, num_layers + 1), INF)      # last stage on order[pos], k-th stage, ends at b
    prev = np.full((n, depth, num_layers + 1), -1)        # position of the stage before (-1: first stage)
    start_a = np.zeros((n, depth, num_layers + 1), dtype=int)
    for pos, j in enumerate(order):
        value[pos, 0] = _start(costs, j)
        for k in range(depth):
            source = k - 1 if limited else 0
            if pos == 0 or source < 0:
                continue
            arrived, which = _enter(costs, value[:pos, source], order[:pos], j)
            cand, best_a = _stage(costs, arrived, j)
            better = cand < value[pos, k]
            value[pos, k] = np.where(better, cand, value[pos, k])
            prev[pos, k] = np.where(better, which[best_a], prev[pos, k])
            start_a[pos, k] = np.where(better, best_a, start_a[pos, k])
    return _best_end(costs, order, value, prev, start_a, limited, exact_stages)


def _best_end(costs: Costs, order: Sequence[int], value: np.ndarray, prev: np.ndarray, start_a: np.ndarray,
              limited: bool, exact_stages: bool) -> Split | None:
    """The best finished pipeline (its last stage ends at the last layer) and its units and ranges."""
    end = costs.num_layers
    finished = costs.op(value[:, :, end], costs.leave[list(order)][:, None])   # [n, depth]
    if exact_stages:
        finished[:, :-1] = INF
    pos, k = np.unravel_index(int(np.argmin(finished)), finished.shape)
    best = float(finished[pos, k])
    if not np.isfinite(best):
        return None
    units, ranges, pos, k = [], [], int(pos), int(k)
    while pos >= 0:
        a = int(start_a[pos, k, end])
        units.append(order[pos])
        ranges.append((a, end))
        pos, end = int(prev[pos, k, end]), a
        k = k - 1 if limited else 0
    return Split(best, tuple(reversed(units)), tuple(reversed(ranges)))


def every_order(costs: Costs, max_stages: int | None = None, exact_stages: bool = False) -> Split | None:
    """Exact over every ordered subset of the units (Held-Karp over subsets); for a handful of units.

    exact_stages: exactly max_stages stages, not at most."""
    n, num_layers = len(costs.stage), costs.num_layers
    limit = min(max_stages or n, n, num_layers)
    if exact_stages and max_stages is not None and max_stages > limit:
        return None
    # table[(mask, j)]: the stages on the units of mask, the last on j -> (value, prev unit, start a) over b
    table: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for mask in range(1, 1 << n):
        if mask.bit_count() > limit:
            continue
        for j in (j for j in range(n) if mask >> j & 1):
            rest = mask & ~(1 << j)
            if not rest:
                table[(mask, j)] = (_start(costs, j), np.full(num_layers + 1, -1), np.zeros(num_layers + 1, int))
                continue
            prevs = [i for i in range(n) if (rest, i) in table]
            if not prevs:
                continue
            arrived, which = _enter(costs, np.stack([table[(rest, i)][0] for i in prevs]), prevs, j)
            if not np.isfinite(arrived).any():
                continue
            cand, best_a = _stage(costs, arrived, j)
            table[(mask, j)] = (cand, np.asarray(prevs)[which[best_a]], best_a)
    return _best_subset_end(costs, table, num_layers, limit if exact_stages else None)


def _best_subset_end(costs: Costs, table: dict, num_layers: int, num_stages: int | None) -> Split | None:
    chosen, chosen_value = None, INF
    for (mask, j) in sorted(table):
        if num_stages is not None and mask.bit_count() != num_stages:
            continue
        value = float(costs.op(table[(mask, j)][0][num_layers], costs.leave[j]))
        if value < chosen_value:
            chosen, chosen_value = (mask, j), value
    if chosen is None:
        return None
    units, ranges, (mask, j), end = [], [], chosen, num_layers
    while j >= 0:
        _, prev, start_a = table[(mask, j)]
        a, i = int(start_a[end]), int(prev[end])
        units.append(j)
        ranges.append((a, end))
        mask, j, end = mask & ~(1 << j), i, a
    return Split(chosen_value, tuple(reversed(units)), tuple(reversed(ranges)))
