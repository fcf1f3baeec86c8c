"""The SwiGLU feed-forward block of Llama-family decoders."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for x [N, hidden] and weights [out, in] as in the checkpoint -> [N, hidden]."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
