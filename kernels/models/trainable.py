"""A Llama decoder as a trainable torch module whose parameters carry Hugging Face checkpoint names.

It computes what the serving code (kernels.models.decoder) computes, with the same ops, over a batch of whole
sequences and with autograd: what it learns is what the mesh then serves. Llama only (no biases, no sliding
window): it trains the demo model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stratamesh.kernels.models.config import ModelConfig
from stratamesh.kernels.ops.mlp import swiglu
from stratamesh.kernels.ops.norm import rms_norm
from stratamesh.kernels.ops.rope import apply_rope, rope_cos_sin, rope_inv_freq


class TrainableDecoder(nn.Module):
    """ids [B, T] -> logits [B, T, vocab]; state_dict() names are a Llama checkpoint's (model.layers.0...)."""

    def __init__(self, config: ModelConfig, seed: int = 0, dropout: float = 0.0) -> None:
        super().__init__()
        if config.arch != "llama" or config.attention_bias or config.sliding_window:
            raise ValueError("TrainableDecoder trains plain Llama decoders (no biases, no sliding window)")
        self.config, self.dropout = config, dropout   # dropout: on each residual branch, while training only
        g = torch.Generator().manual_seed(seed)
        c, std = config, 0.02
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.model = nn.Module()
        self.model.embed_tokens = _Weight(torch.randn(c.vocab_size, c.hidden_size, generator=g) * std)
        self.model.layers = nn.ModuleList(_Layer(c.hidden_size, q_dim, kv_dim, c.intermediate_size, c.num_layers,
                                                 std, g) for _ in range(c.num_layers))
        self.model.norm = _Weight(torch.ones(c.hidden_size))
        if not c.tie_word_embeddings:
            self.lm_head = _Weight(torch.randn(c.vocab_size, c.hidden_size, generator=g) * std)
        self.register_buffer("inv_freq", rope_inv_freq(c.rotary_dim, c.rope_theta, c.rope_scaling), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        c = self.config
        x = F.embedding(ids, self.model.embed_tokens.weight)                # x: [B, T, hidden]
        cos, sin = rope_cos_sin(self.inv_freq, torch.arange(ids.shape[1]), torch.float32)
        cos, sin = cos[:, None], sin[:, None]                                # [T, 1, D]: broadcast over heads
        for layer in self.model.layers:
            x = x + self._drop(self._attention(layer, x, cos, sin))
            h = rms_norm(x, layer.post_attention_layernorm.weight, c.rms_norm_eps)
            x = x + self._drop(swiglu(h, torch.cat((layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight)),
                                      layer.mlp.down_proj.weight))
        h = rms_norm(x, self.model.norm.weight, c.rms_norm_eps)
        head = self.model.embed_tokens if c.tie_word_embeddings else self.lm_head
        return F.linear(h, head.weight)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout, self.training) if self.dropout else x

    def _attention(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c, (batch, num_tokens, _) = self.config, x.shape
        a = layer.self_attn
        h = rms_norm(x, layer.input_layernorm.weight, c.rms_norm_eps)
        q = apply_rope(F.linear(h, a.q_proj.weight).view(batch, num_tokens, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(F.linear(h, a.k_proj.weight).view(batch, num_tokens, c.num_kv_heads, c.head_dim), cos, sin)
        v = F.linear(h, a.v_proj.weight).view(batch, num_tokens, c.num_kv_heads, c.head_dim)
        # q: [B, H, T, D]  k, v: [B, KV, T, D]; each KV head serves H / KV query heads
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=True)
        return F.linear(out.transpose(1, 2).reshape(batch, num_tokens, -1), a.o_proj.weight)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The weights under their checkpoint names, detached and contiguous (what safetensors saves)."""
        return {name: t.detach().contiguous() for name, t in self.state_dict().items()}


class _Weight(nn.Module):
    """A module holding one parameter named `weight`, so that state_dict() spells HF's names."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(value)


class _Layer(nn.Module):
    def __init__(self, hidden: int, q_dim: int, kv_dim: int, inter: int, num_layers: int, std: float,
                 g: torch.Generator) -> None:
        super().__init__()
        out_std = std / (2 * num_layers) ** 0.5     # residual projections scaled down, as GPT-2 does

        def w(rows: int, cols: int, scale: float = std) -> _Weight:
            return _Weight(torch.randn(rows, cols, generator=g) * scale)

        self.input_layernorm, self.post_attention_layernorm = _Weight(torch.ones(hidden)), _Weight(torch.ones(hidden))
        self.self_attn = nn.Module()
        self.self_attn.q_proj, self.self_attn.k_proj = w(q_dim, hidden), w(kv_dim, hidden)
        self.self_attn.v_proj, self.self_attn.o_proj = w(kv_dim, hidden), w(hidden, q_dim, out_std)
        self.mlp = nn.Module()
        self.mlp.gate_proj, self.mlp.up_proj = w(inter, hidden), w(inter, hidden)
        self.mlp.down_proj = w(hidden, inter, out_std)
