"""stratamesh: an edge-to-cloud inference mesh; `from stratamesh import Mesh` for the Python SDK."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stratamesh.sdk import (  # noqa: F401
        Agent,
        AmbiguousModelError,
        AsyncMesh,
        AsyncStream,
        AuthenticationError,
        BadRequestError,
        ChatChunk,
        ChatCompletion,
        Completion,
        CompletionChunk,
        ConflictError,
        EmbeddingsNotSupportedError,
        Gpu,
        InternalServerError,
        Mesh,
        MeshAPIError,
        MeshConnectionError,
        MeshError,
        MeshTimeoutError,
        Message,
        Model,
        NotFoundError,
        PermissionDeniedError,
        RateLimitError,
        ServiceUnavailableError,
        Stream,
        ToolCall,
        UnexpectedResponseError,
        Usage,
    )

# the SDK (and httpx) load on first use: the CLI and the daemons import this package too
__all__ = [
    "Agent", "AmbiguousModelError", "AsyncMesh", "AsyncStream", "AuthenticationError", "BadRequestError",
    "ChatChunk", "ChatCompletion", "Completion", "CompletionChunk", "ConflictError", "EmbeddingsNotSupportedError",
    "Gpu", "InternalServerError", "Mesh", "MeshAPIError", "MeshConnectionError", "MeshError", "MeshTimeoutError",
    "Message", "Model", "NotFoundError", "PermissionDeniedError", "RateLimitError", "ServiceUnavailableError",
    "Stream", "ToolCall", "UnexpectedResponseError", "Usage",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'stratamesh' has no attribute {name!r}")
    from stratamesh import sdk

    value = getattr(sdk, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
