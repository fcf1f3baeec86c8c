"""The sampling parameters' formulas written out plainly, one token at a time, as the reference the batched
implementation (kernels/ops/sampler.py) is checked against."""

from __future__ import annotations

import torch

from stratamesh.fleet.sessions import SamplingParams


def reference_processed(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row processed by the formulas as written (vLLM's sampler, one token at a time): the bias added, the stop
    tokens banned below min_tokens, then each seen token's logit divided (positive) or multiplied (negative) by the
    repetition penalty, then the frequency penalty times its count in the output and the presence penalty once."""
    x = [float(v) for v in row]
    for token, bias in p.logit_bias:
        x[token] += bias
    if len(output) < p.min_tokens:
        for token in p.stop_token_ids:
            x[token] = float("-inf")
    for token in set(prompt) | set(output):
        x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token in set(output):
        x[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return torch.tensor(x)
