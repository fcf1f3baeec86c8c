"""Who of several coordinators on one PostgreSQL leads: a lease row, not consensus written here, and not an advisory
lock (docs/registry.md section 5 says why).

One row per mesh holds the leader's name, an epoch that grows by one at every takeover (the fencing token), and when
the lease expires, on the database's clock only (so the coordinators' clocks do not matter). A coordinator takes the
lease when it has expired (or was never held), keeps it by renewing it well within its time, and checks it at the
start of every write transaction (`fence`): the check holds a share lock on the row, so a takeover waits for the
leader's writes in flight, and once a takeover has committed every later write of the old leader fails with Deposed.
This module needs psycopg 3 (the `postgres` extra)."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stratamesh.fleet.errors import InvalidInput, MeshError

LEASE_TTL_S = 10.0          # a lease not renewed for this long passes to whoever takes it
RENEW_SHARE = 0.2           # a leader renews its lease every this share of its time (2 s of 10)
GIVE_UP_SHARE = 0.7         # ... and stops leading once it could not renew it for this share (7 s of 10), before
                            # a standby can take it over: a leader cut off from the database stops by itself
log = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9._:@-]{1,200}")

_SCHEMA = """CREATE TABLE IF NOT EXISTS coordinator_lease (
    mesh text PRIMARY KEY,
    holder text NOT NULL,
    epoch bigint NOT NULL,
    expires timestamptz NOT NULL);
CREATE TABLE IF NOT EXISTS coordinators (
    mesh text NOT NULL,
    name text NOT NULL,
    http_url text NOT NULL,
    grpc_address text NOT NULL,
    seen timestamptz NOT NULL,
    PRIMARY KEY (mesh, name))"""
MEMBER_FOR_TTLS = 3         # a coordinator not heard from for this many lease times is no longer listed


class Deposed(MeshError):
    """This coordinator no longer holds the lease: another took it over. It must stop writing, and exit."""


@dataclass(frozen=True, slots=True)
class Member:
    """A coordinator of the mesh, as it last announced itself: where its APIs listen, whether it leads, and how long
    ago it was last heard of."""

    name: str
    http_url: str
    grpc_address: str
    leads: bool
    seen_s_ago: float


@dataclass(frozen=True, slots=True)
class LeaseState:
    """The lease as the database has it: who holds it, its epoch, and the seconds until it expires (< 0: expired)."""

    holder: str
    epoch: int
    expires_in_s: float


class Lease:
    """This coordinator's view of its mesh's lease, over a connection of its own (each statement commits at once)."""

    def __init__(self, conninfo: str, mesh: str, holder: str, ttl_s: float = LEASE_TTL_S) -> None:
        for what, value in (("mesh", mesh), ("holder", holder)):
            if not _NAME.fullmatch(value):
                raise InvalidInput(f"lease {what} {value!r} must be 1..200 letters, digits or ._:@-")
        if ttl_s <= 0:
            raise InvalidInput(f"lease ttl_s must be > 0, got {ttl_s}")
        self.mesh, self.holder, self.ttl_s = mesh, holder, ttl_s
        self.epoch: int | None = None       # the epoch it holds the lease in; None: it does not hold it
        self.addresses: tuple[str, str] | None = None   # its (HTTP URL, gRPC address): take and keep announce them
        self._conninfo = conninfo
        self._lock = threading.Lock()      # the lease's loop and the admin API's reads share the connection
        self._conn = self._connect()
        self._conn.execute(_SCHEMA)

    def _connect(self) -> Any:
        import psycopg     # (the postgres extra: only a coordinator on PostgreSQL needs it)

        return psycopg.connect(self._conninfo, autocommit=True, application_name="stratamesh-lease")

    def _execute(self, sql: str, params: tuple[Any, ...]) -> Any:
        """One statement on the lease's own connection, connecting again first if the last one broke (the database
        restarted, or failed over to its standby)."""
        with self._lock:
            if self._conn.closed:
                self._conn = self._connect()
            try:
                return self._conn.execute(sql, params)
            except Exception:
                if self._conn.broken:
                    self._conn.close()
                raise

    def acquire(self) -> bool:
        """Takes the lease if it is free (never held, or expired), in a new epoch; whether this coordinator holds it
        now (it may hold it already)."""
        if self.epoch is not None and self.renew():
            return True
        ttl = f"{self.ttl_s} seconds"
        row = self._execute(
            "INSERT INTO coordinator_lease (mesh, holder, epoch, expires) "
            "VALUES (%s, %s, 1, clock_timestamp() + %s::interval) ON CONFLICT (mesh) DO NOTHING RETURNING epoch",
            (self.mesh, self.holder, ttl)).fetchone()
        if row is None:
            row = self._execute(
                "UPDATE coordinator_lease SET holder = %s, epoch = epoch + 1, expires = clock_timestamp() + "
                "%s::interval WHERE mesh = %s AND expires < clock_timestamp() RETURNING epoch",
                (self.holder, ttl, self.mesh)).fetchone()
        self.epoch = row[0] if row is not None else None
        return self.epoch is not None

    def renew(self) -> bool:
        """Extends the lease this coordinator holds; False (and it holds none) if it was taken over meanwhile."""
        if self.epoch is None:
            return False
        renewed = self._execute(
            "UPDATE coordinator_lease SET expires = clock_timestamp() + %s::interval "
            "WHERE mesh = %s AND holder = %s AND epoch = %s", (f"{self.ttl_s} seconds", self.mesh, self.holder,
                                                              self.epoch)).rowcount
        if not renewed:
            self.epoch = None
        return bool(renewed)

    def fence(self, cursor: Any) -> None:
        """Checks, inside the caller's write transaction (a psycopg cursor or connection of the same database), that
        this coordinator still holds the lease, and keeps it share-locked to the transaction's end; Deposed if not
        (the caller rolls back)."""
        row = None if self.epoch is None else cursor.execute(
            "SELECT 1 FROM coordinator_lease WHERE mesh = %s AND holder = %s AND epoch = %s FOR SHARE",
            (self.mesh, self.holder, self.epoch)).fetchone()
        if row is None:
            self.epoch = None
            raise Deposed(f"coordinator {self.holder} no longer leads mesh {self.mesh}: another took its lease over")

    def release(self) -> None:
        """Gives the lease up at once (a clean shutdown: a standby takes over without waiting for it to expire)."""
        if self.epoch is not None:
            self._execute("UPDATE coordinator_lease SET expires = clock_timestamp() WHERE mesh = %s AND "
                          "holder = %s AND epoch = %s", (self.mesh, self.holder, self.epoch))
            self.epoch = None

    def state(self) -> LeaseState | None:
        """The lease as it stands (None: never held)."""
        row = self._execute(
            "SELECT holder, epoch, extract(epoch FROM expires - clock_timestamp()) FROM coordinator_lease "
            "WHERE mesh = %s", (self.mesh,)).fetchone()
        return None if row is None else LeaseState(row[0], row[1], float(row[2]))

    def announce(self, http_url: str, grpc_address: str) -> None:
        """Says where this coordinator's APIs listen (what members() lists, and where a follower forwards writes)."""
        self._execute("INSERT INTO coordinators (mesh, name, http_url, grpc_address, seen) VALUES "
                      "(%s, %s, %s, %s, clock_timestamp()) ON CONFLICT (mesh, name) DO UPDATE SET http_url = "
                      "excluded.http_url, grpc_address = excluded.grpc_address, seen = excluded.seen",
                      (self.mesh, self.holder, http_url, grpc_address))

    def members(self) -> list[Member]:
        """The mesh's coordinators heard of within MEMBER_FOR_TTLS lease times, the leader first, then by name."""
        rows = self._execute(
            "SELECT c.name, c.http_url, c.grpc_address, l.holder IS NOT NULL, "
            "extract(epoch FROM clock_timestamp() - c.seen) FROM coordinators c LEFT JOIN coordinator_lease l ON "
            "l.mesh = c.mesh AND l.holder = c.name AND l.expires > clock_timestamp() WHERE c.mesh = %s AND "
            "c.seen > clock_timestamp() - %s::interval ORDER BY 4 DESC, c.name",
            (self.mesh, f"{self.ttl_s * MEMBER_FOR_TTLS} seconds")).fetchall()
        return [Member(name, http_url, grpc, leads, float(ago)) for name, http_url, grpc, leads, ago in rows]

    def close(self) -> None:
        self._conn.close()


