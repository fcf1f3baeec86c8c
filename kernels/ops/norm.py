"""RMSNorm, computed in float32 whatever the activation dtype: Llama's, and Gemma's (1 + w) one."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hidden] scaled to unit RMS per row in float32, cast back to x's dtype, times weight [hidden] (Hugging
    Face Llama's order of operations); one fused kernel for the normalization."""
    x32 = x if x.dtype == torch.float32 else x.float()
    normed = F.rms_norm(x32, (x.shape[-1],), eps=eps)
    return weight * (normed if x.dtype == torch.float32 else normed.to(x.dtype))


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] scaled to unit RMS over D and times (1 + weight), both in float32, then cast to x's dtype
    (Gemma's order: Llama casts before the weight)."""
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * (1.0 + weight.float())).to(x.dtype)
