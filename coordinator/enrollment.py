"""The mesh's CA on disk, join tokens, and the Enroll service that turns a token into a certificate."""

from __future__ import annotations

import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from stratamesh.coordinator.credentials import CredentialStore, TokenRecord
from stratamesh.coordinator.registry_store import RegistryStore, open_registry
from stratamesh.coordinator.throttle import FailureThrottle
from stratamesh.fleet import pki
from stratamesh.fleet.enrollment import (EnrollmentRefused, EnrollReply, EnrollRequest, JoinToken, check_mac,
                                         new_token_id, reply_mac, request_mac, token_for)
from stratamesh.fleet.errors import InvalidInput, MeshError
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.state import make_private_dir
from stratamesh.fleet.wire.channels import MeshTls

log = logging.getLogger(__name__)

# An agent's certificate, and the coordinator's (issued afresh at every start: one up for months keeps a valid one).
CERT_VALID_S = 365 * 86400
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass(frozen=True, slots=True)
class MeshCa:
    """The CA's key and certificate, and the key join-token secrets derive from (all PEM / bytes)."""

    key_pem: bytes
    cert_pem: bytes
    token_key: bytes

    @classmethod
    def load_or_create(cls, directory: str | Path, mesh: str, now: float) -> MeshCa:
        """Reads the CA from directory, creating it there (keys readable by the owner only) on first start."""
        directory = Path(directory)
        paths = [directory / name for name in ("ca.key", "ca.pem", "token.key")]
        make_private_dir(directory)
        if not paths[0].exists():
            key_pem, cert_pem = pki.create_ca(mesh, now)
            for path, data in zip(paths, (key_pem, cert_pem, secrets.token_bytes(32))):
                _write_private(path, data)
            log.info("created the CA of mesh %s in %s", mesh, directory)
        return cls(*(path.read_bytes() for path in paths))

    def issue(self, csr_pem: bytes, serial: int, now: float, valid_s: float) -> bytes:
        return pki.issue(self.key_pem, self.cert_pem, csr_pem, serial, now, valid_s)

    def coordinator_tls(self, now: float) -> MeshTls:
        """Fresh credentials for the coordinator itself, signed by this CA."""
        key_pem = pki.new_key()
        cert_pem = self.issue(pki.make_csr(key_pem, pki.COORDINATOR_NAME), pki.random_serial(), now,
                              CERT_VALID_S)
        return MeshTls(self.cert_pem, cert_pem, key_pem)


class Enroller:
    """Checks a join token's proof and issues the agent's certificate; creates and revokes tokens."""

    def __init__(self, store: CredentialStore, ca: MeshCa, mesh: str, clock: Callable[[], float]) -> None:
        self._store = store
        self._ca = ca
        self._mesh = mesh
        self._clock = clock

    def create_token(self, ttl_s: float | None, description: str = "") -> tuple[JoinToken, TokenRecord]:
        record = self._store.add_token(new_token_id(), self._clock(), ttl_s, description)
        return token_for(self._ca.token_key, record.token_id), record

    def tokens(self) -> list[TokenRecord]:
        return self._store.tokens()

    def revoke_token(self, token_id: str) -> None:
        self._store.revoke_token(token_id, self._clock())

    def refusal(self, token: JoinToken) -> str:
        """Why an agent holding this token could not enroll now (unknown, another CA's, revoked, expired), or ""."""
        record = self._store.token(token.token_id)
        if record is None:
            return f"unknown join token {token.token_id}"
        if token != token_for(self._ca.token_key, token.token_id):
            return f"join token {token.token_id} is not this mesh's"
        return record.refusal(self._clock())

    def join(self, request: EnrollRequest) -> EnrollReply:
        """A certificate for request.agent_id; EnrollmentRefused (or InvalidInput) says why not."""
        now = self._clock()
        record = self._store.token(request.token_id)
        if record is None:
            raise EnrollmentRefused(f"unknown join token {request.token_id}")
        if refusal := record.refusal(now):
            raise EnrollmentRefused(refusal)
        if request.mesh != self._mesh:
            raise EnrollmentRefused(f"this coordinator serves mesh {self._mesh!r}, not {request.mesh!r}")
        token = token_for(self._ca.token_key, request.token_id)
        check_mac(request_mac(token.secret, request.mesh, request.token_id, request.agent_id, request.csr_pem),
                  request.mac, "the request")
        if (named := pki.csr_name(request.csr_pem)) != request.agent_id:
            raise InvalidInput(f"the csr names {named!r}, not agent {request.agent_id!r}")
        if request.agent_id == pki.COORDINATOR_NAME:
            raise InvalidInput(f"an agent cannot be called {pki.COORDINATOR_NAME!r}")
        cert_pem = self._ca.issue(request.csr_pem, pki.random_serial(), now, CERT_VALID_S)
        info = pki.cert_info(cert_pem)
        self._store.add_certificate(info.serial, request.agent_id, request.token_id, now, info.not_after)
        log.info("enrolled agent %s with token %s", request.agent_id, request.token_id)
        return EnrollReply(cert_pem, self._ca.cert_pem,
                           reply_mac(token.secret, request.mac, cert_pem, self._ca.cert_pem))


