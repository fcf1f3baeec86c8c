"""The Llama layer (Llama, Mistral, Qwen2): pre-norm attention with rotary q and k, then a pre-norm SwiGLU MLP,
each added to the residual stream. Other families are this layer with a difference (qwen3.py: q and k normed;
phi3.py: the projections stored fused)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from stratamesh.kernels.models.config import ModelConfig
from stratamesh.kernels.ops.attention import Attention
from stratamesh.kernels.ops.mlp import swiglu
from stratamesh.kernels.ops.moe import ExpertLoad
from stratamesh.kernels.ops.norm import rms_norm
from stratamesh.kernels.ops.quant import SCALE_SUFFIX, Int4Weight, Int8Weight, QuantizedWeight, linear
from stratamesh.kernels.ops.rope import apply_rope

Weight = torch.Tensor | QuantizedWeight    # a matrix [out, in] as the checkpoint has it, or quantized
MATRICES = ("qkv", "o", "gate_up", "down")     # a LlamaLayer's matrices (each maybe quantized)
QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")   # Qwen3's and Gemma 3's per-head norms


@dataclass(slots=True)
class Step:
    """What every layer of one forward step shares: the heads this stage computes (a tensor-parallel rank's share),
    the rotary cos and signed sin [N, 1, D] of the step's positions, where attention runs, and how partial outputs
    of the o and down projections combine across ranks."""

    config: ModelConfig
    num_heads: int
    num_kv_heads: int
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    attn: Attention
    reduce: Callable[[torch.Tensor], torch.Tensor]
    local_cos: torch.Tensor | None = None    # the sliding layers' own rope, where the family has one (Gemma 3)
    local_sin: torch.Tensor | None = None
    expert_load: ExpertLoad | None = None    # a mixture of experts' stage: what its routers do, counted


@dataclass(slots=True)
class LlamaLayer:
    """One decoder layer's tensors, fused for fewer kernels per step: q, k and v as one [q + 2 kv, hidden] matrix,
    the MLP's gate and up as one [2 inter, hidden]; weights are [out, in] as in the checkpoint."""

    input_norm: torch.Tensor
    post_attn_norm: torch.Tensor
    qkv: Weight
    o: Weight
    gate_up: Weight | None          # (None in a mixture of experts' sparse layer: families/moe.py)
    down: Weight | None
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None      # a family's per-head q and k norms (HEAD_NORMS): [head_dim], shared by
    k_norm: torch.Tensor | None = None      # every head (and by a tensor-parallel rank's share of them)

    # The layer's norms in the checkpoint (their names after "model.layers.{i}."): each [hidden], or [head_dim]
    # for those applied to every head (a family's q and k norms)
    NORMS: ClassVar[tuple[str, ...]] = ("input_layernorm.weight", "post_attention_layernorm.weight")
    HEAD_NORMS: ClassVar[tuple[str, ...]] = ()
    # The checkpoint's projections that the layer fuses, in the order of its fused rows (after "self_attn." and
    # "mlp."): a family that stores them fused already names the one matrix
    QKV: ClassVar[tuple[str, ...]] = ("q_proj", "k_proj", "v_proj")
    GATE_UP: ClassVar[tuple[str, ...]] = ("gate_proj", "up_proj")
    norm = staticmethod(rms_norm)       # how the family's RMSNorms weigh (the final norm's too)

    @classmethod
    def fuse(cls, t: dict[str, torch.Tensor], layer_idx: int) -> LlamaLayer:
        """The layer's weights from its checkpoint tensors; t's q, k, v, gate and up entries become views of the
        fused matrices (so the separate copies are freed, and t still names every tensor)."""
        return cls(**cls._fused(t, f"model.layers.{layer_idx}."))

    @classmethod
    def _fused(cls, t: dict[str, torch.Tensor], p: str) -> dict[str, object]:
        a = p + "self_attn."
        biases = [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]
        head_norms = dict(zip(("q_norm", "k_norm"), (t[p + name] for name in cls.HEAD_NORMS)))
        return dict(input_norm=t[p + cls.NORMS[0]], post_attn_norm=t[p + cls.NORMS[1]], **head_norms,
                    qkv=fuse_weight(t, [f"{a}{name}.weight" for name in cls.QKV]), o=weight(t, a + "o_proj.weight"),
                    qkv_bias=_fuse(t, biases) if biases[0] in t else None, o_bias=t.get(a + "o_proj.bias"),
                    **cls._mlp_fused(t, p))

    @classmethod
    def _mlp_fused(cls, t: dict[str, torch.Tensor], p: str) -> dict[str, object]:
        """The layer's MLP weights (a family with another MLP names its own)."""
        m = p + "mlp."
        return dict(gate_up=fuse_weight(t, [f"{m}{name}.weight" for name in cls.GATE_UP]),
                    down=weight(t, m + "down_proj.weight"))

    @classmethod
    def tensor_names(cls, config: ModelConfig, layer_idx: int) -> list[str]:
        """The HF names of one layer's tensors."""
        p = f"model.layers.{layer_idx}."
        names = [p + name for name in cls.NORMS + cls.HEAD_NORMS]
        names += [f"{p}self_attn.{n}.weight" for n in cls.QKV + ("o_proj",)]
        if config.attention_bias:
            names += [f"{p}self_attn.{n}.bias" for n in cls.QKV]
        if config.o_proj_bias:
            names.append(p + "self_attn.o_proj.bias")
        return names + cls._mlp_tensor_names(config, layer_idx)

    @classmethod
    def _mlp_tensor_names(cls, config: ModelConfig, layer_idx: int) -> list[str]:
        return [f"model.layers.{layer_idx}.mlp.{n}.weight" for n in cls.GATE_UP + ("down_proj",)]

    @classmethod
    def shapes(cls, c: ModelConfig, world_size: int = 1) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape by its name after "model.layers.{i}.", for one of world_size ranks."""
        q_dim, kv_dim = c.num_heads * c.head_dim // world_size, c.num_kv_heads * c.head_dim // world_size
        mlp = c.intermediate_size // world_size
        return {
            **{name: (c.hidden_size,) for name in cls.NORMS}, **{name: (c.head_dim,) for name in cls.HEAD_NORMS},
            "self_attn.q_proj.weight": (q_dim, c.hidden_size), "self_attn.q_proj.bias": (q_dim,),
            "self_attn.k_proj.weight": (kv_dim, c.hidden_size), "self_attn.k_proj.bias": (kv_dim,),
            "self_attn.v_proj.weight": (kv_dim, c.hidden_size), "self_attn.v_proj.bias": (kv_dim,),
            "self_attn.o_proj.weight": (c.hidden_size, q_dim), "self_attn.o_proj.bias": (c.hidden_size,),
            "mlp.gate_proj.weight": (mlp, c.hidden_size), "mlp.up_proj.weight": (mlp, c.hidden_size),
            "mlp.down_proj.weight": (c.hidden_size, mlp),
            "self_attn.qkv_proj.weight": (q_dim + 2 * kv_dim, c.hidden_size), "mlp.gate_up_proj.weight": (2 * mlp,
                                                                                                   c.hidden_size),
        }

    def forward(self, x: torch.Tensor, step: Step, local_idx: int, window: int | None) -> torch.Tensor:
        """x [N, hidden] through the layer (local_idx: its index within the stage's KV cache; window: its sliding
        window, or None) -> [N, hidden]."""
        eps = step.config.rms_norm_eps
        x = x + self.attention(rms_norm(x, self.input_norm, eps), step, local_idx, window)
        return x + self.mlp(rms_norm(x, self.post_attn_norm, eps), step)

    def mlp(self, h: torch.Tensor, step: Step) -> torch.Tensor:
        """The MLP block on the normed h [N, hidden] -> [N, hidden]."""
        return step.reduce(swiglu(h, self.gate_up, self.down))

    def attention(self, h: torch.Tensor, step: Step, local_idx: int, window: int | None) -> torch.Tensor:
        """The attention block on the normed h [N, hidden], through the o projection -> [N, hidden]."""
        head_dim, num_tokens, heads, kv_heads = step.config.head_dim, h.shape[0], step.num_heads, step.num_kv_heads
        qkv = linear(h, self.qkv, self.qkv_bias).view(num_tokens, heads + 2 * kv_heads, head_dim)
        q, k = self.rotate(qkv[:, :heads + kv_heads], step, window)   # q: [N, H, D]  k: [N, KV, D]
        out = step.attn.attend(local_idx, q, k, qkv[:, heads + kv_heads:], step.positions, window,
                               step.config.attn_logit_softcap)                                 # [N, H, D]
        out = step.reduce(linear(out.reshape(num_tokens, heads * head_dim), self.o))
        return out if self.o_bias is None else out + self.o_bias   # the bias once, after the partial sums

    def rotate(self, qk: torch.Tensor, step: Step, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """q's and k's heads [N, H + KV, D] rotated (at once) -> (q [N, H, D], k [N, KV, D]); window: the layer's
        (None: full attention)."""
        qk = apply_rope(qk, step.cos, step.sin)
        return qk[:, :step.num_heads], qk[:, step.num_heads:]


def weight(t: dict[str, torch.Tensor], name: str) -> Weight:
    """The named matrix: quantized where the tensors hold its scales (decoder.quantize_tensors: an Int4Weight if
    it is packed in bytes, else an Int8Weight), else the tensor."""
    return _weight(t[name], t.get(name + SCALE_SUFFIX))


def _weight(matrix: torch.Tensor, scale: torch.Tensor | None) -> Weight:
    if scale is None:
        return matrix
    return Int4Weight(matrix, scale) if matrix.dtype == torch.uint8 else Int8Weight(matrix, scale)


def fuse_weight(t: dict[str, torch.Tensor], names: list[str]) -> Weight:
    """_fuse of the named matrices, and of their scales where they are quantized (one name: that matrix, fused
    already)."""
    if len(names) == 1:
        return weight(t, names[0])
    if names[0] + SCALE_SUFFIX not in t:
        return _fuse(t, names)
    return _weight(_fuse(t, names), _fuse(t, [name + SCALE_SUFFIX for name in names]))


def _fuse(t: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """The named tensors concatenated along their first dimension; each name then holds a view of its rows."""
    fused = torch.cat([t[name] for name in names])
    for name, view in zip(names, fused.split([t[name].shape[0] for name in names]), strict=True):
        t[name] = view
    return fused
