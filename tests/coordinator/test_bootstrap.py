"""The bootstrap credentials `stratamesh up` hands out: kept across coordinator starts while they work, replaced
one by one when they do not; and the coordinator's files on disk are its owner's only."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from stratamesh.coordinator.access import AccessStore
from stratamesh.coordinator.bootstrap import (JOIN_TOKEN_TTL_S, Bootstrap, read_bootstrap, renew_bootstrap,
                                              write_bootstrap)
from stratamesh.coordinator.credentials import CredentialStore
from stratamesh.coordinator.enrollment import Enroller, MeshCa
from stratamesh.coordinator.registry import Registry
from stratamesh.fleet.enrollment import parse_token

NOW = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def mesh(tmp_path: Path) -> tuple[Enroller, AccessStore, Clock]:
    registry, clock = Registry(":memory:"), Clock()
    enroller = Enroller(CredentialStore(registry), MeshCa.load_or_create(tmp_path / "pki", "m", NOW), "m", clock)
    return enroller, AccessStore(registry), clock


def works(bootstrap: Bootstrap, enroller: Enroller, access: AccessStore, now: float) -> bool:
    return (not enroller.refusal(parse_token(bootstrap.join_token))
            and access.check_key(bootstrap.api_key, now).role == "operator"
            and access.check_login(bootstrap.admin_user, bootstrap.admin_password).role == "operator")


def test_a_second_start_keeps_every_credential_that_works(mesh: tuple[Enroller, AccessStore, Clock]) -> None:
    enroller, access, clock = mesh
    first = renew_bootstrap(None, enroller, access, NOW)
    assert works(first, enroller, access, NOW) and first.admin_user == "admin"
    clock.now = NOW + 3600
    assert renew_bootstrap(first, enroller, access, clock.now) == first
    assert len(access.keys()) == 1 and len(enroller.tokens()) == 1, "nothing new was made"


def test_only_what_stopped_working_is_replaced(mesh: tuple[Enroller, AccessStore, Clock]) -> None:
    enroller, access, clock = mesh
    first = renew_bootstrap(None, enroller, access, NOW)
    clock.now = NOW + JOIN_TOKEN_TTL_S + 1                 # the token expired; key and login never do
    second = renew_bootstrap(first, enroller, access, clock.now)
    assert second.join_token != first.join_token
    assert (second.api_key, second.admin_password) == (first.api_key, first.admin_password)
    access.revoke_key(first.api_key.split("-")[2], clock.now)
    access.add_user("admin", "an operator's own choice", "operator", clock.now)
    third = renew_bootstrap(second, enroller, access, clock.now)
    assert third.join_token == second.join_token
    assert third.api_key != first.api_key and third.admin_password != first.admin_password
    assert works(third, enroller, access, clock.now)


def test_credentials_of_another_registry_are_not_taken(mesh: tuple[Enroller, AccessStore, Clock],
                                                       tmp_path: Path) -> None:
    enroller, access, _ = mesh
    other_registry = Registry(":memory:")
    other_ca = MeshCa.load_or_create(tmp_path / "other-pki", "m", NOW)
    other = renew_bootstrap(None, Enroller(CredentialStore(other_registry), other_ca, "m", Clock()),
                            AccessStore(other_registry), NOW)
    ours = renew_bootstrap(other, enroller, access, NOW)
    assert {ours.join_token, ours.api_key, ours.admin_password}.isdisjoint(
        {other.join_token, other.api_key, other.admin_password})
    assert works(ours, enroller, access, NOW)


def test_the_file_is_0600_and_a_broken_one_is_replaced(mesh: tuple[Enroller, AccessStore, Clock], tmp_path: Path,
                                                       open_umask: None) -> None:
    enroller, access, _ = mesh
    path = tmp_path / "bootstrap.json"
    path.write_text("{not json")
    assert read_bootstrap(path) is None and read_bootstrap(tmp_path / "none.json") is None
    written = write_bootstrap(path, enroller, access, NOW)
    assert mode(path) == 0o600 and json.loads(path.read_text())["api_key"] == written.api_key
    assert write_bootstrap(path, enroller, access, NOW) == written


def test_the_registry_and_the_ca_are_the_owners_only(tmp_path: Path, open_umask: None) -> None:
    db = tmp_path / "registry.db"
    registry = Registry(str(db))
    AccessStore(registry).create_key("operator", "k", NOW)    # a write: SQLite makes its -wal and -shm files now
    companions = [p for p in (tmp_path / "registry.db-wal", tmp_path / "registry.db-shm") if p.exists()]
    assert companions, "WAL mode keeps these beside the database while it is open"
    assert [mode(p) for p in (db, *companions)] == [0o600] * (1 + len(companions))
    registry.close()
    with sqlite3.connect(db) as again:
        assert again.execute("SELECT count(*) FROM api_keys").fetchone() == (1,)
    MeshCa.load_or_create(tmp_path / "registry.db.pki", "m", NOW)
    pki_dir = tmp_path / "registry.db.pki"
    assert mode(pki_dir) == 0o700
    assert {p.name: mode(p) for p in pki_dir.iterdir()} == {"ca.key": 0o600, "ca.pem": 0o600, "token.key": 0o600}
