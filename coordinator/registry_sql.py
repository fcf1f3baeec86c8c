"""The registry's queries in SQL that SQLite and PostgreSQL both run (SqlRegistry), and the converters between rows
and records. A store subclasses SqlRegistry with its connection, its transactions and its schema: coordinator/
registry.py (SQLite, the embedded default) and coordinator/registry_postgres.py.

Statements are written with ? parameters; inside a transaction they run on the handle _tx() yields, which offers
what sqlite-utils' Database does and no more (SqlHandle)."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict
from typing import Any, ClassVar, Protocol

from stratamesh.coordinator.plain import plain
from stratamesh.coordinator.records import (AgentRecord, Autoscale, Rollout, DrainStatus, EventRecord, ModelRecord,
                                            PlanRecord, StageRecord)
from stratamesh.fleet.boxes import Capabilities, GpuInfo, Speed, StageLoad, Telemetry
from stratamesh.fleet.control_messages import LinkMeasurement
from stratamesh.fleet.errors import InvalidInput, MeshError, ModelNotFound
from stratamesh.fleet.sessions import Speculation
from stratamesh.fleet.states import PlanState, RolloutState
from stratamesh.fleet.stages import MAX_REPLICAS, StageSpec

__all__ = ["SchemaTooNew", "SqlHandle", "SqlRegistry", "SqlTable"]

CAPABILITIES_CACHED = 65_536    # distinct capability reports kept parsed: more than a fleet of 10,000 holds at once


class SchemaTooNew(MeshError):
    """The database was written by a newer stratamesh with migrations this code lacks."""


class SqlTable(Protocol):
    """One table of a transaction's handle (sqlite-utils' Table, as far as the registry and its stores use it)."""

    def insert(self, record: dict[str, Any]) -> Any:
        """Inserts one row (an IntegrityError of the store's driver if its key is taken)."""

    def insert_all(self, records: Iterable[dict[str, Any]]) -> Any:
        """Inserts rows that all have the same columns."""

    def upsert(self, record: dict[str, Any], pk: str) -> Any:
        """Inserts the row, or sets its columns on the row of the same primary key pk."""


class SqlHandle(Protocol):
    """What a transaction yields: statements with ? parameters (execute's cursor has rowcount, fetchone and
    fetchall, rows as tuples) and tables by name."""

    def execute(self, sql: str, parameters: Sequence[Any] = ...) -> Any: ...

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None: ...

    def __getitem__(self, table: str) -> SqlTable: ...


class SqlRegistry:
    """Agents, models, plans, events, drains, telemetry and links over a store's SQL (a RegistryStore once a
    subclass gives it _tx, _rows and close). Safe to share between threads: every statement runs under one lock."""

    _integrity_errors: ClassVar[tuple[type[Exception], ...]]     # what the driver raises for a key already taken

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.commits = 0        # transactions committed by this process (what a fleet's load costs the store)

    def _tx(self) -> AbstractContextManager[SqlHandle]:
        """One transaction under the lock (a savepoint inside an open one): commits on success, rolls back on error."""
        raise NotImplementedError

    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """The rows of one statement, as dicts, under the lock."""
        raise NotImplementedError

    # Stores of their own tables (credentials, API keys) share the connection and its lock (registry_store.SqlTables).
    def transaction(self) -> AbstractContextManager[Any]:
        return self._tx()

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        return self._rows(sql, params)

    def close(self) -> None:
        raise NotImplementedError

    def _update(self, table: str, pk: str, updates: dict[str, Any]) -> None:
        """Update one existing row; InvalidInput names the unknown id. (Plain SQL: sqlite-utils' update reads the
        table's schema first, which a join storm of thousands of agents feels.)"""
        key = _PRIMARY_KEYS[table]
        with self._tx() as db:
            cursor = db.execute(f"UPDATE {table} SET {', '.join(f'{column} = ?' for column in updates)} "
                                f"WHERE {key} = ?", [*updates.values(), pk])
            if cursor.rowcount == 0:
                raise InvalidInput(f"unknown {key} {pk!r}")

    # ------------------------------------------------------------ agents
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
            ids = [row[0] for row in db.execute(f"SELECT agent_id FROM agents WHERE {where} ORDER BY agent_id",
                                                args).fetchall()]
            db.execute(f"UPDATE agents SET state = 'lost', state_since = ? WHERE {where}", [now, *args])
        return ids

    # ------------------------------------------------------------ models
    def add_model(self, model_id: str, path: str, num_layers: int, config: dict[str, Any],
                  now: float, first_site: str = "", last_site: str = "", quantize: str = "",
                  num_replicas: int = 1, num_stages: int = 0, speculation: Speculation | None = None,
                  autoscale: Autoscale | None = None, revision: str = "") -> None:
        """Add a model, or update its path, config, site pins, quantization, replicas, the stages its plans are
        asked for, its speculative decoding and its autoscaling if it exists (keeping created)."""
        if num_layers < 1:
            raise InvalidInput(f"num_layers must be >= 1, got {num_layers}")
        _check_replicas(num_replicas, autoscale)
        row = {"model_id": model_id, "created": now, "path": path, "num_layers": num_layers,
               "config_json": json.dumps(config, sort_keys=True), "first_site": first_site, "last_site": last_site,
               "quantize": quantize, "num_replicas": num_replicas, "num_stages": num_stages,
               "speculation_json": _speculation_json(speculation), "autoscale_json": _autoscale_json(autoscale),
               "revision": revision}
        kept = {"model_id", "created"}
        with self._tx() as db:
            db.execute(f"INSERT INTO models ({', '.join(row)}) VALUES ({', '.join('?' * len(row))}) "
                       f"ON CONFLICT (model_id) DO UPDATE SET "
                       f"{', '.join(f'{c} = excluded.{c}' for c in row if c not in kept)}", list(row.values()))

    def set_num_replicas(self, model_id: str, num_replicas: int) -> None:
        """The replicas an autoscaled model wants now (within its bounds: InvalidInput otherwise; ModelNotFound)."""
        model = self.model(model_id)
        if model is None:
            raise ModelNotFound(f"no model {model_id!r}")
        _check_replicas(num_replicas, model.autoscale)
        self._update("models", model_id, {"num_replicas": num_replicas})

    def set_rollout(self, model_id: str, rollout: Rollout | None) -> None:
        """Records the model's rollout (None: none); ModelNotFound."""
        if self.model(model_id) is None:
            raise ModelNotFound(f"no model {model_id!r}")
        self._update("models", model_id, {"rollout_json": json.dumps(asdict(rollout)) if rollout else ""})

    def models(self) -> list[ModelRecord]:
        """All models, ordered by model_id."""
        return [_model(r) for r in self._rows("SELECT * FROM models ORDER BY model_id")]

    def model(self, model_id: str) -> ModelRecord | None:
        """One model, or None."""
        rows = self._rows("SELECT * FROM models WHERE model_id = ?", [model_id])
        return _model(rows[0]) if rows else None

    def forget_models(self) -> None:
        """Drops every model and retires its plans; agents, events and credentials stay. For a launcher that
        starts every agent afresh and deploys the model it is given (`stratamesh up` on the mesh it kept)."""
        with self._tx() as db:
            db.execute("UPDATE plans SET state = 'superseded' WHERE state IN ('active', 'standby')")
            db.execute("DELETE FROM models")

    # ------------------------------------------------------------ plans and stages
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

    def drop_replicas(self, model_id: str, keep: int) -> None:
        """Retires the plans of the model's replicas keep and above (the operator asked for fewer)."""
        with self._tx() as db:
            db.execute("UPDATE plans SET state = 'superseded' WHERE model_id = ? AND replica >= ? "
                       "AND state IN ('active', 'standby')", [model_id, keep])

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
        except self._integrity_errors as exc:
            raise InvalidInput(f"plan {plan_id!r} repeats an existing id: {exc}") from None

    def activate_plan(self, model_id: str, plan_id: str) -> None:
        """Makes the standby plan plan_id of a replica of the model active; the replica's active one becomes
        "superseded"."""
        with self._tx() as db:
            row = db.execute("SELECT replica FROM plans WHERE plan_id = ? AND model_id = ? AND state = 'standby'",
                             [plan_id, model_id]).fetchone()
            if row is None:
                raise InvalidInput(f"plan {plan_id!r} is not a standby plan of model {model_id!r}")
            db.execute("UPDATE plans SET state = 'superseded' WHERE model_id = ? AND replica = ? AND state = 'active'",
                       [model_id, row[0]])
            db.execute("UPDATE plans SET state = 'active' WHERE plan_id = ?", [plan_id])

    def abandon_standby(self, model_id: str, replica: int = 0) -> None:
        """Drops the standby plan of the model's replica, if it has one."""
        with self._tx() as db:
            db.execute("UPDATE plans SET state = 'abandoned' WHERE model_id = ? AND replica = ? "
                       "AND state = 'standby'", [model_id, replica])

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
            row = db.execute("SELECT plan_id, stage_index FROM stages WHERE assignment_id = ?",
                             [assignment_id]).fetchone()
            if row is None or row[1] != stage.stage_index:
                raise InvalidInput(f"no stage {assignment_id!r} at index {stage.stage_index} to replace")
            db.execute("DELETE FROM stages WHERE assignment_id = ?", [assignment_id])
            db["stages"].insert({**_stage_row(row[0], stage), "state": "ready"})

    def set_stage_state(self, assignment_id: str, state: str) -> None:
        """Set one stage's state (e.g. "ready", "failed")."""
        self._update("stages", assignment_id, {"state": state})

    # ------------------------------------------------------------ events
    def log_event(self, kind: str, detail: str, now: float, agent_id: str | None = None) -> int:
        """Append an event; return its id."""
        with self._tx() as db:
            return db.execute("INSERT INTO events (ts, kind, agent_id, detail) VALUES (?, ?, ?, ?) RETURNING id",
                              [now, kind, agent_id, detail]).fetchone()[0]

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
            db.executemany("UPDATE agents SET last_seen = ? WHERE agent_id = ?",
                           [(ts, agent_id) for agent_id, ts in seen.items()])
            db.executemany(_INSERT_TELEMETRY, [_telemetry_row(*row) for row in telemetry])

    def telemetry(self, agent_id: str, since: float = 0.0, limit: int = 1000) -> list[tuple[float, Telemetry]]:
        """An agent's telemetry newer than since, oldest first (at most the newest limit rows)."""
        rows = self._rows("SELECT ts, telemetry_json FROM (SELECT * FROM telemetry WHERE agent_id = ? AND ts > ? "
                          "ORDER BY ts DESC, id DESC LIMIT ?) AS newest ORDER BY ts, id", [agent_id, since, limit])
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
                "(PARTITION BY agent_id ORDER BY id DESC) AS n FROM telemetry) AS ranked WHERE n > ?)",
                [max_rows_per_agent]).rowcount
        return old + extra

    # ------------------------------------------------------------ links
    def record_links(self, agent_id: str, links: Sequence[LinkMeasurement], now: float) -> None:
        """Keep each link's newest measurement from agent_id; a failed probe keeps the last figures."""
        with self._tx() as db:
            for m in links:
                if m.error:
                    db.execute(_UPSERT_FAILED_LINK, (agent_id, m.peer_agent_id, m.error, now))
                else:
                    db.execute(_UPSERT_LINK, (agent_id, m.peer_agent_id, "", now, m.rtt_s, m.bandwidth_bytes_per_s))

    def links(self) -> list[LinkMeasurement]:
        """Every link measured at least once, ordered by its two ends."""
        rows = self._rows("SELECT * FROM links WHERE rtt_s IS NOT NULL ORDER BY agent_id, peer_id")
        return [LinkMeasurement(r["peer_id"], r["rtt_s"], r["bandwidth_bytes_per_s"], r["error"], r["agent_id"],
                                r["ts"]) for r in rows]


