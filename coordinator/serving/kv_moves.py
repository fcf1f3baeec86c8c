"""Moving a live session's KV to the stages that replace some of its route's: each new stage pulls from the old."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from stratamesh.fleet.kv import KvImportRequest
from stratamesh.fleet.sessions import Hop
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import describe_error, make_channel

log = logging.getLogger(__name__)

# A stage that has not pulled a session's KV in this long is given up on: the session replays there instead.
IMPORT_TIMEOUT_S = 60.0


def replaced_hops(old: Sequence[Hop], new: Sequence[Hop]) -> list[tuple[Hop, Hop]]:
    """(old hop, new hop) at each position where the new route has another stage; none if the stage count changed
    (then the layer ranges differ and no KV can move)."""
    if len(old) != len(new):
        return []
    return [(o, n) for o, n in zip(old, new, strict=True) if o.assignment_id != n.assignment_id]


async def move_kv(session_id: str, old: Sequence[Hop], new: Sequence[Hop], wait_for_prefill: bool = False) -> int:
    """Has each stage new to the route pull the quiet session's KV from the stage it replaces, all at once;
    returns the bytes pulled. A stage that could not pull is logged: it computes the session again.

    wait_for_prefill: the session is still prefilling on old (a hand-off, asked for as the prefill starts): each
    old stage exports once it has computed the prompt, while the stages after it may still be computing theirs."""
    pairs = replaced_hops(old, new)
    results = await asyncio.gather(*(_pull(session_id, source, target, wait_for_prefill) for source, target in pairs),
                                   return_exceptions=True)
    for (_, target), result in zip(pairs, results, strict=True):
        if isinstance(result, BaseException):
            log.warning("session %s: KV not moved to %s (%s); that stage computes it again", session_id,
                        target.address, describe_error(result))
    return sum(r for r in results if isinstance(r, int))


async def _pull(session_id: str, source: Hop, target: Hop, wait_for_prefill: bool) -> int:
    channel = make_channel(target.address)
    try:
        request = convert.kv_import_request_to_pb(KvImportRequest(session_id, target.assignment_id, source,
                                                                   wait_for_prefill))
        summary = await pb_grpc.StageStub(channel).ImportKv(request, timeout=IMPORT_TIMEOUT_S)
        return convert.kv_import_summary_from_pb(summary).num_bytes
    finally:
        await channel.close(grace=None)
