"""A session's KV cache on the move between stages (its layout, a header and its pieces, the export and import
requests), and the prefix-cache events stages report to the router."""

from __future__ import annotations

from dataclasses import dataclass

from stratamesh.fleet.sessions import Hop, TensorBlob


@dataclass(frozen=True, slots=True)
class KvLayout:
    """The shape of a stage's KV cache: a session's KV moves only between stages of equal layout."""

    model_id: str
    start_layer: int
    end_layer: int
    dtype: str
    block_size: int
    num_kv_heads: int
    head_dim: int

    def mismatch(self, other: KvLayout) -> str:
        """What differs from other ("block_size 4 here, 8 there; ..."); "" when nothing does."""
        mine, theirs = self._parts(), other._parts()
        return "; ".join(f"{name} {mine[name]} here, {theirs[name]} there" for name in mine
                         if mine[name] != theirs[name])

    def _parts(self) -> dict[str, str]:
        return {"model": repr(self.model_id), "layers": f"[{self.start_layer}, {self.end_layer})",
                "dtype": self.dtype, "block_size": str(self.block_size), "kv_heads": str(self.num_kv_heads),
                "head_dim": str(self.head_dim)}


@dataclass(frozen=True, slots=True)
class KvHeader:
    """The first message of a session's export: its state, and what the data pieces after it must be."""

    layout: KvLayout
    session_id: str
    token_ids: tuple[int, ...]  # every token id the session has, prompt first
    prompt_len: int
    num_computed: int           # positions with KV: the data holds exactly these
    kv: TensorBlob              # dtype and shape of the data ([2, layers, num_computed, kv heads, head dim]), no bytes
    num_bytes: int
    digest: bytes               # BLAKE2b (16 bytes) of the data


@dataclass(frozen=True, slots=True)
class KvPiece:
    """data[offset:offset + len(data)] of an export, with its CRC-32."""

    offset: int
    data: bytes
    crc32: int


@dataclass(frozen=True, slots=True)
class KvExportRequest:
    session_id: str
    assignment_id: str          # the exporting stage
    layout: KvLayout            # the importing stage's: the export is refused unless it is the exporter's
    wait_for_prefill: bool = False  # export once the session's prompt is computed there, not at once


@dataclass(frozen=True, slots=True)
class KvImportRequest:
    session_id: str
    assignment_id: str          # the importing stage
    source: Hop                 # the stage that holds the session now
    wait_for_prefill: bool = False  # ... or will, once it has computed the session's prompt


@dataclass(frozen=True, slots=True)
class KvImportSummary:
    num_tokens: int
    num_bytes: int
    num_pieces: int


@dataclass(frozen=True, slots=True)
class KvEvents:
    """What a stage's prefix cache gained (stored) and lost (evicted) since its last report, as block hashes
    (fleet.prefix); cleared: forget what it said before, stored is all it holds. The router's index feeds on them."""

    assignment_id: str
    block_size: int
    cleared: bool
    stored: tuple[bytes, ...]
    evicted: tuple[bytes, ...] = ()
