"""`stratamesh bench plan`: the planner's prediction of a local mesh next to the measurement, over a real mesh."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from stratamesh.bench.plan_check import PlanCheck, check_mesh, format_table


def check(predicted: float, measured: float, serving_cpu_s: float = 0.0) -> PlanCheck:
    return PlanCheck(2, "0-3 | 3-6", 16, predicted, measured, 0.002, 0.008, serving_cpu_s)


def test_a_prediction_is_honest_within_twice_the_measurement_either_way() -> None:
    assert check(1000, 500).honest and check(1000, 2000).honest
    assert not check(1000, 499).honest and not check(1000, 2001).honest
    assert check(1000, 250).ratio == 0.25


def test_the_table_shows_both_figures_their_ratio_and_the_verdict() -> None:
    table = format_table([check(1000, 600, 1.3e-4), check(4000, 1000)])
    assert "1000.0" in table and "600.0" in table and "0.60x" in table and "0.25x" in table
    assert table.splitlines()[1].endswith(" 0.130") and table.splitlines()[2].endswith(" -")   # none measured
    assert table.splitlines()[-1] == "NOT every prediction within 2x of the measurement"
    assert format_table([check(1000, 600)]).splitlines()[-1] == "every prediction within 2x of the measurement"


@pytest.mark.slow
@pytest.mark.bench     # a benchmark's smoke run: make test-bench
def test_a_one_agent_mesh_is_predicted_and_measured(tiny_model: Callable[..., Path]) -> None:
    result = check_mesh(str(tiny_model()), 1, input_len=16, output_len=8, rounds=1)
    assert result.layout == "0-6" and result.concurrency >= 8
    assert result.predicted_tokens_per_s > 0 and result.measured_tokens_per_s > 0 and result.measured_tpot_s > 0
    print(f"\n{format_table([result])}")
