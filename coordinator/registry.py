"""The coordinator's durable state in SQLite (sqlite-utils): the embedded RegistryStore (coordinator/
registry_store.py), and the default. Its queries are registry_sql.SqlRegistry's; this module holds the schema's
migrations and the connection."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlite_utils import Database

from stratamesh.coordinator.records import AgentRecord, EventRecord, ModelRecord, PlanRecord, StageRecord
from stratamesh.coordinator.registry_sql import SchemaTooNew, SqlRegistry
from stratamesh.fleet.state import make_private_database

__all__ = ["AgentRecord", "EventRecord", "ModelRecord", "PlanRecord", "Registry", "SchemaTooNew", "StageRecord"]

log = logging.getLogger(__name__)

Migration = Callable[[Database], None]


def _m001_core_tables(db: Database) -> None:
    """Agents, models, plans, stages and events."""
    db["agents"].create({"agent_id": str, "name": str, "address": str, "capabilities_json": str,
                         "state": str, "first_seen": float, "last_seen": float,
                         "state_since": float}, pk="agent_id", if_not_exists=True)
    db["models"].create({"model_id": str, "path": str, "num_layers": int, "config_json": str,
                         "created": float}, pk="model_id", if_not_exists=True)
    db["plans"].create({"plan_id": str, "model_id": str, "created": float, "state": str,
                        "reason": str}, pk="plan_id", if_not_exists=True)
    db["stages"].create({"assignment_id": str, "plan_id": str, "stage_index": int,
                         "agent_id": str, "model_path": str, "start_layer": int,
                         "end_layer": int, "num_layers": int, "dtype": str, "device": str,
                         "state": str}, pk="assignment_id", if_not_exists=True)
    db["events"].create({"id": int, "ts": float, "kind": str, "agent_id": str, "detail": str},
                        pk="id", if_not_exists=True)


def _m002_capability_history_and_indexes(db: Database) -> None:
    """Every capability report an agent sent, and indexes for the common lookups."""
    db["agent_capabilities"].create({"id": int, "agent_id": str, "ts": float,
                                     "capabilities_json": str}, pk="id", if_not_exists=True)
    db["agent_capabilities"].create_index(["agent_id", "ts"], if_not_exists=True)
    db["plans"].create_index(["model_id", "state"], if_not_exists=True)
    db["stages"].create_index(["plan_id", "stage_index"], if_not_exists=True)
    db["events"].create_index(["ts"], if_not_exists=True)


def _m003_stage_kv_block_size(db: Database) -> None:
    """Stages carry the block size of their paged KV cache."""
    db["stages"].add_column("kv_block_size", int, not_null_default=16)


def _m004_telemetry_and_links(db: Database) -> None:
    """Heartbeat telemetry (a bounded history) and the latest measurement of each link."""
    db["telemetry"].create({"id": int, "agent_id": str, "ts": float, "queue_depth": int,
                            "tokens_per_s": float, "kv_usage": float, "telemetry_json": str},
                           pk="id", if_not_exists=True)
    db["telemetry"].create_index(["agent_id", "ts"], if_not_exists=True)
    db["telemetry"].create_index(["ts"], if_not_exists=True)
    db["links"].create({"agent_id": str, "peer_id": str, "rtt_s": float, "bandwidth_bytes_per_s": float,
                        "error": str, "ts": float}, pk=("agent_id", "peer_id"), if_not_exists=True)


def _m005_stage_tp_degree(db: Database) -> None:
    """Stages carry the ranks of the tensor-parallel group serving them."""
    db["stages"].add_column("tp_degree", int, not_null_default=1)


def _m006_model_site_pins(db: Database) -> None:
    """Models carry the sites their first and last stages are pinned to ("" for none)."""
    db["models"].add_column("first_site", str, not_null_default="")
    db["models"].add_column("last_site", str, not_null_default="")


def _m007_join_tokens_and_certificates(db: Database) -> None:
    """Join tokens (no secrets: they derive from the CA's token key) and every certificate issued."""
    db["join_tokens"].create({"token_id": str, "created": float, "expires": float, "revoked": float,
                              "description": str, "num_uses": int}, pk="token_id", not_null={"created"},
                             defaults={"expires": 0.0, "revoked": 0.0, "description": "", "num_uses": 0},
                             if_not_exists=True)
    db["certificates"].create({"serial": str, "agent_id": str, "token_id": str, "issued": float,
                               "expires": float, "revoked": float}, pk="serial",
                              defaults={"revoked": 0.0}, if_not_exists=True)
    db["certificates"].create_index(["agent_id"], if_not_exists=True)


def _m008_api_keys_users_sessions(db: Database) -> None:
    """API keys (only a hash of each), admin users (scrypt) and their login sessions: see coordinator/access.py."""
    db["api_keys"].create({"key_id": str, "secret_sha256": str, "role": str, "name": str, "created": float,
                           "expires": float, "revoked": float}, pk="key_id", if_not_exists=True)
    db["users"].create({"username": str, "password_hash": str, "role": str, "created": float},
                       pk="username", if_not_exists=True)
    db["sessions"].create({"token_sha256": str, "username": str, "created": float, "expires": float},
                          pk="token_sha256", if_not_exists=True)


def _m009_drains(db: Database) -> None:
    """Each agent's newest drain and its progress, so that a restarted coordinator finishes it."""
    db["drains"].create({"agent_id": str, "started_unix_s": float, "state": str, "stages_json": str,
                         "sessions_asked": int, "finished_unix_s": float, "error": str, "resumed": int},
                        pk="agent_id", if_not_exists=True)


def _m010_plan_predictions(db: Database) -> None:
    """What the planner predicted of each plan (tokens/s, step and bottleneck, each stage's step), as JSON."""
    db["plans"].add_column("prediction_json", str, not_null_default="{}")


def _m011_stage_runtime(db: Database) -> None:
    """What computes each stage's layers: torch, or onnxruntime."""
    db["stages"].add_column("runtime", str, not_null_default="torch")


def _m012_drain_rest(db: Database) -> None:
    """Whether a drain is an owner's rest (why), after which the agent stays connected, planned on no more."""
    db["drains"].add_column("rest", str, not_null_default="")


def _m013_model_quantize(db: Database) -> None:
    """The operator's choice of quantized weights for each model ("", "int8" or "int4"), and each stage's."""
    db["models"].add_column("quantize", str, not_null_default="")
    db["stages"].add_column("quantize", str, not_null_default="")


def _m014_replicas(db: Database) -> None:
    """Each model's number of replicas (pipelines serving it side by side), and the replica each plan is of."""
    db["models"].add_column("num_replicas", int, not_null_default=1)
    db["plans"].add_column("replica", int, not_null_default=0)
    db["plans"].create_index(["model_id", "replica", "state"], if_not_exists=True)


def _m015_model_num_stages(db: Database) -> None:
    """The stages each model's first plan is asked for: a model still waiting for one is planned after a restart
    (0: a model added before this column, planned in 1 stage if it still waits)."""
    db["models"].add_column("num_stages", int, not_null_default=0)


def _m016_stage_kv_cache_bytes(db: Database) -> None:
    """Stages carry the KV cache their plan reserved for them (0: a stage planned before this column)."""
    db["stages"].add_column("kv_cache_bytes", int, not_null_default=0)


def _m017_model_speculation(db: Database) -> None:
    """Each model's speculative decoding, the operator's (fleet.sessions.Speculation's vLLM keys as JSON; "": the
    coordinator's default)."""
    db["models"].add_column("speculation_json", str, not_null_default="")


def _m018_model_autoscale(db: Database) -> None:
    """Each autoscaled model's bounds and targets (records.Autoscale as JSON; "": its replicas are fixed)."""
    db["models"].add_column("autoscale_json", str, not_null_default="")


def _m019_revisions(db: Database) -> None:
    """Which revision of its folder each model is (model_folder.revision_of) and each stage serves ("": a model
    or stage of an older registry)."""
    db["models"].add_column("revision", str, not_null_default="")
    db["stages"].add_column("revision", str, not_null_default="")


def _m020_model_rollout(db: Database) -> None:
    """Each model's newest rollout of another revision (records.Rollout as JSON; "": none)."""
    db["models"].add_column("rollout_json", str, not_null_default="")


# Append only: version N is MIGRATIONS[N - 1]. Each runs in one transaction with its version row.
MIGRATIONS: tuple[Migration, ...] = (_m001_core_tables, _m002_capability_history_and_indexes,
                                     _m003_stage_kv_block_size, _m004_telemetry_and_links, _m005_stage_tp_degree,
                                     _m006_model_site_pins, _m007_join_tokens_and_certificates,
                                     _m008_api_keys_users_sessions, _m009_drains,
                                     _m010_plan_predictions, _m011_stage_runtime,
                                     _m012_drain_rest, _m013_model_quantize, _m014_replicas, _m015_model_num_stages,
                                     _m016_stage_kv_cache_bytes, _m017_model_speculation,
                                     _m018_model_autoscale, _m019_revisions, _m020_model_rollout)


class _Database(Database):
    """sqlite-utils' Database with executemany: what registry_sql.SqlHandle asks of a transaction's handle."""

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        self.conn.executemany(sql, rows)


class Registry(SqlRegistry):
    """Agents, models, plans and events in one SQLite database, safe to share between threads: a RegistryStore."""

    _integrity_errors = (sqlite3.IntegrityError,)

    def __init__(self, path: str, migrations: Sequence[Migration] = MIGRATIONS) -> None:
        super().__init__()
        if path != ":memory:":   # it holds password and key hashes
            make_private_database(path)
        self._db = _Database(sqlite3.connect(path, check_same_thread=False))
        try:
            if path != ":memory:":
                self._db.enable_wal()
                # In WAL mode NORMAL syncs at checkpoints, not at every commit: the database cannot be corrupted,
                # and only the last commits before a power loss (not a crash of the process) can be lost. A
                # fleet's joins and heartbeats are hundreds of commits a second; FULL would fsync each one.
                self._db.execute("PRAGMA synchronous=NORMAL")
            self.applied_migrations = self._migrate(migrations)
        except BaseException:
            self._db.close()
            raise

    def _migrate(self, migrations: Sequence[Migration]) -> list[int]:
        """Apply the migrations this database lacks, in order; return the versions applied now."""
        table = self._db["migrations"]
        table.create({"version": int, "name": str}, pk="version", if_not_exists=True)
        done = {row["version"] for row in table.rows}
        if done and max(done) > len(migrations):
            raise SchemaTooNew(f"database schema version {max(done)} is newer than this "
                               f"code's {len(migrations)}")
        applied = []
        for version, migration in enumerate(migrations, start=1):
            if version in done:
                continue
            with self._tx():
                migration(self._db)
                table.insert({"version": version, "name": migration.__name__})
            log.info("applied registry migration %d (%s)", version, migration.__name__)
            applied.append(version)
        return applied

    @contextmanager
    def _tx(self) -> Iterator[Database]:
        """One transaction under the lock: commits on success, rolls back on error.

        BEGIN IMMEDIATE takes the write lock at once. A deferred transaction that reads first and writes
        second fails at once with "database is locked" when another process (`stratamesh token create`
        beside a running coordinator) wrote in between; an immediate one waits for it instead."""
        with self._lock:
            if self._db.conn.in_transaction:     # nested: a savepoint inside the open transaction
                with self._db.atomic() as db:
                    yield db
                return
            self._db.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.conn.rollback()
                raise
            self._db.conn.execute("COMMIT")
            self.commits += 1

    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._db.query(sql, list(params)))

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._db.close()
