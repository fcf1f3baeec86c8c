"""The SDK's exceptions: server errors by HTTP status, and transport failures."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from stratamesh.fleet.errors import MeshError

__all__ = [
    "AmbiguousModelError", "AuthenticationError", "BadRequestError", "ConflictError",
    "EmbeddingsNotSupportedError", "InternalServerError", "MeshAPIError", "MeshConnectionError", "MeshError",
    "MeshTimeoutError", "NotFoundError", "PermissionDeniedError", "RateLimitError", "ServiceUnavailableError",
    "UnexpectedResponseError",
]


class MeshAPIError(MeshError):
    """The server answered with an error; carries its status and OpenAI's error fields."""

    def __init__(self, status_code: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(f"{status_code} {type or 'error'}: {message}")
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s


class BadRequestError(MeshAPIError):
    """400 or 422: the request was invalid (the param field names what)."""


class AuthenticationError(MeshAPIError):
    """401: the API key is missing or wrong."""


class PermissionDeniedError(MeshAPIError):
    """403: the API key may not do this."""


class NotFoundError(MeshAPIError):
    """404: no such model or route."""




class EmbeddingsNotSupportedError(BadRequestError):
    """The model serves no embeddings (a 400 model_not_embedding, or a 404 from a server without the route)."""


class ConflictError(MeshAPIError):
    """409: the request conflicts with the mesh's state."""


class RateLimitError(MeshAPIError):
    """429: too many requests; retry_after_s says when to try again, if the server said."""


class ServiceUnavailableError(MeshAPIError):
    """503: the model is loading or the mesh is recovering; retry after retry_after_s."""


class InternalServerError(MeshAPIError):
    """Another 5xx: the server or a pipeline stage failed."""


class MeshConnectionError(MeshError):
    """The server could not be reached, or the connection dropped mid-response."""


class MeshTimeoutError(MeshConnectionError):
    """The server did not answer within the client's timeout."""


class AmbiguousModelError(MeshError):
    """model=None, but the mesh serves no model or several; the message lists them."""


class UnexpectedResponseError(MeshError):
    """The server answered, but not in the shape the SDK expects."""


_BY_STATUS: dict[int, type[MeshAPIError]] = {
    400: BadRequestError, 401: AuthenticationError, 403: PermissionDeniedError, 404: NotFoundError,
    409: ConflictError, 422: BadRequestError, 429: RateLimitError, 503: ServiceUnavailableError,
}
# a mid-stream error event carries no status; infer it from the body as the server's to_api_error sets it
_STATUS_BY_TYPE = {"invalid_request_error": 400, "service_unavailable_error": 503, "upstream_error": 502,
                   "server_error": 500}
_STATUS_BY_CODE = {"model_not_found": 404, "model_not_ready": 503, "stage_failed": 502}


def api_error(status_code: int, error: dict[str, Any], retry_after_s: float | None = None) -> MeshAPIError:
    """The exception for status_code and an OpenAI error object {"message", "type", "param", "code"}."""
    cls = _BY_STATUS.get(status_code) or (InternalServerError if status_code >= 500 else MeshAPIError)
    return cls(status_code, str(error.get("message") or "unknown error"), _str_or_none(error.get("type")),
               _str_or_none(error.get("param")), _str_or_none(error.get("code")), retry_after_s)


def error_from_response(response: httpx.Response) -> MeshAPIError:
    """The exception for an error response whose body has been read (any body, OpenAI-shaped or not)."""
    error = _error_object(response.content)
    if error is None:
        error = {"message": response.text.strip()[:500] or response.reason_phrase}
    return api_error(response.status_code, error, parse_retry_after(response.headers.get("retry-after")))


def error_from_event(event: dict[str, Any]) -> MeshAPIError:
    """The exception for an SSE event {"error": {...}} sent in the middle of a stream."""
    error = event["error"] if isinstance(event.get("error"), dict) else {"message": str(event.get("error"))}
    code, type_ = _str_or_none(error.get("code")), _str_or_none(error.get("type"))
    status = _STATUS_BY_CODE.get(code or "") or _STATUS_BY_TYPE.get(type_ or "", 500)
    return api_error(status, error)


def transport_error(exc: httpx.TransportError, what: str) -> MeshConnectionError:
    """The SDK exception for an httpx transport failure while doing what (e.g. "POST /v1/completions")."""
    if isinstance(exc, httpx.TimeoutException):
        return MeshTimeoutError(f"{what}: timed out ({type(exc).__name__})")
    return MeshConnectionError(f"{what}: {exc or type(exc).__name__}")


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date); None if absent or unreadable."""
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:     # "-0000": UTC, says RFC 5322
        when = when.replace(tzinfo=timezone.utc)
    now = now or datetime.now(timezone.utc)
    return max((when - now).total_seconds(), 0.0)


def _error_object(content: bytes) -> dict[str, Any] | None:
    try:
        body = json.loads(content)
    except ValueError:
        return None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        error: dict[str, Any] = body["error"]
        return error
    if isinstance(body, dict) and isinstance(body.get("detail"), str):  # a plain FastAPI error
        return {"message": body["detail"]}
    return None


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)
