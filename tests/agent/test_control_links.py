"""Link probes over the real control plane: the coordinator asks, agents measure each other, the registry keeps it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from stratamesh.agent.control import ControlClient, Identity
from stratamesh.agent.engine.stage_engine import EngineConfig
from stratamesh.agent.stages import StageHost
from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.control.servicer import ControlService
from stratamesh.coordinator.registry import Registry
from stratamesh.fleet.links import LinkService
from stratamesh.fleet.boxes import Capabilities
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import bind, make_server
from tests.patience import eventually

CAPS = Capabilities("box", "cpu", 2, 8 << 30, 8 << 30)


@pytest.fixture
async def coordinator() -> AsyncIterator[tuple[str, Registry]]:
    registry = Registry(":memory:")
    server = make_server()
    pb_grpc.add_ControlServicer_to_server(ControlService(Deployer(registry, clock=lambda: 1.0), mesh="m1"), server)
    address = f"127.0.0.1:{bind(server, '127.0.0.1', 0)}"
    await server.start()
    yield address, registry
    await server.stop(grace=None)


async def start_agent(agent_id: str, coordinator: str) -> tuple[asyncio.Task[None], grpc.aio.Server]:
    """An agent reduced to its Link service and its control client."""
    server = make_server()
    pb_grpc.add_LinkServicer_to_server(LinkService(), server)
    address = f"127.0.0.1:{bind(server, '127.0.0.1', 0)}"
    await server.start()

    async def find() -> str:
        return coordinator

    client = ControlClient(Identity(agent_id, agent_id, address, "m1", CAPS),
                           StageHost(EngineConfig()), find)
    return asyncio.create_task(client.run()), server


async def test_connected_agents_measure_each_other_and_the_coordinator_keeps_the_links(coordinator) -> None:
    address, registry = coordinator
    agents = [await start_agent(agent_id, address) for agent_id in ("a1", "a2")]
    try:
        await eventually(lambda: len(registry.links()) == 2)
        links = registry.links()
        assert [(r.agent_id, r.peer_agent_id) for r in links] == [("a1", "a2"), ("a2", "a1")]
        assert all(r.rtt_s > 0 and r.bandwidth_bytes_per_s > 0 and not r.error for r in links)
    finally:
        for task, server in agents:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await server.stop(grace=None)
