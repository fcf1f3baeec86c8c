"""The gated feed-forward blocks of decoders: SwiGLU (Llama, Qwen, Mistral), GeGLU with tanh's GELU (Gemma)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from stratamesh.kernels.ops.quant import linear


Product = Callable[[torch.Tensor, Any], torch.Tensor]


def swiglu(x: torch.Tensor, gate_up: Any, down: Any, product: Product = linear) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for x [N, hidden]; gate_up [2 * inter, hidden] holds the gate's rows then the up
    projection's (one matmul for both), down [hidden, inter] as in the checkpoint -> [N, hidden]. The weights are
    float or Int8Weight matrices, or whatever product (x, weight) multiplies (an ONNX export's packed int8)."""
    return _gated(x, gate_up, down, F.silu, product)


def geglu(x: torch.Tensor, gate_up: Any, down: Any, product: Product = linear) -> torch.Tensor:
    """swiglu with the tanh approximation of GELU for the gate (Gemma's gelu_pytorch_tanh)."""
    return _gated(x, gate_up, down, lambda gate: F.gelu(gate, approximate="tanh"), product)


def _gated(x: torch.Tensor, gate_up: Any, down: Any, act: Callable[[torch.Tensor], torch.Tensor],
           product: Product) -> torch.Tensor:
    gate, up = product(x, gate_up).chunk(2, dim=-1)         # [N, inter] each
    return product(act(gate) * up, down)
