"""Prompts whose greedy tokens a mesh must reproduce exactly, however its float sums are ordered.

A greedy stream is checked token for token against the same request on an undisturbed mesh. Its float sums need
not run in the same order there: a failover's new route recomputes the context's KV in one prefill, and the
batches a step's decodes share decide how a matrix product sums (torch's CPU products differ in the last bits
below 32 rows). On the tiny models that moves a logit by up to ~7e-6 (a context recomputed after 16 of 48 tokens,
6 streams: max 7.4e-6, median 2.9e-6; tests/kernels/test_recompute_drift.py). A step whose two best logits are
closer than that may take the other token with nothing wrong, so chaos runs and the failover tests draw prompts
whose every greedy step leads its runner-up by far more. Quantized weights are computed with bfloat16 or int8
activations (kernels.ops.quant), whose rounding can turn such a difference into one of a step of theirs (2^-8): a
quantized mesh's runs draw prompts of a larger margin, on the quantized model.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace
from pathlib import Path

import torch

from stratamesh.bench.chaos import StreamJob
from stratamesh.bench.datasets import regular_token_ids
from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels.models.config import read_config
from stratamesh.kernels.models.decoder import StageModel, load_stage, one_sequence

MIN_MARGIN = 1e-4
MAX_DRAWS = 1000        # prompts drawn for one job before giving up on the model


def decisive(jobs: list[StreamJob], model_dir: str | Path, seed: int = 0,
             min_margin: float = MIN_MARGIN, quantize: str = "") -> list[StreamJob]:
    """The jobs, each greedy one's prompt drawn again (as long, from the regular vocabulary) until each of its
    max_tokens greedy steps leads the runner-up logit by min_margin in a one-process run of the model (its weights
    quantized: StageSpec.quantize; InvalidInput after MAX_DRAWS prompts); sampled jobs as they are."""
    stage = whole_model(model_dir, quantize)
    vocab, rng = regular_token_ids(model_dir), random.Random(seed)
    out = []
    for job in jobs:
        draws = 0
        while job.temperature == 0 and smallest_margin(stage, job.prompt_ids, job.max_tokens) < min_margin:
            draws += 1
            if draws > MAX_DRAWS:
                raise InvalidInput(f"no prompt of {len(job.prompt_ids)} tokens in {MAX_DRAWS} draws has "
                                   f"{job.max_tokens} greedy steps that each lead by {min_margin:g}: ask for fewer "
                                   "tokens or a smaller margin")
            job = replace(job, prompt_ids=tuple(rng.choice(vocab) for _ in job.prompt_ids))
        out.append(job)
    return out


def whole_model(model_dir: str | Path, quantize: str = "") -> StageModel:
    """The model in one stage, in this process (float32, its weights quantized: StageSpec.quantize), as the
    one-process reference computes it."""
    num_layers = read_config(model_dir).num_layers
    return load_stage(StageSpec(Path(model_dir).name, str(model_dir), 0, num_layers, num_layers, quantize=quantize))


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
