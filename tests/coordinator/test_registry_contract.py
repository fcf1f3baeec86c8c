"""The RegistryStore contract (coordinator/registry_store.py), checked on every store open_registry offers: what
is one transaction, what a reader on another thread sees, what a refused write leaves, what a reopened store still
holds and what a crash loses. SQLite in memory, in a file and by URL, and PostgreSQL on a real server
(tests/postgres.py: each test a database of its own; skipped, saying why, where the server cannot start)."""

from __future__ import annotations

import ast
import inspect
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol

import pytest

from stratamesh.coordinator.access import AccessStore
from stratamesh.coordinator.credentials import CredentialStore
from stratamesh.coordinator.records import DrainStatus, StageRecord
from stratamesh.coordinator.registry import Registry
from stratamesh.coordinator.registry_store import (DESIGN_NOTE, AgentStore, EventLog, PlanStore, RegistryStore,
                                                   RegistryUnavailable,
                                                   SqlTables, TelemetryStore, UnsupportedStore, open_registry,
                                                   sqlite_path)
from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.boxes import Capabilities, StageLoad, Telemetry
from stratamesh.fleet.control_messages import LinkMeasurement
from stratamesh.fleet.stages import StageSpec



def _postgres_registry() -> type | None:
    """PostgresRegistry, or None where psycopg (the postgres extra) is not installed."""
    try:
        from stratamesh.coordinator.registry_postgres import PostgresRegistry
    except ImportError:
        return None
    return PostgresRegistry


ROOT = Path(__file__).resolve().parents[2]
T0 = 1_700_000_000.0
BOX = Capabilities("edge-1", "ARM Cortex-A78", 8, 16 << 30, 12 << 30, site="factory")
BOX2 = Capabilities("edge-1", "ARM Cortex-A78", 8, 32 << 30, 28 << 30, site="factory")
BLOCKED_S = 0.3     # how long a reader on another thread is given while a transaction is open


@dataclass(frozen=True, slots=True)
class Backend:
    """A store open_registry offers: where it is, and whether what it holds outlives closing it."""

    location: str
    durable: bool


BACKENDS = ("memory", "file", "sqlite-url", "postgresql")
STORES = (Registry, PostgresRegistry) if (PostgresRegistry := _postgres_registry()) else (Registry,)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "postgresql":
        return Backend(request.getfixturevalue("postgres_database"), durable=True)
    return {"memory": Backend(":memory:", durable=False),
            "file": Backend(str(tmp_path / "registry.db"), durable=True),
            "sqlite-url": Backend(f"sqlite:///{tmp_path / 'registry.db'}", durable=True)}[request.param]


@pytest.fixture
def store(backend: Backend) -> Iterator[RegistryStore]:
    opened = open_registry(backend.location)
    yield opened
    opened.close()


