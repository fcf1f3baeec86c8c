"""The drain driver and its admin API: refusals by name, the stages first, then the sessions, then the agent."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from stratamesh.coordinator.mesh_admin import MeshAdmin
from stratamesh.coordinator.api.admin import admin_router
from stratamesh.coordinator.control.drainer import Drainer
from stratamesh.coordinator.serving.records import RequestLog
from stratamesh.coordinator.serving.sessions import SessionTable
from tests.coordinator.test_deployer import (connect_all, model_dir, ready_pair, report_ready,  # noqa: F401
                                           shutdowns)


async def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_drain_through_the_admin_api_from_request_to_the_agent_told_to_exit(model_dir: Path) -> None:
    registry, deployer, (a1, a2, spare) = ready_pair(model_dir, [100.0])
    drainer = Drainer(deployer, SessionTable(), registry)
    app = FastAPI()
    app.include_router(admin_router(MeshAdmin(registry, RequestLog(), {}, drainer)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mesh") as client:
        missing = await client.post("/admin/api/agents/nobody/drain")
        assert missing.status_code == 404 and "not connected" in missing.json()["error"]["message"]

        started = await client.post("/admin/api/agents/a2/drain")
        assert started.status_code == 202
        drain = started.json()["drain"]
        layers = next([s.spec.start_layer, s.spec.end_layer] for s in registry.active_plan("m").stages
                      if s.agent_id == "a2")
        assert drain["state"] == "moving_stages"
        assert drain["stages"] == [{"model": "m", "layers": layers, "from": "a2", "to": "a3"}]

        again = await client.post("/admin/api/agents/a2/drain")
        assert again.status_code == 409 and "already" in again.json()["error"]["message"]
        refused = await client.post("/admin/api/agents/a1/drain")   # the only spare is taken
        assert refused.status_code == 409 and "no spare agent" in refused.json()["error"]["message"]

        await asyncio.sleep(0.1)
        assert (await client.get("/admin/api/agents/a2/drain")).json()["drain"]["state"] == "moving_stages"
        report_ready(deployer, [spare])                 # the replacement loaded: sessions move, then a2 goes
        await wait_for(lambda: drainer.status("a2").state == "drained")
        assert shutdowns(a2) and registry.agent("a2").state == "drained"
        assert (await client.get("/admin/api/agents/a1/drain")).status_code == 404
    await drainer.close()


async def test_a_drain_whose_replacement_fails_to_load_fails_and_the_agent_stays(model_dir: Path) -> None:
    from stratamesh.fleet.stages import StageStatus

    registry, deployer, (a1, a2, spare) = ready_pair(model_dir, [100.0])
    drainer = Drainer(deployer, SessionTable(), registry)
    status = drainer.start("a1")
    new_id = deployer.drains.replacing("a1")[0][1].assignment_id
    deployer.stage_status("a3", StageStatus(new_id, "failed", "disk full"))
    await wait_for(lambda: status.state == "failed")
    assert "disk full" in status.error and not shutdowns(a1)
    assert "a1" in deployer.plans.plannable()               # planned on again
    await drainer.close()


def test_kv_moves_only_to_stages_that_replace_one_at_the_same_position() -> None:
    from stratamesh.coordinator.serving.kv_moves import replaced_hops
    from stratamesh.fleet.sessions import Hop

    old = [Hop("h1:1", "p-0"), Hop("h2:1", "p-1"), Hop("h3:1", "p-2")]
    new = [old[0], Hop("h4:1", "p-1-m1"), old[2]]
    assert replaced_hops(old, new) == [(old[1], new[1])]
    assert replaced_hops(old, old) == []
    assert replaced_hops(old, new[:2]) == []          # another stage count: other layer ranges, nothing moves


@pytest.fixture(params=["sqlite", "postgresql"])
def registry_location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where the coordinators of a test keep their registry: an SQLite file, or a PostgreSQL database."""
    if request.param == "postgresql":
        return request.getfixturevalue("postgres_database")
    return str(tmp_path / "registry.db")


async def test_a_restarted_coordinator_takes_up_a_drain_it_left_half_done(model_dir: Path,
                                                                          registry_location: str) -> None:
    from stratamesh.coordinator.control.deployer import Deployer
    from stratamesh.coordinator.liveness import LivenessConfig
    from stratamesh.coordinator.registry_store import open_registry

    registry, deployer, (a1, a2, spare) = ready_pair(model_dir, [100.0], registry=open_registry(registry_location))
    first = Drainer(deployer, SessionTable(), registry)
    first.start("a2")
    await first.close()                          # it stops before the replacement loaded
    registry.close()

    # The next coordinator, on the registry it opens anew; the agents connect again, the only spare last.
    registry = open_registry(registry_location)
    assert [(d.agent_id, d.state, d.resumed) for d in registry.drains()] == [("a2", "moving_stages", 0)]
    deployer = Deployer(registry, clock=lambda: 200.0, liveness=LivenessConfig(lease_s=2.0))
    drainer = Drainer(deployer, SessionTable(), registry)
    assert [d.agent_id for d in drainer.resume()] == ["a2"]
    connect_all(deployer, [a1, a2])
    report_ready(deployer, [a1, a2])
    await asyncio.sleep(0)                       # the resume looks: no spare yet, so it waits for one
    assert drainer.status("a2").state == "moving_stages" and not shutdowns(a2)
    sent = len(spare.assignments())
    connect_all(deployer, [spare])
    await wait_for(lambda: len(spare.assignments()) > sent)
    report_ready(deployer, [spare])
    await wait_for(lambda: drainer.status("a2").state == "drained")
    assert shutdowns(a2) and registry.agent("a2").state == "drained"
    (stored,) = registry.drains()
    assert (stored.state, stored.resumed, stored.finished_unix_s > 0) == ("drained", 1, True)
    assert [m["to"] for m in stored.stages] == ["a3"]
    await drainer.close()
    registry.close()


