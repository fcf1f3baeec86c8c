"""The SwiGLU feed-forward block of Llama-family decoders."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stratamesh.kernels.ops.quant import Int8Weight, linear


def swiglu(x: torch.Tensor, gate_up: torch.Tensor | Int8Weight, down: torch.Tensor | Int8Weight) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for x [N, hidden]; gate_up [2 * inter, hidden] holds the gate's rows then the up
    projection's (one matmul for both), down [hidden, inter] as in the checkpoint -> [N, hidden]."""
    gate, up = linear(x, gate_up).chunk(2, dim=-1)         # [N, inter] each
    return linear(F.silu(gate) * up, down)
