"""The Python SDK: Mesh and AsyncMesh clients of a stratamesh mesh, and an embedded local mesh."""

from __future__ import annotations

from stratamesh.sdk.async_client import AsyncMesh
from stratamesh.sdk.calls import ChatOptions, SamplingOptions
from stratamesh.sdk.client import Mesh
from stratamesh.sdk.errors import (
    AmbiguousModelError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    EmbeddingsNotSupportedError,
    InternalServerError,
    MeshAPIError,
    MeshConnectionError,
    MeshError,
    MeshTimeoutError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    ServiceUnavailableError,
    UnexpectedResponseError,
)
from stratamesh.sdk.results import (
    Agent,
    ChatChoice,
    ChatChunk,
    ChatCompletion,
    Completion,
    CompletionChunk,
    Gpu,
    Message,
    Model,
    TextChoice,
    TokenLogprob,
    ToolCall,
    Usage,
)
from stratamesh.sdk.streams import AsyncStream, Stream

__all__ = [
    "Agent", "AmbiguousModelError", "AsyncMesh", "AsyncStream", "AuthenticationError", "BadRequestError",
    "ChatChoice", "ChatChunk", "ChatCompletion", "ChatOptions", "Completion", "CompletionChunk", "ConflictError",
    "EmbeddingsNotSupportedError", "Gpu", "InternalServerError", "Mesh", "MeshAPIError", "MeshConnectionError",
    "MeshError", "MeshTimeoutError", "Message", "Model", "NotFoundError", "PermissionDeniedError", "RateLimitError",
    "SamplingOptions", "ServiceUnavailableError", "Stream", "TextChoice", "TokenLogprob", "ToolCall",
    "UnexpectedResponseError", "Usage",
]
