"""The one place gRPC servers and channels are made: message limits, keepalive and mesh mTLS live here.

A daemon calls use_tls() once at start with the certificate its mesh's CA issued it. From then on every
server it makes demands a client certificate of that CA and refuses a revoked one, and every channel it
dials presents its own certificate and checks the peer's. Without use_tls() (the explicit insecure
development mode) servers and channels are plaintext, as every caller's code is the same either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import sys
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from stratamesh.fleet.pki import MESH_TLS_NAME, CertInfo, cert_info

log = logging.getLogger(__name__)

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
# Peers are checked against the mesh's name, not their address: see pki.MESH_TLS_NAME.
_TLS_CHANNEL_OPTIONS = _OPTIONS + [("grpc.ssl_target_name_override", MESH_TLS_NAME)]


@dataclass(frozen=True, slots=True)
class MeshTls:
    """A process's mesh credentials (PEM): the CA it trusts, and the certificate and key it presents."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes


class Revocations:
    """The serials this process refuses, and the calls in flight from each peer, so a revocation cuts them."""

    def __init__(self) -> None:
        self._serials: frozenset[str] = frozenset()
        self._calls: dict[str, set[asyncio.Task]] = {}

    def __contains__(self, serial: str) -> bool:
        return serial in self._serials

    def replace(self, serials: Iterable[str]) -> None:
        """Sets the revoked serials and cancels every call in flight from a peer holding one."""
        self._serials = frozenset(serials)
        for serial in self._serials & self._calls.keys():
            for task in self._calls.pop(serial):
                log.warning("cutting off a call from revoked certificate %s", serial)
                task.cancel()

    @property
    def serials(self) -> frozenset[str]:
        return self._serials

    def track(self, serial: str, task: asyncio.Task) -> Callable[[], None]:
        """Remembers a call's task under its peer's serial; returns what forgets it."""
        calls = self._calls.setdefault(serial, set())
        calls.add(task)
        return lambda: (calls.discard(task), calls or self._calls.pop(serial, None))


class _Process:
    """Stands for "this process's credentials" as a default argument."""


PROCESS = _Process()
_tls: MeshTls | None = None
revoked = Revocations()    # this process's refused serials, kept current by the control plane


def use_tls(tls: MeshTls | None) -> None:
    """Sets this process's mesh credentials (None: plaintext); call before anything listens or dials."""
    global _tls
    _tls = tls


def current_tls() -> MeshTls | None:
    """This process's mesh credentials (None: plaintext)."""
    return _tls


def warn_insecure(component: str) -> None:
    """Says loudly, in the log and on stderr, that this process runs without mesh security."""
    banner = (f"INSECURE DEVELOPMENT MODE: this {component} runs plaintext gRPC without certificates; "
              "anyone who reaches its ports can join the mesh, send it activations or read them. "
              "Never run a mesh like this outside a development machine.")
    log.warning("%s", banner)
    print(f"\n{'!' * 100}\n{banner}\n{'!' * 100}\n", file=sys.stderr, flush=True)


def make_server(tls: MeshTls | None | _Process = PROCESS) -> grpc.aio.Server:
    """A grpc.aio server with the mesh's message limits and keepalive; every call passes _Boundary."""
    return grpc.aio.server(options=_SERVER_OPTIONS, interceptors=[_Boundary(tls=_resolve(tls) is not None)])


def bind(server: grpc.aio.Server, host: str, port: int = 0, tls: MeshTls | None | _Process = PROCESS) -> int:
    """Binds host:port (0 picks a free port), with mTLS unless insecure, and returns the port bound."""
    tls = _resolve(tls)
    address = f"{host}:{port}"
    if tls is None:
        bound = server.add_insecure_port(address)
    else:
        credentials = grpc.ssl_server_credentials([(tls.key_pem, tls.cert_pem)], root_certificates=tls.ca_pem,
                                                  require_client_auth=True)
        bound = server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"could not bind gRPC server to {address}")
    return bound


def make_channel(address: str, tls: MeshTls | None | _Process = PROCESS) -> grpc.aio.Channel:
    """A grpc.aio channel to host:port with the mesh's limits and keepalive; with TLS, it presents our cert."""
    tls = _resolve(tls)
    if tls is None:
        return grpc.aio.insecure_channel(address, options=_OPTIONS)
    credentials = grpc.ssl_channel_credentials(tls.ca_pem, tls.key_pem, tls.cert_pem)
    return grpc.aio.secure_channel(address, credentials, options=_TLS_CHANNEL_OPTIONS)


def peer_cert(context: grpc.aio.ServicerContext) -> CertInfo | None:
    """The certificate the caller presented (verified by the TLS handshake), or None over plaintext."""
    pems = context.auth_context().get("x509_pem_cert")
    return _parse_cert(bytes(pems[0])) if pems else None


def describe_error(exc: BaseException) -> str:
    """One line for a failed call or dial: the gRPC status and details, "timed out", or the exception."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _resolve(tls: MeshTls | None | _Process) -> MeshTls | None:
    return _tls if isinstance(tls, _Process) else tls


@functools.lru_cache(maxsize=1024)
def _parse_cert(pem: bytes) -> CertInfo:
    return cert_info(pem)


class _Boundary(grpc.aio.ServerInterceptor):
    """Every call's way in: with TLS, refuses a call without a mesh certificate or with a revoked one and
    tracks it, so a revocation cuts it; always, answers a message that does not parse with INVALID_ARGUMENT
    (gRPC would answer UNKNOWN and log a traceback) instead of letting it reach the servicer's loop."""

    def __init__(self, tls: bool) -> None:
        self._tls = tls

    async def intercept_service(self, continuation, handler_call_details):  # noqa: ANN001, ANN201
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                return handler._replace(**{kind: _guarded(behavior, self._tls)})
        return handler


def _guarded(behavior: Callable, tls: bool) -> Callable:
    if inspect.isasyncgenfunction(behavior):
        async def stream(request: object, context: grpc.aio.ServicerContext):  # noqa: ANN202
            async with _boundary(context, tls):
                async for response in behavior(request, context):
                    yield response
        return stream

    async def call(request: object, context: grpc.aio.ServicerContext) -> object:
        async with _boundary(context, tls):
            return await behavior(request, context)
    return call


@contextlib.asynccontextmanager
async def _boundary(context: grpc.aio.ServicerContext, tls: bool) -> AsyncIterator[None]:
    """Admits the caller, and turns what goes wrong at the boundary into the status the caller should see."""
    peer, forget = await _admit(context, tls)
    try:
        yield
    except DecodeError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"a message does not parse: {exc}")
    except asyncio.CancelledError:
        await _abort_if_revoked(peer, context)
        raise
    finally:
        forget()


async def _admit(context: grpc.aio.ServicerContext, tls: bool) -> tuple[CertInfo | None, Callable[[], None]]:
    if not tls:
        return None, lambda: None
    peer = peer_cert(context)
    if peer is None:   # cannot happen behind require_client_auth; refuse rather than trust
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a mesh certificate is required")
    await _abort_if_revoked(peer, context)
    return peer, revoked.track(peer.serial, asyncio.current_task())


async def _abort_if_revoked(peer: CertInfo | None, context: grpc.aio.ServicerContext) -> None:
    """Ends the call with PERMISSION_DENIED if the peer's certificate is revoked (a cut call ends so too:
    gRPC would send a cancelled handler's caller no status at all)."""
    if peer is not None and peer.serial in revoked:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"the certificate of {peer.name!r} (serial {peer.serial}) is revoked")
