"""PagedBatch against the slow reference: random block tables, mixed decode and prefill, GQA, windows."""

from __future__ import annotations

import random
import sys

import pytest
import torch

from stratamesh.kernels.ops.paged_attention import PagedBatch, PagedKVCache, SeqSlice
from stratamesh.kernels.ops.reference import paged_attention_reference

ATOL = 1e-5   # float32 against a float64 reference; observed max |diff| is about 1e-7
BLOCK_SIZE = 4
NUM_BLOCKS = 64
HEAD_DIM = 16


def build_batch(cache: PagedKVCache, specs: list[tuple[int, int]], num_heads: int, seed: int):
    """Sequences (start_pos, q_len) with random non-contiguous blocks and random cached prefixes in layer 1.

    Returns the batch, q, new k, v, and each sequence's full keys and values (prefix then new)."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(cache.num_blocks, generator=g).tolist()
    kv_shape = (cache.num_kv_heads, cache.head_dim)
    seqs, keys, values, row = [], [], [], 0
    for start_pos, q_len in specs:
        num_blocks = -(-(start_pos + q_len) // cache.block_size) + 1   # one spare block, as an engine may hold
        table = [free.pop() for _ in range(num_blocks)]
        seqs.append(SeqSlice(row, q_len, start_pos, table))
        keys.append(torch.randn(start_pos + q_len, *kv_shape, generator=g))
        values.append(torch.randn(start_pos + q_len, *kv_shape, generator=g))
        for p in range(start_pos):   # the prefix an earlier step wrote
            block, offset = table[p // cache.block_size], p % cache.block_size
            cache.k[1][block, offset], cache.v[1][block, offset] = keys[-1][p], values[-1][p]
        row += q_len
    q = torch.randn(row, num_heads, cache.head_dim, generator=g)
    new_k = torch.cat([k[s.start_pos:] for s, k in zip(seqs, keys)])
    new_v = torch.cat([v[s.start_pos:] for s, v in zip(seqs, values)])
    return PagedBatch(cache, seqs), q, new_k, new_v, keys, values


MIXES = {
    "decode_only": [(9, 1), (0, 1), (30, 1), (17, 1)],
    "prefill_only": [(0, 7), (0, 2), (0, 13)],
    "mixed": [(12, 1), (0, 9), (21, 6), (5, 1), (40, 1), (3, 2)],
}


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 5, 16])
def test_matches_the_reference(mix, num_heads, num_kv_heads, window):
    cache = PagedKVCache(3, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    batch, q, k, v, keys, values = build_batch(cache, MIXES[mix], num_heads, seed=len(mix) + num_heads)
    out = batch.attend(1, q, k, v, batch.positions, window)
    expected = paged_attention_reference(q, batch.seqs, keys, values, window)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(40))
def test_random_batches_match_the_reference(seed: int) -> None:
    """Batches as a busy stage forms them: up to 24 sequences, mostly decodes with up to 150 cached tokens, some
    prefill chunks of 2-40 tokens after 0-100 cached; GQA or not, head 16 or 64, block 4 or 16, a window or none.
    (CPU attention runs SDPA's flash kernel on 4-D inputs, queries grouped per KV head: shapes it must not miss.)"""
    rng = random.Random(seed)
    block_size, (num_heads, num_kv_heads) = rng.choice([4, 16]), rng.choice([(4, 2), (8, 4), (4, 4), (8, 1)])
    specs = [(rng.randint(0, 150), 1) if rng.random() < 0.7
             else (rng.choice([0, rng.randint(0, 100)]), rng.randint(2, 40)) for _ in range(rng.randint(1, 24))]
    num_blocks = sum(-(-(start + length) // block_size) + 1 for start, length in specs)
    cache = PagedKVCache(3, num_blocks, block_size, num_kv_heads, rng.choice([16, 64]))
    window = rng.choice([None, None, None, 7, 32])
    batch, q, k, v, keys, values = build_batch(cache, specs, num_heads, seed=seed)
    out = batch.attend(1, q, k, v, batch.positions, window)
    torch.testing.assert_close(out.double(), paged_attention_reference(q, batch.seqs, keys, values, window),
                               atol=ATOL, rtol=0)


def test_new_tokens_land_in_their_slots_of_their_layer_only():
    cache = PagedKVCache(3, NUM_BLOCKS, BLOCK_SIZE, 2, HEAD_DIM)
    batch, q, k, v, keys, values = build_batch(cache, MIXES["mixed"], 4, seed=1)
    batch.attend(1, q, k, v, batch.positions, None)
    for seq, seq_k, seq_v in zip(batch.seqs, keys, values):
        for p in range(seq.num_ctx):
            block, offset = seq.block_table[p // BLOCK_SIZE], p % BLOCK_SIZE
            assert torch.equal(cache.k[1][block, offset], seq_k[p]) and torch.equal(cache.v[1][block, offset], seq_v[p])
    assert not cache.k[0].any() and not cache.v[2].any()


def test_window_and_prefix_change_the_output():
    """Guards the reference test: the window and the cached prefix must both matter on these inputs."""
    cache = PagedKVCache(3, NUM_BLOCKS, BLOCK_SIZE, 2, HEAD_DIM)
    batch, q, k, v, keys, values = build_batch(cache, MIXES["mixed"], 4, seed=2)
    full = paged_attention_reference(q, batch.seqs, keys, values, None)
    assert (full - paged_attention_reference(q, batch.seqs, keys, values, 5)).abs().max() > 1e-2
    out = batch.attend(1, q, k, v, batch.positions, None)
    cache.k[1].zero_()   # forget the prefixes: the sequences with a cached prefix must now differ
    assert (batch.attend(1, q, k, v, batch.positions, None) - out).abs().max() > 1e-2


def test_half_precision_cache_tracks_the_reference():
    cache = PagedKVCache(3, NUM_BLOCKS, BLOCK_SIZE, 2, HEAD_DIM, dtype=torch.bfloat16)
    batch, q, k, v, keys, values = build_batch(cache, MIXES["mixed"], 4, seed=3)
    out = batch.attend(1, q.bfloat16(), k.bfloat16(), v.bfloat16(), batch.positions, 16)
    expected = paged_attention_reference(q, batch.seqs, keys, values, 16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, atol=5e-2, rtol=0)   # bf16 has ~3 significant digits


@pytest.mark.parametrize("seqs, match", [
    ([SeqSlice(1, 2, 0, [0])], "tile"),
    ([SeqSlice(0, 2, 0, [0]), SeqSlice(3, 1, 0, [1])], "tile"),
    ([SeqSlice(0, 0, 0, [0])], "tile"),
    ([SeqSlice(0, 3, 3, [0])], "cannot hold"),
    ([SeqSlice(0, 1, 0, [NUM_BLOCKS])], "block ids"),
    ([], "at least one"),
])
def test_bad_batches_are_rejected(seqs, match):
    with pytest.raises(ValueError, match=match):
        PagedBatch(PagedKVCache(1, NUM_BLOCKS, BLOCK_SIZE, 2, HEAD_DIM), seqs)


def test_check_positions():
    batch = PagedBatch(PagedKVCache(1, NUM_BLOCKS, BLOCK_SIZE, 2, HEAD_DIM),
                       [SeqSlice(0, 2, 3, [0, 1]), SeqSlice(2, 1, 7, [2, 3])])
    assert batch.positions.tolist() == [3, 4, 7]
    batch.check_positions(torch.tensor([3, 4, 7]))
    with pytest.raises(ValueError, match="disagree"):
        batch.check_positions(torch.tensor([3, 4, 8]))


def test_sizes():
    cache = PagedKVCache(2, 10, 16, 4, 32, dtype=torch.float16)
    assert cache.nbytes == 2 * 2 * 10 * 16 * 4 * 32 * 2
    assert PagedKVCache.blocks_for_bytes(cache.nbytes, 2, 16, 4, 32, torch.float16) == 10
    assert PagedKVCache.blocks_for_bytes(cache.nbytes - 1, 2, 16, 4, 32, torch.float16) == 9
    assert cache.flat(1)[0].shape == (160, 4, 32) and cache.flat(1)[0].data_ptr() == cache.k[1].data_ptr()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_cpu_cache_is_zeros_and_holds_memory_only_for_the_blocks_written() -> None:
    """A 512 MiB cache (what a CPU stage reserves at least) is resident only where its blocks are written; the
    rest reads as zeros, in float32 and bfloat16."""
    for dtype in (torch.float32, torch.bfloat16):
        before = _resident_bytes()
        num_blocks = PagedKVCache.blocks_for_bytes(512 << 20, 2, 16, 2, 64, dtype)
        cache = PagedKVCache(2, num_blocks, 16, 2, 64, dtype=dtype)
        assert cache.nbytes > (500 << 20)
        assert _resident_bytes() - before < (64 << 20)
        cache.k[1][7] = 1.5
        cache.v[0][num_blocks - 1] = -2.0
        assert cache.k[1][7].eq(1.5).all() and cache.v[0][-1].eq(-2.0).all()
        assert not cache.k[1][:7].any() and not cache.k[0][::101].any() and not cache.v[1][::101].any()
        assert _resident_bytes() - before < (64 << 20)          # reading untouched blocks commits nothing
        del cache
