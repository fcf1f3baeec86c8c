"""What the API takes in: a cap on body size, on requests in flight in all and per caller, and on prompt and
completion lengths. Over a cap the answer is at once: 413, or 429 with Retry-After, never a growing queue."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stratamesh.coordinator.api.errors import ApiError, error_response
from stratamesh.fleet.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class Limits:
    """The API's limits; 0 leaves a token limit to the model's context."""

    max_requests: int = 256            # generations and embeddings in flight, all callers together
    max_requests_per_caller: int = 64  # ... per API key or user
    max_body_bytes: int = 8 << 20      # any request body
    max_prompt_tokens: int = 0
    max_tokens: int = 0                # a completion's max_tokens (and its default)
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        for name in ("max_requests", "max_requests_per_caller", "max_body_bytes", "retry_after_s"):
            if getattr(self, name) < 1:
                raise InvalidInput(f"limits: {name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_prompt_tokens", "max_tokens"):
            if getattr(self, name) < 0:
                raise InvalidInput(f"limits: {name} must be 0 (no cap) or more, got {getattr(self, name)}")


class Gate:
    """Counts the requests in flight, in all and per caller, and says when one more would pass a limit."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.in_flight = 0
        self.per_caller: Counter[str] = Counter()
        self.num_refused = 0

    def refusal(self, caller: str) -> ApiError | None:
        """A 429 if caller may not start a request now, else None."""
        limits = self.limits
        if self.in_flight >= limits.max_requests:
            self.num_refused += 1
            return ApiError(429, f"the mesh is serving its limit of {limits.max_requests} requests; retry after "
                                 f"{limits.retry_after_s} s", "rate_limit_error", code="server_overloaded")
        if self.per_caller[caller] >= limits.max_requests_per_caller:
            self.num_refused += 1
            return ApiError(429, f"{caller} has {limits.max_requests_per_caller} requests in flight, its limit; "
                                 f"retry after {limits.retry_after_s} s", "rate_limit_error", code="too_many_requests")
        return None

    def enter(self, caller: str) -> None:
        self.in_flight += 1
        self.per_caller[caller] += 1

    def leave(self, caller: str) -> None:
        self.in_flight -= 1
        self.per_caller[caller] -= 1
        if not self.per_caller[caller]:
            del self.per_caller[caller]


class Admission:
    """ASGI middleware: refuses any request body over the limit with 413 (the admin login's too), and a /v1
    request over a concurrency limit with 429 and Retry-After; counts each admitted /v1 request until its
    response has ended (a stream included). Runs after access control, which names the caller in
    scope["state"]["principal"]."""

    def __init__(self, app: ASGIApp, gate: Gate) -> None:
        self._app = app
        self._gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self._app(scope, receive, send)
        limits = self._gate.limits
        body = await _read_body(receive, limits.max_body_bytes)
        if body is None:
            error = ApiError(413, f"the request body is over {limits.max_body_bytes} bytes", code="request_too_large")
            return await error_response(error)(scope, receive, send)
        if not scope["path"].startswith("/v1/"):      # the admin API's bodies are capped, not counted
            return await self._app(scope, _replay(body, receive), send)
        caller = _caller(scope)
        if refusal := self._gate.refusal(caller):
            return await error_response(refusal, {"Retry-After": str(limits.retry_after_s)})(scope, receive, send)
        self._gate.enter(caller)
        try:
            await self._app(scope, _replay(body, receive), send)
        finally:
            self._gate.leave(caller)


def _caller(scope: Scope) -> str:
    principal = scope.get("state", {}).get("principal")
    return principal.name if principal is not None else "anonymous"


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None as soon as it passes limit bytes (a declared Content-Length over it included)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)     # the client left: the app sees an empty body and its disconnect
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the app the body read already, then passes on what the client sends next."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
