"""What a launcher on the coordinator's box (`stratamesh up`) hands its user without a command per credential: a
join token, an operator API key and an operator's admin UI login, in one JSON file readable by its owner only.

The file outlives the coordinator: started again over the same registry, it keeps every credential in the file that
still works and makes afresh only the ones that do not (an expired token, a revoked key, a changed password).
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

from stratamesh.coordinator.access import AccessStore, Principal
from stratamesh.coordinator.enrollment import Enroller
from stratamesh.fleet.enrollment import parse_token
from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.state import write_private

log = logging.getLogger(__name__)

BOOTSTRAP_ADMIN = "admin"
JOIN_TOKEN_TTL_S = 24 * 3600


@dataclass(frozen=True, slots=True)
class Bootstrap:
    join_token: str
    api_key: str
    admin_user: str
    admin_password: str


def read_bootstrap(path: str | Path) -> Bootstrap | None:
    """The credentials in the file, or None if there is none (or it is not one of ours)."""
    try:
        return Bootstrap(**json.loads(Path(path).read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        log.warning("ignoring the bootstrap file %s: %s", path, exc)
        return None


def renew_bootstrap(kept: Bootstrap | None, enroller: Enroller, access: AccessStore, now: float) -> Bootstrap:
    """kept's credentials where they still work; new ones (a token for 24 h, an operator key, admin's password)
    for the rest."""
    kept = kept or Bootstrap("", "", BOOTSTRAP_ADMIN, "")
    token = kept.join_token if _token_works(enroller, kept.join_token) else ""
    if not token:
        token = str(enroller.create_token(JOIN_TOKEN_TTL_S, "bootstrap")[0])
    key = kept.api_key if _operator(access.check_key(kept.api_key, now)) else ""
    if not key:
        key = access.create_key("operator", "bootstrap", now)[0]
    user, password = kept.admin_user, kept.admin_password
    if not (password and _operator(access.check_login(user, password))):
        user, password = BOOTSTRAP_ADMIN, secrets.token_urlsafe(12)
        access.add_user(user, password, "operator", now)
    renewed = Bootstrap(token, key, user, password)
    made = [name for name, old, new in zip(("join token", "API key", "admin login"), _fields(kept), _fields(renewed))
            if old != new]
    log.info("bootstrap credentials: %s", f"new {', '.join(made)}" if made else "all kept")
    return renewed


def write_bootstrap(path: str | Path, enroller: Enroller, access: AccessStore, now: float) -> Bootstrap:
    """Renews the credentials in the file (creating it), mode 0600; returns them."""
    bootstrap = renew_bootstrap(read_bootstrap(path), enroller, access, now)
    write_private(path, json.dumps(asdict(bootstrap)).encode())
    return bootstrap


def _token_works(enroller: Enroller, text: str) -> bool:
    try:
        return not enroller.refusal(parse_token(text))
    except InvalidInput:
        return False


def _operator(principal: Principal | None) -> bool:
    return principal is not None and principal.role == "operator"


def _fields(bootstrap: Bootstrap) -> tuple[str, str, tuple[str, str]]:
    return bootstrap.join_token, bootstrap.api_key, (bootstrap.admin_user, bootstrap.admin_password)