async def test_an_agent_whose_owner_asks_it_to_rest_moves_its_stages_stays_and_serves_again(model_dir: Path) -> None:
    from stratamesh.coordinator.control.deployer import Deployer
    from stratamesh.coordinator.liveness import LivenessConfig
    from stratamesh.coordinator.registry import Registry
    from stratamesh.fleet.boxes import Telemetry
    from tests.coordinator.test_deployer import Agent, released

    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: 100.0, liveness=LivenessConfig(lease_s=2.0))
    a1, a2, spare = Agent("a1", 8), Agent("a2", 8), Agent("a3", 8)
    deployer.plans.add_model("m", str(model_dir), num_stages=2)
    connect_all(deployer, [a1, a2])
    report_ready(deployer, [a1, a2])
    connect_all(deployer, [spare])
    drainer = Drainer(deployer, SessionTable(), registry)
    deployer.on_rest = drainer.rest
    hot = "at 90 C, above 80 C"
    deployer.heartbeat("a2", Telemetry(100.0, resting=hot))
    status = drainer.status("a2")
    assert (status.rest, status.state) == (hot, "moving_stages") and "a2" not in deployer.plans.plannable()
    deployer.heartbeat("a2", Telemetry(100.5, resting=hot))            # said with every heartbeat: one rest
    assert drainer.status("a2") is status
    report_ready(deployer, [spare])                                      # the replacement loaded
    await wait_for(lambda: status.state == "drained")
    assert not shutdowns(a2) and released(a2) and deployer.roster.stage_address("a2")   # it stays, holding nothing
    assert registry.agent("a2").state == "resting" and "a2" not in deployer.plans.plannable()
    assert all(s.agent_id != "a2" for s in registry.active_plan("m").stages)
    deployer.heartbeat("a2", Telemetry(400.0))                           # its owner's limits allow it again
    assert registry.agent("a2").state == "connected" and "a2" in deployer.plans.plannable()
    kinds = [(e.kind, e.detail) for e in registry.events() if e.agent_id == "a2"]
    assert ("agent_resting", hot) in kinds and any(k == "agent_serving" for k, _ in kinds)
    deployer.heartbeat("a2", Telemetry(401.0, resting=hot))            # and may rest again later
    assert drainer.status("a2") is not status and drainer.status("a2").rest == hot
    await drainer.close()


async def test_a_rest_no_spare_can_take_says_why_keeps_serving_and_begins_once_a_spare_joins(model_dir: Path) -> None:
    from stratamesh.coordinator.control.deployer import REST_RETRY_S, Deployer
    from stratamesh.coordinator.liveness import LivenessConfig
    from stratamesh.coordinator.registry import Registry
    from stratamesh.fleet.boxes import Telemetry
    from tests.coordinator.test_deployer import Agent

    now = [100.0]
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: now[0], liveness=LivenessConfig(lease_s=1e9))
    a1, a2, spare = Agent("a1", 8), Agent("a2", 8), Agent("a3", 8)
    deployer.plans.add_model("m", str(model_dir), num_stages=2)
    connect_all(deployer, [a1, a2])
    report_ready(deployer, [a1, a2])
    drainer = Drainer(deployer, SessionTable(), registry)
    deployer.on_rest = drainer.rest
    hot = "at 90 C, above 80 C"
    deployer.heartbeat("a2", Telemetry(now[0], resting=hot))              # no spare: it cannot rest
    blocked = [e.detail for e in registry.events() if e.kind == "agent_rest_blocked"]
    assert len(blocked) == 1 and hot in blocked[0] and "spare" in blocked[0]
    assert "a2" in deployer.plans.plannable() and registry.agent("a2").state == "connected"   # it serves on
    assert any(s.agent_id == "a2" for s in registry.active_plan("m").stages)
    connect_all(deployer, [spare])
    now[0] += REST_RETRY_S / 2
    deployer.heartbeat("a2", Telemetry(now[0], resting=hot))              # not asked again yet
    assert not any(d.agent_id == "a2" for d in drainer.all())
    now[0] += REST_RETRY_S / 2
    deployer.heartbeat("a2", Telemetry(now[0], resting=hot))              # asked again: a spare can take it now
    status = drainer.status("a2")
    assert (status.rest, status.state) == (hot, "moving_stages") and "a2" not in deployer.plans.plannable()
    report_ready(deployer, [spare])
    await wait_for(lambda: status.state == "drained")
    assert registry.agent("a2").state == "resting"
    assert len([e for e in registry.events() if e.kind == "agent_rest_blocked"]) == 1   # said once, not per retry
    await drainer.close()
