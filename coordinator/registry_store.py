"""What the coordinator needs of the store behind its registry (RegistryStore), and open_registry(), which opens
one of the two stores built in: SQLite in the coordinator's own process (coordinator/registry.py, the default), or
a PostgreSQL database that several coordinators share (coordinator/registry_postgres.py).

The contract is split by what the data is. Plans, models, drains, credentials and events are durable: a restarted
coordinator (or a standby taking over) must find them. Agents' heartbeats, telemetry and links are soft: they are
rebuilt within seconds from what the agents report. docs/registry.md maps each part onto a replicated store
(PostgreSQL or etcd) with a standby coordinator. The SQL stores offer a few methods no caller uses
(touch_agent, expire, capability_history, record_telemetry); they are not part of the contract.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

from stratamesh.coordinator.records import (AgentRecord, Autoscale, Rollout, DrainStatus, EventRecord, ModelRecord,
                                            PlanRecord, StageRecord)
from stratamesh.coordinator.registry import Registry
from stratamesh.fleet.errors import InvalidInput, MeshError
from stratamesh.fleet.state import is_postgres
from stratamesh.fleet.boxes import Capabilities, Telemetry
from stratamesh.fleet.control_messages import LinkMeasurement
from stratamesh.fleet.sessions import Speculation

__all__ = ["AgentStore", "EventLog", "PlanStore", "RegistryStore", "RegistryUnavailable", "SqlTables", "TelemetryStore",
           "UnsupportedStore", "open_registry", "sqlite_path"]

DESIGN_NOTE = "docs/registry.md"


class UnsupportedStore(MeshError):
    """A registry location names a store this coordinator cannot open (SQLite and PostgreSQL are built in)."""


class RegistryUnavailable(MeshError):
    """The registry's server (PostgreSQL) cannot be reached or refused the connection."""


@runtime_checkable
class AgentStore(Protocol):
    """Every agent that ever joined: who it is, where its stages listen, and the state the roster last gave it."""

    def upsert_agent(self, agent_id: str, name: str, address: str, capabilities: Capabilities,
                     now: float) -> None:
        """Registers or re-registers an agent as "online": name, address and capabilities replace the old ones,
        last_seen and state_since become now, first_seen stays that of its first registration."""

    def set_agent_state(self, agent_id: str, state: str, now: float) -> None:
        """Sets an agent's state ("connected", "disconnected", "dead", "drained", "resting") and state_since;
        InvalidInput, with nothing written, for an agent never registered."""

    def agent(self, agent_id: str) -> AgentRecord | None:
        """One agent, or None."""

    def agents(self) -> list[AgentRecord]:
        """Every agent, by agent_id."""


@runtime_checkable
class TelemetryStore(Protocol):
    """What agents report while connected: heartbeats (last_seen), a bounded telemetry history, and the newest
    measurement of each link. The only writes whose rate grows with the fleet; the roster batches them
    (Roster.flush: one record_heartbeats a tick)."""

    def record_heartbeats(self, seen: Mapping[str, float], telemetry: Sequence[tuple[str, Telemetry, float]]) -> None:
        """Many heartbeats as one transaction: each agent's last_seen from seen (its state unchanged; ids never
        registered are skipped), and (agent id, telemetry, when it came) rows appended to the history."""

    def telemetry(self, agent_id: str, since: float = 0.0, limit: int = 1000) -> list[tuple[float, Telemetry]]:
        """An agent's telemetry history newer than since, oldest first: at most its newest limit rows."""

    def latest_telemetry(self) -> dict[str, tuple[float, Telemetry]]:
        """Each agent's newest row in the history, and when it came."""

    def prune_telemetry(self, now: float, max_age_s: float, max_rows_per_agent: int) -> int:
        """Drops history older than max_age_s and all but each agent's newest max_rows_per_agent rows; returns the
        rows dropped."""

    def record_links(self, agent_id: str, links: Sequence[LinkMeasurement], now: float) -> None:
        """Keeps the newest measurement of each link from agent_id, as one transaction; a failed probe records its
        error and keeps the last figures measured."""

    def links(self) -> list[LinkMeasurement]:
        """Every link measured successfully at least once, by (agent_id, peer_id)."""


