"""KVCache: growth in chunks, reads of the written prefix, rollback."""

from __future__ import annotations

import pytest
import torch

from stratamesh.kernels.ops.kv_cache import KVCache


def kv(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_tokens, 8, generator=g), torch.randn(2, num_tokens, 8, generator=g)


def test_grows_and_returns_the_whole_prefix():
    cache = KVCache(num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=4)
    chunks = [kv(3, 0), kv(5, 1), kv(1, 2)]
    pos = 0
    for k, v in chunks:
        for layer in range(2):
            k_all, v_all = cache.update(layer, k, v, pos)
        pos += k.shape[1]
    assert cache.num_tokens == 9 and cache.capacity_tokens == 12
    torch.testing.assert_close(k_all, torch.cat([c[0] for c in chunks], dim=1), atol=0, rtol=0)
    torch.testing.assert_close(v_all, torch.cat([c[1] for c in chunks], dim=1), atol=0, rtol=0)


def test_num_tokens_counts_only_complete_layers():
    cache = KVCache(num_layers=2, num_kv_heads=2, head_dim=8)
    cache.update(0, *kv(4, 0), 0)
    assert cache.num_tokens == 0


def test_rewrite_and_truncate():
    cache = KVCache(num_layers=1, num_kv_heads=2, head_dim=8)
    k, v = kv(6, 0)
    cache.update(0, k, v, 0)
    k2, v2 = kv(2, 1)
    k_all, _ = cache.update(0, k2, v2, 3)
    assert cache.num_tokens == 5 and torch.equal(k_all[:, :3], k[:, :3]) and torch.equal(k_all[:, 3:], k2)
    cache.truncate(2)
    assert cache.num_tokens == 2
    with pytest.raises(ValueError, match="gap"):
        cache.update(0, k2, v2, 4)
