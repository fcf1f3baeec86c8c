"""Qwen3: the Llama layer with each head's query and key RMS-normed over its head_dim before the rotation (q_norm,
k_norm), no q/k/v bias, and a head_dim that need not be hidden_size / heads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from stratamesh.kernels.models.families.llama import QK_NORMS, LlamaLayer, Step
from stratamesh.kernels.ops.norm import rms_norm
from stratamesh.kernels.ops.rope import apply_rope


@dataclass(slots=True)
class Qwen3Layer(LlamaLayer):
    HEAD_NORMS: ClassVar[tuple[str, ...]] = QK_NORMS

    def rotate(self, qk: torch.Tensor, step: Step, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        eps, heads = step.config.rms_norm_eps, step.num_heads
        q = apply_rope(rms_norm(qk[:, :heads], self.q_norm, eps), step.cos, step.sin)
        k = apply_rope(rms_norm(qk[:, heads:], self.k_norm, eps), step.cos, step.sin)
        return q, k
