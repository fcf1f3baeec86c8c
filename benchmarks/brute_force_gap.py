"""The planner against an independent brute force on the 200 seeded instances of the optimality test.

    python benchmarks/brute_force_gap.py

tests/partitioner/test_planner.py::test_objective_equals_brute_force_optimum asserts, per instance (at most
8 devices and 16 layers, random pins, exclusions and stage limits), that plan_pipeline's objective equals
the brute force's optimum; this prints the worst relative gap over them, the figure the issue asks for.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repo root: the tests' brute force

from tests.partitioner.random_fleets import random_case  # noqa: E402
from tests.partitioner.test_planner import (  # noqa: E402
    INF, NUM_OPTIMALITY_CASES, Reference, _plan_or_none, brute_force,
)


def main() -> None:
    worst, feasible = 0.0, 0
    for seed in range(NUM_OPTIMALITY_CASES):
        case = random_case(seed, tensor_parallel=False)
        optimum = brute_force(Reference(case), case.request.objective)
        plan = _plan_or_none(case)
        if plan is None:
            assert optimum == INF, f"seed {seed}: no plan, but the brute force found {optimum}"
            continue
        feasible += 1
        worst = max(worst, abs(plan.objective_s - optimum) / optimum)
    print(f"| instances | feasible | worst relative gap to the brute force |\n|---:|---:|---:|\n"
          f"| {NUM_OPTIMALITY_CASES} | {feasible} | {worst:.2e} |")


if __name__ == "__main__":
    main()
