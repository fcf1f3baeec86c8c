"""The registry on PostgreSQL (psycopg 3, the `postgres` extra): the RegistryStore several coordinators share, one of
them leading (coordinator/leadership.py). Its queries are registry_sql.SqlRegistry's, as SQLite's are; this module
holds the schema, its migrations (run by one coordinator at a time, under an advisory lock) and the connection.

The schema is SQLite's (coordinator/registry.py, MIGRATIONS) as of its migration 20, made in one step: version 1
here. A change to the schema appends a migration to both lists; tests/coordinator/test_registry_postgres.py checks
that both stores end with the same tables and columns. Floats are double precision, integers bigint, JSON is kept
as text (the registry never looks inside it: one converter reads both stores), and ids that grow are identities."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row

from stratamesh.coordinator.registry_sql import SchemaTooNew, SqlRegistry

__all__ = ["MIGRATIONS", "PostgresRegistry"]

log = logging.getLogger(__name__)

MIGRATION_LOCK = 0x5354524D    # the advisory lock a migrating coordinator holds ("STRM"): one migrates at a time

Fence = Callable[[Any], None]   # leadership.Lease.fence: raises Deposed inside a write transaction of a leader no more

_SCHEMA_OF_SQLITE_20 = """
CREATE TABLE agents (agent_id text PRIMARY KEY, name text, address text, capabilities_json text, state text,
                     first_seen double precision, last_seen double precision, state_since double precision);
CREATE TABLE agent_capabilities (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, agent_id text,
                                 ts double precision, capabilities_json text);
CREATE INDEX agent_capabilities_agent_id_ts ON agent_capabilities (agent_id, ts);
CREATE TABLE models (model_id text PRIMARY KEY, path text, num_layers bigint, config_json text,
                     created double precision, first_site text NOT NULL DEFAULT '',
                     last_site text NOT NULL DEFAULT '', quantize text NOT NULL DEFAULT '',
                     num_replicas bigint NOT NULL DEFAULT 1, num_stages bigint NOT NULL DEFAULT 0,
                     speculation_json text NOT NULL DEFAULT '', autoscale_json text NOT NULL DEFAULT '',
                     revision text NOT NULL DEFAULT '', rollout_json text NOT NULL DEFAULT '');
CREATE TABLE plans (plan_id text PRIMARY KEY, model_id text, created double precision, state text, reason text,
                    prediction_json text NOT NULL DEFAULT '{}', replica bigint NOT NULL DEFAULT 0);
CREATE INDEX plans_model_id_replica_state ON plans (model_id, replica, state);
-- the plan invariant (registry_store.PlanStore), kept by the store itself
CREATE UNIQUE INDEX plans_one_active ON plans (model_id, replica) WHERE state = 'active';
CREATE UNIQUE INDEX plans_one_standby ON plans (model_id, replica) WHERE state = 'standby';
CREATE TABLE stages (assignment_id text PRIMARY KEY, plan_id text, stage_index bigint, agent_id text,
                     model_path text, start_layer bigint, end_layer bigint, num_layers bigint, dtype text,
                     device text, state text, kv_block_size bigint NOT NULL DEFAULT 16,
                     tp_degree bigint NOT NULL DEFAULT 1, runtime text NOT NULL DEFAULT 'torch',
                     quantize text NOT NULL DEFAULT '', kv_cache_bytes bigint NOT NULL DEFAULT 0,
                     revision text NOT NULL DEFAULT '');
CREATE INDEX stages_plan_id_stage_index ON stages (plan_id, stage_index);
CREATE INDEX stages_agent_id ON stages (agent_id);
CREATE TABLE events (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, ts double precision, kind text,
                     agent_id text, detail text);
CREATE INDEX events_ts ON events (ts);
CREATE TABLE telemetry (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, agent_id text, ts double precision,
                        queue_depth bigint, tokens_per_s double precision, kv_usage double precision,
                        telemetry_json text);
CREATE INDEX telemetry_agent_id_ts ON telemetry (agent_id, ts);
CREATE INDEX telemetry_ts ON telemetry (ts);
CREATE TABLE links (agent_id text, peer_id text, rtt_s double precision, bandwidth_bytes_per_s double precision,
                    error text, ts double precision, PRIMARY KEY (agent_id, peer_id));
CREATE TABLE join_tokens (token_id text PRIMARY KEY, created double precision NOT NULL,
                          expires double precision DEFAULT 0.0, revoked double precision DEFAULT 0.0,
                          description text DEFAULT '', num_uses bigint DEFAULT 0);
CREATE TABLE certificates (serial text PRIMARY KEY, agent_id text, token_id text, issued double precision,
                           expires double precision, revoked double precision DEFAULT 0.0);
CREATE INDEX certificates_agent_id ON certificates (agent_id);
CREATE TABLE api_keys (key_id text PRIMARY KEY, secret_sha256 text, role text, name text, created double precision,
                       expires double precision, revoked double precision);
