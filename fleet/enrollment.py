"""Join tokens and the proofs of an enrollment. Pure: no files, no sockets, no clock.

An agent's first contact with the coordinator happens before it holds a certificate, so it travels over
plaintext. The join token's secret never does: the request carries an HMAC of what the agent asks for
(its name and signing request) keyed by the secret, and the reply an HMAC of the certificate and CA it
returns. An eavesdropper learns only public keys and certificates; someone in the middle can neither
obtain a certificate for a key of their own nor hand the agent a CA of their own.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from stratamesh.fleet.errors import InvalidInput, Refused

TOKEN_PREFIX = "smj1"
_TOKEN = re.compile(rf"^{TOKEN_PREFIX}\.([0-9a-f]{{8}})\.([0-9a-f]{{32}})$")


class EnrollmentRefused(Refused):
    """The coordinator would not issue a certificate: no such token, an expired or revoked one, a bad proof."""


@dataclass(frozen=True, slots=True)
class JoinToken:
    """A join token: a public id the coordinator looks up, and a secret both sides derive proofs from."""

    token_id: str
    secret: str

    def __str__(self) -> str:
        return f"{TOKEN_PREFIX}.{self.token_id}.{self.secret}"


def new_token_id() -> str:
    return secrets.token_hex(4)


def token_for(token_key: bytes, token_id: str) -> JoinToken:
    """The token with this id: its secret is derived from the coordinator's token key, so no secret is stored."""
    digest = hmac.new(token_key, f"join-token|{token_id}".encode(), hashlib.sha256).hexdigest()
    return JoinToken(token_id, digest[:32])


def parse_token(text: str) -> JoinToken:
    """A token as `stratamesh token create` prints it; InvalidInput names what is wrong."""
    match = _TOKEN.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise InvalidInput(f"a join token looks like {TOKEN_PREFIX}.<8 hex>.<32 hex>; got {_redact(text)!r}")
    return JoinToken(*match.groups())


def request_mac(secret: str, mesh: str, token_id: str, agent_id: str, csr_pem: bytes) -> bytes:
    """The agent's proof that it holds the token, bound to the name and key it asks a certificate for."""
    return _mac(secret, b"enroll-request", mesh.encode(), token_id.encode(), agent_id.encode(), csr_pem)


def reply_mac(secret: str, request: bytes, cert_pem: bytes, ca_pem: bytes) -> bytes:
    """The coordinator's proof that it holds the token too, bound to the request it answers."""
    return _mac(secret, b"enroll-reply", request, cert_pem, ca_pem)


def check_mac(expected: bytes, got: bytes, what: str) -> None:
    if not hmac.compare_digest(expected, got):
        raise EnrollmentRefused(f"{what} does not prove knowledge of the join token's secret")


def _mac(secret: str, *fields: bytes) -> bytes:
    # Length-prefixed, so no two different field lists hash the same bytes.
    message = b"".join(len(f).to_bytes(4, "big") + f for f in fields)
    return hmac.new(secret.encode(), message, hashlib.sha256).digest()


def _redact(text: object) -> str:
    """Enough of a bad token to recognise it in a log, never its secret."""
    return f"{str(text)[:13]}..." if isinstance(text, str) and len(text) > 13 else str(text)


@dataclass(frozen=True, slots=True)
class EnrollRequest:
    """An agent asks for a certificate for agent_id, proving it holds the token token_id."""

    mesh: str
    token_id: str
    agent_id: str
    csr_pem: bytes
    mac: bytes


@dataclass(frozen=True, slots=True)
class EnrollReply:
    """The certificate issued, the mesh's CA, and the coordinator's proof."""

    cert_pem: bytes
    ca_pem: bytes
    mac: bytes
