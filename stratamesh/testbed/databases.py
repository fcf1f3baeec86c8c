"""Databases of their own on a PostgreSQL server, for a test or a benchmark: made, and dropped after."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit


@contextmanager
def scratch_database(server_url: str, prefix: str = "stratamesh_scratch") -> Iterator[str]:
    """The URL of a new database on the PostgreSQL server of server_url (whose user may create databases), dropped
    (its connections cut) once the block ends."""
    import psycopg     # (the postgres extra)

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    try:
        yield urlunsplit(urlsplit(server_url)._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(server_url, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE {name} WITH (FORCE)")
