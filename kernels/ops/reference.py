"""Slow plain-torch references of the ops, written independently of them; for tests only."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from stratamesh.kernels.ops.paged_attention import SeqSlice


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Row by row: x / sqrt(mean(x^2) + eps) * weight, in float64."""
    rows = [r.double() / math.sqrt(float((r.double() ** 2).mean()) + eps) for r in x]
    return torch.stack(rows) * weight.double()


def rope_reference(x: torch.Tensor, positions: torch.Tensor, head_dim: int, theta: float,
                   scaling: dict[str, Any] | None) -> torch.Tensor:
    """Rotate each pair (i, i + D/2) of x [N, H, D] by position * freq_i as a complex product, in float64."""
    half = head_dim // 2
    freqs = torch.tensor([_scaled_freq(theta ** (-2 * i / head_dim), scaling) for i in range(half)],
                         dtype=torch.float64)
    angles = positions.double()[:, None] * freqs[None, :]                     # [N, D/2]
    z = torch.complex(x[..., :half].double(), x[..., half:].double())         # [N, H, D/2]
    z = z * torch.polar(torch.ones_like(angles), angles)[:, None, :]
    return torch.cat((z.real, z.imag), dim=-1)


def _scaled_freq(freq: float, s: dict[str, Any] | None) -> float:
    """One inverse frequency under linear or llama3 scaling, as the Llama 3.1 paper states it."""
    if s is None:
        return freq
    if s["rope_type"] == "linear":
        return freq / s["factor"]
    wavelen, old_len = 2 * math.pi / freq, s["original_max_position_embeddings"]
    if wavelen < old_len / s["high_freq_factor"]:
        return freq
    if wavelen > old_len / s["low_freq_factor"]:
        return freq / s["factor"]
    smooth = (old_len / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    return (1 - smooth) * freq / s["factor"] + smooth * freq


def swiglu_reference(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down @ (g / (1 + exp(-g)) * u) with g = gate @ x, u = up @ x, per row in float64."""
    x, gate, up, down = x.double(), gate.double(), up.double(), down.double()
    g, u = x @ gate.T, x @ up.T
    return (g / (1 + torch.exp(-g)) * u) @ down.T


def paged_attention_reference(q: torch.Tensor, seqs: Sequence[SeqSlice], keys: Sequence[torch.Tensor],
                              values: Sequence[torch.Tensor], window: int | None) -> torch.Tensor:
    """q [N, H, D]; keys[i], values[i] [ctx_i, KV, D] hold sequence i's positions 0..ctx_i-1 -> [N, H, D].

    Explicit softmax(q k^T / sqrt(D)) v per sequence, token and head, in float64."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for seq, k, v in zip(seqs, keys, values):
        group = num_heads // k.shape[1]
        for t in range(seq.q_len):
            pos = seq.start_pos + t
            first = 0 if window is None else max(0, pos - window + 1)
            for h in range(num_heads):
                kh, vh = k[first:pos + 1, h // group].double(), v[first:pos + 1, h // group].double()
                scores = kh @ q[seq.q_start + t, h].double() / math.sqrt(head_dim)   # [S]
                weights = torch.exp(scores - scores.max())
                out[seq.q_start + t, h] = (weights / weights.sum()) @ vh
    return out
