"""The coordinator's WebRTC signalling: offers reach their callee naming the real caller, answers go back only to
the caller of that call, and an agent is NAT'd only when it cannot be dialed where it says it serves."""

from __future__ import annotations

import asyncio

import pytest

from stratamesh.coordinator.control.rtc_relay import RtcRelay, nat_address
from stratamesh.fleet.control_messages import RtcAnswer, RtcOffer


class Agents:
    """Connected agents' control streams: what the relay sent each."""

    def __init__(self, *connected: str):
        self.inbox: dict[str, list[RtcOffer | RtcAnswer]] = {a: [] for a in connected}

    def send(self, agent_id: str, message: RtcOffer | RtcAnswer) -> bool:
        if agent_id not in self.inbox:
            return False
        self.inbox[agent_id].append(message)
        return True


def test_an_offer_reaches_its_callee_naming_the_caller_and_the_answer_comes_back() -> None:
    agents = Agents("cloud-1", "edge-1")
    relay = RtcRelay(agents.send, "coordinator")
    relay.offer_from("cloud-1", RtcOffer("c1", "edge-1", "offer-sdp", b"cert"))
    assert agents.inbox["edge-1"] == [RtcOffer("c1", "cloud-1", "offer-sdp", b"cert")]
    relay.answer_from("edge-1", RtcAnswer("c1", "cloud-1", "answer-sdp", b"edge-cert"))
    assert agents.inbox["cloud-1"] == [RtcAnswer("c1", "edge-1", "answer-sdp", b"edge-cert")]


def test_only_the_callee_can_answer_a_call_and_only_once() -> None:
    agents = Agents("cloud-1", "edge-1", "edge-2")
    relay = RtcRelay(agents.send, "coordinator")
    relay.offer_from("cloud-1", RtcOffer("c1", "edge-1", "offer-sdp"))
    relay.answer_from("edge-2", RtcAnswer("c1", "cloud-1", "forged"))     # not the callee
    relay.answer_from("edge-1", RtcAnswer("c2", "cloud-1", "unknown call"))
    assert agents.inbox["cloud-1"] == []
    relay.answer_from("edge-1", RtcAnswer("c1", "cloud-1", "answer-sdp"))
    relay.answer_from("edge-1", RtcAnswer("c1", "cloud-1", "again"))
    assert [a.sdp for a in agents.inbox["cloud-1"]] == ["answer-sdp"]


def test_an_offer_to_an_agent_not_connected_is_refused_to_its_caller() -> None:
    agents = Agents("cloud-1")
    relay = RtcRelay(agents.send, "coordinator")
    relay.offer_from("cloud-1", RtcOffer("c1", "edge-9", "offer-sdp"))
    relay.offer_from("cloud-1", RtcOffer("c2", "cloud-1", "to itself"))
    assert [(a.call_id, a.error) for a in agents.inbox["cloud-1"]] == [
        ("c1", "agent edge-9 is not connected"), ("c2", "agent cloud-1 is not connected")]


async def test_the_coordinators_own_offer_waits_for_its_answer() -> None:
    agents = Agents("edge-1")
    relay = RtcRelay(agents.send, "coordinator")
    pending = asyncio.ensure_future(relay.offer(RtcOffer("c1", "edge-1", "offer-sdp", b"coordinator-cert")))
    while not agents.inbox["edge-1"]:
        await asyncio.sleep(0)
    assert agents.inbox["edge-1"] == [RtcOffer("c1", "coordinator", "offer-sdp", b"coordinator-cert")]
    relay.answer_from("edge-1", RtcAnswer("c1", "coordinator", "answer-sdp"))
    assert await pending == RtcAnswer("c1", "edge-1", "answer-sdp")
    assert (await relay.offer(RtcOffer("c2", "edge-7", "x"))).error == "agent edge-7 is not connected"


async def test_an_agent_seen_where_it_serves_or_that_can_be_dialed_there_is_not_behind_nat() -> None:
    """(An agent that cannot be dialed where it serves is NAT'd: tests/e2e/test_nat.py, on a test bed, since only a
    host without routes off the bed can try an address nobody reaches.)"""
    server = await asyncio.start_server(lambda reader, writer: writer.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        # seen where it serves, or over loopback: not NAT'd, whatever else
        assert await nat_address("ipv4:10.1.2.3:4000", "10.1.2.3:7000") == ""
        assert await nat_address("ipv4:127.0.0.1:4000", "192.168.1.5:7000") == ""
        assert await nat_address("unix:/tmp/x", "192.168.1.5:7000") == ""
        # seen from elsewhere, but it can be dialed where it serves (a box with two addresses): not NAT'd
        assert await nat_address("ipv4:10.9.9.9:4000", f"127.0.0.1:{port}") == ""
        assert await nat_address("ipv6:[2001:db8::7]:4000", f"127.0.0.1:{port}") == ""


@pytest.mark.parametrize("peer", ["ipv4:not-an-ip:1", "ipv4:", ""])
async def test_a_peer_string_without_an_address_is_not_nat(peer: str) -> None:
    assert await nat_address(peer, "192.168.1.5:7000") == ""
