"""Run inside a test-bed host (one with no route off the test bed): streams a few messages through a StreamPool with
an RtcDialer to three peers, and prints JSON with what happened to each: one serving a real Stage gRPC service on
this host, one at a port nobody listens on (refused), and one at an address there is no route to (ENETUNREACH),
whose agent answers data channels. `python reach_probe.py HOST_ADDRESS`."""

from __future__ import annotations

import asyncio
import json
import sys

from stratamesh.fleet.control_messages import RtcAnswer, RtcOffer
from stratamesh.fleet.sessions import Hop
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire import rtc
from stratamesh.fleet.wire.channels import bind, make_server
from stratamesh.fleet.wire.stream import RtcDialer, StreamPool

MESSAGES = [pb.StageMessage(close=pb.SessionClose(session_id=f"s{i}")) for i in range(5)]


class Stage(pb_grpc.StageServicer):
    def __init__(self) -> None:
        self.received: list[str] = []

    async def Push(self, request_iterator, context):  # noqa: ANN001, ANN201
        async for message in request_iterator:
            self.received.append(message.close.session_id)
        return pb.PushSummary()


async def main(host: str) -> dict:
    rtc.offer_addresses([host])
    stage = Stage()
    server = make_server(tls=None)
    pb_grpc.add_StageServicer_to_server(stage, server)
    port = bind(server, host, 0, tls=None)
    await server.start()

    over_rtc: list[str] = []
    offered: list[str] = []

    def on_channel(channel: rtc.DataChannel) -> None:
        async def read() -> None:
            async for data in channel.messages():
                over_rtc.append(pb.StageMessage.FromString(data).close.session_id)
        asyncio.ensure_future(read())

    async def signal(offer: RtcOffer) -> RtcAnswer:    # the coordinator's relay, in one process
        offered.append(offer.peer_id)
        answer, _ = await rtc.accept(RtcOffer(offer.call_id, "caller", offer.sdp, offer.cert_pem), on_channel, None)
        return RtcAnswer(answer.call_id, offer.peer_id, answer.sdp, answer.cert_pem, answer.error)

    broken: dict[str, str] = {}
    pool = StreamPool(lambda ch, it: pb_grpc.StageStub(ch).Push(it),
                      on_broken=lambda stream, exc: broken.setdefault(stream.address, str(exc)),
                      rtc_dialer=RtcDialer(lambda offer: signal(offer)))
    hops = {"serving": Hop(f"{host}:{port}", "a", agent_id="near"),
            "refused": Hop(f"{host}:1", "b", agent_id="down"),
            "no-route": Hop("192.168.99.7:5000", "c", agent_id="behind-nat")}
    pool.learn(hops.values())
    streams = {name: pool.get(hop.address) for name, hop in hops.items()}
    for stream in streams.values():
        for message in MESSAGES:
            stream.send(message)
    deadline = asyncio.get_running_loop().time() + 60
    while (len(stage.received) < len(MESSAGES) or len(over_rtc) < len(MESSAGES)
           or hops["refused"].address not in broken) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    result = {"transports": {name: s.transport for name, s in streams.items()},
              "grpc_received": stage.received, "rtc_received": over_rtc, "offered": offered,
              "broken": sorted(name for name, hop in hops.items() if hop.address in broken)}
    await pool.close()
    await server.stop(None)
    return result


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