@runtime_checkable
class PlanStore(Protocol):
    """Models, their plans with their stages, and drains: what should run where. Each replica of a model has at
    most one "active" and one "standby" plan in any state a reader can see. Plans are never deleted, only
    retired ("superseded", "abandoned"), so an id once used is never used again."""

    def add_model(self, model_id: str, path: str, num_layers: int, config: dict[str, Any],
                  now: float, first_site: str = "", last_site: str = "", quantize: str = "",
                  num_replicas: int = 1, num_stages: int = 0, speculation: Speculation | None = None,
                  autoscale: Autoscale | None = None, revision: str = "") -> None:
        """Adds a model, or replaces every field of an existing one but created (num_stages: what its plans are
        asked for, kept so that a model still waiting for its first plan is planned after a restart); InvalidInput, with nothing
        written, for num_layers < 1 or num_replicas outside 1..MAX_REPLICAS (or outside autoscale's bounds)."""

    def set_num_replicas(self, model_id: str, num_replicas: int) -> None:
        """Sets the replicas an autoscaled model wants (InvalidInput outside its bounds; ModelNotFound)."""

    def set_rollout(self, model_id: str, rollout: Rollout | None) -> None:
        """Records the model's rollout of another revision (None: none); ModelNotFound."""

    def drop_replica(self, model_id: str, replica: int) -> None:
        """Retires the live plans of one replica of the model, as one transaction."""

    def move_replica(self, model_id: str, replica: int, to: int) -> None:
        """Renumbers the live plans of one replica as another, which has none (InvalidInput otherwise)."""

    def model(self, model_id: str) -> ModelRecord | None:
        """One model, or None."""

    def models(self) -> list[ModelRecord]:
        """Every model, by model_id."""

    def forget_models(self) -> None:
        """Drops every model and retires all their live plans, as one transaction; agents, events, drains and
        credentials stay."""

    def drop_replicas(self, model_id: str, keep: int) -> None:
        """Retires the live plans of the model's replicas keep and above, as one transaction."""

    def save_plan(self, plan_id: str, model_id: str, stages: Sequence[StageRecord], reason: str,
                  now: float, standby: bool = False, prediction: dict[str, Any] | None = None,
                  replica: int = 0) -> None:
        """Stores a new plan of a replica with its stages ("pending"), as one transaction with retiring the plan it
        replaces: an active one supersedes the replica's active plan, a standby abandons its standby. InvalidInput,
        with nothing written, for stages not indexed 0..n-1, stages of another model, or an id already used."""

    def activate_plan(self, model_id: str, plan_id: str) -> None:
        """Makes a standby plan its replica's active one and supersedes the active one it replaces, as one
        transaction; InvalidInput, with nothing changed, if plan_id is not a standby plan of model_id."""

    def abandon_standby(self, model_id: str, replica: int = 0) -> None:
        """Retires the standby plan of the model's replica ("abandoned"), if it has one."""

    def active_plan(self, model_id: str, replica: int = 0) -> PlanRecord | None:
        """The active plan of the model's replica, its stages in pipeline order, or None."""

    def standby_plan(self, model_id: str, replica: int = 0) -> PlanRecord | None:
        """The standby plan of the model's replica, its stages in pipeline order, or None."""

    def active_plans(self, model_id: str) -> list[PlanRecord]:
        """The active plan of each of the model's replicas that has one, by replica."""

    def live_plans(self, model_id: str) -> list[PlanRecord]:
        """Each replica's active plan and the standby it moves to next: by replica, the active one first."""

    def in_live_plan(self, agent_id: str) -> bool:
        """Whether an active or standby plan of any model has a stage on the agent (called on every join: cheap)."""

    def replace_stage(self, assignment_id: str, stage: StageRecord) -> None:
        """Puts stage, "ready", in place of the stage assignment_id (same plan and index: a drain moved it), as one
        transaction; InvalidInput, with nothing changed, if no such stage is at stage.stage_index."""

    def set_stage_state(self, assignment_id: str, state: str) -> None:
        """Sets one stage's state ("assigned", "loading", "ready", "failed"); InvalidInput for an unknown id."""

    def save_drain(self, drain: DrainStatus) -> None:
        """Stores an agent's drain as it stands now, replacing the agent's earlier one."""

    def drains(self) -> list[DrainStatus]:
        """Every agent's newest drain, oldest first: what a restarted coordinator resumes (Drainer.resume)."""


@runtime_checkable
class EventLog(Protocol):
    """What happened in the mesh, for the operator: append only."""

    def log_event(self, kind: str, detail: str, now: float, agent_id: str | None = None) -> int:
        """Appends an event; returns its id, greater than any id returned before."""

    def events(self, limit: int = 100) -> list[EventRecord]:
        """The newest limit events, newest first (by time, then id)."""


