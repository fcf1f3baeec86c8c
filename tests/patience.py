"""How much longer than on the machine they were set on the suite's limits may take here (STRATAMESH_PATIENCE).

Every wait in the suite waits for a state, but some must still give up at last (a mesh that never gets ready, a test
stuck for good): those limits were set on a 2-core VM, and the same VM type runs 3.4x slower from one session to the
next. So a limit is scaled by this machine's patience: how much slower than that VM one interpreter runs a fixed loop
here, times how many fewer cores this process may use than its 2 (`taskset -c 0` halves them). CI, or anyone, can
set STRATAMESH_PATIENCE instead; the value found is put there, so that the processes the suite starts (meshes,
benchmarks, pytest-xdist's workers) use the same one. LocalMesh (stratamesh.launcher) reads it for its limits."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

from stratamesh import launcher
from stratamesh.launcher import PATIENCE_ENV as ENV

REFERENCE_LOOP_S = 0.040        # the loop's best time on the VM the limits were set on (0.036-0.045 s there)
REFERENCE_CORES = 2


def _loop_s() -> float:
    """The best of 10 runs of a 1M-step interpreter loop (~40 ms each on the reference VM)."""
    best = float("inf")
    for _ in range(10):
        started, x = time.perf_counter(), 0
        for i in range(1_000_000):
            x += i % 7
        best = min(best, time.perf_counter() - started)
    return best


def measured_patience() -> float:
    """This machine's patience, measured: at least 1 (a faster machine keeps the limits as they were set)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1.0, _loop_s() / REFERENCE_LOOP_S) * max(1.0, REFERENCE_CORES / cores)


def patience() -> float:
    """STRATAMESH_PATIENCE, measured and set on first use where nobody set it."""
    if ENV not in os.environ:
        os.environ[ENV] = f"{measured_patience():.2f}"
    return launcher.patience()      # the one reading of the variable, LocalMesh's


def patient(seconds: float) -> float:
    """A limit of seconds on the reference VM, as it stands here."""
    return seconds * patience()


async def eventually(predicate: Callable[[], object], timeout_s: float = 10.0) -> None:
    """Polls predicate until it holds (AssertionError once timeout_s, scaled by patience, passes): waits for a
    state, not for a duration."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patient(timeout_s)
    while not predicate():
        assert loop.time() < deadline, "the state never came"
        await asyncio.sleep(0.005)


def wait_until(predicate: Callable[[], object], timeout_s: float = 10.0, interval_s: float = 0.1) -> None:
    """eventually() for a test without an event loop: polls predicate until it holds (AssertionError once timeout_s,
    scaled by patience, passes)."""
    deadline = time.monotonic() + patient(timeout_s)
    while not predicate():
        assert time.monotonic() < deadline, "the state never came"
        time.sleep(interval_s)
