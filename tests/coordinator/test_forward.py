"""A standby's admin API (coordinator/api/forward.py): what it answers itself, and the clear 503 it gives while no
coordinator leads (the forwarding itself runs end to end in tests/e2e/test_coordinators.py)."""

from __future__ import annotations

import socket

import httpx
from fastapi import FastAPI

from stratamesh.coordinator.api.forward import ForwardToLeader, forwarded


def _app(standing_by: list[bool], leader: str | None) -> FastAPI:
    app = FastAPI()

    @app.get("/admin/api/plans")
    async def plans() -> dict:
        return {"plans": "local"}

    @app.get("/admin/api/requests")
    async def requests() -> dict:
        return {"requests": "own"}

    async def leader_url() -> str | None:
        return leader

    app.add_middleware(ForwardToLeader, standing_by=lambda: standing_by[0], leader_url=leader_url)
    return app


async def _get(app: FastAPI, path: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://standby") as client:
        return await client.get(path)


def test_only_the_admin_api_beyond_the_standbys_own_paths_is_forwarded() -> None:
    assert [forwarded(p) for p in ("/admin/api/plans", "/admin/api/models/m/replan", "/admin/api/requests",
                                   "/admin/api/requests/r1/trace", "/admin/api/stats", "/admin/api/coordinators",
                                   "/admin/api/whoami", "/v1/completions", "/admin/", "/health")] == [
        True, True, False, False, False, False, False, False, False, False]


async def test_with_no_leader_a_forwarded_call_is_refused_saying_to_retry_and_its_own_are_answered() -> None:
    standing_by = [True]
    app = _app(standing_by, leader=None)
    refused = await _get(app, "/admin/api/plans")
    assert refused.status_code == 503 and refused.headers["retry-after"] == "2"
    assert refused.json()["error"]["code"] == "no_leader"
    assert (await _get(app, "/admin/api/requests")).json() == {"requests": "own"}
    standing_by[0] = False          # it leads now: it answers everything itself
    assert (await _get(app, "/admin/api/plans")).json() == {"plans": "local"}


async def test_a_leader_that_does_not_answer_is_a_503_too() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    refused = await _get(_app([True], leader=f"http://127.0.0.1:{port}"), "/admin/api/plans")
    assert refused.status_code == 503 and f"127.0.0.1:{port}" in refused.json()["error"]["message"]
