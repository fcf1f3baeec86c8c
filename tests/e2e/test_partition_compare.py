"""The placement benchmark stays runnable: --quick prints both tables and both target lines (pass or fail)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.bench]  # a benchmark's smoke run
ROOT = Path(__file__).resolve().parents[2]


def test_partition_compare_quick_prints_its_tables_and_targets() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "partition_compare.py"), "--quick"],
                            check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for row in ("| exo: memory-proportional ring | ", "| Petals: throughput-greedy spans | ",
                "| stratamesh: plan_pipeline | ", "| ours / exo | ", "| ours / petals | ",
                "| ours / min(exo, petals) | ", "| 1,000 | 3 | "):
        assert row in out, row
    assert re.search(r"^median ours / better-of-two <= 0\.7x: (PASS|FAIL) \(", out, re.MULTILINE)
    assert re.search(r"^target < 1 s: (PASS|FAIL) \(", out, re.MULTILINE)
    assert "30 seeded fleets" in out and "large_fleet(seed, 1,000)" in out
