"""benchmarks/serve_compare.py --quick runs end to end and prints its table and targets."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.bench]
ROOT = Path(__file__).resolve().parents[2]


def test_serve_compare_quick_prints_the_table_and_the_targets() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_compare.py"), "--quick",
                             "--range-ratio", "0.5"],
                            check=False, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for config in ("(a) transformers, sequential", "(b) transformers, batched", "(c) stratamesh, 1 stage",
                   "(d) stratamesh, 3 stages"):
        row = re.search(rf"\| {re.escape(config)} +\| +([\d.]+) \| +([\d.]+) \|", out)
        assert row, f"no numbers for {config}:\n{out}"
        assert all(float(v) > 0 for v in row.groups())
    assert "| configuration" in out and "C=1" in out and "C=4" in out
    assert len(re.findall(r"target >= [\d.]+x\)  (PASS|FAIL)", out)) == 6, out
