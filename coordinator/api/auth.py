"""Who may call what over HTTP: an ASGI layer in front of every route, and the admin login routes.

/v1 needs an API key of any role (`Authorization: Bearer sk-sm-...`, or `x-api-key: sk-sm-...` as Anthropic's clients
send it), and so do /tokenize and /detokenize; /admin/api needs a viewer to read and an
operator to act, by API key or by the session cookie the admin UI logs in for. /health, /metrics (as in vLLM,
for scrapers and load balancers), the UI's static files and the OpenAPI document are open.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.datastructures import Headers
from starlette.requests import cookie_parser
from starlette.types import ASGIApp, Receive, Scope, Send

from stratamesh.coordinator.access import SESSION_TTL_S, Principal
from stratamesh.coordinator.api.admission import Admission, Gate, Limits
from stratamesh.coordinator.api.errors import ApiError, error_response, error_responses
from stratamesh.coordinator.throttle import FailureThrottle

SESSION_COOKIE = "stratamesh_session"
INSECURE = Principal("insecure development mode", "operator", "insecure")
_OPEN_ADMIN = {"/admin/api/login", "/admin/api/logout"}
_CLIENT_ROUTES = {"/tokenize", "/detokenize"}      # vLLM's, outside /v1: a client's key as for /v1


class Access(Protocol):
    """What the HTTP layer asks of the access store; the coordinator's AccessStore implements it."""

    def check_key(self, text: str, now: float) -> Principal | None: ...

    def check_session(self, token: str, now: float) -> Principal | None: ...

    def login(self, username: str, password: str, now: float) -> str | None: ...

    def logout(self, token: str) -> None: ...


def required_role(method: str, path: str) -> str | None:
    """The least role a request needs, or None for an open route."""
    if path == "/v1" or path.startswith("/v1/") or path in _CLIENT_ROUTES:
        return "client"
    if path.startswith("/admin/api/") and path not in _OPEN_ADMIN:
        return "viewer" if method in ("GET", "HEAD") else "operator"
    return None


class AccessControl:
    """ASGI middleware: answers 401 without a valid credential and 403 for too small a role; otherwise
    passes the request on with its principal in scope["state"]["principal"]."""

    def __init__(self, app: ASGIApp, access: Access | None, clock: Callable[[], float] = time.time) -> None:
        self._app = app
        self._access = access          # None: insecure development mode, everyone is an operator
        self._clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self._app(scope, receive, send)
        need = required_role(scope["method"], scope["path"])
        # Open routes (health, metrics, the UI's files) cost no credential lookup.
        principal = self.principal(Headers(scope=scope)) if need is not None else None
        scope.setdefault("state", {})["principal"] = principal
        if need is not None and principal is None:
            error = ApiError(401, "a valid API key is required: Authorization: Bearer sk-sm-... (see `stratamesh "
                                  "key create`), or log in to the admin UI", code="invalid_api_key")
            return await error_response(error, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
        if need is not None and not principal.may(need):
            error = ApiError(403, f"{principal.name} has the {principal.role} role; this needs {need}",
                             type_="permission_error", code="insufficient_role")
            return await error_response(error)(scope, receive, send)
        await self._app(scope, receive, send)

    def principal(self, headers: Headers) -> Principal | None:
        """Who sent these headers: a bearer key, else a session cookie; None if neither is valid."""
        if self._access is None:
            return INSECURE
        now = self._clock()
        scheme, _, credential = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and credential:
            return self._access.check_key(credential.strip(), now)
        if headers.get("x-api-key"):            # Anthropic's clients send their key so
            return self._access.check_key(headers["x-api-key"].strip(), now)
        token = cookie_parser(headers.get("cookie", "")).get(SESSION_COOKIE, "")
        return self._access.check_session(token, now) if token else None


class Login(BaseModel):
    username: str = Field(min_length=1, max_length=64)
    password: str = Field(min_length=1, max_length=1024)


class UserView(BaseModel):
    name: str
    role: str
    kind: str


class WhoAmI(BaseModel):
    user: UserView


def auth_router(access: Access | None, clock: Callable[[], float] = time.time) -> APIRouter:
    """POST /admin/api/login and /logout, GET /admin/api/whoami."""
    router = APIRouter(prefix="/admin/api", tags=["admin"])

    # Guessing slows down: 5 wrong passwords for a user, or 20 from one address, in 5 minutes, and it waits.
    by_user, by_address = FailureThrottle(max_failures=5), FailureThrottle(max_failures=20)

    @router.post("/login", response_model=WhoAmI, responses=error_responses(400, 401, 409, 413, 429))
    async def login(body: Login, request: Request) -> Any:
        """Checks a user's password and sets the session cookie the admin UI then sends with every call."""
        if access is None:
            return error_response(ApiError(409, "this mesh runs --insecure: there is nothing to log in to",
                                           code="insecure_mode"))
        user, address = body.username, request.client.host if request.client else ""
        wait_s = max(by_user.wait_s(user, clock()), by_address.wait_s(address, clock()))
        if wait_s > 0:
            return error_response(ApiError(429, f"too many failed logins; try again in {wait_s:.0f} s",
                                           "rate_limit_error", code="too_many_logins"),
                                  {"Retry-After": str(max(1, round(wait_s)))})
        token = await asyncio.to_thread(access.login, user, body.password, clock())   # scrypt: ~30 ms
        if token is None:
            by_user.failed(user, clock())
            by_address.failed(address, clock())
            return error_response(ApiError(401, "wrong username or password", code="invalid_login"))
        by_user.succeeded(user)
        principal = access.check_session(token, clock())
        response = JSONResponse({"user": _view(principal)})
        # secure=False: the coordinator serves plain HTTP (on loopback for `stratamesh up`); SameSite=Strict and
        # HttpOnly still keep the cookie from other sites and from scripts.
        response.set_cookie(SESSION_COOKIE, token, httponly=True, samesite="strict", path="/",
                            max_age=SESSION_TTL_S)
        return response

    @router.post("/logout", status_code=204)
    async def logout(request: Request) -> Response:
        token = request.cookies.get(SESSION_COOKIE, "")
        if access is not None and token:
            access.logout(token)
        response = Response(status_code=204)
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response

    @router.get("/whoami", response_model=WhoAmI, responses=error_responses(401))
    async def whoami(request: Request) -> Any:
        """Who this request is from: the UI asks it first, and shows the login form on 401."""
        return {"user": _view(request.scope["state"]["principal"])}

    return router


def install_access(app: FastAPI, access: Access | None, clock: Callable[[], float] = time.time,
                   limits: Limits = Limits()) -> Gate:
    """Puts access control, then admission (limits per caller), in front of every route of app, and adds the
    login routes. Returns the admission gate (its counts are the requests in flight)."""
    gate = Gate(limits)
    app.include_router(auth_router(access, clock))
    app.add_middleware(Admission, gate=gate)                        # inner: it reads the principal ...
    app.add_middleware(AccessControl, access=access, clock=clock)   # ... that this outer layer sets
    return gate


def _view(principal: Principal) -> dict[str, str]:
    return {"name": principal.name, "role": principal.role, "kind": principal.kind}
