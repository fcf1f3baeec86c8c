"""The coordinator's durable state in SQLite (sqlite-utils): agents, models, plans, stages, events. It is the
embedded RegistryStore (coordinator/registry_store.py), and the only one built in."""

from __future__ import annotations

import functools
import json
import logging
import sqlite3
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

from sqlite_utils import Database

from stratamesh.fleet.errors import InvalidInput, MeshError, ModelNotFound
from stratamesh.fleet.state import make_private_database
from stratamesh.coordinator.plain import plain
from stratamesh.coordinator.records import (AgentRecord, Autoscale, Rollout, DrainStatus, EventRecord, ModelRecord,
                                            PlanRecord, StageRecord)
from stratamesh.fleet.states import PlanState, RolloutState
from stratamesh.fleet.boxes import Capabilities, GpuInfo, Speed, StageLoad, Telemetry
from stratamesh.fleet.control_messages import LinkMeasurement
from stratamesh.fleet.sessions import Speculation
from stratamesh.fleet.stages import MAX_REPLICAS, StageSpec

__all__ = ["AgentRecord", "EventRecord", "ModelRecord", "PlanRecord", "Registry", "StageRecord"]

log = logging.getLogger(__name__)

CAPABILITIES_CACHED = 65_536    # distinct capability reports kept parsed: more than a fleet of 10,000 holds at once

Migration = Callable[[Database], None]


class SchemaTooNew(MeshError):
    """The database was written by a newer stratamesh with migrations this code lacks."""


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


def _caps_to_json(caps: Capabilities) -> str:
    return json.dumps(plain(caps), sort_keys=True)


@functools.lru_cache(maxsize=CAPABILITIES_CACHED)
def _caps_from_json(text: str) -> Capabilities:
    """Capabilities from their JSON, each distinct text parsed once: an agent's rarely changes, and parsing them was
    nine tenths of reading 10,000 agents (the admin API's pages and the UI's view read them all)."""
    d = json.loads(text)
    return Capabilities(**{**d, "gpus": tuple(GpuInfo(**g) for g in d["gpus"]),
                           "backends": tuple(d["backends"]),
                           "speeds": tuple(Speed(**s) for s in d.get("speeds", ()))})


_PRIMARY_KEYS = {"agents": "agent_id", "stages": "assignment_id"}     # of the tables _update writes


# Plain SQL: sqlite-utils' insert_all works out its query anew for every batch, a tenth of a busy coordinator's CPU.
_INSERT_TELEMETRY = ("INSERT INTO telemetry (agent_id, ts, queue_depth, tokens_per_s, kv_usage, telemetry_json) "
                     "VALUES (?, ?, ?, ?, ?, ?)")


def _telemetry_row(agent_id: str, telemetry: Telemetry, ts: float) -> tuple[str, float, int, float, float, str]:
    return (agent_id, ts, telemetry.queue_depth, telemetry.tokens_per_s,
            max((s.kv_usage for s in telemetry.stages), default=0.0), json.dumps(plain(telemetry)))


def _telemetry_from_json(text: str) -> Telemetry:
    d = json.loads(text)
    return Telemetry(**{**d, "stages": tuple(StageLoad(**{**s, "expert_tokens": tuple(s.get("expert_tokens", ()))})
                                             for s in d["stages"]),
                        "gpus": tuple(GpuInfo(**g) for g in d["gpus"])})


def _agent(row: dict[str, Any]) -> AgentRecord:
    return AgentRecord(capabilities=_caps_from_json(row.pop("capabilities_json")), **row)


def _model(row: dict[str, Any]) -> ModelRecord:
    speculation, autoscale = row.pop("speculation_json", ""), row.pop("autoscale_json", "")
    rollout = row.pop("rollout_json", "")
    return ModelRecord(config=json.loads(row.pop("config_json")), **row,
                       speculation=Speculation.of(json.loads(speculation)) if speculation else None,
                       autoscale=Autoscale(**json.loads(autoscale)) if autoscale else None,
                       rollout=_rollout(json.loads(rollout)) if rollout else None)


def _rollout(d: dict[str, Any]) -> Rollout:
    return Rollout(**{**d, "steps": tuple(d["steps"]), "state": RolloutState(d["state"])})


def _autoscale_json(autoscale: Autoscale | None) -> str:
    return json.dumps(asdict(autoscale), sort_keys=True) if autoscale is not None else ""


