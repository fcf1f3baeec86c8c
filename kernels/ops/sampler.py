"""Token sampling: greedy, or temperature + top-k + top-p with randomness keyed by (seed, position)."""

from __future__ import annotations

import hashlib
import secrets

import torch

from stratamesh.fleet.types import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Pick the token at `position` from logits [vocab]; the same (seed, position) gives the same token."""
    if params.is_greedy:
        return int(torch.argmax(logits))
    probs, token_ids = _filtered_probs(logits.float() / params.temperature, params)
    u = torch.rand((), generator=_generator(params.seed, position), dtype=torch.float64)
    cdf = torch.cumsum(probs.double(), dim=0)                      # [K], ends near 1
    idx = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    return int(token_ids[min(idx, token_ids.numel() - 1)])


def _filtered_probs(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities of the kept tokens, highest first, and their ids."""
    sorted_logits, token_ids = torch.sort(logits, descending=True)   # [vocab]
    if params.top_k > 0:
        sorted_logits, token_ids = sorted_logits[:params.top_k], token_ids[:params.top_k]
    probs = torch.softmax(sorted_logits, dim=0)
    if params.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p
        mass_before = torch.cumsum(probs, dim=0) - probs
        num_kept = max(1, int((mass_before < params.top_p).sum()))
        probs, token_ids = probs[:num_kept], token_ids[:num_kept]
    return probs, token_ids


def _generator(seed: int | None, position: int) -> torch.Generator:
    """A fresh generator per draw: keyed by (seed, position), or by OS randomness when seed is None."""
    if seed is None:
        key = secrets.randbits(63)
    else:
        digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
        key = int.from_bytes(digest, "little") & (2**63 - 1)
    return torch.Generator(device="cpu").manual_seed(key)
