"""The control plane over real gRPC: registration is validated, assignments flow, readiness is tracked."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.control.servicer import ControlService
from stratamesh.coordinator.registry import Registry
from stratamesh.fleet.boxes import Capabilities, Registration
from stratamesh.fleet.stages import StageStatus
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import bind, make_channel, make_server
from stratamesh.fleet.versions import PROTOCOL_VERSION
from tests.patience import eventually

CAPS = Capabilities("box", "cpu", 2, 8 << 30, 8 << 30)


@pytest.fixture
async def coordinator(tiny_model):
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: 1.0)
    server = make_server()
    pb_grpc.add_ControlServicer_to_server(ControlService(deployer, mesh="m1", heartbeat_interval_s=0.1), server)
    port = bind(server, "127.0.0.1", 0)
    await server.start()
    model_dir = tiny_model("llama", num_layers=2, hidden_size=64, intermediate_size=128)
    deployer.plans.add_model("tiny", str(model_dir), num_stages=1)
    yield f"127.0.0.1:{port}", deployer, registry
    await server.stop(grace=None)


async def connect(address: str, first: pb.AgentMessage):
    channel = make_channel(address)
    outbox: asyncio.Queue = asyncio.Queue()
    outbox.put_nowait(first)

    async def drain():
        while (message := await outbox.get()) is not None:
            yield message

    return channel, outbox, pb_grpc.ControlStub(channel).Connect(drain())


@pytest.mark.parametrize("first, code", [
    (pb.AgentMessage(heartbeat=pb.Heartbeat(seq=1)), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.AgentMessage(register=pb.Register(agent_id="a", stage_address="no-port", mesh="m1")),
     grpc.StatusCode.INVALID_ARGUMENT),
    (convert.registration_to_pb(Registration("a", "a", "127.0.0.1:5", CAPS, (), "other-mesh")),
     grpc.StatusCode.FAILED_PRECONDITION),
])
async def test_bad_registrations_are_refused_with_a_status(coordinator, first, code) -> None:
    address, deployer, _ = coordinator
    channel, _, call = await connect(address, first)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in call:
            pass
    assert caught.value.code() == code
    assert deployer.roster.num_agents == 0
    await channel.close()


async def test_an_agent_is_welcomed_assigned_and_becomes_ready(coordinator) -> None:
    address, deployer, registry = coordinator
    reg = Registration("agent-1", "box", "127.0.0.1:5555", CAPS, (), "m1", protocol_version=PROTOCOL_VERSION)
    channel, outbox, call = await connect(address, convert.registration_to_pb(reg))
    welcome = await asyncio.wait_for(call.read(), 5)
    assert welcome.welcome.agent_id == "agent-1" and welcome.welcome.heartbeat_interval_s == pytest.approx(0.1)
    assign = await asyncio.wait_for(call.read(), 5)
    assert (assign.assign.stage.start_layer, assign.assign.stage.end_layer) == (0, 2)
    assert not deployer.routes.is_ready("tiny")
    outbox.put_nowait(convert.stage_status_to_pb(StageStatus(assign.assign.assignment_id, "ready")))
    outbox.put_nowait(convert.heartbeat_to_pb(1, 0))
    await eventually(lambda: deployer.routes.is_ready("tiny"))
    assert [hop.address for _, hops in deployer.routes.hops(deployer.routes.ready_plans("tiny")) for hop in hops] == [
        "127.0.0.1:5555"]
    assert registry.agent("agent-1").state == "connected"
    await channel.close()
    await eventually(lambda: deployer.roster.num_agents == 0)
    assert not deployer.routes.is_ready("tiny") and registry.agent("agent-1").state == "disconnected"