def _check_replicas(num_replicas: int, autoscale: Autoscale | None) -> None:
    """A model's replicas: 1..MAX_REPLICAS, or within its autoscaling bounds (which may reach 0)."""
    if autoscale is None and not 1 <= num_replicas <= MAX_REPLICAS:
        raise InvalidInput(f"num_replicas must be in 1..{MAX_REPLICAS}, got {num_replicas}")
    if autoscale is not None and not autoscale.min_replicas <= num_replicas <= autoscale.max_replicas:
        raise InvalidInput(f"num_replicas must be in {autoscale.min_replicas}..{autoscale.max_replicas} (its "
                           f"autoscaling bounds), got {num_replicas}")


def _speculation_json(speculation: Speculation | None) -> str:
    return json.dumps(speculation.config(), sort_keys=True) if speculation is not None else ""


def _plan(row: dict[str, Any], stages: list[StageRecord]) -> PlanRecord:
    prediction = json.loads(row.pop("prediction_json") or "{}")
    return PlanRecord(**row, stages=tuple(stages), prediction=prediction)


def _stage(row: dict[str, Any], model_id: str) -> StageRecord:
    spec = StageSpec(model_id, *(row.pop(k) for k in _SPEC_COLUMNS))
    return StageRecord(**row, spec=spec)


