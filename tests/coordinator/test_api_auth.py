"""Access control in front of the HTTP API, over a real access store: who gets 401, 403, or through."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from stratamesh.coordinator.access import AccessStore
from stratamesh.coordinator.api.auth import SESSION_COOKIE, install_access, required_role
from stratamesh.coordinator.registry import Registry

NOW = 1_800_000_000.0


def app_with(access: AccessStore | None) -> FastAPI:
    """Routes shaped like the coordinator's: /v1, admin reads and actions, a stream, and the open ones."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> dict:
        return {"ok": "completions"}

    @app.get("/admin/api/agents")
    async def agents() -> dict:
        return {"agents": []}

    @app.post("/admin/api/agents/{agent_id}/drain")
    async def drain(agent_id: str) -> dict:
        return {"drained": agent_id}

    @app.get("/admin/api/stream")
    async def stream() -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            yield b"event: snapshot\ndata: {}\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    install_access(app, access, clock=lambda: NOW)
    return app


@pytest.fixture
def access() -> AccessStore:
    return AccessStore(Registry(":memory:"))


def client(app: FastAPI, key: str = "") -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mesh", headers=headers)


@pytest.mark.parametrize("method, path, role", [
    ("POST", "/v1/completions", "client"), ("POST", "/v1/responses", "client"), ("GET", "/v1/models", "client"),
    ("GET", "/v1", "client"),
    ("GET", "/admin/api/agents", "viewer"), ("HEAD", "/admin/api/agents", "viewer"),
    ("POST", "/admin/api/agents/a/drain", "operator"), ("DELETE", "/admin/api/x", "operator"),
    ("POST", "/admin/api/login", None), ("POST", "/admin/api/logout", None), ("GET", "/health", None),
    ("GET", "/metrics", None), ("GET", "/admin/", None), ("GET", "/admin/app.js", None),
    ("GET", "/openapi.json", None), ("GET", "/v1x", None), ("POST", "/tokenize", "client"),
    ("POST", "/detokenize", "client")])
def test_required_roles(method: str, path: str, role: str | None) -> None:
    assert required_role(method, path) == role


async def test_no_or_a_wrong_key_gets_401_in_openais_shape(access: AccessStore) -> None:
    app = app_with(access)
    good, _ = access.create_key("client", "app", NOW)
    for key in ("", good[:-1] + ("x" if good[-1] != "x" else "y"), "sk-sm-00000000-" + "a" * 43, "garbage"):
        async with client(app, key) as http:
            response = await http.post("/v1/completions")
        assert response.status_code == 401, key
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "invalid_api_key"
    async with client(app, good) as http:
        assert (await http.post("/v1/completions")).json() == {"ok": "completions"}
        assert (await http.get("/health")).status_code == 200
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mesh",
                                 headers={"x-api-key": good}) as http:     # as Anthropic's clients send it
        assert (await http.post("/v1/completions")).json() == {"ok": "completions"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mesh",
                                 headers={"x-api-key": "garbage"}) as http:
        assert (await http.post("/v1/completions")).status_code == 401


async def test_each_role_reaches_what_it_may(access: AccessStore) -> None:
    app = app_with(access)
    keys = {role: access.create_key(role, role, NOW)[0] for role in ("client", "viewer", "operator")}
    expected = {  # (v1 completion, admin read, drain)
        "client": (200, 403, 403), "viewer": (200, 200, 403), "operator": (200, 200, 200)}
    for role, statuses in expected.items():
        async with client(app, keys[role]) as http:
            got = ((await http.post("/v1/completions")).status_code, (await http.get("/admin/api/agents")).status_code,
                   (await http.post("/admin/api/agents/a1/drain")).status_code)
        assert got == statuses, role
    async with client(app, keys["viewer"]) as http:
        refused = (await http.post("/admin/api/agents/a1/drain")).json()["error"]
    assert refused["code"] == "insufficient_role" and "operator" in refused["message"]


