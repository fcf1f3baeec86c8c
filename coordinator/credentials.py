"""Join tokens and issued certificates in the registry's SQLite database."""

from __future__ import annotations

from dataclasses import dataclass

from stratamesh.coordinator.registry_store import SqlTables
from stratamesh.fleet.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class TokenRecord:
    """A join token as stored: its id and life, never its secret."""

    token_id: str
    created: float
    expires: float       # 0: never
    revoked: float       # 0: not revoked
    description: str
    num_uses: int

    def refusal(self, now: float) -> str:
        """Why this token cannot enroll an agent now, or "" if it can."""
        if self.revoked:
            return f"join token {self.token_id} was revoked"
        if self.expires and now >= self.expires:
            return f"join token {self.token_id} expired"
        return ""


@dataclass(frozen=True, slots=True)
class CertRecord:
    """A certificate the mesh's CA issued."""

    serial: str
    agent_id: str
    token_id: str
    issued: float
    expires: float
    revoked: float


class CredentialStore:
    """Tokens and certificates: create, look up, revoke. Time is a parameter."""

    def __init__(self, registry: SqlTables) -> None:
        self._registry = registry

    def add_token(self, token_id: str, now: float, ttl_s: float | None, description: str = "") -> TokenRecord:
        """A new token valid for ttl_s seconds (None: until revoked)."""
        if ttl_s is not None and ttl_s <= 0:
            raise InvalidInput(f"a token's lifetime must be positive, got {ttl_s} s")
        row = {"token_id": token_id, "created": now, "expires": now + ttl_s if ttl_s else 0.0,
               "revoked": 0.0, "description": description, "num_uses": 0}
        with self._registry.transaction() as db:
            db["join_tokens"].insert(row)
        return TokenRecord(**row)

    def token(self, token_id: str) -> TokenRecord | None:
        rows = self._registry.query("SELECT * FROM join_tokens WHERE token_id = ?", [token_id])
        return TokenRecord(**rows[0]) if rows else None

    def tokens(self) -> list[TokenRecord]:
        return [TokenRecord(**r) for r in self._registry.query("SELECT * FROM join_tokens ORDER BY created")]

    def revoke_token(self, token_id: str, now: float) -> None:
        """Revokes a token: no agent enrolls with it again. Certificates it already got stay valid."""
        with self._registry.transaction() as db:
            if db.execute("UPDATE join_tokens SET revoked = ? WHERE token_id = ? AND revoked = 0",
                          [now, token_id]).rowcount == 0 and self.token(token_id) is None:
                raise InvalidInput(f"unknown join token {token_id!r}")

    def add_certificate(self, serial: str, agent_id: str, token_id: str, issued: float, expires: float) -> None:
        """Records a certificate issued with a token, and counts the token's use."""
        with self._registry.transaction() as db:
            db["certificates"].insert({"serial": serial, "agent_id": agent_id, "token_id": token_id,
                                       "issued": issued, "expires": expires, "revoked": 0.0})
            db.execute("UPDATE join_tokens SET num_uses = num_uses + 1 WHERE token_id = ?", [token_id])

    def certificates(self, agent_id: str | None = None) -> list[CertRecord]:
        where, args = ("WHERE agent_id = ?", [agent_id]) if agent_id is not None else ("", [])
        rows = self._registry.query(f"SELECT * FROM certificates {where} ORDER BY issued", args)
        return [CertRecord(**r) for r in rows]

    def revoke_agent(self, agent_id: str, now: float) -> list[str]:
        """Revokes every certificate of an agent; returns the serials newly revoked."""
        serials = [c.serial for c in self.certificates(agent_id) if not c.revoked]
        with self._registry.transaction() as db:
            db.execute("UPDATE certificates SET revoked = ? WHERE agent_id = ? AND revoked = 0", [now, agent_id])
        return serials

    def revoked_serials(self, now: float) -> set[str]:
        """Serials revoked and not yet expired: the list every peer must refuse (an expired one fails TLS)."""
        rows = self._registry.query("SELECT serial FROM certificates WHERE revoked > 0 AND expires > ?", [now])
        return {r["serial"] for r in rows}
