"""Streams held open for as long as a test needs them running, and the request records they leave."""

from __future__ import annotations

import time
from dataclasses import replace

import httpx

from stratamesh.bench.chaos import StreamJob
from stratamesh.fleet.launcher import LocalMesh

# A held stream (StreamJob.hold_tokens) asks for about the tiny models' whole context room (2048 tokens): it runs
# until the test releases it, then ends at its own max_tokens.
HOLD_TOKENS = 2000


def held(jobs: list[StreamJob]) -> list[StreamJob]:
    """The jobs held open until their run is released (see StreamJob.hold_tokens)."""
    return [replace(j, hold_tokens=HOLD_TOKENS) for j in jobs]


def settled_requests(mesh: LocalMesh, count: int, timeout_s: float = 30.0) -> list[dict]:
    """The newest count request records once none of them runs (a stream the client closed ends at the
    coordinator a moment later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = httpx.get(f"{mesh.url}/admin/api/requests", params={"limit": count},
                            headers=mesh.headers).json()["requests"]
        if all(r["state"] != "running" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)