async def test_a_revoked_key_is_refused_from_its_next_request(access: AccessStore) -> None:
    app = app_with(access)
    key, record = access.create_key("client", "", NOW)
    async with client(app, key) as http:
        assert (await http.post("/v1/completions")).status_code == 200
        access.revoke_key(record.key_id, NOW)
        assert (await http.post("/v1/completions")).status_code == 401


async def test_a_viewer_logs_in_reads_and_streams_but_cannot_drain(access: AccessStore) -> None:
    access.add_user("ada", "correct horse", "viewer", NOW)
    app = app_with(access)
    async with client(app) as http:
        assert (await http.get("/admin/api/whoami")).status_code == 401
        wrong = await http.post("/admin/api/login", json={"username": "ada", "password": "wrong horse"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_login"
        login = await http.post("/admin/api/login", json={"username": "ada", "password": "correct horse"})
        assert login.status_code == 200 and login.json()["user"] == {"name": "ada", "role": "viewer", "kind": "user"}
        cookie = login.headers["set-cookie"]
        assert f"{SESSION_COOKIE}=" in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie
        assert (await http.get("/admin/api/whoami")).json()["user"]["name"] == "ada"
        assert (await http.get("/admin/api/agents")).status_code == 200
        stream = await http.get("/admin/api/stream")
        assert stream.status_code == 200 and stream.text.startswith("event: snapshot")
        assert (await http.post("/admin/api/agents/a1/drain")).status_code == 403
        assert (await http.post("/admin/api/logout")).status_code == 204
        http.cookies.clear()
        assert (await http.get("/admin/api/agents")).status_code == 401


async def test_an_operator_session_may_drain(access: AccessStore) -> None:
    access.add_user("root", "correct horse", "operator", NOW)
    async with client(app_with(access)) as http:
        await http.post("/admin/api/login", json={"username": "root", "password": "correct horse"})
        assert (await http.post("/admin/api/agents/a1/drain")).json() == {"drained": "a1"}


async def test_insecure_mode_lets_everyone_in_and_says_so() -> None:
    async with client(app_with(None)) as http:
        assert (await http.post("/admin/api/agents/a1/drain")).status_code == 200
        assert (await http.get("/admin/api/whoami")).json()["user"]["kind"] == "insecure"
        login = await http.post("/admin/api/login", json={"username": "ada", "password": "correct horse"})
        assert login.status_code == 409


@pytest.mark.parametrize("body", [{}, {"username": "ada"}, {"username": "", "password": "x"},
                                  {"username": "a" * 65, "password": "x"}, [], "text"])
async def test_a_malformed_login_is_a_400(access: AccessStore, body: object) -> None:
    from stratamesh.coordinator.api.errors import install_error_handlers

    app = app_with(access)
    install_error_handlers(app)
    async with client(app) as http:
        response = await http.post("/admin/api/login", json=body)
    assert response.status_code == 400 and "error" in response.json()


async def test_failed_logins_make_the_guesser_wait(access: AccessStore) -> None:
    access.add_user("ada", "correct horse", "operator", NOW)
    access.add_user("bob", "battery staple", "viewer", NOW)
    async with client(app_with(access)) as http:
        for _ in range(5):
            wrong = await http.post("/admin/api/login", json={"username": "ada", "password": "wrong horse"})
            assert wrong.status_code == 401
        refused = await http.post("/admin/api/login", json={"username": "ada", "password": "correct horse"})
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_logins"
        assert int(refused.headers["retry-after"]) == 300
        other = await http.post("/admin/api/login", json={"username": "bob", "password": "battery staple"})
        assert other.status_code == 200, "another user of the same address still logs in"


async def test_a_huge_login_body_is_refused_before_it_is_read_whole(access: AccessStore) -> None:
    async with client(app_with(access)) as http:
        response = await http.post("/admin/api/login", content=b"{" + b" " * (9 << 20) + b"}",
                                   headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
