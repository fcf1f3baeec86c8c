"""Rotary position embedding (default, linear, llama3, yarn, longrope and dynamic scaling), as Hugging Face
transformers computes it, over a head's first rotary_dim dimensions (all of them, but for Phi-3's partial rotary).

LongRoPE and dynamic NTK pick their frequencies by a sequence's length in transformers, anew at each forward: a
sequence that grows past the original context is rotated one way before and another after, its cached keys
computed with frequencies its later queries no longer use, and a prompt's rotation depends on how it was chunked.
A mesh that chunks prefills, batches sequences, replays them after a failover and moves their KV cannot serve that.
Here, as in vLLM, a model's frequencies are fixed by the context it is served at: LongRoPE's long factors where that
context is longer than the original, its short ones otherwise; dynamic NTK's base for its whole scaled context
(ModelConfig.max_position_embeddings: the original times factor). Those are transformers' frequencies for a
sequence of that length (docs/models.md says where the two differ)."""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] in float32 for the rotated dimensions of a head, a base and a normalized
    rope scaling (kernels.models.config)."""
    kind = None if scaling is None else scaling["rope_type"]
    if kind == "yarn":
        return _yarn_inv_freq(rotary_dim, theta, scaling)
    if kind == "dynamic":       # NTK-aware: the base raised for the scaled context (transformers' formula)
        factor, context = scaling["factor"], scaling["context"]
        theta = theta * (factor * context / scaling["original_max_position_embeddings"] - (factor - 1)) ** (
            rotary_dim / (rotary_dim - 2))
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    if kind == "longrope":      # each frequency divided by its own factor, the long ones or the short ones
        factors = scaling["long_factor"] if scaling["long"] else scaling["short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** exponents)
    inv_freq = 1.0 / (theta ** exponents)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    assert kind in (None, "dynamic"), scaling
    return inv_freq


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: YaRN's and LongRoPE's attention factor (a softmax temperature, folded
    into q and k), 1 for every other scaling."""
    return 1.0 if scaling is None else float(scaling.get("attention_factor", 1.0))


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, the band between interpolated."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, theta: float, s: dict[str, Any]) -> torch.Tensor:
    """YaRN (Peng et al. 2023): the dimensions that turn fewer than beta_slow times over the original context are
    interpolated (divided by factor), those that turn more than beta_fast times kept, a linear ramp between."""
    old_len, factor = s["original_max_position_embeddings"], s["factor"]

    def dim_of(rotations: float) -> float:      # the dimension that turns `rotations` times over old_len positions
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(s["beta_fast"]), dim_of(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    wavelengths = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    kept = 1 - ramp     # (transformers' order of operations, so that the frequencies are bit-identical)
    return 1.0 / (factor * wavelengths) * (1 - kept) + 1.0 / wavelengths * kept


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
                 attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [T, D] for positions [T], computed in float32 (times attention_factor: yarn's) then cast
    to dtype.

    The signed sin is HF's sin with its first half negated: apply_rope then rotates with one roll
    instead of slicing, negating and concatenating (8x faster on a 512-token prefill here)."""
    freqs = positions[:, None] * inv_freq[None, :]          # [T, D/2] in float32 (positions are int64)
    emb = torch.cat((freqs, freqs), dim=-1)                   # [T, D]
    sin = emb.sin()
    cos = emb.cos()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    sin[:, :freqs.shape[1]].neg_()
    return (cos, sin) if dtype == torch.float32 else (cos.to(dtype), sin.to(dtype))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., D] by cos / signed sin [..., R] broadcastable to it (the rotate-half layout HF checkpoints
    use): its first R dimensions, the others passed through where R < D (partial rotary).

    HF computes x * cos + cat(-x2, x1) * sin for the halves x1, x2 of x; roll(x) is cat(x2, x1), and
    the sign moves into signed_sin. Every product and sum is the same, so the result is bit-identical."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + x.roll(rotary_dim // 2, dims=-1) * signed_sin
    rot = x[..., :rotary_dim]
    return torch.cat((rot * cos + rot.roll(rotary_dim // 2, dims=-1) * signed_sin, x[..., rotary_dim:]), dim=-1)
