"""Gemma 2 and 3: the Llama layer's projections with Gemma's differences. RMSNorms weigh by (1 + w), in float32
before the cast back; four of them, around attention and around the MLP (sandwich norms); queries scaled by
query_pre_attn_scalar ** -0.5 rather than head_dim's; a GeGLU MLP (tanh GELU); sliding-window layers beside
full-attention ones. Gemma 2 soft-caps the attention scores (the layer passes the config's cap to attention);
Gemma 3 instead RMS-norms each head's q and k before the rotation and gives its sliding layers a rope of their own
(base 10,000). The stage scales the embedding by sqrt(hidden) and soft-caps the logits where the config says."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from stratamesh.kernels.models.config import ModelConfig
from stratamesh.kernels.models.families.llama import QK_NORMS, LlamaLayer, Step
from stratamesh.kernels.ops.mlp import geglu
from stratamesh.kernels.ops.norm import gemma_rms_norm
from stratamesh.kernels.ops.rope import apply_rope

@dataclass(slots=True)
class GemmaLayer(LlamaLayer):
    """Gemma 2's layer."""

    pre_ff_norm: torch.Tensor | None = None
    post_ff_norm: torch.Tensor | None = None

    NORMS: ClassVar[tuple[str, ...]] = ("input_layernorm.weight", "post_attention_layernorm.weight",
                                        "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")
    norm = staticmethod(gemma_rms_norm)

    @classmethod
    def _fused(cls, t: dict[str, torch.Tensor], p: str) -> dict[str, object]:
        return {**super(GemmaLayer, cls)._fused(t, p), "pre_ff_norm": t[p + cls.NORMS[2]],
                "post_ff_norm": t[p + cls.NORMS[3]]}

    def forward(self, x: torch.Tensor, step: Step, local_idx: int, window: int | None) -> torch.Tensor:
        eps = step.config.rms_norm_eps
        h = self.attention(gemma_rms_norm(x, self.input_norm, eps), step, local_idx, window)
        x = x + gemma_rms_norm(h, self.post_attn_norm, eps)
        h = step.reduce(geglu(gemma_rms_norm(x, self.pre_ff_norm, eps), self.gate_up, self.down))
        return x + gemma_rms_norm(h, self.post_ff_norm, eps)

    def rotate(self, qk: torch.Tensor, step: Step, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        qk = apply_rope(qk, step.cos, step.sin)
        return scaled_queries(qk[:, :step.num_heads], step.config), qk[:, step.num_heads:]


@dataclass(slots=True)
class Gemma3Layer(GemmaLayer):
    """Gemma 3's layer: Gemma 2's, with q and k normed per head and the sliding layers' own rope."""

    HEAD_NORMS: ClassVar[tuple[str, ...]] = QK_NORMS

    def rotate(self, qk: torch.Tensor, step: Step, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        c, heads = step.config, step.num_heads
        cos, sin = (step.local_cos, step.local_sin) if window is not None else (step.cos, step.sin)
        q = apply_rope(gemma_rms_norm(qk[:, :heads], self.q_norm, c.rms_norm_eps), cos, sin)
        k = apply_rope(gemma_rms_norm(qk[:, heads:], self.k_norm, c.rms_norm_eps), cos, sin)
        return scaled_queries(q, c), k


def scaled_queries(q: torch.Tensor, c: ModelConfig) -> torch.Tensor:
    """q such that attention, which scales scores by head_dim ** -0.5, scales them by query_pre_attn_scalar ** -0.5."""
    return q if c.query_pre_attn_scalar == c.head_dim else q * (c.head_dim / c.query_pre_attn_scalar) ** 0.5
