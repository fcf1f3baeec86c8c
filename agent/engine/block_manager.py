"""A stage's paged KV cache bookkeeping: ref-counted blocks, block tables, a prefix cache by chained hash."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from stratamesh.fleet.errors import InvalidInput, MeshError
from stratamesh.fleet.prefix import ROOT_HASH, chain_hash
from stratamesh.fleet.kv import KvEvents

# Changes of the prefix cache kept for the next KV event report, at most; past that the report starts over
# from every cached hash (cheaper to send than a longer backlog, and nothing is lost when no one collects them).
MAX_PENDING_KV_CHANGES = 65536


class NoFreeBlocks(MeshError):
    """A reservation needs more KV blocks than are free or evictable."""


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None    # set only while the block holds a full, cached block


class BlockManager:
    """Owns num_blocks KV blocks of block_size slots; sessions hold them through block tables."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))      # never hashed (or hash dropped)
        self.evictable: OrderedDict[int, None] = OrderedDict()    # hashed, unreferenced; oldest first
        self.hash_to_block: dict[bytes, int] = {}
        self.tables: dict[str, list[int]] = {}
        self.hashes: dict[str, list[bytes]] = {}                  # chained hashes of a table's cached blocks
        self.num_prefix_queries_tokens = 0
        self.num_prefix_hit_tokens = 0
        # for the coordinator's router (take_kv_events): hashes cached or dropped since the last report, and
        # whether the next report starts over from every cached hash (the first does)
        self._changed: set[bytes] = set()
        self._resend_all = True

    # ------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some session."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_table(self, seq_id: str) -> list[int]:
        return list(self.tables[seq_id])

    def match_prefix(self, token_ids: Sequence[int]) -> int:
        """Number of leading tokens (whole blocks) whose chain of blocks is cached; changes nothing."""
        return len(self._cached_chain(token_ids, len(token_ids))) * self.block_size

    def _cached_chain(self, token_ids: Sequence[int], max_tokens: int) -> list[tuple[int, bytes]]:
        """(block id, hash) of each cached block of the longest cached prefix within max_tokens."""
        if not self.enable_prefix_cache:
            return []
        chain: list[tuple[int, bytes]] = []
        parent, bs = ROOT_HASH, self.block_size
        for i in range(min(max_tokens, len(token_ids)) // bs):
            parent = chain_hash(parent, token_ids[i * bs:(i + 1) * bs])
            block_id = self.hash_to_block.get(parent)
            if block_id is None:
                break
            chain.append((block_id, parent))
        return chain

    # ------------------------------------------------------------ sessions
    def open(self, seq_id: str, token_ids: Sequence[int], max_cached_tokens: int) -> int:
        """Pins the cached blocks of the longest cached prefix of at most max_cached_tokens; returns its tokens."""
        assert seq_id not in self.tables, f"sequence {seq_id} is already open"
        chain = self._cached_chain(token_ids, max(0, max_cached_tokens))
        for block_id, _ in chain:
            self._ref(block_id)
        self.tables[seq_id] = [block_id for block_id, _ in chain]
        self.hashes[seq_id] = [h for _, h in chain]
        num_cached = len(chain) * self.block_size
        self.num_prefix_queries_tokens += len(token_ids)
        self.num_prefix_hit_tokens += num_cached
        return num_cached

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Keeps only the blocks the first num_tokens tokens need; later positions will be rewritten."""
        table, bs = self.tables[seq_id], self.block_size
        assert 0 <= num_tokens <= len(table) * bs
        keep = -(-num_tokens // bs)
        partial = self.blocks[table[keep - 1]] if num_tokens % bs else None
        if partial is not None and partial.hash is not None and partial.ref_count > 1:
            # Rewriting its tail would corrupt the KV the other holders read; a copy needs the device.
            raise InvalidInput(f"start_pos {num_tokens} splits a cached block that another session shares")
        while len(table) > keep:
            self._release(table.pop())
        del self.hashes[seq_id][num_tokens // bs:]
        if partial is not None and partial.hash is not None:
            del self.hash_to_block[partial.hash]    # ours alone now, and its tail is about to change
            self._changed_hash(partial.hash)
            partial.hash = None

    def can_reserve(self, seq_id: str, end_pos: int) -> bool:
        return self._blocks_needed(seq_id, end_pos) <= self.num_free_blocks

    def reserve(self, seq_id: str, end_pos: int) -> list[int]:
        """Grows the table so every position < end_pos has a slot; returns the new table."""
        needed = self._blocks_needed(seq_id, end_pos)
        if needed > self.num_free_blocks:
            raise NoFreeBlocks(f"{seq_id} needs {needed} blocks, {self.num_free_blocks} free")
        table = self.tables[seq_id]
        for _ in range(needed):
            block_id = self._take_free()
            self._ref(block_id)
            table.append(block_id)
        return list(table)

    def _blocks_needed(self, seq_id: str, end_pos: int) -> int:
        return max(0, -(-end_pos // self.block_size) - len(self.tables[seq_id]))

    def commit(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Registers every block fully covered by the first num_computed tokens in the prefix cache."""
        if not self.enable_prefix_cache:
            return
        table, hashes, bs = self.tables[seq_id], self.hashes[seq_id], self.block_size
        assert num_computed <= min(len(token_ids), len(table) * bs)
        for i in range(len(hashes), num_computed // bs):
            h = chain_hash(hashes[-1] if hashes else ROOT_HASH, token_ids[i * bs:(i + 1) * bs])
            hashes.append(h)
            block = self.blocks[table[i]]
            if h not in self.hash_to_block and block.hash is None:
                block.hash = h
                self.hash_to_block[h] = block.block_id
                self._changed_hash(h)
            # else: another block already caches this content; ours stays private and is freed plain.

    def rename(self, seq_id: str, new_id: str) -> None:
        """The session's blocks and cached hashes go on under new_id."""
        assert new_id not in self.tables, f"sequence {new_id} is already open"
        self.tables[new_id] = self.tables.pop(seq_id)
        self.hashes[new_id] = self.hashes.pop(seq_id)

    def free(self, seq_id: str) -> None:
        """Releases all blocks of the session, last block first, so a prefix outlives its tail in the LRU."""
        for block_id in reversed(self.tables.pop(seq_id)):
            self._release(block_id)
        del self.hashes[seq_id]

    # ------------------------------------------------------------ blocks
    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0 and block.hash is not None:
            del self.evictable[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is None:
                self.free_ids.append(block_id)
            else:
                self.evictable[block_id] = None

    def _take_free(self) -> int:
        """A never-hashed free block if any, else the least recently released cached block, evicted."""
        if self.free_ids:
            return self.free_ids.popleft()
        block_id, _ = self.evictable.popitem(last=False)
        block = self.blocks[block_id]
        assert block.hash is not None
        del self.hash_to_block[block.hash]
        self._changed_hash(block.hash)
        block.hash = None
        return block_id

    # ------------------------------------------------------------ KV events
    def _changed_hash(self, h: bytes) -> None:
        if self._resend_all:
            return
        self._changed.add(h)
        if len(self._changed) > MAX_PENDING_KV_CHANGES:
            self.resend_all_kv()

    def resend_all_kv(self) -> None:
        """The next report starts over from every cached hash (its receiver lost track, or may have)."""
        self._changed.clear()
        self._resend_all = True

    def take_kv_events(self, assignment_id: str) -> KvEvents | None:
        """What the prefix cache gained (stored) and lost (evicted) since the last call, None if nothing: a hash
        cached and dropped in between is reported as its state now. The first report, and one after
        resend_all_kv(), is `cleared`: every cached hash, to replace whatever its receiver knew."""
        if not self.enable_prefix_cache:
            return None
        if self._resend_all:
            self._resend_all = False
            return KvEvents(assignment_id, self.block_size, True, tuple(self.hash_to_block))
        if not self._changed:
            return None
        changed, self._changed = self._changed, set()
        return KvEvents(assignment_id, self.block_size, False,
                        tuple(h for h in changed if h in self.hash_to_block),
                        tuple(h for h in changed if h not in self.hash_to_block))
