"""A mesh across a WAN test bed: the coordinator and one agent in the cloud, two agents on an edge site behind NAT,
in a pipeline edge -> cloud -> edge. Nobody can dial the edge agents: the cloud agent and the coordinator's origin
reach them over WebRTC data channels signalled through the coordinator."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stratamesh.fleet import pki
from stratamesh.launcher import LocalMesh
from stratamesh.testbed.netbed import Netbed, NetbedUnavailable, check_can_build, nat_tool
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import MeshTls, make_channel

from .reference import encode, greedy_tokens

pytestmark = pytest.mark.slow

PROMPT = "The edge box runs the first layers, the cloud the middle ones, and the edge again the last"


@pytest.fixture
def netbed() -> Iterator[Netbed]:
    prefix = f"sm-{secrets.token_hex(3)}"
    try:
        check_can_build(prefix)
        nat_tool()
    except NetbedUnavailable as exc:
        pytest.skip(f"the WAN test bed cannot run here: {exc}")
    with Netbed(prefix) as bed:
        yield bed
    assert bed.leftovers() == []


def transport_messages(mesh: LocalMesh, index: int) -> dict[tuple[str, str, str], float]:
    """An agent's stratamesh:transport_messages by (peer, transport, direction)."""
    text = mesh.metrics_text(index)
    return {(s.labels["peer"], s.labels["transport"], s.labels["direction"]): s.value
            for family in text_string_to_metric_families(text) if family.name == "stratamesh:transport_messages"
            for s in family.samples if s.name.endswith("_total")}


def test_an_edge_site_behind_nat_serves_through_webrtc(netbed: Netbed, tiny_models: dict[str, Path],
                                                        tmp_path: Path) -> None:
    netbed.attach_here()
    cloud, gpu_box = netbed.add_host("cloud"), netbed.add_host("gpu")
    netbed.add_site("edge")
    box1, box2 = netbed.add_site_host("edge", "box1"), netbed.add_site_host("edge", "box2")
    model_dir = tiny_models["llama"]
    mesh = LocalMesh(str(model_dir), num_agents=3, num_stages=3, threads_per_agent=1, coordinator_host=cloud,
                     agent_hosts={0: box1, 1: gpu_box, 2: box2}, log_dir=str(tmp_path / "logs"),
                     coordinator_args=["--first-site", "edge", "--last-site", "edge"])
    with mesh:
        prompt_ids = encode(model_dir, PROMPT)
        body = {"model": model_dir.name, "prompt": prompt_ids, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        response = httpx.post(f"{mesh.url}/v1/completions", json=body, timeout=120, headers=mesh.headers)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == greedy_tokens(model_dir, prompt_ids, 24)

        plans = httpx.get(f"{mesh.url}/admin/api/plans", headers=mesh.headers, timeout=30).json()["plans"]
        order = [mesh.agent_ids.index(stage["agent_id"]) for stage in plans[0]["stages"]]
        assert [mesh.agent_hosts[index].site for index in order] == ["edge", "", "edge"]
        first, middle, last = order
        counts = {index: transport_messages(mesh, index) for index in order}
        address = mesh.agent_addresses
        # edge -> cloud: the edge box dials out over gRPC; cloud -> edge: the cloud agent cannot dial the last
        # stage, and reaches it over a data channel; the last stage feeds tokens to the first inside the site
        assert counts[first].get((address[middle], "grpc", "sent"), 0) > 0
        assert counts[middle].get((address[last], "webrtc", "sent"), 0) > 0
        assert counts[middle].get((address[last], "grpc", "sent"), 0) == 0
        assert counts[last].get((mesh.agent_ids[middle], "webrtc", "received"), 0) > 0
        assert counts[last].get((address[first], "grpc", "sent"), 0) > 0
        # the coordinator's origin reaches the first stage the same way
        assert counts[first].get(("coordinator", "webrtc", "received"), 0) > 0

        # a peer holding a certificate it signed itself cannot open the control stream that signalling goes
        # through, nor a stage's stream
        key, cert = pki.create_ca(mesh.agent_ids[1], time.time())
        rogue = MeshTls(mesh.client_tls().ca_pem, cert, key)
        for target, call in ((mesh.grpc_address, lambda ch: pb_grpc.ControlStub(ch).Connect(_no_requests())),
                             (address[middle], lambda ch: pb_grpc.StageStub(ch).Info(pb.StageInfoRequest()))):
            with pytest.raises(grpc.RpcError) as refused:
                run_sync(target, rogue, call)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def _no_requests() -> AsyncIterator[pb.AgentMessage]:
    """A request stream that sends nothing until the call ends: the answer decides (an ended request stream would
    be written as the handshake fails, and gRPC then cancels the call locally instead of reporting the refusal)."""
    await asyncio.Event().wait()
    yield pb.AgentMessage()


def run_sync(address: str, tls: MeshTls, call) -> None:  # noqa: ANN001
    """Makes call(channel) over a channel to address that presents tls, to its end (an RpcError if refused)."""
    async def go() -> None:
        channel = make_channel(address, tls)
        try:
            result = call(channel)
            if hasattr(result, "__aiter__"):
                async for _ in result:
                    pass
            else:
                await result
        finally:
            await channel.close()

    asyncio.run(asyncio.wait_for(go(), 60))
