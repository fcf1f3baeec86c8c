"""`stratamesh bench chaos` as a user runs it: a local mesh, streams, an agent killed with SIGKILL and started
again, every output checked against an undisturbed run, and the exit status that says whether all held."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.bench]  # a benchmark's smoke run


def test_bench_chaos_kills_an_agent_under_load_and_every_output_holds() -> None:
    # 3 agents for 2 stages: one spare to take a killed stage's place; one kill, half-way through
    result = subprocess.run([sys.executable, "-m", "stratamesh.cli", "bench", "chaos", "--agents", "3", "--stages", "2",
                             "--duration", "6", "--kill-every", "3", "--clients", "2", "--jobs", "4",
                             "--max-tokens", "12"], capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr[-3000:]
    assert "greedy prompts drawn so that each of their greedy steps leads by 0.0001 or more" in out
    table = dict(re.findall(r"^(\S.*?)  +(\S.*)$", out, re.MULTILINE))
    assert table["agents killed (SIGKILL) and restarted"].startswith("1 (indexes ")
    assert table["requests failed"] == "0" and table["outputs differing from the undisturbed run"] == "0"
    assert int(table["requests completed"]) > 0