class Registry:
    """Agents, models, plans and events in one SQLite database, safe to share between threads: a RegistryStore."""

    def __init__(self, path: str, migrations: Sequence[Migration] = MIGRATIONS) -> None:
        if path != ":memory:":   # it holds password and key hashes
            make_private_database(path)
        self._db = Database(sqlite3.connect(path, check_same_thread=False))
        self._lock = threading.RLock()
        self.commits = 0        # transactions committed by this process (what a fleet's load costs the disk)
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

    # Stores of their own tables (credentials, API keys) share this connection and its lock (registry_store.SqlTables).
    transaction = _tx
    query = _rows

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._db.close()

    def upsert_agent(self, agent_id: str, name: str, address: str, capabilities: Capabilities,
                     now: float) -> None:
        """Register or re-register an agent as "online"; keeps first_seen, logs capability changes."""
        caps = _caps_to_json(capabilities)
        with self._tx() as db:
            old = db.execute("SELECT capabilities_json FROM agents WHERE agent_id = ?", [agent_id]).fetchone()
            db.execute("INSERT INTO agents (agent_id, first_seen, name, address, capabilities_json, state, last_seen, "
                       "state_since) VALUES (?, ?, ?, ?, ?, 'online', ?, ?) ON CONFLICT (agent_id) DO UPDATE SET "
                       "name = excluded.name, address = excluded.address, capabilities_json = "
                       "excluded.capabilities_json, state = 'online', last_seen = excluded.last_seen, "
                       "state_since = excluded.state_since", [agent_id, now, name, address, caps, now, now])
            if old is None or _caps_from_json(old[0]) != capabilities:
                db.execute("INSERT INTO agent_capabilities (agent_id, ts, capabilities_json) VALUES (?, ?, ?)",
                           [agent_id, now, caps])

    def _update(self, table: str, pk: str, updates: dict[str, Any]) -> None:
        """Update one existing row; InvalidInput names the unknown id. (Plain SQL: sqlite-utils' update reads the
        table's schema first, which a join storm of thousands of agents feels.)"""
        key = _PRIMARY_KEYS[table]
        with self._tx() as db:
            cursor = db.execute(f"UPDATE {table} SET {', '.join(f'{column} = ?' for column in updates)} "
                                f"WHERE {key} = ?", [*updates.values(), pk])
            if cursor.rowcount == 0:
                raise InvalidInput(f"unknown {key} {pk!r}")

    def set_agent_state(self, agent_id: str, state: str, now: float) -> None:
        """Set an agent's state (e.g. "draining") and when it entered it."""
        self._update("agents", agent_id, {"state": state, "state_since": now})

    def touch_agent(self, agent_id: str, now: float) -> None:
        """Record a heartbeat; a "lost" agent stays lost until it registers again."""
        self._update("agents", agent_id, {"last_seen": now})

    def agents(self) -> list[AgentRecord]:
        """All agents, ordered by agent_id."""
        return [_agent(r) for r in self._rows("SELECT * FROM agents ORDER BY agent_id")]

    def agent(self, agent_id: str) -> AgentRecord | None:
        """One agent, or None."""
        rows = self._rows("SELECT * FROM agents WHERE agent_id = ?", [agent_id])
        return _agent(rows[0]) if rows else None

    def capability_history(self, agent_id: str) -> list[tuple[float, Capabilities]]:
        """Each distinct capability report of an agent, oldest first."""
        rows = self._rows("SELECT ts, capabilities_json FROM agent_capabilities "
                          "WHERE agent_id = ? ORDER BY ts, id", [agent_id])
        return [(r["ts"], _caps_from_json(r["capabilities_json"])) for r in rows]

    def expire(self, now: float, ttl_s: float) -> list[str]:
        """Mark agents not seen for more than ttl_s as "lost"; return the newly lost ids."""
        where, args = "state != 'lost' AND last_seen < ?", [now - ttl_s]
        with self._tx() as db:
            ids = [r["agent_id"] for r in db["agents"].rows_where(where, args, order_by="agent_id")]
            db.execute(f"UPDATE agents SET state = 'lost', state_since = ? WHERE {where}",
                       [now, *args])
        return ids

    def add_model(self, model_id: str, path: str, num_layers: int, config: dict[str, Any],
                  now: float, first_site: str = "", last_site: str = "", quantize: str = "",
                  num_replicas: int = 1, num_stages: int = 0, speculation: Speculation | None = None,
                  autoscale: Autoscale | None = None, revision: str = "") -> None:
        """Add a model, or update its path, config, site pins, quantization, replicas, the stages its plans are
        asked for, its speculative decoding and its autoscaling if it exists (keeping created)."""
        if num_layers < 1:
            raise InvalidInput(f"num_layers must be >= 1, got {num_layers}")
        _check_replicas(num_replicas, autoscale)
        with self._tx() as db:
            db["models"].insert({"model_id": model_id, "created": now}, ignore=True)
            db["models"].update(model_id, {"path": path, "num_layers": num_layers,
                                           "config_json": json.dumps(config, sort_keys=True),
                                           "first_site": first_site, "last_site": last_site,
                                           "quantize": quantize, "num_replicas": num_replicas,
                                           "num_stages": num_stages,
                                           "speculation_json": _speculation_json(speculation),
                                           "autoscale_json": _autoscale_json(autoscale), "revision": revision})

    def set_num_replicas(self, model_id: str, num_replicas: int) -> None:
        """The replicas an autoscaled model wants now (within its bounds: InvalidInput otherwise; ModelNotFound)."""
        model = self.model(model_id)
        if model is None:
            raise ModelNotFound(f"no model {model_id!r}")
        _check_replicas(num_replicas, model.autoscale)
        with self._tx() as db:
            db["models"].update(model_id, {"num_replicas": num_replicas})

    def set_rollout(self, model_id: str, rollout: Rollout | None) -> None:
        """Records the model's rollout (None: none); ModelNotFound."""
        if self.model(model_id) is None:
            raise ModelNotFound(f"no model {model_id!r}")
        with self._tx() as db:
            db["models"].update(model_id, {"rollout_json": json.dumps(asdict(rollout)) if rollout else ""})

    def drop_replica(self, model_id: str, replica: int) -> None:
        """Retires the live plans of one replica of the model (the autoscaler gives it back)."""
        with self._tx() as db:
            db.execute("UPDATE plans SET state = 'superseded' WHERE model_id = ? AND replica = ? "
                       "AND state IN ('active', 'standby')", [model_id, replica])

    def move_replica(self, model_id: str, replica: int, to: int) -> None:
        """Numbers the live plans of one replica of the model as another (InvalidInput if that one has live plans):
        replicas stay numbered 0..n-1 when one that is not the last is given back."""
        with self._tx() as db:
            taken = db.execute("SELECT 1 FROM plans WHERE model_id = ? AND replica = ? AND state IN "
                               "('active', 'standby')", [model_id, to]).fetchone()
            if taken:
                raise InvalidInput(f"replica {to} of {model_id!r} has live plans")
            db.execute("UPDATE plans SET replica = ? WHERE model_id = ? AND replica = ? "
                       "AND state IN ('active', 'standby')", [to, model_id, replica])

    def models(self) -> list[ModelRecord]:
        """All models, ordered by model_id."""
        return [_model(r) for r in self._rows("SELECT * FROM models ORDER BY model_id")]

    def model(self, model_id: str) -> ModelRecord | None:
        """One model, or None."""
        rows = self._rows("SELECT * FROM models WHERE model_id = ?", [model_id])
        return _model(rows[0]) if rows else None

    def save_plan(self, plan_id: str, model_id: str, stages: Sequence[StageRecord], reason: str,
                  now: float, standby: bool = False, prediction: dict[str, Any] | None = None,
                  replica: int = 0) -> None:
        """Store a new plan for a replica of model_id: active (the replica's previous active plan becomes
        "superseded"), or a standby that activate_plan() promotes once its stages are loaded (a previous standby
        of the replica is "abandoned")."""
        _check_stages(model_id, stages)
        try:
            with self._tx() as db:
                replaced = PlanState.STANDBY if standby else PlanState.ACTIVE
                db.execute("UPDATE plans SET state = ? WHERE model_id = ? AND replica = ? AND state = ?",
                           [PlanState.ABANDONED if standby else PlanState.SUPERSEDED, model_id, replica, replaced])
                db["plans"].insert({"plan_id": plan_id, "model_id": model_id, "created": now,
                                    "state": replaced, "reason": reason, "replica": replica,
                                    "prediction_json": json.dumps(prediction or {})})
                db["stages"].insert_all(_stage_row(plan_id, s) for s in stages)
        except sqlite3.IntegrityError as exc:
            raise InvalidInput(f"plan {plan_id!r} repeats an existing id: {exc}") from None

    def activate_plan(self, model_id: str, plan_id: str) -> None:
        """Makes the standby plan plan_id of a replica of the model active; the replica's active one becomes
        "superseded"."""
        with self._tx() as db:
            rows = list(db["plans"].rows_where("plan_id = ? AND model_id = ? AND state = 'standby'",
                                               [plan_id, model_id]))
            if not rows:
                raise InvalidInput(f"plan {plan_id!r} is not a standby plan of model {model_id!r}")
            db.execute("UPDATE plans SET state = 'superseded' WHERE model_id = ? AND replica = ? AND state = 'active'",
                       [model_id, rows[0]["replica"]])
            db.execute("UPDATE plans SET state = 'active' WHERE plan_id = ?", [plan_id])

    def abandon_standby(self, model_id: str, replica: int = 0) -> None:
        """Drops the standby plan of the model's replica, if it has one."""
        with self._tx() as db:
            db.execute("UPDATE plans SET state = 'abandoned' WHERE model_id = ? AND replica = ? "
                       "AND state = 'standby'", [model_id, replica])

    def drop_replicas(self, model_id: str, keep: int) -> None:
        """Retires the plans of the model's replicas keep and above (the operator asked for fewer)."""
        with self._tx() as db:
            db.execute("UPDATE plans SET state = 'superseded' WHERE model_id = ? AND replica >= ? "
                       "AND state IN ('active', 'standby')", [model_id, keep])

    def forget_models(self) -> None:
        """Drops every model and retires its plans; agents, events and credentials stay. For a launcher that
        starts every agent afresh and deploys the model it is given (`stratamesh up` on the mesh it kept)."""
        with self._tx() as db:
            db.execute("UPDATE plans SET state = 'superseded' WHERE state IN ('active', 'standby')")
            db.execute("DELETE FROM models")

    def active_plan(self, model_id: str, replica: int = 0) -> PlanRecord | None:
        """The active plan of the model's replica with its stages in pipeline order, or None."""
        return next(iter(self._plans(model_id, (PlanState.ACTIVE,), replica)), None)

    def standby_plan(self, model_id: str, replica: int = 0) -> PlanRecord | None:
        """The plan the model's replica moves to once its stages are loaded, or None."""
        return next(iter(self._plans(model_id, (PlanState.STANDBY,), replica)), None)

    def active_plans(self, model_id: str) -> list[PlanRecord]:
        """The active plan of each of the model's replicas that has one, by replica."""
        return self._plans(model_id, (PlanState.ACTIVE,))

    def in_live_plan(self, agent_id: str) -> bool:
        """Whether an active or standby plan of any model has a stage on the agent (one query)."""
        return bool(self._rows("SELECT 1 FROM stages JOIN plans ON stages.plan_id = plans.plan_id WHERE "
                               "stages.agent_id = ? AND plans.state IN ('active', 'standby') LIMIT 1", [agent_id]))

    def live_plans(self, model_id: str) -> list[PlanRecord]:
        """Every replica's active plan and the standby it moves to next, by replica (active first)."""
        return self._plans(model_id, (PlanState.ACTIVE, PlanState.STANDBY))

    def _plans(self, model_id: str, states: Sequence[str], replica: int | None = None) -> list[PlanRecord]:
        """The model's plans in these states (of one replica, or of all), by replica then state, each with its
        stages in pipeline order: two queries, whatever their number."""
        where = f"model_id = ? AND state IN ({', '.join('?' * len(states))})"
        args: list[Any] = [model_id, *states]
        if replica is not None:
            where, args = where + " AND replica = ?", [*args, replica]
        plans = self._rows(f"SELECT * FROM plans WHERE {where} ORDER BY replica, state = 'standby'", args)
        if not plans:
            return []
        ids = [plan["plan_id"] for plan in plans]
        stages: dict[str, list[StageRecord]] = {plan_id: [] for plan_id in ids}
        for row in self._rows(f"SELECT * FROM stages WHERE plan_id IN ({', '.join('?' * len(ids))}) "
                              "ORDER BY stage_index", ids):
            stages[row["plan_id"]].append(_stage(row, model_id))
        return [_plan(plan, stages[plan["plan_id"]]) for plan in plans]

    def replace_stage(self, assignment_id: str, stage: StageRecord) -> None:
        """Puts stage in place of the stage assignment_id in its plan (same index; a drain moved it), as ready."""
        with self._tx() as db:
            rows = list(db["stages"].rows_where("assignment_id = ?", [assignment_id]))
            if not rows or rows[0]["stage_index"] != stage.stage_index:
                raise InvalidInput(f"no stage {assignment_id!r} at index {stage.stage_index} to replace")
            db["stages"].delete(assignment_id)
            db["stages"].insert({**_stage_row(rows[0]["plan_id"], stage), "state": "ready"})

    def set_stage_state(self, assignment_id: str, state: str) -> None:
        """Set one stage's state (e.g. "ready", "failed")."""
        self._update("stages", assignment_id, {"state": state})

    def log_event(self, kind: str, detail: str, now: float, agent_id: str | None = None) -> int:
        """Append an event; return its id."""
        with self._tx() as db:
            return db.execute("INSERT INTO events (ts, kind, agent_id, detail) VALUES (?, ?, ?, ?)",
                              [now, kind, agent_id, detail]).lastrowid

    def events(self, limit: int = 100) -> list[EventRecord]:
        """The newest events, newest first."""
        rows = self._rows("SELECT * FROM events ORDER BY ts DESC, id DESC LIMIT ?", [limit])
        return [EventRecord(**r) for r in rows]

    # ------------------------------------------------------------ drains
    def save_drain(self, drain: DrainStatus) -> None:
        """Stores an agent's drain as it stands now (replacing its earlier one)."""
        row = {k: v for k, v in drain.as_json().items() if k != "stages"}
        with self._tx() as db:
            db["drains"].upsert({**row, "stages_json": json.dumps(drain.stages)}, pk="agent_id")

    def drains(self) -> list[DrainStatus]:
        """Every agent's newest drain, oldest first."""
        rows = self._rows("SELECT * FROM drains ORDER BY started_unix_s, agent_id")
        return [DrainStatus(stages=json.loads(r.pop("stages_json")), **r) for r in rows]

    # ------------------------------------------------------------ telemetry
    def record_telemetry(self, agent_id: str, telemetry: Telemetry, now: float) -> None:
        """Append one heartbeat's telemetry, stamped with the coordinator's clock."""
        self.record_heartbeats({}, [(agent_id, telemetry, now)])

    def record_heartbeats(self, seen: Mapping[str, float], telemetry: Sequence[tuple[str, Telemetry, float]]) -> None:
        """Many heartbeats in one transaction: each agent's newest last_seen (agents unknown here are skipped), and
        telemetry rows as record_telemetry appends them."""
        with self._tx() as db:
            db.conn.executemany("UPDATE agents SET last_seen = ? WHERE agent_id = ?",
                                [(ts, agent_id) for agent_id, ts in seen.items()])
            db.conn.executemany(_INSERT_TELEMETRY, (_telemetry_row(*row) for row in telemetry))

    def telemetry(self, agent_id: str, since: float = 0.0, limit: int = 1000) -> list[tuple[float, Telemetry]]:
        """An agent's telemetry newer than since, oldest first (at most the newest limit rows)."""
        rows = self._rows("SELECT ts, telemetry_json FROM (SELECT * FROM telemetry WHERE agent_id = ? AND ts > ? "
                          "ORDER BY ts DESC, id DESC LIMIT ?) ORDER BY ts, id", [agent_id, since, limit])
        return [(r["ts"], _telemetry_from_json(r["telemetry_json"])) for r in rows]

    def latest_telemetry(self) -> dict[str, tuple[float, Telemetry]]:
        """Each agent's newest telemetry and when it came."""
        rows = self._rows("SELECT t.agent_id, t.ts, t.telemetry_json FROM telemetry t JOIN "
                          "(SELECT agent_id, MAX(id) AS id FROM telemetry GROUP BY agent_id) m ON t.id = m.id")
        return {r["agent_id"]: (r["ts"], _telemetry_from_json(r["telemetry_json"])) for r in rows}

    def prune_telemetry(self, now: float, max_age_s: float, max_rows_per_agent: int) -> int:
        """Drop telemetry older than max_age_s and all but each agent's newest rows; return rows dropped."""
        with self._tx() as db:
            old = db.execute("DELETE FROM telemetry WHERE ts < ?", [now - max_age_s]).rowcount
            extra = db.execute(
                "DELETE FROM telemetry WHERE id IN (SELECT id FROM (SELECT id, ROW_NUMBER() OVER "
                "(PARTITION BY agent_id ORDER BY id DESC) AS n FROM telemetry) WHERE n > ?)",
                [max_rows_per_agent]).rowcount
        return old + extra

    # ------------------------------------------------------------ links
    def record_links(self, agent_id: str, links: Sequence[LinkMeasurement], now: float) -> None:
        """Keep each link's newest measurement from agent_id; a failed probe keeps the last figures."""
        with self._tx() as db:
            for m in links:
                if m.error:
                    db.conn.execute(_UPSERT_FAILED_LINK, (agent_id, m.peer_agent_id, m.error, now))
                else:
                    db.conn.execute(_UPSERT_LINK, (agent_id, m.peer_agent_id, "", now, m.rtt_s, m.bandwidth_bytes_per_s))

    def links(self) -> list[LinkMeasurement]:
        """Every link measured at least once, ordered by its two ends."""
        rows = self._rows("SELECT * FROM links WHERE rtt_s IS NOT NULL ORDER BY agent_id, peer_id")
        return [LinkMeasurement(r["peer_id"], r["rtt_s"], r["bandwidth_bytes_per_s"], r["error"], r["agent_id"],
                                r["ts"]) for r in rows]