def open_lease(conninfo: str, mesh: str, holder: str, ttl_s: float = LEASE_TTL_S) -> Lease:
    """A coordinator's view of its mesh's lease on the registry's PostgreSQL (RegistryUnavailable if it does not
    answer, naming it without its password)."""
    import psycopg

    from stratamesh.coordinator.registry_store import RegistryUnavailable, postgres_name

    try:
        return Lease(conninfo, mesh, holder, ttl_s)
    except psycopg.OperationalError as exc:
        raise RegistryUnavailable(f"cannot reach the lease at {postgres_name(conninfo)}: {exc}") from None


async def take(lease: Lease, stop: asyncio.Event) -> bool:
    """Waits until this coordinator holds the lease (True), trying every RENEW_SHARE of its time, or until stop is
    set (False). A database that does not answer is tried again."""
    said = False
    while not stop.is_set():
        try:
            if lease.addresses is not None:
                await asyncio.to_thread(lease.announce, *lease.addresses)
            if await asyncio.to_thread(lease.acquire):
                return True
            if not said:
                state = await asyncio.to_thread(lease.state)
                log.info("standing by for mesh %s: %s leads (epoch %d)", lease.mesh, state.holder if state else "-",
                         state.epoch if state else 0)
                said = True
        except Exception as exc:  # (psycopg's errors: the database is down or failing over)
            log.warning("cannot reach the lease of mesh %s: %s", lease.mesh, exc)
        try:
            await asyncio.wait_for(stop.wait(), lease.ttl_s * RENEW_SHARE)
        except TimeoutError:
            pass
    return False


async def keep(lease: Lease, on_lost: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
    """Renews the lease this coordinator holds every RENEW_SHARE of its time until cancelled; calls on_lost(why)
    and returns once another took it over, or it could not be renewed for GIVE_UP_SHARE of its time."""
    renewed_at = clock()
    while True:
        await asyncio.sleep(lease.ttl_s * RENEW_SHARE)
        try:
            if lease.addresses is not None:
                await asyncio.to_thread(lease.announce, *lease.addresses)
            if not await asyncio.to_thread(lease.renew):
                on_lost(f"coordinator {lease.holder} lost the lease of mesh {lease.mesh}: another took it over")
                return
            renewed_at = clock()
        except Exception as exc:  # (psycopg's errors)
            log.warning("could not renew the lease of mesh %s: %s", lease.mesh, exc)
            if clock() - renewed_at >= lease.ttl_s * GIVE_UP_SHARE:
                lease.epoch = None      # it may have expired by now: this coordinator writes nothing more
                on_lost(f"coordinator {lease.holder} could not renew the lease of mesh {lease.mesh} for "
                        f"{clock() - renewed_at:.1f} s: it stops leading before another may take it over")
                return
