"""Streams held open for as long as a test needs them running, and the request records they leave."""

from __future__ import annotations

import math
import random
import time
from dataclasses import replace
from pathlib import Path

import httpx
import torch

from stratamesh.bench.chaos import StreamJob, StreamOutcome
from stratamesh.bench.datasets import regular_token_ids
from stratamesh.fleet.launcher import LocalMesh
from stratamesh.fleet.types import StageSpec
from stratamesh.kernels.models.config import read_config
from stratamesh.kernels.models.decoder import StageModel, greedy_tokens, load_stage, one_sequence

# A held stream (StreamJob.hold_tokens) asks for about the tiny models' whole context room (2048 tokens): it runs
# until the test releases it, then ends at its own max_tokens.
HOLD_TOKENS = 2000


# A greedy stream is checked token for token against the same request on an undisturbed mesh. Its float sums need
# not run in the same order there: a failover's new route recomputes the context's KV in one prefill, and the
# batches a step's decodes share decide how a matrix product sums (torch's CPU products differ in the last bits
# below 32 rows). On the tiny models that moves a logit by up to ~7e-6 (a context recomputed after 16 of 48 tokens,
# 6 streams: max 7.4e-6, median 2.9e-6). A step whose two best logits are closer than that may take the other token
# with nothing wrong, so the tests draw prompts whose every greedy step leads its runner-up by far more.
MIN_MARGIN = 1e-4


def decisive(jobs: list[StreamJob], model_dir: Path, seed: int = 0) -> list[StreamJob]:
    """The jobs, each greedy one's prompt drawn again (as long, from the regular vocabulary) until each of its
    max_tokens greedy steps leads the runner-up logit by MIN_MARGIN in a one-process run of the model."""
    stage = whole_model(model_dir)
    vocab, rng = regular_token_ids(model_dir), random.Random(seed)
    out = []
    for job in jobs:
        while job.temperature == 0 and smallest_margin(stage, job.prompt_ids, job.max_tokens) < MIN_MARGIN:
            job = replace(job, prompt_ids=tuple(rng.choice(vocab) for _ in job.prompt_ids))
        out.append(job)
    return out


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


def whole_model(model_dir: Path) -> StageModel:
    """The model in one stage, in this process (float32), as the one-process reference computes it."""
    num_layers = read_config(model_dir).num_layers
    return load_stage(StageSpec(Path(model_dir).name, str(model_dir), 0, num_layers, num_layers))


def smallest_margin(stage: StageModel, prompt_ids: tuple[int, ...], num_tokens: int) -> float:
    """The least lead of the best logit over the second best across num_tokens greedy steps after prompt_ids."""
    forward = one_sequence(stage, len(prompt_ids) + num_tokens)
    hidden, margin = forward(torch.tensor(prompt_ids), 0), math.inf
    for i in range(num_tokens):
        best = stage.logits(hidden[-1:])[0].topk(2)
        margin = min(margin, float(best.values[0] - best.values[1]))
        if i + 1 < num_tokens:
            hidden = forward(best.indices[:1], len(prompt_ids) + i)
    return margin


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
