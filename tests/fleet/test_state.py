"""The per-user state folder and private files: which folder an environment names, and the modes we set."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from stratamesh.fleet.state import (default_registry, make_private_database, make_private_dir, make_private_file,
                                    state_home, up_folder, write_private)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """umask 0: a mode we get is one we set, not one the umask happened to give."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize(("env", "expected"), [
    ({"STRATAMESH_HOME": "/srv/sm", "XDG_STATE_HOME": "/x", "HOME": "/home/u"}, "/srv/sm"),
    ({"STRATAMESH_HOME": "", "XDG_STATE_HOME": "/x/state", "HOME": "/home/u"}, "/x/state/stratamesh"),
    ({"XDG_STATE_HOME": "relative/state", "HOME": "/home/u"}, "/home/u/.local/state/stratamesh"),  # XDG: ignored
    ({"HOME": "/home/u"}, "/home/u/.local/state/stratamesh"),
])
def test_the_state_folder_is_stratamesh_home_then_xdg_then_the_home_folder(env: dict[str, str],
                                                                           expected: str) -> None:
    assert state_home(env) == Path(expected)
    assert up_folder(env) == Path(expected, "up")


@pytest.mark.parametrize(("db", "env", "expected"), [
    ("here.db", {"STRATAMESH_DB": "/env.db", "STRATAMESH_HOME": "/sm"}, "here.db"),
    ("", {"STRATAMESH_DB": "/env.db", "STRATAMESH_HOME": "/sm"}, "/env.db"),
    ("", {"STRATAMESH_DB": "", "STRATAMESH_HOME": "/sm"}, "/sm/up/registry.db"),
    ("", {"HOME": "/home/u"}, "/home/u/.local/state/stratamesh/up/registry.db"),
])
def test_a_command_uses_its_db_flag_then_stratamesh_db_then_the_registry_of_up(db: str, env: dict[str, str],
                                                                                 expected: str) -> None:
    assert default_registry(db, env) == Path(expected)


def test_a_private_folder_and_the_folders_made_for_it_are_0700(tmp_path: Path, open_umask: None) -> None:
    tmp_path.chmod(0o755)
    made = make_private_dir(tmp_path / "state" / "up")
    assert (mode(tmp_path / "state"), mode(made)) == (0o700, 0o700)
    assert mode(tmp_path) == 0o755, "a folder that was there before, above it, is left alone"
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    make_private_dir(loose)
    assert mode(loose) == 0o700, "an existing folder is tightened"


def test_a_private_file_is_created_0600_and_an_existing_one_tightened(tmp_path: Path, open_umask: None) -> None:
    assert mode(make_private_file(tmp_path / "new")) == 0o600
    old = tmp_path / "old"
    old.write_text("kept")
    old.chmod(0o644)
    make_private_file(old)
    assert (mode(old), old.read_text()) == (0o600, "kept")


def test_a_database_and_the_wal_files_left_beside_it_are_made_private(tmp_path: Path, open_umask: None) -> None:
    db = tmp_path / "r.db"
    for path in (db, tmp_path / "r.db-wal", tmp_path / "r.db-shm"):
        path.write_bytes(b"")
        path.chmod(0o644)
    make_private_database(db)
    assert [mode(p) for p in (db, tmp_path / "r.db-wal", tmp_path / "r.db-shm")] == [0o600] * 3
    make_private_database(tmp_path / "fresh.db")
    assert not (tmp_path / "fresh.db-wal").exists(), "no -wal file is made where there was none"


def test_write_private_replaces_a_looser_file_with_a_0600_one(tmp_path: Path, open_umask: None) -> None:
    path = tmp_path / "bootstrap.json"
    path.write_text("old")
    path.chmod(0o644)
    (tmp_path / ".bootstrap.json.tmp").write_text("a crash's leftover")
    (tmp_path / ".bootstrap.json.tmp").chmod(0o666)
    write_private(path, b"new")
    assert (path.read_bytes(), mode(path)) == (b"new", 0o600)
    assert [p.name for p in tmp_path.iterdir()] == ["bootstrap.json"]
