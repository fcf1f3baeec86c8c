"""Token sampling: greedy, or temperature + top-k + top-p with randomness keyed by (seed, position).

A batch of rows is sampled where its logits are (on a GPU stage, on the GPU: the host gets back the width of the
longest kept prefix and the picked ids), each row with its own settings. The only randomness is one uniform number a row, drawn on the host from its (seed,
position): whatever device computes the rest, a replay of a position draws the same token (up to the device's
rounding of the probabilities)."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

import torch

from stratamesh.fleet.sessions import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Pick the token at `position` from logits [vocab]; the same (seed, position) gives the same token."""
    if params.is_greedy:
        return int(torch.argmax(logits))
    return sample_rows(logits[None], [params], [position])[0]


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> list[int]:
    """The token of each row of logits [B, vocab] drawn with its params (none greedy) at its position, computed on
    logits' device: temperature, then top-k, then top-p over the highest-first order, then the inverse CDF at the
    row's uniform draw (one copy of the kept width and one of the tokens to the host)."""
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    scaled = logits.float() / temperature[:, None]
    top_ks = [min(p.top_k or vocab, vocab) for p in params]
    if max(top_ks) < vocab:     # every row keeps at most its top-k: only those need ordering
        sorted_logits, token_ids = torch.topk(scaled, max(top_ks), dim=-1)          # [B, K], highest first
    else:
        sorted_logits, token_ids = torch.sort(scaled, dim=-1, descending=True)      # [B, V]
    ranks = torch.arange(sorted_logits.shape[-1], device=device)
    kept = torch.tensor(top_ks, device=device)                                      # [B]: a prefix of each row
    if min(top_ks) < sorted_logits.shape[-1]:
        sorted_logits = sorted_logits.masked_fill(ranks >= kept[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        # top-p: the smallest prefix whose mass reaches top_p (a token stays if the mass before it is < top_p)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        nucleus = (mass_before < top_p[:, None]).sum(dim=-1).clamp(min=1)
        kept = torch.where(top_p < 1.0, torch.minimum(kept, nucleus), kept)
    width = int(kept.max())                                                         # the inverse CDF needs no more
    head = probs[:, :width].masked_fill(ranks[:width] >= kept[:, None], 0.0)
    cdf = torch.cumsum(head.double(), dim=-1)                                       # [B, width], ends near 1
    u = torch.tensor([_uniform(p.seed, pos) for p, pos in zip(params, positions, strict=True)],
                     dtype=torch.float64, device=device)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)           # [B, 1]
    return token_ids.gather(-1, torch.minimum(idx, kept[:, None] - 1)).squeeze(-1).tolist()


def _uniform(seed: int | None, position: int) -> float:
    """A uniform draw in [0, 1) keyed by (seed, position), or by OS randomness when seed is None."""
    if seed is None:
        key = secrets.randbits(63)
    else:
        digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
        key = int.from_bytes(digest, "little") & (2**63 - 1)
    return float(torch.rand((), generator=torch.Generator(device="cpu").manual_seed(key), dtype=torch.float64))
