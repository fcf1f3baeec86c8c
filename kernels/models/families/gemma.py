"""Gemma 3 (gemma3_text): the Llama layer's projections with Gemma's differences. RMSNorms weigh by (1 + w), in
float32 before the cast back; four of them, around attention and around the MLP (sandwich norms); each head's q
and k RMS-normed before the rotation; queries scaled by query_pre_attn_scalar ** -0.5 rather than head_dim's; a
GeGLU MLP (tanh GELU); sliding-window layers with a rope of their own (base 10,000) beside full-attention ones. The
stage scales the embedding by sqrt(hidden) and soft-caps the logits where the config says (ModelConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from stratamesh.kernels.models.families.llama import LlamaLayer, Step
from stratamesh.kernels.ops.mlp import geglu
from stratamesh.kernels.ops.rope import apply_rope

QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] scaled to unit RMS over D and times (1 + weight), both in float32, then cast to x's dtype
    (Gemma's order: Llama casts before the weight)."""
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * (1.0 + weight.float())).to(x.dtype)


@dataclass(slots=True)
class Gemma3Layer(LlamaLayer):
    pre_ff_norm: torch.Tensor | None = None
    post_ff_norm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None      # [head_dim], shared by every query head
    k_norm: torch.Tensor | None = None

    NORMS: ClassVar[tuple[str, ...]] = ("input_layernorm.weight", "post_attention_layernorm.weight",
                                        "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")
    HEAD_NORMS: ClassVar[tuple[str, ...]] = QK_NORMS
    norm = staticmethod(gemma_rms_norm)

    @classmethod
    def fuse(cls, t: dict[str, torch.Tensor], layer_idx: int) -> Gemma3Layer:
        p = f"model.layers.{layer_idx}."
        return cls(**cls._fused(t, p), pre_ff_norm=t[p + cls.NORMS[2]], post_ff_norm=t[p + cls.NORMS[3]],
                   q_norm=t[p + QK_NORMS[0]], k_norm=t[p + QK_NORMS[1]])

    def forward(self, x: torch.Tensor, step: Step, local_idx: int, window: int | None) -> torch.Tensor:
        eps = step.config.rms_norm_eps
        h = self.attention(gemma_rms_norm(x, self.input_norm, eps), step, local_idx, window)
        x = x + gemma_rms_norm(h, self.post_attn_norm, eps)
        h = step.reduce(geglu(gemma_rms_norm(x, self.pre_ff_norm, eps), self.gate_up, self.down))
        return x + gemma_rms_norm(h, self.post_ff_norm, eps)

    def rotate(self, qk: torch.Tensor, step: Step, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        c, heads = step.config, step.num_heads
        cos, sin = (step.local_cos, step.local_sin) if window is not None else (step.cos, step.sin)
        q = apply_rope(gemma_rms_norm(qk[:, :heads], self.q_norm, c.rms_norm_eps), cos, sin)
        k = apply_rope(gemma_rms_norm(qk[:, heads:], self.k_norm, c.rms_norm_eps), cos, sin)
        if c.query_pre_attn_scalar != c.head_dim:   # attention scales by head_dim ** -0.5: make it this instead
            q = q * (c.head_dim / c.query_pre_attn_scalar) ** 0.5
        return q, k
