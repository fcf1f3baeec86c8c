"""KV migration between stages: a quiet session's state and KV leave one stage as checksummed pieces, and the
stage that pulled them holds the session until a SessionOpen resumes it there (no token is computed again)."""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterator
from dataclasses import replace

import grpc

from stratamesh.agent.engine.block_manager import NoFreeBlocks
from stratamesh.agent.engine.stage_engine import SessionKv
from stratamesh.fleet.errors import InvalidInput, MeshError
from stratamesh.fleet.kv import KvExportRequest, KvHeader, KvImportRequest, KvImportSummary, KvLayout, KvPiece
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import CHUNK_BYTES, describe_error, make_channel
from stratamesh.kernels import codec

# An imported session that no SessionOpen resumes within this long is freed.
PARK_S = 30.0
# A pull that has not finished in this long fails (the origin then replays the session instead).
PULL_TIMEOUT_S = 60.0


class KvMismatch(InvalidInput):
    """The two stages' KV layouts differ (model, layer range, dtype, block size or head shape)."""


class KvCorrupt(MeshError):
    """An export arrived damaged: a piece failed its CRC-32, or the whole its length or digest."""


class KvPullFailed(MeshError):
    """The stage holding the session could not be reached, or refused the export for another reason."""


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def seal(layout: KvLayout, session: SessionKv) -> tuple[KvHeader, bytes]:
    """The header of an export and the data its pieces carry."""
    blob = codec.encode(session.kv.contiguous())
    header = KvHeader(layout, session.session_id, session.token_ids, session.prompt_len, session.num_computed,
                      replace(blob, data=b""), len(blob.data), digest(blob.data))
    return header, blob.data


def pieces(data: bytes, piece_bytes: int = CHUNK_BYTES) -> Iterator[KvPiece]:
    """data cut into pieces of at most piece_bytes, each with its CRC-32."""
    for offset in range(0, len(data), piece_bytes):
        part = data[offset:offset + piece_bytes]
        yield KvPiece(offset, part, zlib.crc32(part))


class KvReceiver:
    """Checks an export as it arrives, against the layout of the stage that imports it."""

    def __init__(self, layout: KvLayout):
        self.layout = layout
        self.header: KvHeader | None = None
        self.num_pieces = 0
        self._data = bytearray()

    def add(self, chunk: KvHeader | KvPiece) -> None:
        if isinstance(chunk, KvHeader):
            if self.header is not None:
                raise KvCorrupt("the export sent a second header")
            if diff := self.layout.mismatch(chunk.layout):
                raise KvMismatch(f"cannot import session {chunk.session_id}: {diff}")
            self.header = chunk
            return
        if self.header is None:
            raise KvCorrupt("the export sent data before its header")
        if chunk.offset != len(self._data) or len(self._data) + len(chunk.data) > self.header.num_bytes:
            raise KvCorrupt(f"piece at offset {chunk.offset} does not continue the {len(self._data)} bytes so far "
                            f"within {self.header.num_bytes}")
        if zlib.crc32(chunk.data) != chunk.crc32:
            raise KvCorrupt(f"piece at offset {chunk.offset} failed its CRC-32")
        self._data += chunk.data
        self.num_pieces += 1

    def finish(self) -> tuple[SessionKv, KvImportSummary]:
        """The session as received; KvCorrupt if it is incomplete or its digest or shape is wrong."""
        header = self.header
        if header is None:
            raise KvCorrupt("the export ended before its header")
        data = bytes(self._data)
        matches = digest(data) == header.digest
        if len(data) != header.num_bytes or not matches:
            raise KvCorrupt(f"session {header.session_id}: {len(data)} of {header.num_bytes} bytes, "
                            f"digest {'matches' if matches else 'differs'}")
        layout = self.layout
        expected = (2, layout.end_layer - layout.start_layer, header.num_computed, layout.num_kv_heads,
                    layout.head_dim)
        if header.kv.shape != expected or header.kv.dtype != layout.dtype:
            raise KvCorrupt(f"session {header.session_id}: KV of {header.kv.dtype} {list(header.kv.shape)}, "
                            f"expected {layout.dtype} {list(expected)}")
        kv = codec.decode(replace(header.kv, data=data))
        session = SessionKv(header.session_id, header.token_ids, header.prompt_len, header.num_computed, kv)
        return session, KvImportSummary(header.num_computed, len(data), self.num_pieces)


async def pull(request: KvImportRequest, layout: KvLayout) -> tuple[SessionKv, KvImportSummary]:
    """Pulls a session from the stage at request.source with its ExportKv (which then lets it go)."""
    channel = make_channel(request.source.address)
    receiver = KvReceiver(layout)
    try:
        export = KvExportRequest(request.session_id, request.source.assignment_id, layout, request.wait_for_prefill)
        call = pb_grpc.StageStub(channel).ExportKv(convert.kv_export_request_to_pb(export), timeout=PULL_TIMEOUT_S)
        async for message in call:
            receiver.add(convert.kv_chunk_from_pb(message))
        return receiver.finish()
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
            raise KvMismatch(f"{request.source.address} refused the export: {exc.details()}") from None
        raise KvPullFailed(f"export from {request.source.address} failed: {describe_error(exc)}") from None
    finally:
        await channel.close(grace=None)


def check_export(layout: KvLayout, request: KvExportRequest) -> None:
    """Refuses an export to a stage whose layout differs from this one's."""
    if diff := layout.mismatch(request.layout):
        raise KvMismatch(f"cannot export session {request.session_id}: {diff}")


# How each failure of an export or import is answered on the wire.
STATUS_OF: tuple[tuple[type[MeshError], grpc.StatusCode], ...] = (
    (KvMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (KvCorrupt, grpc.StatusCode.DATA_LOSS),
    (KvPullFailed, grpc.StatusCode.UNAVAILABLE),
    (InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),
    (NoFreeBlocks, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (MeshError, grpc.StatusCode.INTERNAL),
)


def status_of(exc: MeshError) -> grpc.StatusCode:
    return next(code for kind, code in STATUS_OF if isinstance(exc, kind))
