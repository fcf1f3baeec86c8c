"""The coordinators' lease on a real PostgreSQL server (tests/postgres.py): one holder at a time, a new epoch at each
takeover, and a deposed leader's writes refused."""

from __future__ import annotations

import secrets

import pytest

from stratamesh.coordinator.leadership import Deposed, Lease
from stratamesh.fleet.errors import InvalidInput
from tests.patience import wait_until

psycopg = pytest.importorskip("psycopg")


@pytest.fixture
def mesh() -> str:
    return f"mesh-{secrets.token_hex(4)}"       # each test its own row of the shared server


def test_one_coordinator_holds_the_lease_until_it_gives_it_up_and_each_takeover_is_a_new_epoch(
        postgres_url: str, mesh: str) -> None:
    a, b = Lease(postgres_url, mesh, "coord-a"), Lease(postgres_url, mesh, "coord-b")
    try:
        assert a.acquire() and a.epoch == 1
        assert not b.acquire() and b.epoch is None          # held, not expired
        assert a.acquire() and a.renew() and a.epoch == 1   # its holder keeps it, in the same epoch
        state = b.state()
        assert state is not None and (state.holder, state.epoch) == ("coord-a", 1) and state.expires_in_s > 0
        a.release()
        assert b.acquire() and b.epoch == 2                  # at once after a clean release
        assert not a.renew() and a.epoch is None
    finally:
        a.close()
        b.close()


def test_an_expired_lease_passes_to_a_standby_and_the_deposed_leaders_writes_are_refused(
        postgres_url: str, mesh: str) -> None:
    leader, standby = Lease(postgres_url, mesh, "coord-a", ttl_s=0.5), Lease(postgres_url, mesh, "coord-b")
    try:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f"CREATE TABLE IF NOT EXISTS plans_{mesh.replace('-', '_')} (plan text)")
        table = f"plans_{mesh.replace('-', '_')}"
        assert leader.acquire()
        with psycopg.connect(postgres_url) as conn:          # a fenced write while it leads commits
            with conn.transaction():
                leader.fence(conn)
                conn.execute(f"INSERT INTO {table} VALUES ('first')")
        wait_until(standby.acquire, timeout_s=10)            # the leader stopped renewing: its lease expires
        assert standby.epoch == 2
        with psycopg.connect(postgres_url) as conn:
            with pytest.raises(Deposed, match="coord-a no longer leads"):
                with conn.transaction():
                    conn.execute(f"INSERT INTO {table} VALUES ('late')")
                    leader.fence(conn)                        # (the check may come after a statement: rolled back)
            assert conn.execute(f"SELECT plan FROM {table}").fetchall() == [("first",)]
        assert not leader.renew() and not leader.acquire()   # it cannot take the lease back while it is held
    finally:
        leader.close()
        standby.close()


def test_a_lease_refuses_names_a_row_could_not_hold(postgres_url: str) -> None:
    with pytest.raises(InvalidInput, match="holder"):
        Lease(postgres_url, "mesh", "a holder with spaces")
    with pytest.raises(InvalidInput, match="ttl_s"):
        Lease(postgres_url, "mesh", "coord-a", ttl_s=0)
