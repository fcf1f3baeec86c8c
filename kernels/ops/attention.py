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
               positions: torch.Tensor, window: int | None, softcap: float | None = None) -> torch.Tensor:
        """Store k, v [N, KV, D] of a layer (index within the stage); q [N, H, D] attends -> [N, H, D]; softcap:
        the scores soft-capped, tanh(s / cap) * cap (Gemma 2), or None."""


def causal_mask(q_positions: torch.Tensor, num_keys: int, window: int | None,
                first_key: int = 0) -> torch.Tensor | None:
    """Bool mask [T, S]: query at position p sees keys 0..p, or only the last `window` of them; None if all. The S
    keys are those at positions first_key .. num_keys - 1 (a window's reads start past the first ones)."""
    if window is None and q_positions.numel() == 1 and int(q_positions[0]) == num_keys - 1 and first_key == 0:
        return None   # one new token, full attention: it sees every cached key
    k_positions = torch.arange(first_key, num_keys, device=q_positions.device)
    diff = q_positions[:, None] - k_positions[None, :]   # [T, S]
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    return mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *,
              is_causal: bool = False, softcap: float | None = None) -> torch.Tensor:
    """q [H, T, D] over k, v [KV, S, D] (grouped-query when KV < H) -> [H, T, D], as a batch of one: SDPA's CPU
    flash kernel takes 4-D inputs only, and 3-D ones run its math path (2x slower at 128 tokens, masked or not).
    softcap: the scores soft-capped (capped_attention), which SDPA cannot do."""
    if softcap is not None:
        if is_causal:
            mask = causal_mask(torch.arange(k.shape[1] - q.shape[1], k.shape[1], device=q.device), k.shape[1], None)
        return capped_attention(q, k, v, mask, softcap)
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=is_causal,
                                         enable_gqa=q.shape[0] != k.shape[0])
    return out[0]


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     softcap: float) -> torch.Tensor:
    """Attention whose scores are soft-capped before the softmax, tanh(s / cap) * cap (Gemma 2), in transformers'
    order: scores scaled by head_dim ** -0.5 and capped in q's dtype, masked, softmax in float32, cast back. q
    [..., H, T, D] over k, v [..., KV, S, D], H a multiple of KV (each KV head serves H / KV query heads in a row,
    as transformers' repeat_kv); mask: True where a query sees a key, broadcastable to [..., H, T, S]."""
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
