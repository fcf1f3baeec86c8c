"""Streams held open for as long as a test needs them running, and the request records they leave."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import httpx

from stratamesh.bench.chaos import StreamJob, StreamOutcome
from stratamesh.bench.margins import whole_model
from stratamesh.launcher import LocalMesh
from stratamesh.kernels.models.decoder import greedy_tokens

# A held stream (StreamJob.hold_tokens) asks for about the tiny models' whole context room (2048 tokens): it runs
# until the test releases it, then ends at its own max_tokens.
HOLD_TOKENS = 2000


def which_diverged(model_dir: Path, jobs: list[StreamJob], **runs: list[StreamOutcome]) -> str:
    """For each greedy job the runs disagree on, where each run first left the model's greedy tokens in one process
    (float32): an assertion message that tells a wrong reference run from a wrong failover."""
    stage = whole_model(model_dir)
    lines = []
    for i, job in enumerate(jobs):
        tokens = {name: outcomes[i].tokens for name, outcomes in runs.items()}
        if job.temperature != 0 or len({tuple(t) for t in tokens.values()}) == 1:
            continue
        model = greedy_tokens(stage, list(job.prompt_ids), max(len(t) for t in tokens.values()))
        left = {name: next((k for k, (a, b) in enumerate(zip(t, model)) if a != b), None) for name, t in tokens.items()}
        lines.append(f"job {i}: first token off the one-process model's, by run: {left}")
    return "\n".join(lines)


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
