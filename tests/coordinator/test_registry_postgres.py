"""What only the registry on PostgreSQL does (the contract both stores keep is tests/coordinator/
test_registry_contract.py): its schema is SQLite's, coordinators starting at once migrate it once, the store itself
holds the plan invariant, and a leader's writes are fenced by its lease."""

from __future__ import annotations

import threading

import pytest

from stratamesh.coordinator.credentials import CredentialStore
from stratamesh.coordinator.leadership import Deposed, Lease
from stratamesh.coordinator.registry import Registry
from stratamesh.coordinator.registry_sql import SchemaTooNew
from stratamesh.fleet.boxes import Capabilities
from tests.patience import wait_until

psycopg = pytest.importorskip("psycopg")
from stratamesh.coordinator.registry_postgres import MIGRATIONS, PostgresRegistry  # noqa: E402

T0 = 1_700_000_000.0
BOX = Capabilities("edge-1", "ARM Cortex-A78", 8, 16 << 30, 12 << 30)


def _columns_sqlite() -> dict[str, set[str]]:
    sqlite = Registry(":memory:")
    tables = [r["name"] for r in sqlite.query("SELECT name FROM sqlite_master WHERE type = 'table'")]
    columns = {table: {r["name"] for r in sqlite.query(f"PRAGMA table_info({table})")} for table in tables}
    sqlite.close()
    return columns


def _columns_postgres(url: str) -> dict[str, set[str]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT table_name, column_name FROM information_schema.columns "
                            "WHERE table_schema = 'public'").fetchall()
    columns: dict[str, set[str]] = {}
    for table, column in rows:
        columns.setdefault(table, set()).add(column)
    return columns


def test_the_schema_is_sqlites_table_for_table_column_for_column(postgres_database: str) -> None:
    PostgresRegistry(postgres_database).close()
    assert _columns_postgres(postgres_database) == _columns_sqlite()


def test_coordinators_starting_at_once_migrate_the_schema_once(postgres_database: str) -> None:
    applied: list[list[int]] = []
    start = threading.Barrier(3)

    def open_store() -> None:
        start.wait()
        store = PostgresRegistry(postgres_database)
        applied.append(store.applied_migrations)
        store.close()

    threads = [threading.Thread(target=open_store) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(applied) == [[], [], list(range(1, len(MIGRATIONS) + 1))]
    store = PostgresRegistry(postgres_database)
    assert store.query("SELECT version FROM migrations") == [{"version": v} for v in range(1, len(MIGRATIONS) + 1)]
    store.close()


def test_a_schema_newer_than_the_code_is_refused(postgres_database: str) -> None:
    PostgresRegistry(postgres_database).close()
    with psycopg.connect(postgres_database, autocommit=True) as conn:
        conn.execute("INSERT INTO migrations (version, name) VALUES (%s, 'from the future')", (len(MIGRATIONS) + 1,))
    with pytest.raises(SchemaTooNew, match="newer"):
        PostgresRegistry(postgres_database)


def test_the_store_itself_refuses_a_second_active_plan_of_a_replica(postgres_database: str) -> None:
    store = PostgresRegistry(postgres_database)
    try:
        with pytest.raises(psycopg.IntegrityError, match="plans_one_active"):
            with store.transaction() as db:
                for plan_id in ("p1", "p2"):
                    db["plans"].insert({"plan_id": plan_id, "model_id": "m", "created": T0, "state": "active",
                                        "reason": "a writer that forgot to supersede", "replica": 0})
        assert store.live_plans("m") == []
    finally:
        store.close()


def test_a_leaders_writes_are_fenced_by_its_lease_and_a_deposed_one_writes_nothing(postgres_database: str) -> None:
    leader_lease = Lease(postgres_database, "mesh", "coord-a", ttl_s=0.5)
    standby_lease = Lease(postgres_database, "mesh", "coord-b")
    assert leader_lease.acquire()
    leader = PostgresRegistry(postgres_database, fence=leader_lease.fence)
    try:
        leader.upsert_agent("a1", "edge", "h:1", BOX, now=T0)           # it leads: written
        before = leader.commits
        wait_until(standby_lease.acquire)                 # the standby takes the expired lease over
        for write in (lambda: leader.set_agent_state("a1", "dead", now=T0 + 1),
                      lambda: leader.log_event("plan", "p1", now=T0 + 1),
                      lambda: CredentialStore(leader).add_token("t1", now=T0, ttl_s=None)):
            with pytest.raises(Deposed):
                write()
        assert leader.commits == before
        assert (leader.agent("a1").state, leader.events(), CredentialStore(leader).tokens()) == ("online", [], [])
    finally:
        leader.close()
        leader_lease.close()
        standby_lease.close()