def _stages(model_id: str, agents: list[str], prefix: str, num_layers: int = 8) -> list[StageRecord]:
    """A plan's stages: agents[i] serves an equal share of the layers, in order."""
    bounds = [num_layers * i // len(agents) for i in range(len(agents) + 1)]
    return [StageRecord(f"{prefix}-{i}", i, agent, StageSpec(model_id, f"/models/{model_id}", bounds[i],
                                                                bounds[i + 1], num_layers))
            for i, agent in enumerate(agents)]


def _telemetry(i: int) -> Telemetry:
    return Telemetry(T0 + i, queue_depth=i, tokens_per_s=10.0 * i, stages=(StageLoad("p-0", 1, i, i, 64),))


def _members(protocol: type) -> set[str]:
    """The public methods and attributes a protocol names, its bases' included."""
    return {name for cls in protocol.__mro__ if getattr(cls, "_is_protocol", False) and cls not in (Protocol, Generic)
            for name in (*vars(cls), *vars(cls).get("__annotations__", {})) if not name.startswith("_")}


# ------------------------------------------------------------ the protocol is the real surface
def test_every_store_keeps_every_part_of_the_contract(store: RegistryStore) -> None:
    for protocol in (AgentStore, TelemetryStore, PlanStore, EventLog, SqlTables, RegistryStore):
        assert isinstance(store, protocol), protocol.__name__


@pytest.mark.parametrize("store_class", STORES, ids=lambda cls: cls.__name__)
def test_each_store_has_the_protocols_signatures(store_class: type) -> None:
    """What isinstance cannot see: each method's parameters, defaults and annotations (mypy is not configured)."""
    differ = []
    for name in sorted(_members(RegistryStore) - {"commits"}):
        want, got = inspect.signature(getattr(RegistryStore, name)), inspect.signature(getattr(store_class, name))
        if want != got:
            differ.append(f"{name}: protocol {want}, {store_class.__name__} {got}")
    assert differ == []


def _used_by_callers() -> dict[str, str]:
    """Every attribute the code outside the registry reads of a registry (a name `registry` or an attribute
    `_registry`), and the first place it does."""
    used: dict[str, str] = {}
    for folder in ("coordinator", "stratamesh", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.parent == ROOT / "coordinator" and path.name.startswith("registry"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and (
                        isinstance(node.value, ast.Name) and node.value.id == "registry"
                        or isinstance(node.value, ast.Attribute) and node.value.attr == "_registry"):
                    used.setdefault(node.attr, f"{path.relative_to(ROOT)}:{node.lineno}")
    return used


def test_the_protocol_is_exactly_what_the_callers_use() -> None:
    used = _used_by_callers()
    members = _members(RegistryStore)
    assert {name: where for name, where in used.items() if name not in members} == {}, \
        "callers use these outside RegistryStore: add them to the protocol with their contract"
    assert members - set(used) == set(), "RegistryStore names these and no caller uses them: drop them"


# ------------------------------------------------------------ transactions
def test_writes_in_a_transaction_are_one_commit(store: RegistryStore) -> None:
    before = store.commits
    with store.transaction():           # a join, as the roster writes it
        store.upsert_agent("a1", "edge", "h:1", BOX, now=T0)
        store.set_agent_state("a1", "connected", now=T0)
        store.log_event("agent_connected", "h:1", now=T0, agent_id="a1")
        with store.transaction():       # a nested one joins it
            store.add_model("m", "/models/m", 8, {}, now=T0)
    assert store.commits == before + 1
    assert store.agent("a1").state == "connected" and store.model("m") is not None
    assert [e.kind for e in store.events()] == ["agent_connected"]


def test_a_transaction_that_raises_leaves_nothing(store: RegistryStore) -> None:
    store.log_event("before", "", now=T0)
    before = store.commits
    with pytest.raises(RuntimeError, match="crashed"):
        with store.transaction():
            store.upsert_agent("a1", "edge", "h:1", BOX, now=T0)
            with store.transaction():   # committed inside, rolled back with the outer one
                store.add_model("m", "/models/m", 8, {}, now=T0)
                store.save_plan("p1", "m", _stages("m", ["a1"], "p1"), "one", now=T0)
            CredentialStore(store).add_token("t1", now=T0, ttl_s=None)      # the SQL stores join it too
            store.log_event("during", "", now=T0)
            raise RuntimeError("crashed")
    assert store.commits == before
    assert (store.agent("a1"), store.model("m"), store.active_plan("m")) == (None, None, None)
    assert CredentialStore(store).token("t1") is None
    assert [e.kind for e in store.events()] == ["before"]


def test_another_thread_never_sees_a_transaction_half_done(store: RegistryStore) -> None:
    seen: list[object] = []
    reader = threading.Thread(target=lambda: seen.append(store.agent("a1")))
    with store.transaction():
        store.upsert_agent("a1", "edge", "h:1", BOX, now=T0)
        reader.start()
        reader.join(BLOCKED_S)
        read_during = not reader.is_alive()   # the reader may wait for the end, or read what was before
        store.set_agent_state("a1", "connected", now=T0)
    reader.join()
    if read_during:
        assert seen == [None]
    else:
        assert seen[0].state == "connected"


def test_another_threads_write_is_not_part_of_an_open_transaction(store: RegistryStore) -> None:
    writer = threading.Thread(target=lambda: store.log_event("other_thread", "", now=T0))
    with pytest.raises(RuntimeError):
        with store.transaction():
            store.log_event("rolled_back", "", now=T0)
            writer.start()
            writer.join(BLOCKED_S)
            raise RuntimeError("rolled back")
    writer.join()
    assert [e.kind for e in store.events()] == ["other_thread"]


def test_reads_and_refused_writes_commit_nothing(store: RegistryStore) -> None:
    store.add_model("m", "/models/m", 8, {}, now=T0)
    before = store.commits
    store.agents(), store.models(), store.live_plans("m"), store.events(), store.links(), store.drains()
    for refused in (lambda: store.set_agent_state("ghost", "dead", now=T0),
                    lambda: store.set_stage_state("ghost", "ready"),
                    lambda: store.add_model("m", "/models/m", 0, {}, now=T0),
                    lambda: store.add_model("m", "/models/m", 8, {}, now=T0, num_replicas=0),
                    lambda: store.activate_plan("m", "ghost")):
        with pytest.raises(InvalidInput):
            refused()
    assert store.commits == before
    assert store.model("m").num_layers == 8 and store.agent("ghost") is None


# ------------------------------------------------------------ agents, heartbeats, telemetry, links
def test_an_agent_registers_again_keeping_its_first_seen(store: RegistryStore) -> None:
    for agent_id in ("b", "a"):
        store.upsert_agent(agent_id, agent_id, f"{agent_id}:1", BOX, now=T0)
    store.set_agent_state("a", "dead", now=T0 + 5)
    store.upsert_agent("a", "renamed", "a:2", BOX2, now=T0 + 10)
    a = store.agent("a")
    assert (a.name, a.address, a.capabilities, a.state) == ("renamed", "a:2", BOX2, "online")
    assert (a.first_seen, a.last_seen, a.state_since) == (T0, T0 + 10, T0 + 10)
    assert [agent.agent_id for agent in store.agents()] == ["a", "b"]


def test_heartbeats_are_one_commit_and_change_no_state(store: RegistryStore) -> None:
    store.upsert_agent("a", "a", "a:1", BOX, now=T0)
    store.upsert_agent("b", "b", "b:1", BOX, now=T0)
    store.set_agent_state("b", "dead", now=T0 + 1)
    before = store.commits
    store.record_heartbeats({"a": T0 + 3, "b": T0 + 4, "ghost": T0 + 4},
                            [("a", _telemetry(1), T0 + 1), ("a", _telemetry(3), T0 + 3)])
    assert store.commits == before + 1
    a, b = store.agents()
    assert (a.last_seen, a.state, b.last_seen, b.state) == (T0 + 3, "online", T0 + 4, "dead")
    assert store.agent("ghost") is None
    assert store.telemetry("a") == [(T0 + 1, _telemetry(1)), (T0 + 3, _telemetry(3))]
    assert store.latest_telemetry() == {"a": (T0 + 3, _telemetry(3))}


def test_telemetry_reads_newest_rows_oldest_first_and_prunes(store: RegistryStore) -> None:
    store.record_heartbeats({}, [(agent, _telemetry(i), T0 + i) for i in range(6) for agent in ("a", "b")])
    assert [ts for ts, _ in store.telemetry("a", since=T0 + 1, limit=3)] == [T0 + 3, T0 + 4, T0 + 5]
    # older than 2.5 s at T0 + 6 goes (rows 0..3 of each), then each agent keeps its newest one
    assert store.prune_telemetry(now=T0 + 6, max_age_s=2.5, max_rows_per_agent=1) == 2 * 4 + 2 * 1
    assert [ts for ts, _ in store.telemetry("a")] == [T0 + 5] and [ts for ts, _ in store.telemetry("b")] == [T0 + 5]


def test_links_keep_the_newest_figures_through_a_failed_probe(store: RegistryStore) -> None:
    store.record_links("b", [LinkMeasurement("a", 0.004, 5e7)], now=T0)
    store.record_links("a", [LinkMeasurement("b", 0.002, 1e8), LinkMeasurement("c", error="refused")], now=T0)
    store.record_links("a", [LinkMeasurement("b", error="timeout")], now=T0 + 1)
    links = store.links()
    assert [(link.agent_id, link.peer_agent_id) for link in links] == [("a", "b"), ("b", "a")]  # c: never measured
    assert (links[0].rtt_s, links[0].bandwidth_bytes_per_s, links[0].error, links[0].measured_at_s) == (
        0.002, 1e8, "timeout", T0 + 1)


# ------------------------------------------------------------ models, plans, stages, drains
def test_a_replica_has_one_active_plan_and_one_standby(store: RegistryStore) -> None:
    store.add_model("m", "/models/m", 8, {}, now=T0, num_replicas=2)
    store.save_plan("p1", "m", _stages("m", ["a1", "a2"], "p1"), "first", now=T0)
    store.save_plan("r1", "m", _stages("m", ["b1"], "r1"), "replica 1", now=T0, replica=1)
    store.save_plan("s1", "m", _stages("m", ["a3"], "s1"), "an idea", now=T0 + 1, standby=True)
    store.save_plan("s2", "m", _stages("m", ["a4"], "s2"), "a better one", now=T0 + 2, standby=True)
    assert [(p.plan_id, p.state, p.replica) for p in store.live_plans("m")] == [
        ("p1", "active", 0), ("s2", "standby", 0), ("r1", "active", 1)]
    assert [s.agent_id for s in store.active_plan("m").stages] == ["a1", "a2"]
    with pytest.raises(InvalidInput, match="not a standby plan"):
        store.activate_plan("m", "s1")          # abandoned by s2
    store.activate_plan("m", "s2")
    assert [p.plan_id for p in store.active_plans("m")] == ["s2", "r1"] and store.standby_plan("m") is None
    store.save_plan("p3", "m", _stages("m", ["a5"], "p3"), "replanned", now=T0 + 3)
    assert store.active_plan("m").plan_id == "p3" and store.active_plan("m", replica=1).plan_id == "r1"
    assert (store.in_live_plan("a1"), store.in_live_plan("a4"), store.in_live_plan("a5")) == (False, False, True)


def test_a_refused_plan_changes_nothing(store: RegistryStore) -> None:
    store.save_plan("p1", "m", _stages("m", ["a1"], "p1"), "one", now=T0)
    store.save_plan("p2", "m", _stages("m", ["a2"], "p2"), "two", now=T0 + 1)     # p1 is superseded
    before = store.commits
    for plan_id, stages in (("p1", _stages("m", ["a3"], "x")),               # a retired plan's id
                            ("p3", _stages("m", ["a3"], "p1")),              # a retired plan's stage id
                            ("p4", _stages("m", ["a3", "a4"], "y")[::-1]),   # out of order
                            ("p5", []),
                            ("p6", _stages("n", ["a3"], "z"))):              # another model's stages
        with pytest.raises(InvalidInput):
            store.save_plan(plan_id, "m", stages, "refused", now=T0 + 2)
    assert store.commits == before
    assert [p.plan_id for p in store.live_plans("m")] == ["p2"] and store.in_live_plan("a3") is False


def test_a_moved_stage_takes_its_place_in_the_plan(store: RegistryStore) -> None:
    store.save_plan("p1", "m", _stages("m", ["a1", "a2", "a3"], "p1"), "three", now=T0)
    store.set_stage_state("p1-0", "ready")
    old = store.active_plan("m").stages[1]
    with pytest.raises(InvalidInput):
        store.replace_stage("p1-1", StageRecord("p1-1-m", 2, "spare", old.spec))    # not its index
    store.replace_stage("p1-1", StageRecord("p1-1-m", 1, "spare", old.spec))
    stages = store.active_plan("m").stages
    assert [(s.assignment_id, s.agent_id, s.state) for s in stages] == [
        ("p1-0", "a1", "ready"), ("p1-1-m", "spare", "ready"), ("p1-2", "a3", "pending")]
    assert stages[1].spec == old.spec and store.in_live_plan("a2") is False


def test_fewer_replicas_and_forgotten_models_retire_their_plans(store: RegistryStore) -> None:
    store.add_model("m", "/models/m", 8, {}, now=T0, num_replicas=3)
    store.add_model("n", "/models/n", 8, {}, now=T0)
    for replica in range(3):
        store.save_plan(f"p{replica}", "m", _stages("m", [f"a{replica}"], f"p{replica}"), "", now=T0, replica=replica)
    store.save_plan("s2", "m", _stages("m", ["b"], "s2"), "", now=T0, standby=True, replica=2)
    store.save_plan("n1", "n", _stages("n", ["c"], "n1"), "", now=T0)
    store.upsert_agent("a0", "a0", "a0:1", BOX, now=T0)
    store.save_drain(DrainStatus("a0", T0))
    store.drop_replicas("m", keep=1)
    assert [p.plan_id for p in store.live_plans("m")] == ["p0"]
    store.forget_models()
    assert (store.models(), store.live_plans("m"), store.live_plans("n")) == ([], [], [])
    assert store.agent("a0") is not None and len(store.drains()) == 1


def test_a_model_updated_keeps_when_it_was_created(store: RegistryStore) -> None:
    store.add_model("b", "/models/b", 8, {"hidden_size": 64}, now=T0)
    store.add_model("a", "/models/a", 4, {}, now=T0 + 1)
    store.add_model("b", "/models/b2", 8, {"hidden_size": 128}, now=T0 + 2, first_site="factory", quantize="int8",
                    num_replicas=2)
    b = store.model("b")
    assert (b.path, b.config, b.created, b.first_site, b.quantize, b.num_replicas) == (
        "/models/b2", {"hidden_size": 128}, T0, "factory", "int8", 2)
    assert [m.model_id for m in store.models()] == ["a", "b"] and store.model("c") is None


def test_a_drain_is_kept_per_agent_as_it_stands(store: RegistryStore) -> None:
    store.save_drain(DrainStatus("b", T0 + 1))
    first = DrainStatus("a", T0 + 2, stages=[{"model": "m", "layers": [0, 4], "from": "a", "to": "s"}])
    store.save_drain(first)
    done = DrainStatus("a", T0 + 2, state="drained", stages=first.stages, sessions_asked=3, finished_unix_s=T0 + 9,
                       resumed=1, rest="too hot")
    store.save_drain(done)
    assert store.drains() == [DrainStatus("b", T0 + 1), done]


def test_events_come_newest_first_with_ever_larger_ids(store: RegistryStore) -> None:
    ids = [store.log_event("joined", f"agent {i}", now=T0 + i, agent_id=f"a{i}") for i in range(4)]
    store.log_event("plan", "p1", now=T0 + 9)
    assert ids == sorted(ids) and len(set(ids)) == 4
    assert [(e.kind, e.agent_id, e.ts) for e in store.events(limit=2)] == [("plan", None, T0 + 9),
                                                                          ("joined", "a3", T0 + 3)]


def test_the_sql_stores_work_on_the_registry(store: RegistryStore) -> None:
    credentials = CredentialStore(store)
    credentials.add_token("t1", now=T0, ttl_s=3600)
    credentials.add_certificate("c1", "a1", "t1", issued=T0, expires=T0 + 86400)
    assert credentials.revoke_agent("a1", now=T0 + 1) == ["c1"]
    assert credentials.revoked_serials(now=T0 + 2) == {"c1"} and credentials.token("t1").num_uses == 1
    text, _ = AccessStore(store).create_key("viewer", "ci", now=T0)
    assert AccessStore(store).check_key(text, now=T0 + 1).role == "viewer"


# ------------------------------------------------------------ durability
def _fill(store: RegistryStore) -> None:
    """One of everything a restarted coordinator needs back."""
    store.upsert_agent("a1", "edge", "h:1", BOX, now=T0)
    store.set_agent_state("a1", "drained", now=T0 + 1)
    store.add_model("m", "/models/m", 8, {"hidden_size": 64}, now=T0, last_site="factory")
    store.save_plan("p1", "m", _stages("m", ["a1", "a2"], "p1"), "two", now=T0, prediction={"tokens_per_s": 9.5})
    store.set_stage_state("p1-1", "ready")
    store.save_plan("s1", "m", _stages("m", ["a3"], "s1"), "one", now=T0 + 1, standby=True)
    store.save_drain(DrainStatus("a1", T0, state="moving_sessions", sessions_asked=2))
    store.record_links("a1", [LinkMeasurement("a2", 0.002, 1e8)], now=T0)
    store.log_event("plan", "two", now=T0)
    CredentialStore(store).add_token("t1", now=T0, ttl_s=None)


def _contents(store: RegistryStore) -> tuple[object, ...]:
    return (store.agents(), store.models(), store.live_plans("m"), store.drains(), store.links(), store.events(),
            CredentialStore(store).tokens())


def test_a_reopened_store_holds_what_was_committed(backend: Backend) -> None:
    if not backend.durable:
        pytest.skip("an in-memory store ends with its process")
    store = open_registry(backend.location)
    _fill(store)
    before = _contents(store)
    store.close()
    again = open_registry(backend.location)
    assert _contents(again) == before
    again.close()


_CRASH = """
import os, sys
from stratamesh.coordinator.registry_store import open_registry
from stratamesh.fleet.boxes import Capabilities
store = open_registry(sys.argv[1])
store.log_event("before", "", 1.0)
with store.transaction():
    store.upsert_agent("a1", "edge", "h:1", Capabilities("h", "cpu", 1, 1, 1), 2.0)
    store.log_event("during", "", 2.0)
    os._exit(9)      # a crash: no rollback, no close
"""


def test_a_crash_keeps_the_calls_before_it_and_nothing_of_the_transaction_it_cut(backend: Backend) -> None:
    if not backend.durable:
        pytest.skip("an in-memory store ends with its process")
    crashed = subprocess.run([sys.executable, "-c", _CRASH, backend.location], capture_output=True, text=True)
    assert crashed.returncode == 9, crashed.stderr
    store = open_registry(backend.location)
    assert [e.kind for e in store.events()] == ["before"] and store.agent("a1") is None
    store.close()


# ------------------------------------------------------------ open_registry
def test_a_path_and_an_sqlite_url_open_the_same_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    by_path = open_registry("mesh.db")
    by_path.log_event("plan", "p1", now=T0)
    by_path.close()
    for location in ("sqlite:///mesh.db", f"sqlite:///{tmp_path / 'mesh.db'}"):
        by_url = open_registry(location)
        assert [e.detail for e in by_url.events()] == ["p1"], location
        by_url.close()
    assert sqlite_path("sqlite://") == sqlite_path("sqlite:///:memory:") == ":memory:"


def test_etcd_is_refused_naming_the_design_note() -> None:
    with pytest.raises(UnsupportedStore, match=DESIGN_NOTE):
        open_registry("etcd://10.0.0.5:2379")
    assert (ROOT / DESIGN_NOTE).is_file()


@pytest.mark.skipif(PostgresRegistry is None, reason="psycopg (the postgres extra) is not installed")
@pytest.mark.parametrize("scheme", ["postgresql", "postgres"])
def test_a_postgresql_server_that_does_not_answer_is_named_without_its_password(scheme: str) -> None:
    with socket.socket() as unused:         # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with pytest.raises(RegistryUnavailable, match=f"127.0.0.1:{port}/mesh") as refused:
        open_registry(f"{scheme}://coordinator:s3cret@127.0.0.1:{port}/mesh?connect_timeout=5")
    assert "s3cret" not in str(refused.value)


@pytest.mark.parametrize("location", ["mysql://db/stratamesh", "sqlite:///", "sqlite://host/mesh.db"])
def test_other_urls_are_refused_by_name(location: str) -> None:
    with pytest.raises(UnsupportedStore, match="sqlite:///"):
        open_registry(location)
