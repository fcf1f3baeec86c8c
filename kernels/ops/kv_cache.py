"""A contiguous per-session KV cache for one stage's layers (a paged cache replaces it later)."""

from __future__ import annotations

import torch

from stratamesh.kernels.ops.attention import attention, causal_mask

CHUNK_TOKENS = 256


class KVCache:
    """K and V of every layer of one stage for one session; grows in chunks of chunk_tokens."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 chunk_tokens: int = CHUNK_TOKENS) -> None:
        self.num_layers = num_layers
        self.chunk_tokens = chunk_tokens
        empty = torch.empty(num_kv_heads, 0, head_dim, dtype=dtype, device=device)
        self._k = [empty] * num_layers   # each: [KV, capacity, D]
        self._v = [empty] * num_layers
        self._lengths = [0] * num_layers

    @property
    def num_tokens(self) -> int:
        """Tokens every layer holds."""
        return min(self._lengths)

    @property
    def capacity_tokens(self) -> int:
        return self._k[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._k + self._v)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
               start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v ([KV, T, D]) at positions start_pos.. of a layer (its index within the stage); return
        that layer's K and V for positions 0..start_pos+T-1, each [KV, start_pos+T, D].

        Writing below the layer's length drops what followed (a replay or a rollback)."""
        if not 0 <= start_pos <= self._lengths[layer_idx]:
            raise ValueError(f"start_pos {start_pos} leaves a gap after {self._lengths[layer_idx]} cached tokens")
        end = start_pos + k.shape[1]
        self._reserve(layer_idx, end)
        self._k[layer_idx][:, start_pos:end] = k
        self._v[layer_idx][:, start_pos:end] = v
        self._lengths[layer_idx] = end
        return self._k[layer_idx][:, :end], self._v[layer_idx][:, :end]

    def check_positions(self, positions: torch.Tensor) -> None:
        """ValueError unless positions [N] run consecutively from a start at or below num_tokens."""
        start = int(positions[0])
        if not 0 <= start <= self.num_tokens:
            raise ValueError(f"positions start at {start} but the cache holds {self.num_tokens} tokens")
        if not torch.equal(positions, torch.arange(start, start + positions.numel(), device=positions.device)):
            raise ValueError("positions must be consecutive")

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, window: int | None, softcap: float | None = None) -> torch.Tensor:
        """The Attention interface for one sequence: q [N, H, D], k, v [N, KV, D] -> [N, H, D]."""
        start_pos = int(positions[0])
        k_all, v_all = self.update(layer_idx, k.transpose(0, 1), v.transpose(0, 1), start_pos)  # [KV, S, D]
        mask = causal_mask(positions, k_all.shape[1], window)   # [N, S] or None
        return attention(q.transpose(0, 1), k_all, v_all, mask, softcap=softcap).transpose(0, 1)

    def truncate(self, num_tokens: int) -> None:
        """Forget every position >= num_tokens in every layer."""
        self._lengths = [min(n, num_tokens) for n in self._lengths]

    def _reserve(self, layer_idx: int, num_tokens: int) -> None:
        old_k, old_v = self._k[layer_idx], self._v[layer_idx]
        if num_tokens <= old_k.shape[1]:
            return
        capacity = -(-num_tokens // self.chunk_tokens) * self.chunk_tokens
        kv_heads, _, head_dim = old_k.shape
        new_k = old_k.new_empty(kv_heads, capacity, head_dim)
        new_v = old_v.new_empty(kv_heads, capacity, head_dim)
        n = self._lengths[layer_idx]
        new_k[:, :n] = old_k[:, :n]
        new_v[:, :n] = old_v[:, :n]
        self._k[layer_idx], self._v[layer_idx] = new_k, new_v