# Plain SQL: sqlite-utils' upsert reads the table's schema for every row.
_UPSERT_LINK = ("INSERT INTO links (agent_id, peer_id, error, ts, rtt_s, bandwidth_bytes_per_s) VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (agent_id, peer_id) DO UPDATE SET error = excluded.error, ts = excluded.ts, "
                "rtt_s = excluded.rtt_s, bandwidth_bytes_per_s = excluded.bandwidth_bytes_per_s")
_UPSERT_FAILED_LINK = ("INSERT INTO links (agent_id, peer_id, error, ts) VALUES (?, ?, ?, ?) "       # keeps the figures
                       "ON CONFLICT (agent_id, peer_id) DO UPDATE SET error = excluded.error, ts = excluded.ts")

_SPEC_COLUMNS = ("model_path", "start_layer", "end_layer", "num_layers", "dtype", "device",
                 "kv_block_size", "tp_degree", "runtime", "quantize", "kv_cache_bytes", "revision")


def _stage_row(plan_id: str, stage: StageRecord) -> dict[str, Any]:
    return {"assignment_id": stage.assignment_id, "plan_id": plan_id,
            "stage_index": stage.stage_index, "agent_id": stage.agent_id,
            **{k: getattr(stage.spec, k) for k in _SPEC_COLUMNS}, "state": "pending"}


def _check_stages(model_id: str, stages: Sequence[StageRecord]) -> None:
    """A plan has stages, indexed 0..n-1 in order, all of model_id."""
    if not stages or [s.stage_index for s in stages] != list(range(len(stages))):
        raise InvalidInput(f"a plan needs stages with indices 0..n-1 in order, got "
                           f"{[s.stage_index for s in stages]}")
    if wrong := [s.assignment_id for s in stages if s.spec.model_id != model_id]:
        raise InvalidInput(f"stages {wrong} are not for model {model_id!r}")
