"""Phi-3 (Phi-3, Phi-3.5, Phi-4-mini): the Llama layer, its checkpoint storing q, k and v as one qkv_proj and the
MLP's gate and up as one gate_up_proj, in the order a stage fuses them anyway. What else differs is the stage's:
rope rotates the first partial_rotary_factor of each head (Phi-4-mini's 3/4; ModelConfig.rotary_dim), often with
LongRoPE scaling (kernels.ops.rope), and every layer may attend over a sliding window (Phi-3-mini's 2,047)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from stratamesh.kernels.models.families.llama import LlamaLayer


@dataclass(slots=True)
class Phi3Layer(LlamaLayer):
    QKV: ClassVar[tuple[str, ...]] = ("qkv_proj",)
    GATE_UP: ClassVar[tuple[str, ...]] = ("gate_up_proj",)