CREATE TABLE users (username text PRIMARY KEY, password_hash text, role text, created double precision);
CREATE TABLE sessions (token_sha256 text PRIMARY KEY, username text, created double precision,
                       expires double precision);
CREATE TABLE drains (agent_id text PRIMARY KEY, started_unix_s double precision, state text, stages_json text,
                     sessions_asked bigint, finished_unix_s double precision, error text, resumed bigint,
                     rest text NOT NULL DEFAULT '');
"""

# Append only: version N is MIGRATIONS[N - 1], (name, SQL). All a database lacks run in one transaction.
MIGRATIONS: tuple[tuple[str, str], ...] = (("p001_schema_of_sqlite_20", _SCHEMA_OF_SQLITE_20),)


@functools.lru_cache(maxsize=1024)
def _placeholders(sql: str) -> str:
    """A statement with ? parameters (as the registry and its stores write them) in psycopg's %s style."""
    return sql.replace("%", "%%").replace("?", "%s")


class _Table:
    """One table of a transaction's handle: insert, insert_all and upsert of dict rows (registry_sql.SqlTable)."""

    def __init__(self, handle: _Handle, name: str) -> None:
        self._handle, self._name = handle, name

    def _insert_sql(self, columns: Sequence[str]) -> str:
        return f"INSERT INTO {self._name} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"

    def insert(self, record: dict[str, Any]) -> None:
        self._handle.execute(self._insert_sql(list(record)), list(record.values()))

    def insert_all(self, records: Iterable[dict[str, Any]]) -> None:
        rows = list(records)
        if rows:
            self._handle.executemany(self._insert_sql(list(rows[0])), [list(row.values()) for row in rows])

    def upsert(self, record: dict[str, Any], pk: str) -> None:
        updates = ", ".join(f"{column} = excluded.{column}" for column in record if column != pk)
        self._handle.execute(f"{self._insert_sql(list(record))} ON CONFLICT ({pk}) DO UPDATE SET {updates}",
                             list(record.values()))


class _Handle:
    """What a transaction yields (registry_sql.SqlHandle) over a psycopg connection."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, parameters: Sequence[Any] = ()) -> psycopg.Cursor:
        return self._conn.execute(_placeholders(sql), parameters)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        rows = list(rows)
        if rows:
            self._conn.cursor().executemany(_placeholders(sql), rows)

    def __getitem__(self, table: str) -> _Table:
        return _Table(self, table)


class PostgresRegistry(SqlRegistry):
    """The registry in a PostgreSQL database over one connection, safe to share between threads: a RegistryStore.
    With fence (a leader's Lease.fence), every write transaction first checks that this coordinator still leads
    and rolls back with Deposed if not."""

    _integrity_errors = (psycopg.IntegrityError,)

    def __init__(self, conninfo: str, migrations: Sequence[tuple[str, str]] = MIGRATIONS,
                 fence: Fence | None = None) -> None:
        super().__init__()
        self._conn = psycopg.connect(conninfo, autocommit=True, application_name="stratamesh-coordinator")
        self._handle = _Handle(self._conn)
        self._fence = fence
        try:
            self.applied_migrations = self._migrate(migrations)
        except BaseException:
            self._conn.close()
            raise

    def _migrate(self, migrations: Sequence[tuple[str, str]]) -> list[int]:
        """Apply the migrations this database lacks, in order, in one transaction under MIGRATION_LOCK (another
        coordinator starting at once waits, then finds them done); return the versions applied now."""
        with self._lock, self._conn.transaction():
            self._conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            self._conn.execute("CREATE TABLE IF NOT EXISTS migrations (version bigint PRIMARY KEY, name text)")
            done = {row[0] for row in self._conn.execute("SELECT version FROM migrations")}
            if done and max(done) > len(migrations):
                raise SchemaTooNew(f"database schema version {max(done)} is newer than this code's {len(migrations)}")
            applied = []
            for version, (name, sql) in enumerate(migrations, start=1):
                if version not in done:
                    self._conn.execute(sql)
                    self._conn.execute("INSERT INTO migrations (version, name) VALUES (%s, %s)", (version, name))
                    applied.append(version)
        for version in applied:
            log.info("applied registry migration %d (%s)", version, migrations[version - 1][0])
        return applied

    @contextmanager
    def _tx(self) -> Iterator[_Handle]:
        """One transaction under the lock, fenced where this store has a fence; nested: a savepoint."""
        with self._lock:
            outermost = self._conn.info.transaction_status == TransactionStatus.IDLE
            with self._conn.transaction():
                if outermost and self._fence is not None:
                    self._fence(self._conn)
                yield self._handle
            if outermost:
                self.commits += 1

    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        with self._lock:
            return self._conn.cursor(row_factory=dict_row).execute(_placeholders(sql), list(params)).fetchall()

    def close(self) -> None:
        """Close the connection (an open transaction of a crashed caller is rolled back by the server)."""
        with self._lock:
            self._conn.close()