# the tables _update writes, by their primary keys
_PRIMARY_KEYS = {"agents": "agent_id", "stages": "assignment_id", "models": "model_id"}

# Plain SQL: sqlite-utils' insert_all works out its query anew for every batch, a tenth of a busy coordinator's CPU,
# and its upsert reads the table's schema for every row.
_INSERT_TELEMETRY = ("INSERT INTO telemetry (agent_id, ts, queue_depth, tokens_per_s, kv_usage, telemetry_json) "
                     "VALUES (?, ?, ?, ?, ?, ?)")
_UPSERT_LINK = ("INSERT INTO links (agent_id, peer_id, error, ts, rtt_s, bandwidth_bytes_per_s) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (agent_id, peer_id) DO UPDATE SET error = excluded.error, "
                "ts = excluded.ts, rtt_s = excluded.rtt_s, bandwidth_bytes_per_s = excluded.bandwidth_bytes_per_s")
_UPSERT_FAILED_LINK = ("INSERT INTO links (agent_id, peer_id, error, ts) VALUES (?, ?, ?, ?) "       # keeps the figures
                       "ON CONFLICT (agent_id, peer_id) DO UPDATE SET error = excluded.error, ts = excluded.ts")

_SPEC_COLUMNS = ("model_path", "start_layer", "end_layer", "num_layers", "dtype", "device",
                 "kv_block_size", "tp_degree", "runtime", "quantize", "kv_cache_bytes", "revision")


