"""The agent's malloc settings: a large tensor freed and allocated again is not faulted in again."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Allocates, fills and frees a 64 MB tensor 12 times; prints the minor page faults of the last 4 together (the
# first few settle the heap: torch's aligned allocations leave holes a freed tensor does not fit at first).
CHURN = """
import resource, sys, torch
from stratamesh.agent.heap import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    torch.ones(16 << 20)
before = faults()
for _ in range(4):
    torch.ones(16 << 20)
print(applied, faults() - before)
"""


def churn(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True,
                         timeout=120).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_a_freed_large_tensor_is_reused_not_faulted_in_again() -> None:
    pages = (64 << 20) // 4096
    applied, kept = churn("keep")
    _, default = churn("default")
    assert applied == "True"
    assert default >= 4 * pages * 0.9       # glibc's default: every allocation over 32 MiB is mapped afresh
    assert kept < pages * 0.1               # kept: the heap hands the same pages back