class EnrollService(pb_grpc.EnrollServicer):
    """The plaintext endpoint an agent calls once, with its join token, for its certificate. An address that
    keeps presenting bad tokens waits (RESOURCE_EXHAUSTED) before it may try again."""

    def __init__(self, enroller: Enroller, on_enrolled: Callable[[str], None] = lambda agent_id: None,
                 clock: Callable[[], float] = time.time) -> None:
        self._enroller = enroller
        self._on_enrolled = on_enrolled
        self._clock = clock
        self._throttle = FailureThrottle(max_failures=10)

    async def Join(self, request: pb.EnrollRequest, context: grpc.aio.ServicerContext) -> pb.EnrollReply:
        address = context.peer().rsplit(":", 1)[0]      # "ipv4:10.0.0.5:41234" -> the host, not the port
        if (wait_s := self._throttle.wait_s(address, self._clock())) > 0:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"too many refused enrollments from this address; try again in {wait_s:.0f} s")
        try:
            parsed = convert.enroll_request_from_pb(request)
            reply = self._enroller.join(parsed)
        except EnrollmentRefused as exc:
            log.warning("refused an enrollment from %s: %s", context.peer(), exc)
            self._throttle.failed(address, self._clock())
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except InvalidInput as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._on_enrolled(parsed.agent_id)
        return convert.enroll_reply_to_pb(reply)


def default_pki_dir(db: str) -> str:
    """Where a coordinator keeps its CA when not told: beside its registry file."""
    return f"{db}.pki"


def open_enroller(db: str, pki_dir: str, mesh: str, clock: Callable[[], float]) -> tuple[Enroller, RegistryStore]:
    """An Enroller over a coordinator's files, for `stratamesh token` and the launcher; close the registry."""
    registry = open_registry(db)
    return Enroller(CredentialStore(registry), MeshCa.load_or_create(pki_dir, mesh, clock()), mesh, clock), registry


def parse_duration(text: str) -> float | None:
    """'90s', '30m', '24h', '7d' -> seconds; 'never' -> None."""
    if text == "never":
        return None
    match = _DURATION.match(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise InvalidInput(f"a duration looks like 90s, 30m, 24h, 7d or never; got {text!r}")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


class UnknownAgentCertificate(MeshError, LookupError):
    """The mesh's CA never issued a certificate to this agent."""


class Revoker:
    """Revokes agents' certificates and hands the whole revoked list to whoever must refuse them."""

    def __init__(self, store: CredentialStore, clock: Callable[[], float],
                 publish: Callable[[frozenset[str]], None]) -> None:
        self._store = store
        self._clock = clock
        self._publish = publish     # sets this process's list and sends it to every connected agent

    def current(self) -> frozenset[str]:
        return frozenset(self._store.revoked_serials(self._clock()))

    def revoke_agent(self, agent_id: str) -> list[str]:
        """Revokes every certificate of agent_id; its calls in flight are cut, its reconnects refused."""
        if not self._store.certificates(agent_id):
            raise UnknownAgentCertificate(f"no certificate was issued to agent {agent_id!r}")
        serials = self._store.revoke_agent(agent_id, self._clock())
        self._publish(self.current())
        log.warning("revoked agent %s (certificates %s)", agent_id, ", ".join(serials) or "already revoked")
        return serials
