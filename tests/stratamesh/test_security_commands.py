"""`stratamesh token|key|user` as a user runs them (a real process): which registry they find, and that they make
none unless told to."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest


def stratamesh(*args: str, cwd: Path, env: dict[str, str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stratamesh.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env, input=stdin)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A user whose state folder is in tmp_path and who has never run `stratamesh up`."""
    clean = {k: v for k, v in os.environ.items() if k not in ("STRATAMESH_DB", "XDG_STATE_HOME")}
    return {**clean, "STRATAMESH_HOME": str(tmp_path / "home")}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("command", [["key", "create"], ["key", "list"], ["token", "create"], ["user", "list"],
                                     ["user", "add", "ada", "--password-stdin"]])
def test_without_a_registry_a_command_refuses_and_creates_nothing(command: list[str], tmp_path: Path,
                                                                  env: dict[str, str]) -> None:
    work = tmp_path / "work"
    work.mkdir()
    result = stratamesh(*command, cwd=work, env=env, stdin="a long password\n")
    expected = tmp_path / "home" / "up" / "registry.db"
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"stratamesh {command[0]}: no registry at {expected} (`stratamesh up`'s registry); start the mesh first, "
        "point --db or $STRATAMESH_DB at its registry, or add --create to make a new one there"]
    assert list(tmp_path.iterdir()) == [work] and list(work.iterdir()) == [], "no registry, CA or folder was made"


def test_an_explicit_db_or_stratamesh_db_that_is_missing_is_refused(tmp_path: Path, env: dict[str, str]) -> None:
    missing = tmp_path / "mesh.db"
    flag = stratamesh("key", "create", "--db", str(missing), cwd=tmp_path, env=env)
    assert flag.returncode == 1 and f"no registry at {missing} (--db)" in flag.stderr
    variable = stratamesh("token", "list", cwd=tmp_path, env={**env, "STRATAMESH_DB": str(missing)})
    assert variable.returncode == 1 and f"no registry at {missing} ($STRATAMESH_DB)" in variable.stderr
    assert not missing.exists() and not Path(f"{missing}.pki").exists()


def test_create_makes_a_private_registry_the_other_commands_then_find(tmp_path: Path, env: dict[str, str]) -> None:
    old_umask = os.umask(0)        # the modes below are set by stratamesh, not left to the umask
    try:
        made = stratamesh("token", "create", "--create", "--mesh", "m", cwd=tmp_path, env=env)
    finally:
        os.umask(old_umask)
    assert made.returncode == 0 and made.stdout.startswith("smj1."), made.stderr
    up = tmp_path / "home" / "up"
    assert (mode(tmp_path / "home"), mode(up), mode(up / "registry.db")) == (0o700, 0o700, 0o600)
    assert mode(up / "registry.db.pki") == 0o700
    assert {mode(p) for p in (up / "registry.db.pki").iterdir()} == {0o600}
    key = stratamesh("key", "create", "--role", "viewer", "--name", "dash", cwd=tmp_path, env=env)   # no --db
    assert key.returncode == 0 and key.stdout.startswith("sk-sm-"), key.stderr
    listed = stratamesh("key", "list", cwd=tmp_path, env={**env, "STRATAMESH_DB": str(up / "registry.db"),
                                                          "STRATAMESH_HOME": str(tmp_path / "elsewhere")})
    assert listed.returncode == 0 and "viewer" in listed.stdout and "dash" in listed.stdout
    own = tmp_path / "own.db"
    user = stratamesh("user", "add", "ada", "--password-stdin", "--db", str(own), "--create", cwd=tmp_path, env=env,
                      stdin="a long password\n")
    assert user.returncode == 0 and mode(own) == 0o600, user.stderr


def test_on_a_postgresql_registry_the_commands_work_on_the_database_and_a_token_needs_the_ca(
        postgres_database: str, tmp_path: Path, env: dict[str, str]) -> None:
    from stratamesh.coordinator.access import AccessStore
    from stratamesh.coordinator.registry_store import open_registry

    made = stratamesh("key", "create", "--role", "viewer", "--name", "ci", cwd=tmp_path,
                      env={**env, "STRATAMESH_DB": postgres_database})
    assert made.returncode == 0 and made.stdout.startswith("sk-sm-"), made.stderr
    no_ca = stratamesh("token", "create", "--db", postgres_database, cwd=tmp_path, env=env)
    assert no_ca.returncode == 1 and "--pki-dir" in no_ca.stderr
    registry = open_registry(postgres_database)
    try:
        assert [(k.role, k.name) for k in AccessStore(registry).keys()] == [("viewer", "ci")]
    finally:
        registry.close()
    assert list(tmp_path.iterdir()) == [], "no registry file was made"