@runtime_checkable
class SqlTables(Protocol):
    """SQL on the registry's own connection and in its transactions: what coordinator/credentials.py (join
    tokens, certificates and their revocations) and coordinator/access.py (API keys, admin users, login sessions)
    are written in. Their statements are plain SQL with ? parameters; inside transaction() they use the handle it
    yields as sqlite-utils' Database: handle[table].insert(row), handle[table].upsert(row, pk=...) and
    handle.execute(sql, params).rowcount. Only an SQL store can offer this."""

    def transaction(self) -> AbstractContextManager[Any]:
        """See RegistryStore.transaction."""

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """The rows one SELECT returns, as dicts, read as of one moment."""


@runtime_checkable
class RegistryStore(AgentStore, TelemetryStore, PlanStore, EventLog, SqlTables, Protocol):
    """Everything the coordinator keeps in its registry.

    Every method is one transaction of its own unless called inside transaction(). A crash between two calls
    keeps the first and loses the second, so callers order their writes such that any prefix is a state a
    restarted coordinator recovers from (the roster writes a join as one transaction; Plans saves a plan, then
    logs it). Every method may be called from any thread: the HTTP API reads from its thread pool while the
    event loop writes. Time is a parameter: no method reads a clock."""

    commits: int    # transactions this process committed: a transaction() of many writes is one; reads, none

    def transaction(self) -> AbstractContextManager[Any]:
        """Makes every write in the block on this thread one transaction: committed together when the block ends,
        rolled back together if it raises. A transaction() inside another joins it, and so do the store's own
        methods called inside. Other threads see none of its writes until it ends, and their writes wait for it."""

    def close(self) -> None:
        """Closes the store; nothing may be called on it after."""


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_SQLITE = "sqlite://"


def sqlite_path(location: str) -> str:
    """The SQLite database a registry location names: a file path, ":memory:", or an SQLite URL (sqlite:///x.db is
    x.db, relative; sqlite:////var/x.db is /var/x.db; sqlite:// is in memory). UnsupportedStore for any other URL
    (a PostgreSQL one names no file), naming DESIGN_NOTE for etcd."""
    match = _SCHEME.match(location)
    if match is None:
        return location
    scheme = match.group(1).lower()
    if scheme == "sqlite":
        path = location[len(_SQLITE):]
        if path in ("", "/:memory:"):
            return ":memory:"
        if path.startswith("/") and path != "/":
            return path[1:]
        raise UnsupportedStore(f"the registry URL {location!r} names no SQLite file: write sqlite:///RELATIVE/PATH, "
                               "sqlite:////ABSOLUTE/PATH or sqlite:// (in memory)")
    if is_postgres(location):
        raise UnsupportedStore("a registry on PostgreSQL is no SQLite file")
    if scheme == "etcd":
        raise UnsupportedStore(f"the registry {location!r} is on etcd, which this coordinator cannot open: SQLite "
                               f"and PostgreSQL are built in. {DESIGN_NOTE} says how a coordinator and its standby "
                               "would run on etcd")
    raise UnsupportedStore(f"cannot open a registry at {location!r}: give an SQLite file path, sqlite:///PATH or "
                           "postgresql://USER@HOST/DATABASE")


def open_registry(location: str, fence: Callable[[Any], None] | None = None) -> RegistryStore:
    """Opens the registry at location (a PostgreSQL URL, or see sqlite_path), migrating it to this code's schema;
    the caller closes it. fence (a leader's leadership.Lease.fence) starts every write transaction on PostgreSQL."""
    if not is_postgres(location):
        if fence is not None:
            raise InvalidInput("only a registry on PostgreSQL is shared by coordinators and fenced by a lease")
        return Registry(sqlite_path(location))
    try:
        from stratamesh.coordinator.registry_postgres import PostgresRegistry
    except ImportError as exc:       # psycopg is the postgres extra
        raise UnsupportedStore(f"a registry on PostgreSQL needs psycopg 3: pip install 'stratamesh[postgres]' "
                               f"({exc})") from None
    import psycopg

    try:
        return PostgresRegistry(location, fence=fence)
    except psycopg.OperationalError as exc:
        raise RegistryUnavailable(f"cannot open the registry at {postgres_name(location)}: {exc}") from None


def postgres_name(location: str) -> str:
    """A PostgreSQL URL without its password or options, fit for an error or a log line: HOST:PORT/DATABASE."""
    from psycopg.conninfo import conninfo_to_dict

    parts = conninfo_to_dict(location)
    return f"{parts.get('host', 'localhost')}:{parts.get('port', 5432)}/{parts.get('dbname', '')}"
