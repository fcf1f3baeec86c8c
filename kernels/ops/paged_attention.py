"""A paged KV cache (fixed-size blocks shared by many sequences) and batched attention over it."""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stratamesh.kernels.ops import triton_decode
from stratamesh.kernels.ops.attention import attention, capped_attention, causal_mask


class PagedKVCache:
    """K and V of every layer of one stage, in num_blocks blocks of block_size token slots each."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: padded gathers read unwritten slots, and garbage NaNs would survive the mask
        self.k = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(num_layers)]

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype if self.k else torch.float32

    @property
    def device(self) -> torch.device:
        return self.k[0].device if self.k else torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @staticmethod
    def blocks_for_bytes(budget_bytes: int, num_layers: int, block_size: int, num_kv_heads: int,
                         head_dim: int, dtype: torch.dtype) -> int:
        """The most blocks whose K and V for num_layers layers fit in budget_bytes."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        block_bytes = 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize
        return max(0, budget_bytes // block_bytes)

    def flat(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's K and V as views [num_blocks * block_size, KV, D], indexed by slot."""
        shape = (self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        return self.k[layer_idx].view(shape), self.v[layer_idx].view(shape)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zeroed tensor; in CPU memory, one whose pages are the kernel's until written (an anonymous mapping): a CPU
    stage's KV cache holds what its plan reserved, but the box commits only the blocks its sequences fill, so a box
    serving the stages of many small models is not out of memory for caches it has not used. (torch.zeros writes
    every byte of it at once: 9 stages' 512 MiB caches were 4.5 GiB resident before a token came.)"""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if not nbytes:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


@dataclass(frozen=True, slots=True)
class SeqSlice:
    """One sequence in a flattened batch: rows [q_start, q_start + q_len) at positions start_pos.. on;
    its KV for positions < start_pos is already in the blocks of block_table."""

    q_start: int
    q_len: int
    start_pos: int
    block_table: Sequence[int]

    @property
    def num_ctx(self) -> int:
        """Keys this sequence's last query sees without a window: cached prefix plus new tokens."""
        return self.start_pos + self.q_len


def _padded(tables: Sequence[Sequence[int]], width: int) -> list[list[int]]:
    """The first width blocks of each table, short ones padded with block 0."""
    return [list(t[:width]) + [0] * (width - len(t[:width])) for t in tables]


def _slots(table: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """The cache slots of positions [start, end) of a sequence with this block table."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


class PagedBatch:
    """The Attention interface over a PagedKVCache for a batch: decodes in one SDPA call (one Triton kernel on
    CUDA), prefills one each. Its index tensors are built once per step, from Python lists, in a few copies."""

    def __init__(self, cache: PagedKVCache, seqs: Sequence[SeqSlice]) -> None:
        _check_seqs(seqs, cache)
        self.cache, self.seqs = cache, list(seqs)
        dev, bs = cache.device, cache.block_size
        self.num_tokens = sum(s.q_len for s in seqs)
        self.positions = _long([p for s in seqs for p in range(s.start_pos, s.num_ctx)], dev)     # [N]
        self._write_slots = _long([x for s in seqs for x in _slots(s.block_table, bs, s.start_pos, s.num_ctx)],
                                  dev)
        decodes = self._decodes = [s for s in seqs if s.q_len == 1]
        self._all_decodes = len(decodes) == len(seqs)
        self._prefills = [(s, _long(_slots(s.block_table, bs, 0, s.num_ctx), dev)) for s in seqs if s.q_len > 1]
        self._decode_rows = None if self._all_decodes else _long([s.q_start for s in decodes], dev)   # [B]
        self._decode_ctx = max((s.num_ctx for s in decodes), default=0)
        # Decodes gather whole blocks (rows of block_size * KV * D values), far fewer copies than slots;
        # positions past a sequence's end read whatever its padded table points at and are masked out.
        width = -(-self._decode_ctx // bs)
        self._decode_blocks = _long(_padded([s.block_table for s in decodes], width), dev)        # [B, blocks]
        self._decode_pos = _long([s.start_pos for s in decodes], dev)                              # [B]
        self._decode_lens = self._decode_pos + 1                                                   # [B] keys each sees
        self._decode_masks: dict[int | None, torch.Tensor | None] = {}
        self._window_reads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def check_positions(self, positions: torch.Tensor) -> None:
        """ValueError unless positions [N] are those the batch's sequences imply."""
        if positions is not self.positions and not torch.equal(positions.to(self.positions.device), self.positions):
            raise ValueError("positions disagree with the batch's sequences")

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, window: int | None, softcap: float | None = None) -> torch.Tensor:
        """Write k, v [N, KV, D] to their slots, then q [N, H, D] attends over each sequence -> [N, H, D]."""
        k_flat, v_flat = self.write_kv(layer_idx, k, v)
        if self._all_decodes:
            return self._decode(layer_idx, q, k_flat, v_flat, window, softcap)
        out = torch.empty_like(q)
        if self._decode_rows.numel():
            out[self._decode_rows] = self._decode(layer_idx, q[self._decode_rows], k_flat, v_flat, window, softcap)
        for seq, slots in self._prefills:
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            out[rows] = self._prefill(seq, q[rows], k_flat, v_flat, slots, window, softcap)
        return out

    def write_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the step's k, v [N, KV, D] of one layer to their slots; returns the layer's flat K and V."""
        k_flat, v_flat = self.cache.flat(layer_idx)                 # [slots, KV, D]
        k_flat.index_copy_(0, self._write_slots, _as(k, k_flat.dtype))
        v_flat.index_copy_(0, self._write_slots, _as(v, v_flat.dtype))
        return k_flat, v_flat

    def _decode(self, layer_idx: int, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                window: int | None, softcap: float | None = None) -> torch.Tensor:
        """Every one-token sequence at once: q [B, H, D] over its context -> [B, H, D].

        On CUDA one Triton kernel reads the blocks in place; elsewhere SDPA over the gathered blocks (soft-capped
        scores: capped_attention)."""
        if q.is_cuda and triton_decode.available() and softcap is None:
            return triton_decode.paged_decode(q, self.cache.k[layer_idx], self.cache.v[layer_idx],
                                              self._decode_blocks, self._decode_lens, q.shape[-1] ** -0.5,
                                              window)
        if window is not None and window < self._decode_ctx:    # the blocks of each one's window alone
            blocks, mask = self._window_read(window)
            num_keys = blocks.shape[1] * self.cache.block_size
        else:
            blocks, mask, num_keys = self._decode_blocks, self._decode_mask(window), self._decode_ctx
        k = self._gather_blocks(k_flat, blocks)[:, :num_keys].transpose(1, 2)  # [B, KV, S, D]
        v = self._gather_blocks(v_flat, blocks)[:, :num_keys].transpose(1, 2)   # mask: [B, 1, 1, S] or None
        # Each KV head's H/KV query heads as that many queries of it (heads h*G..h*G+G-1 share KV head h, as
        # enable_gqa pairs them): q [B, KV, G, D], one SDPA call without repeating K and V per query head, which
        # SDPA's enable_gqa path does on CPU (0.89 -> 0.44 ms a layer at 32 decodes of 192 keys, 2 threads).
        num_seqs, num_heads, head_dim = q.shape
        q = q.reshape(num_seqs, k.shape[1], num_heads // k.shape[1], head_dim)
        if softcap is not None:
            out = capped_attention(q, k, v, mask, softcap)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.reshape(num_seqs, num_heads, head_dim)

    def _gather_blocks(self, flat: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """The blocks each decode reads (table [B, blocks]), whole: [slots, KV, D] -> [B, blocks * bs, KV, D]."""
        bs = self.cache.block_size
        blocks = flat.view(-1, bs, *flat.shape[1:])                            # [num_blocks, bs, KV, D]
        num_seqs, num_blocks = table.shape
        picked = blocks.index_select(0, table.view(-1))                        # [B * blocks, bs, KV, D]
        return picked.view(num_seqs, num_blocks * bs, *flat.shape[1:])

    def _window_read(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the blocks [B, blocks] that hold each decode's last window keys, from the one of its first on; the mask
        [B, 1, 1, S] of the keys in them it sees): a windowed layer reads at most window / block_size + 1 blocks a
        sequence, however long its context."""
        if window not in self._window_reads:
            bs, dev = self.cache.block_size, self._decode_pos.device
            first = [max(0, s.start_pos - window + 1) // bs for s in self._decodes]
            width = max(s.start_pos // bs + 1 - f for s, f in zip(self._decodes, first, strict=True))
            blocks = _long(_padded([s.block_table[f:] for s, f in zip(self._decodes, first, strict=True)], width),
                           dev)
            k_pos = _long(first, dev)[:, None] * bs + torch.arange(width * bs, device=dev)[None, :]   # [B, S]
            diff = self._decode_pos[:, None] - k_pos
            self._window_reads[window] = blocks, ((diff >= 0) & (diff < window))[:, None, None, :]
        return self._window_reads[window]

    def _decode_mask(self, window: int | None) -> torch.Tensor | None:
        """Key-padding (+ window) mask [B, 1, 1, S]: a decode at position p sees keys 0..p (last window)."""
        num_seqs, max_ctx = self._decode_blocks.shape[0], self._decode_ctx
        if num_seqs == 1 and (window is None or window >= max_ctx):
            return None                      # one sequence, nothing padded, nothing out of the window
        if window not in self._decode_masks:
            k_pos = torch.arange(max_ctx, device=self._decode_pos.device)
            diff = self._decode_pos[:, None] - k_pos[None, :]                  # [B, S]
            mask = diff >= 0
            if window is not None:
                mask &= diff < window
            self._decode_masks[window] = mask[:, None, None, :]
        return self._decode_masks[window]

    def _prefill(self, seq: SeqSlice, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                 slots: torch.Tensor, window: int | None, softcap: float | None = None) -> torch.Tensor:
        """One chunk of a sequence: q [T, H, D] over its cached prefix and itself -> [T, H, D]. A chunk with no
        prefix and no window is plain causal attention (no mask to build)."""
        first = 0 if window is None else max(0, seq.start_pos - window + 1)   # the chunk's first query's window
        k = _gather(k_flat, slots[first:]).transpose(0, 1)                     # [KV, S, D]
        v = _gather(v_flat, slots[first:]).transpose(0, 1)
        q = q.transpose(0, 1)                                                  # q: [H, T, D]
        if seq.start_pos == 0 and (window is None or window >= seq.num_ctx):
            return attention(q, k, v, is_causal=True, softcap=softcap).transpose(0, 1)
        q_pos = self.positions[seq.q_start:seq.q_start + seq.q_len]
        mask = causal_mask(q_pos, seq.num_ctx, window, first)
        return attention(q, k, v, mask, softcap=softcap).transpose(0, 1)


def _long(values: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    """An int64 tensor of values on device, in one copy."""
    return torch.tensor(values, dtype=torch.long, device=device)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype, without a dispatch when it already is."""
    return t if t.dtype == dtype else t.to(dtype)


def _gather(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of a flattened cache [slots, KV, D] at slots [S] -> [S, KV, D]."""
    return flat.index_select(0, slots)


def _check_seqs(seqs: Sequence[SeqSlice], cache: PagedKVCache) -> None:
    """ValueError unless seqs tile rows 0..N-1 in order and every block table covers its positions."""
    row = 0
    for s in seqs:
        if s.q_start != row or s.q_len < 1 or s.start_pos < 0:
            raise ValueError(f"sequences must tile the batch rows in order; got q_start={s.q_start}, "
                             f"q_len={s.q_len}, start_pos={s.start_pos} at row {row}")
        if len(s.block_table) * cache.block_size < s.num_ctx:
            raise ValueError(f"block table of {len(s.block_table)} blocks cannot hold {s.num_ctx} positions")
        if any(not 0 <= b < cache.num_blocks for b in s.block_table):
            raise ValueError(f"block ids must be in [0, {cache.num_blocks})")
        row += s.q_len
    if row == 0:
        raise ValueError("a batch needs at least one token")
