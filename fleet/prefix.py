"""The hashes of a prompt's full KV blocks, chained: what a stage's prefix cache is keyed by and what the
coordinator's router looks prompts up by. The same in every process and on every box."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = b""         # the parent of a prompt's first block
HASH_BYTES = 16


def chain_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a full block given its parent's hash."""
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hash of each full block of token_ids, in order (a partial last block has none)."""
    hashes, parent = [], ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes
