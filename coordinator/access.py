"""Who may call the HTTP API: API keys (stored hashed), admin users (scrypt passwords) and their login sessions.

Roles are ordered: a "client" calls /v1; a "viewer" also reads /admin/api; an "operator" also acts there
(deploy, re-plan, drain, revoke). Time is a parameter; the tables live in the registry's SQLite database.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from stratamesh.coordinator.registry_store import SqlTables
from stratamesh.fleet.errors import InvalidInput

ROLES = ("client", "viewer", "operator")
USER_ROLES = ("viewer", "operator")
KEY_PREFIX = "sk-sm"
_KEY = re.compile(rf"^{KEY_PREFIX}-([0-9a-f]{{8}})-([A-Za-z0-9_-]{{32,64}})$")
_USERNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
SESSION_TTL_S = 12 * 3600
MIN_PASSWORD_CHARS = 8
MAX_PASSWORD_CHARS = 1024
_SCRYPT = {"n": 2 ** 14, "r": 8, "p": 1}     # about 30 ms a check: cheap for a login, dear for a guesser


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request comes from, and what it may do."""

    name: str
    role: str
    kind: str            # "key" | "user" | "insecure"

    def may(self, role: str) -> bool:
        return ROLES.index(self.role) >= ROLES.index(role)


@dataclass(frozen=True, slots=True)
class ApiKeyRecord:
    key_id: str
    role: str
    name: str
    created: float
    expires: float       # 0: never
    revoked: float       # 0: not revoked


class AccessStore:
    """Creates, checks and revokes API keys, admin users and login sessions."""

    def __init__(self, registry: SqlTables) -> None:
        self._registry = registry

    # ------------------------------------------------------------ API keys
    def create_key(self, role: str, name: str, now: float, ttl_s: float | None = None) -> tuple[str, ApiKeyRecord]:
        """A new key; the text is shown once and only its SHA-256 is kept (keys are random, so no slow hash)."""
        _check_role(role, ROLES)
        key_id, secret = secrets.token_hex(4), secrets.token_urlsafe(32)
        record = ApiKeyRecord(key_id, role, name[:200], now, now + ttl_s if ttl_s else 0.0, 0.0)
        with self._registry.transaction() as db:
            db["api_keys"].insert({**_fields(record), "secret_sha256": _sha256(secret)})
        return f"{KEY_PREFIX}-{key_id}-{secret}", record

    def keys(self) -> list[ApiKeyRecord]:
        rows = self._registry.query("SELECT * FROM api_keys ORDER BY created")
        return [ApiKeyRecord(**{k: v for k, v in r.items() if k != "secret_sha256"}) for r in rows]

    def revoke_key(self, key_id: str, now: float) -> None:
        with self._registry.transaction() as db:
            if db.execute("UPDATE api_keys SET revoked = ? WHERE key_id = ? AND revoked = 0",
                          [now, key_id]).rowcount == 0 and not self._key_rows(key_id):
                raise InvalidInput(f"unknown API key {key_id!r}")

    def check_key(self, text: str, now: float) -> Principal | None:
        """The principal of a valid, unexpired, unrevoked key; None for anything else."""
        match = _KEY.match(text)
        rows = self._key_rows(match.group(1)) if match else []
        if not rows or not hmac.compare_digest(rows[0]["secret_sha256"], _sha256(match.group(2))):
            return None
        row = rows[0]
        if row["revoked"] or (row["expires"] and now >= row["expires"]):
            return None
        return Principal(f"key {row['key_id']} ({row['name']})" if row["name"] else f"key {row['key_id']}",
                         row["role"], "key")

    def _key_rows(self, key_id: str) -> list[dict]:
        return self._registry.query("SELECT * FROM api_keys WHERE key_id = ?", [key_id])

    # ------------------------------------------------------------ users and sessions
    def add_user(self, username: str, password: str, role: str, now: float) -> None:
        """Adds an admin user, or sets an existing one's password and role."""
        if not isinstance(username, str) or not _USERNAME.match(username):
            raise InvalidInput("a username is 1-64 letters, digits, '.', '_', '@' or '-'")
        _check_role(role, USER_ROLES)
        if not MIN_PASSWORD_CHARS <= len(password) <= MAX_PASSWORD_CHARS:
            raise InvalidInput(f"a password has {MIN_PASSWORD_CHARS}..{MAX_PASSWORD_CHARS} characters")
        with self._registry.transaction() as db:
            db["users"].upsert({"username": username, "password_hash": hash_password(password), "role": role,
                                "created": now}, pk="username")
            db.execute("DELETE FROM sessions WHERE username = ?", [username])   # a new password logs out

    def remove_user(self, username: str) -> None:
        with self._registry.transaction() as db:
            if db.execute("DELETE FROM users WHERE username = ?", [username]).rowcount == 0:
                raise InvalidInput(f"unknown user {username!r}")
            db.execute("DELETE FROM sessions WHERE username = ?", [username])

    def users(self) -> list[tuple[str, str]]:
        """(username, role) of every admin user."""
        return [(r["username"], r["role"]) for r in self._registry.query(
            "SELECT username, role FROM users ORDER BY username")]

    def check_login(self, username: str, password: str) -> Principal | None:
        """The user, if the password is theirs; None otherwise (the same time either way)."""
        rows = self._registry.query("SELECT * FROM users WHERE username = ?", [username])
        stored = rows[0]["password_hash"] if rows else _DUMMY_HASH   # an unknown name costs one scrypt too
        if not (verify_password(password, stored) and rows):
            return None
        return Principal(username, rows[0]["role"], "user")

    def login(self, username: str, password: str, now: float) -> str | None:
        """A new session token for the right password, None otherwise (the same time either way)."""
        if self.check_login(username, password) is None:
            return None
        token = secrets.token_urlsafe(32)
        with self._registry.transaction() as db:
            db.execute("DELETE FROM sessions WHERE expires <= ?", [now])
            db["sessions"].insert({"token_sha256": _sha256(token), "username": username, "created": now,
                                   "expires": now + SESSION_TTL_S})
        return token

    def check_session(self, token: str, now: float) -> Principal | None:
        rows = self._registry.query(
            "SELECT s.username, u.role FROM sessions s JOIN users u ON u.username = s.username "
            "WHERE s.token_sha256 = ? AND s.expires > ?", [_sha256(token), now])
        return Principal(rows[0]["username"], rows[0]["role"], "user") if rows else None

    def logout(self, token: str) -> None:
        with self._registry.transaction() as db:
            db.execute("DELETE FROM sessions WHERE token_sha256 = ?", [_sha256(token)])


def hash_password(password: str) -> str:
    salt = secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, dklen=32, **_SCRYPT)
    return f"scrypt${_SCRYPT['n']}${_SCRYPT['r']}${_SCRYPT['p']}${salt.hex()}${digest.hex()}"


def verify_password(password: str, stored: str) -> bool:
    try:
        scheme, n, r, p, salt, digest = stored.split("$")
        got = hashlib.scrypt(password.encode(), salt=bytes.fromhex(salt), n=int(n), r=int(r), p=int(p), dklen=32)
    except ValueError:
        return False
    return scheme == "scrypt" and hmac.compare_digest(got.hex(), digest)


_DUMMY_HASH = hash_password("not a password anyone has")


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _check_role(role: str, allowed: tuple[str, ...]) -> None:
    if role not in allowed:
        raise InvalidInput(f"role must be one of {', '.join(allowed)}; got {role!r}")


def _fields(record: ApiKeyRecord) -> dict:
    return {name: getattr(record, name) for name in ApiKeyRecord.__slots__}
