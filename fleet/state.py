"""Where stratamesh keeps its files on this box, and how: secrets in files 0600 inside folders 0700.

The per-user state folder is $STRATAMESH_HOME, else $XDG_STATE_HOME/stratamesh, else ~/.local/state/stratamesh.
`stratamesh up` keeps its mesh in UP_FOLDER there; the credentials commands look for a registry in it. What can be
made again (measured speeds, ONNX exports) goes in the cache folder: $STRATAMESH_CACHE_DIR, else
~/.cache/stratamesh.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path

__all__ = ["CACHE_ENV", "DB_ENV", "HOME_ENV", "UP_FOLDER", "UP_REGISTRY", "cache_home", "default_registry",
           "is_postgres", "make_private_database", "make_private_dir", "make_private_file", "state_home", "up_folder",
           "write_private"]

log = logging.getLogger(__name__)

HOME_ENV = "STRATAMESH_HOME"      # the whole state folder
DB_ENV = "STRATAMESH_DB"          # the registry the credentials commands use when given no --db
CACHE_ENV = "STRATAMESH_CACHE_DIR"   # the whole cache folder
UP_FOLDER = "up"                  # `stratamesh up`'s mesh, inside the state folder
UP_REGISTRY = "registry.db"       # ... its registry, inside that


def state_home(env: Mapping[str, str]) -> Path:
    """The per-user state folder that env names (XDG's base directory rules: a relative XDG path is ignored)."""
    if env.get(HOME_ENV):
        return Path(env[HOME_ENV]).expanduser()
    xdg = env.get("XDG_STATE_HOME", "")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg, "stratamesh")
    home = env.get("HOME") or str(Path.home())
    return Path(home, ".local", "state", "stratamesh")


def cache_home(env: Mapping[str, str]) -> Path:
    """The per-user cache folder that env names: what can be made again (measured speeds, ONNX exports)."""
    return Path(env[CACHE_ENV]).expanduser() if env.get(CACHE_ENV) else Path.home() / ".cache" / "stratamesh"


def up_folder(env: Mapping[str, str]) -> Path:
    """Where `stratamesh up` keeps its mesh: registry, CA, agents' keys, bootstrap credentials and logs."""
    return state_home(env) / UP_FOLDER


def is_postgres(location: str) -> bool:
    """Whether a registry location is a PostgreSQL URL (postgresql:// or postgres://): a database, not a file."""
    return location.lower().startswith(("postgresql://", "postgres://"))


def default_registry(db: str, env: Mapping[str, str]) -> Path:
    """The registry a credentials command works on: --db, else $STRATAMESH_DB, else the one `up` keeps."""
    if db:
        return Path(db)
    if env.get(DB_ENV):
        return Path(env[DB_ENV])
    return up_folder(env) / UP_REGISTRY


def make_private_dir(path: str | Path) -> Path:
    """Makes path a folder only its owner can enter (0700), with any folders missing above it (0700 too)."""
    path = Path(path)
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for folder in reversed(missing):
        folder.mkdir(mode=0o700, exist_ok=True)
    _tighten(path, 0o700)
    return path


def make_private_file(path: str | Path) -> Path:
    """Makes path a file only its owner can read and write (0600): created empty if missing, tightened if not."""
    path = Path(path)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    _tighten(path, 0o600)
    return path


def make_private_database(path: str | Path) -> Path:
    """make_private_file for an SQLite database, and for the -wal and -shm files an earlier run left beside it
    (SQLite gives the ones it creates the database's mode)."""
    for companion in (Path(f"{path}-wal"), Path(f"{path}-shm")):
        if companion.exists():
            _tighten(companion, 0o600)
    return make_private_file(path)


def write_private(path: str | Path, data: bytes) -> None:
    """Replaces path's content with data at once (a reader sees the old file or the new one), mode 0600."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        os.fchmod(out.fileno(), 0o600)     # a tmp file a crash left behind may have had another mode
        out.write(data)
    tmp.replace(path)


def _tighten(path: Path, mode: int) -> None:
    """chmod path to mode unless it has it; a path of another user's is left as it is, with a warning."""
    if stat.S_IMODE(path.stat().st_mode) == mode:
        return
    try:
        os.chmod(path, mode)
    except PermissionError:
        log.warning("cannot make %s private (mode %o): it is not ours", path, mode)
