"""The agent's control stream over real gRPC: a bad message from the coordinator is skipped (a bad assignment is
reported failed), and the stream goes on."""

from __future__ import annotations

import asyncio
import socket

from stratamesh.agent.control import ControlClient, Identity
from stratamesh.agent.daemon import AgentOptions, coordinator_finder
from stratamesh.agent.engine.stage_engine import EngineConfig
from stratamesh.agent.stages import StageHost
from stratamesh.fleet import discovery
from stratamesh.fleet.boxes import Capabilities, Registration
from stratamesh.fleet.control_messages import AgentMessage, Heartbeat, Welcome
from stratamesh.fleet.stages import StageStatus
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import bind, make_server

CAPS = Capabilities("box", "cpu", 2, 8 << 30, 8 << 30)
BAD_STAGE = pb.StageSpec(model_id="m", start_layer=0, end_layer=2, num_layers=4, dtype="float64")


class ScriptedCoordinator(pb_grpc.ControlServicer):
    """Sends each agent that connects the same messages, then holds its stream open; keeps what the agents send."""

    def __init__(self, script: list[pb.CoordinatorMessage]):
        self.script = script
        self.received: asyncio.Queue[AgentMessage] = asyncio.Queue()
        self.num_connects = 0

    async def Connect(self, request_iterator, context) -> None:
        self.num_connects += 1
        reader = asyncio.create_task(self._read(request_iterator))
        try:
            for message in self.script:
                await context.write(message)
            await asyncio.Event().wait()
        finally:
            reader.cancel()

    async def _read(self, request_iterator) -> None:
        async for message in request_iterator:
            self.received.put_nowait(convert.agent_message_from_pb(message))


async def test_bad_messages_from_the_coordinator_are_skipped_and_the_stream_goes_on() -> None:
    coordinator = ScriptedCoordinator([
        pb.CoordinatorMessage(revocations=pb.Revocations(serials=["not-hex"])),
        pb.CoordinatorMessage(rtc_answer=pb.RtcAnswer(call_id="c", peer_id="a")),
        pb.CoordinatorMessage(assign=pb.Assignment(assignment_id="p-9", stage=BAD_STAGE)),
        pb.CoordinatorMessage(),
        convert.coordinator_message_to_pb(Welcome("a1", 0.05)),
    ])
    server = make_server()
    pb_grpc.add_ControlServicer_to_server(coordinator, server)
    address = f"127.0.0.1:{bind(server, '127.0.0.1', 0)}"
    await server.start()

    async def find() -> str:
        return address

    client = ControlClient(Identity("a1", "a1", "127.0.0.1:1", "m1", CAPS), StageHost(EngineConfig()), find)
    task = asyncio.create_task(client.run())
    try:
        received: list[AgentMessage] = []
        async with asyncio.timeout(10):     # a stream the bad messages kill redials, and registers again, forever
            while not any(isinstance(m, Heartbeat) for m in received):
                received.append(await coordinator.received.get())
        assert isinstance(received[0], Registration) and received[0].agent_id == "a1"
        failed = [m for m in received if isinstance(m, StageStatus)]
        assert [(s.assignment_id, s.state) for s in failed] == [("p-9", "failed")] and "dtype" in failed[0].error
        assert client.connected.is_set() and coordinator.num_connects == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await server.stop(grace=None)


async def test_an_agent_given_several_coordinators_goes_on_at_the_next_when_one_cannot_be_reached() -> None:
    """--coordinator A,B: the control stream dials A, which is down, then B, where the agent registers."""
    coordinator = ScriptedCoordinator([convert.coordinator_message_to_pb(Welcome("a1", 0.05))])
    server = make_server()
    pb_grpc.add_ControlServicer_to_server(coordinator, server)
    address = f"127.0.0.1:{bind(server, '127.0.0.1', 0)}"
    await server.start()
    with socket.socket() as free:                         # a port nobody listens on
        free.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{free.getsockname()[1]}"
    options = AgentOptions(mesh="m1", coordinator=f"{dead}, {address}")
    browser = discovery.Browser(["127.0.0.1"])              # (never asked: the addresses were given)
    find = coordinator_finder(options, browser)
    assert [await find() for _ in range(3)] == [dead, address, dead]       # in turn, round and round
    client = ControlClient(Identity("a1", "a1", "127.0.0.1:1", "m1", CAPS), StageHost(EngineConfig()),
                           coordinator_finder(options, browser), retry_s=0.01)
    task = asyncio.create_task(client.run())
    try:
        async with asyncio.timeout(10):
            await client.connected.wait()
            registration = await coordinator.received.get()
        assert isinstance(registration, Registration) and registration.agent_id == "a1"
    finally:
        task.cancel()
        await server.stop(None)
        await browser.close()
