"""A standby coordinator's admin API: what it cannot answer from what it holds goes to the leader (docs/registry.md).

A standby serves the OpenAI API from its own origin, and of the admin API what is its own: its requests and their
traces, its API's live stats, the mesh's coordinators, who is logged in. Every other /admin/api call (the writes,
and the reads of what only the leader holds in memory: connected agents, drains, plans' live state) is forwarded
to the leader as it came, and its answer passed back as it is; the leader checks the caller's credentials.
Without a leader to forward to, the answer is 503 with a Retry-After."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

import httpx
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stratamesh.coordinator.api.errors import ApiError

log = logging.getLogger(__name__)

ADMIN_API = "/admin/api/"
OWN = ("requests", "stats", "coordinators", "whoami")   # the admin API's paths a standby answers itself
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization",
               "proxy-authenticate", "host", "content-length"}
FORWARD_TIMEOUT_S = 60.0


def forwarded(path: str) -> bool:
    """Whether a standby forwards a request for path to the leader."""
    if not path.startswith(ADMIN_API):
        return False
    return path[len(ADMIN_API):].split("/", 1)[0] not in OWN


class ForwardToLeader:
    """ASGI middleware: while standing_by(), forwards the admin API's calls that are not the standby's own to
    leader_url() (None: no leader is known)."""

    def __init__(self, app: ASGIApp, standing_by: Callable[[], bool],
                 leader_url: Callable[[], Awaitable[str | None]]) -> None:
        self._app = app
        self._standing_by = standing_by
        self._leader_url = leader_url
        self._client = httpx.AsyncClient(timeout=FORWARD_TIMEOUT_S)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._standing_by() or not forwarded(scope["path"]):
            await self._app(scope, receive, send)
            return
        leader = await self._leader_url()
        if leader is None:
            await _error(send, 503, "no coordinator of this mesh leads now: try again in a few seconds")
            return
        body = await _body(receive)
        url = f"{leader.rstrip('/')}{scope['path']}" + (f"?{scope['query_string'].decode()}"
                                                         if scope["query_string"] else "")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                   if k.decode("latin-1").lower() not in _HOP_BY_HOP]
        try:
            request = self._client.build_request(scope["method"], url, headers=headers, content=body)
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            log.warning("could not forward %s %s to the leader at %s: %s", scope["method"], scope["path"], leader, exc)
            await _error(send, 503, f"the leader at {leader} did not answer: try again in a few seconds")
            return
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.items()
                                    if k.lower() not in _HOP_BY_HOP]})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()


async def _body(receive: Receive) -> bytes:
    chunks, more = [], True
    while more:
        message: Message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


async def _error(send: Send, status: int, message: str) -> None:
    body = json.dumps(ApiError(status, message, "unavailable", code="no_leader").body()).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"2")]})
    await send({"type": "http.response.body", "body": body})
