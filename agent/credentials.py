"""An agent's mesh identity: its key and certificate on disk, and the enrollment that obtains them."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from stratamesh.fleet import pki
from stratamesh.fleet.errors import InvalidInput, MeshError, Refused
from stratamesh.fleet.state import make_private_dir, state_home, write_private
from stratamesh.fleet.wire.channels import MeshTls
from stratamesh.fleet.wire.enroll import enroll

__all__ = ["NotEnrolled", "default_state_dir", "enroll", "load_credentials", "obtain_credentials",
           "read_join_token", "save_credentials", "stored_agent_id"]

log = logging.getLogger(__name__)
# An agent that cannot reach the coordinator to enroll tries again, waiting ENROLL_RETRY_S and then twice as long each
# time (at most ENROLL_RETRY_MAX_S), for ENROLL_PATIENCE_S in all
ENROLL_PATIENCE_S, ENROLL_RETRY_S, ENROLL_RETRY_MAX_S = 120.0, 0.5, 8.0

_FILES = ("key.pem", "cert.pem", "ca.pem")


class NotEnrolled(Refused):
    """The agent holds no usable mesh certificate and was given no join token to get one."""


def default_state_dir(mesh: str) -> str:
    """agent-<mesh> in the per-user state folder (fleet/state.py)."""
    return str(state_home(os.environ) / f"agent-{mesh}")


def stored_agent_id(state_dir: str) -> str:
    """The agent id in the certificate kept in state_dir, or "" if there is none."""
    path = Path(state_dir, "cert.pem")
    try:
        return pki.cert_info(path.read_bytes()).name
    except (OSError, InvalidInput):
        return ""


def load_credentials(state_dir: str, agent_id: str, now: float) -> MeshTls | None:
    """The credentials in state_dir if they are whole, ours, signed by their CA and unexpired; else None."""
    try:
        key_pem, cert_pem, ca_pem = (Path(state_dir, name).read_bytes() for name in _FILES)
        info = pki.cert_info(cert_pem)
    except (OSError, InvalidInput):
        return None
    problems = [why for bad, why in (
        (info.name != agent_id, f"it names {info.name!r}, not {agent_id!r}"),
        (info.not_after <= now, "it expired"),
        (not pki.signed_by(cert_pem, ca_pem), "its CA did not sign it"),
        (not pki.key_matches(key_pem, cert_pem), "the key is not its key"))
        if bad]
    if problems:
        log.warning("not using the certificate in %s: %s", state_dir, "; ".join(problems))
        return None
    return MeshTls(ca_pem, cert_pem, key_pem)


def save_credentials(state_dir: str, tls: MeshTls) -> None:
    """Writes key, certificate and CA into state_dir: files 0600 in a folder 0700."""
    directory = make_private_dir(state_dir)
    for name, data in zip(_FILES, (tls.key_pem, tls.cert_pem, tls.ca_pem)):
        write_private(directory / name, data)


async def obtain_credentials(state_dir: str, agent_id: str, mesh: str, join_token: str,
                             find_enroll_address: Callable[[], Awaitable[str]], join_token_file: str = "") -> MeshTls:
    """The credentials kept in state_dir, or new ones from enrolling with join_token (then kept there); without
    join_token, with the one in join_token_file, read once the coordinator is found (see read_join_token)."""
    tls = load_credentials(state_dir, agent_id, time.time())
    if tls is not None:
        return tls
    if not join_token and not join_token_file:
        raise NotEnrolled(f"agent {agent_id} holds no mesh certificate in {state_dir}: start it with "
                          "--join-token (from `stratamesh token create` on the coordinator), or run the "
                          "whole mesh with --insecure for development")
    tls = await _enrolled(agent_id, mesh, join_token, join_token_file, find_enroll_address)
    save_credentials(state_dir, tls)
    log.info("enrolled in mesh %s as %s; certificate kept in %s", mesh, agent_id, state_dir)
    return tls


async def _enrolled(agent_id: str, mesh: str, join_token: str, join_token_file: str,
                    find_enroll_address: Callable[[], Awaitable[str]]) -> MeshTls:
    """Enrolls, trying again (the coordinator found anew each time) while the coordinator cannot answer (starting,
    restarting, too busy to answer within the call's deadline), for up to ENROLL_PATIENCE_S; a refusal is final."""
    deadline, delay = time.monotonic() + ENROLL_PATIENCE_S, ENROLL_RETRY_S
    while True:
        address = await find_enroll_address()
        try:
            return await enroll(address, join_token or read_join_token(join_token_file), mesh, agent_id)
        except Refused:
            raise
        except MeshError as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("%s; trying again in %.1f s", exc, delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, ENROLL_RETRY_MAX_S)


def read_join_token(path: str) -> str:
    """The join token in the file at path: its text, or the join_token of a coordinator's bootstrap file (JSON; see
    `stratamesh coordinator --bootstrap-file`). Read when the agent enrolls, after it found the coordinator: a
    coordinator started beside the agent writes its bootstrap file before it can be found."""
    try:
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise NotEnrolled(f"cannot read the join token file {path}: {exc.strerror or exc}") from exc
    if not text.startswith("{"):
        return text
    try:
        token = json.loads(text).get("join_token")
    except (ValueError, AttributeError):
        token = None
    if not isinstance(token, str):
        raise NotEnrolled(f"the join token file {path} is JSON without a join_token")
    return token
