"""RMSNorm, computed in float32 whatever the activation dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hidden] scaled to unit RMS per row in float32, cast back to x's dtype, times weight [hidden] (Hugging
    Face Llama's order of operations); one fused kernel for the normalization."""
    x32 = x if x.dtype == torch.float32 else x.float()
    normed = F.rms_norm(x32, (x.shape[-1],), eps=eps)
    return weight * (normed if x.dtype == torch.float32 else normed.to(x.dtype))
