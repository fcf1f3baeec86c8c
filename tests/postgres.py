"""A real PostgreSQL server for the tests that need one: Debian's `postgresql` binaries, a cluster made with initdb
in a temporary folder, listening on 127.0.0.1 on a free port and on a socket in that folder, stopped at the end.

Where it cannot start (no binaries, initdb or the server failing) the tests that need it skip, saying why. As root
(this project's CI) the cluster is made and run as the `postgres` user the package creates: PostgreSQL refuses to
run as root."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from stratamesh.testbed.databases import scratch_database

DATABASE = "stratamesh"


def _bin_dir() -> Path | None:
    """The newest installed PostgreSQL's bin folder (Debian keeps one per major version), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parent.parent.name))
    return Path(found[-1]).parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_owner(argv: list[str], owner: str | None) -> list[str]:
    return ["runuser", "-u", owner, "--", *argv] if owner else argv


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """postgresql://... of a database on a server this session started (the test skips where it cannot start)."""
    bin_dir = _bin_dir()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (Debian's postgresql package: `make test` installs it)")
    owner = None
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root with no postgres user to run PostgreSQL as")
        owner = "postgres"
    # (not under pytest's temporary folders: their parents let only this user in, and the server runs as postgres)
    folder = Path(tempfile.mkdtemp(prefix="stratamesh-postgres-"))
    data, port = folder / "data", _free_port()
    if owner:
        shutil.chown(folder, owner)
    try:
        yield from _serve(bin_dir, folder, data, port, owner)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _serve(bin_dir: Path, folder: Path, data: Path, port: int, owner: str | None) -> Iterator[str]:
    made = subprocess.run(_as_owner([str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust",
                                     "--no-sync"], owner), capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"initdb failed: {made.stderr.strip()[-300:]}")
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {folder} -c fsync=off"
    started = subprocess.run(_as_owner([str(bin_dir / "pg_ctl"), "-D", str(data), "-o", options, "-l",
                                        str(folder / "server.log"), "-w", "-t", "60", "start"], owner),
                             capture_output=True, text=True)
    if started.returncode != 0:
        log = (folder / "server.log").read_text(errors="replace") if (folder / "server.log").exists() else ""
        pytest.skip(f"PostgreSQL did not start: {(started.stderr + log).strip()[-300:]}")
    try:
        subprocess.run(_as_owner([str(bin_dir / "createdb"), "-h", str(folder), "-p", str(port), "-U", "postgres",
                                  DATABASE], owner), check=True, capture_output=True)
        yield f"postgresql://postgres@127.0.0.1:{port}/{DATABASE}"
    finally:
        subprocess.run(_as_owner([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"], owner),
                       capture_output=True)


@pytest.fixture
def postgres_database(postgres_url: str) -> Iterator[str]:
    """postgresql://... of a database of one test's own on the session's server, dropped after it."""
    pytest.importorskip("psycopg")
    with scratch_database(postgres_url, "test") as url:
        yield url
