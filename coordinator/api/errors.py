"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, and the app's handlers for them."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from stratamesh.fleet.errors import (
    ContextLengthExceeded,
    InvalidInput,
    MeshError,
    ModelNotFound,
    ModelNotReady,
    StageFailed,
)

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5  # what a 503 tells a client to wait: a model that is loading is usually ready in seconds


class ApiError(Exception):
    """An HTTP error with everything OpenAI's error body carries."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body, also sent as an SSE event when a stream fails."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_ERROR_MEANINGS = {400: "a malformed request, or one the model cannot serve", 401: "no valid API key",
                   403: "the API key's or user's role may not do this",
                   404: "no such model (or route)", 409: "a conflict with the mesh's state",
                   413: "the request body is over the limit",
                   429: "over a limit: retry after Retry-After seconds", 499: "the client went away",
                   502: "a pipeline stage failed", 503: "the model is loading or recovering: retry after Retry-After"}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI responses for these error statuses, each with OpenAI's error body."""
    return {status: {"description": _ERROR_MEANINGS.get(status, "an error"),
                     "content": {"application/json": {"schema": _ERROR_SCHEMA}}} for status in statuses}


def to_api_error(exc: BaseException) -> ApiError:
    """Map any exception to the HTTP error a client should see; unexpected ones are logged with a trace."""
    match exc:
        case ApiError():
            return exc
        case ContextLengthExceeded():
            return ApiError(400, str(exc), code="context_length_exceeded")
        case InvalidInput():
            return ApiError(400, str(exc))
        case ModelNotFound():
            return ApiError(404, str(exc), param="model", code="model_not_found")
        case ModelNotReady():
            return ApiError(503, str(exc), "service_unavailable_error", code="model_not_ready")
        case StageFailed():
            return ApiError(502, f"a pipeline stage failed: {exc}", "upstream_error", code="stage_failed")
        case MeshError():
            return ApiError(500, str(exc), "server_error", code=type(exc).__name__)
    log.error("unexpected error serving a request", exc_info=exc)
    return ApiError(500, f"internal error ({type(exc).__name__})", "server_error", code="internal_error")


def error_response(exc: BaseException, headers: dict[str, str] | None = None) -> JSONResponse:
    """The JSON response for an exception raised while serving a request (also an ASGI app: middleware answers
    with it before any route runs)."""
    err = to_api_error(exc)
    if err.status >= 500:
        log.warning("request failed with %d: %s", err.status, err.message)
    else:
        log.debug("request rejected with %d: %s", err.status, err.message)
    retry = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 503 else {}
    return JSONResponse(err.body(), status_code=err.status, headers={**retry, **(headers or {})})


def validation_error(exc: ValidationError | RequestValidationError) -> ApiError:
    """A 400 naming the first field that failed validation, e.g. param "messages[0].role"."""
    first = exc.errors()[0]
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', '')}".rstrip(": "))
    param = _param_name(loc)
    message = first.get("msg", "invalid value")
    return ApiError(400, f"{param}: {message}" if param else message, param=param)


_UNION_MEMBERS = frozenset({"str", "int", "float", "bool"})   # loc parts naming a union's member, not a field


def _param_name(loc: list[Any]) -> str | None:
    # Pydantic puts union member names ("str", "list[str]") and validator tags in loc; keep the field path.
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _UNION_MEMBERS:
            name += f".{part}" if name else part
        else:
            break
    return name or None


def install_error_handlers(app: FastAPI) -> None:
    """Send every error the app raises in OpenAI's shape; 400, not FastAPI's 422, for invalid bodies."""

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(exc))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        err = ApiError(exc.status_code, str(exc.detail), type_, code=None)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    async def on_other(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(MeshError, on_other)
    app.add_exception_handler(Exception, on_other)
