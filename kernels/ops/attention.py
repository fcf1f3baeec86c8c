"""The attention interface a decoder calls, and causal (optionally sliding-window) masked SDPA."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class Attention(Protocol):
    """Where a stage's attention runs: owns the KV it writes, the masks and the math (KVCache, PagedBatch)."""

    def check_positions(self, positions: torch.Tensor) -> None:
        """ValueError unless positions [N] are ones this backend can attend at."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, window: int | None) -> torch.Tensor:
        """Store k, v [N, KV, D] of a layer (index within the stage); q [N, H, D] attends -> [N, H, D]."""


def causal_mask(q_positions: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor | None:
    """Bool mask [T, S]: query at position p sees keys 0..p, or only the last `window` of them; None if all."""
    if window is None and q_positions.numel() == 1 and int(q_positions[0]) == num_keys - 1:
        return None   # one new token, full attention: it sees every cached key
    k_positions = torch.arange(num_keys, device=q_positions.device)
    diff = q_positions[:, None] - k_positions[None, :]   # [T, S]
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    return mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *,
              is_causal: bool = False) -> torch.Tensor:
    """q [H, T, D] over k, v [KV, S, D] (grouped-query when KV < H) -> [H, T, D], as a batch of one: SDPA's CPU
    flash kernel takes 4-D inputs only, and 3-D ones run its math path (2x slower at 128 tokens, masked or not)."""
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=is_causal,
                                         enable_gqa=q.shape[0] != k.shape[0])
    return out[0]
