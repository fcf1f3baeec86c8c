"""The one place gRPC servers and channels are made: limits, keepalive and (later) mTLS live here."""

from __future__ import annotations

import grpc

# Both sides accept messages this large; senders still chunk activations well under it.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Prefill activations are cut into messages of at most this many bytes.
CHUNK_BYTES = 4 * 1024 * 1024

_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
_SERVER_OPTIONS = _OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
]


def make_server() -> grpc.aio.Server:
    """A grpc.aio server with the mesh's message limits and keepalive."""
    return grpc.aio.server(options=_SERVER_OPTIONS)


def bind(server: grpc.aio.Server, host: str, port: int = 0) -> int:
    """Binds host:port (0 picks a free port) and returns the port bound."""
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind gRPC server to {host}:{port}")
    return bound


def describe_error(exc: BaseException) -> str:
    """One line for a failed call or dial: the gRPC status and details, "timed out", or the exception."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def make_channel(address: str) -> grpc.aio.Channel:
    """A grpc.aio channel to host:port with the mesh's message limits and keepalive."""
    return grpc.aio.insecure_channel(address, options=_OPTIONS)