# ------------------------------------------------------------ rows <-> records
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


def _speculation_json(speculation: Speculation | None) -> str:
    return json.dumps(speculation.config(), sort_keys=True) if speculation is not None else ""


def _check_replicas(num_replicas: int, autoscale: Autoscale | None) -> None:
    """A model's replicas: 1..MAX_REPLICAS, or within its autoscaling bounds (which may reach 0)."""
    if autoscale is None and not 1 <= num_replicas <= MAX_REPLICAS:
        raise InvalidInput(f"num_replicas must be in 1..{MAX_REPLICAS}, got {num_replicas}")
    if autoscale is not None and not autoscale.min_replicas <= num_replicas <= autoscale.max_replicas:
        raise InvalidInput(f"num_replicas must be in {autoscale.min_replicas}..{autoscale.max_replicas} (its "
                           f"autoscaling bounds), got {num_replicas}")


def _plan(row: dict[str, Any], stages: list[StageRecord]) -> PlanRecord:
    prediction = json.loads(row.pop("prediction_json") or "{}")
    return PlanRecord(**row, stages=tuple(stages), prediction=prediction)


def _stage(row: dict[str, Any], model_id: str) -> StageRecord:
    spec = StageSpec(model_id, *(row.pop(k) for k in _SPEC_COLUMNS))
    return StageRecord(**row, spec=spec)


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
