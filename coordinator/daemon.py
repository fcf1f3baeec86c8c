"""`stratamesh coordinator`: its life: a front that serves from start to stop (front.py), leading
the mesh (leader.py) from the start on SQLite, and on a PostgreSQL registry while it holds the mesh's lease
(leadership.py), standing by until then."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from stratamesh.coordinator import leadership
from stratamesh.coordinator.control.models import check_model
from stratamesh.coordinator.front import open_front
from stratamesh.coordinator.leader import take_control
from stratamesh.coordinator.leadership import Deposed, Lease, open_lease
from stratamesh.coordinator.options import CoordinatorOptions
from stratamesh.coordinator.registry_store import RegistryStore, open_registry
from stratamesh.fleet.state import is_postgres

__all__ = ["default_name", "run_coordinator"]

log = logging.getLogger(__name__)


async def run_coordinator(options: CoordinatorOptions, stop: asyncio.Event) -> None:
    """Runs the coordinator until stop is set. On SQLite it leads its mesh from the start. On a PostgreSQL registry
    it leads only while it holds the mesh's lease: until it takes it, a standby that serves the API from its own
    origin over the routes the leader writes; Deposed once it lost the lease (docs/registry.md)."""
    for model in options.models:  # a bad model folder fails here, before anything listens
        check_model(model.path, model.num_stages)
    lease = (open_lease(options.db, options.mesh, options.name or default_name(options), options.lease_ttl_s)
             if is_postgres(options.db) else None)
    lost: list[str] = []
    try:
        registry = open_registry(options.db, fence=lease.fence if lease is not None else None)
        try:
            await _serve(options, stop, registry, lease, lost)
        finally:
            registry.close()
        if lease is not None and not lost:
            await asyncio.to_thread(lease.release)     # a clean stop: a standby takes over at once
    finally:
        if lease is not None:
            lease.close()
    if lost:
        raise Deposed(lost[0])


async def _serve(options: CoordinatorOptions, stop: asyncio.Event, registry: RegistryStore, lease: Lease | None,
                 lost: list[str]) -> None:
    """Serves from the front, leading once the lease is held (at once without one), until stop is set."""
    front = await open_front(options, registry, _coordinators(lease), _leader_url(lease) if lease else None,
                             (lambda: lease.epoch) if lease else lambda: None)
    leader, tasks = None, []
    try:
        if lease is not None:
            lease.addresses = (front.http_url, front.grpc_address)
            tasks.append(asyncio.create_task(front.standby.run()))
            log.info("coordinator %s of mesh %s stands by: http %s, grpc %s", lease.holder, lease.mesh,
                     front.http_url, front.grpc_address)
            print(f"stratamesh coordinator standing by: http={front.http_url} grpc={front.grpc_address}", flush=True)
            if not await leadership.take(lease, stop):
                return
            tasks.pop().cancel()
            log.info("coordinator %s leads mesh %s (epoch %d)", lease.holder, lease.mesh, lease.epoch)
            tasks.append(asyncio.create_task(leadership.keep(lease, lambda why: (lost.append(why), stop.set()))))
        leader = await take_control(options, registry, front)
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        if leader is not None:
            await leader.close()
        await front.close()


def _coordinators(lease: Lease | None) -> Callable[[], Awaitable[dict[str, Any]]] | None:
    """What /admin/api/coordinators shows: the lease's members and state (None: a lone coordinator)."""
    if lease is None:
        return None

    async def read() -> dict[str, Any]:
        members, state = await asyncio.to_thread(lambda: (lease.members(), lease.state()))
        return {"coordinators": [asdict(m) for m in members], "lease": asdict(state) if state else None}
    return read


def _leader_url(lease: Lease) -> Callable[[], Awaitable[str | None]]:
    """Where a standby forwards the admin calls it does not answer: the HTTP API of the lease's holder."""
    async def read() -> str | None:
        members = await asyncio.to_thread(lease.members)
        return next((m.http_url for m in members if m.leads), None)
    return read


def default_name(options: CoordinatorOptions) -> str:
    """This coordinator's name in its mesh's lease when not given one: its host's, and its HTTP port."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:100]
    return f"{host}:{options.http_port}" if options.http_port else f"{host}-{os.getpid()}"
