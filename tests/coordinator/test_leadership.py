"""The coordinators' lease on a real PostgreSQL server (tests/postgres.py): one holder at a time, a new epoch at each
takeover, a deposed leader's writes refused, and the loops that take and keep it: a leader stops when another took
its lease over, or when it could not renew it (cut off from the database) for most of its time."""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
from urllib.parse import urlsplit, urlunsplit

import pytest

from stratamesh.coordinator import leadership
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


async def test_a_standby_waits_until_the_lease_is_free_or_it_is_stopped(postgres_url: str, mesh: str) -> None:
    leader, standby = Lease(postgres_url, mesh, "coord-a", ttl_s=60), Lease(postgres_url, mesh, "coord-b", ttl_s=0.5)
    try:
        assert leader.acquire()
        stop = asyncio.Event()
        waiting = asyncio.create_task(leadership.take(standby, stop))   # held for a minute: it tries, and waits
        await asyncio.to_thread(leader.release)
        assert await asyncio.wait_for(waiting, 10) and standby.epoch == 2
        stop.set()
        assert await leadership.take(leader, stop) is False      # stopped: it gives up waiting at once
    finally:
        leader.close()
        standby.close()


async def test_a_leader_whose_lease_was_taken_over_is_told_at_its_next_renewal(postgres_url: str, mesh: str) -> None:
    leader = Lease(postgres_url, mesh, "coord-a", ttl_s=0.5)
    lost: list[str] = []
    try:
        assert leader.acquire()
        keeper = asyncio.create_task(leadership.keep(leader, lost.append))
        with psycopg.connect(postgres_url, autocommit=True) as conn:   # an operator, or a standby's takeover
            conn.execute("UPDATE coordinator_lease SET holder = 'coord-b', epoch = epoch + 1 WHERE mesh = %s", (mesh,))
        await asyncio.wait_for(keeper, 10)
        assert len(lost) == 1 and "another took it over" in lost[0] and leader.epoch is None
    finally:
        leader.close()


class _Cable:
    """A TCP proxy from a port of its own to the database's: a network cable the test can cut."""

    def __init__(self, target: tuple[str, int]) -> None:
        self._target, self._pairs, self._cut = target, [], False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._cut:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._cut:
                client.close()
                return
            server = socket.create_connection(self._target)
            self._pairs += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass

    def cut(self) -> None:
        self._cut = True
        self._listener.close()
        for s in self._pairs:
            s.close()


async def test_a_leader_cut_off_from_the_database_stops_leading_before_its_lease_can_pass(
        postgres_url: str, mesh: str) -> None:
    parts = urlsplit(postgres_url)
    cable = _Cable((parts.hostname, parts.port))
    through = urlunsplit(parts._replace(netloc=f"{parts.username}@127.0.0.1:{cable.port}"))
    leader = Lease(f"{through}?connect_timeout=2", mesh, "coord-a", ttl_s=1.0)
    lost: list[str] = []
    try:
        assert leader.acquire()
        keeper = asyncio.create_task(leadership.keep(leader, lost.append))
        cable.cut()
        await asyncio.wait_for(keeper, 20)
        assert len(lost) == 1 and "could not renew" in lost[0]
        with psycopg.connect(postgres_url) as conn:     # and it writes nothing more, whatever the lease says
            with pytest.raises(Deposed):
                with conn.transaction():
                    leader.fence(conn)
    finally:
        leader.close()
