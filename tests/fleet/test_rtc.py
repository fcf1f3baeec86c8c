"""WebRTC data channels between two real aiortc peers in this process (ICE over loopback), with mesh certificates."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from stratamesh.fleet import pki
from stratamesh.fleet.control_messages import RtcAnswer, RtcOffer
from stratamesh.fleet.wire import rtc
from stratamesh.fleet.wire.channels import MeshTls, revoked


@pytest.fixture(autouse=True)
def loopback_candidates():
    rtc.offer_addresses(["127.0.0.1"])
    yield
    rtc.offer_addresses([])


@pytest.fixture(scope="module")
def ca() -> tuple[bytes, bytes]:
    return pki.create_ca("m1", time.time())


def credentials(ca: tuple[bytes, bytes], name: str) -> MeshTls:
    key = pki.new_key()
    return MeshTls(ca[1], pki.issue(*ca, pki.make_csr(key, name), pki.random_serial(), time.time(), 3600), key)


def self_signed(name: str, ca_pem: bytes) -> MeshTls:
    """A certificate its holder signed itself, naming a member of the mesh."""
    own_key, own_cert = pki.create_ca(name, time.time())
    return MeshTls(ca_pem, own_cert, own_key)


class Callee:
    """The answering side: what the coordinator would hand the offer to, vouching it comes from caller_id."""

    def __init__(self, tls: MeshTls | None, caller_id: str):
        self.tls = tls
        self.caller_id = caller_id
        self.channels: asyncio.Queue[rtc.DataChannel] = asyncio.Queue()
        self.connections = []

    async def signal(self, offer: RtcOffer) -> RtcAnswer:
        vouched = RtcOffer(offer.call_id, self.caller_id, offer.sdp, offer.cert_pem)
        answer, pc = await rtc.accept(vouched, self.channels.put_nowait, self.tls)
        if pc is not None:
            self.connections.append(pc)
        return answer

    async def close(self) -> None:
        for pc in self.connections:
            await pc.close()


async def test_messages_of_any_size_arrive_whole_and_in_order(ca):
    callee = Callee(credentials(ca, "edge-1"), "cloud-1")
    channel = await rtc.dial("edge-1", callee.signal, credentials(ca, "cloud-1"))
    incoming = await asyncio.wait_for(callee.channels.get(), 30)
    sent = [b"", b"x", bytes(range(256)) * 4096, b"y" * rtc.PIECE_BYTES, b"z" * (rtc.PIECE_BYTES + 1)]
    for message in sent:
        channel.send(message)
    received = []
    async for message in incoming.messages():
        received.append(message)
        if len(received) == len(sent):
            break
    assert received == sent
    assert incoming.peer_id == "cloud-1"
    await channel.close()
    await asyncio.wait_for(incoming.closed.wait(), 30)
    await callee.close()


async def test_a_self_signed_caller_is_refused(ca):
    callee = Callee(credentials(ca, "edge-1"), "rogue")
    with pytest.raises(rtc.RtcRefused, match="not signed by this mesh's CA"):
        await rtc.dial("edge-1", callee.signal, self_signed("rogue", ca[1]))
    assert callee.channels.empty() and not callee.connections


async def test_a_self_signed_callee_is_refused(ca):
    callee = Callee(self_signed("edge-1", ca[1]), "cloud-1")
    with pytest.raises(rtc.RtcRefused, match="not signed by this mesh's CA"):
        await rtc.dial("edge-1", callee.signal, credentials(ca, "cloud-1"))
    await callee.close()


async def test_a_caller_presenting_another_members_certificate_is_refused(ca):
    """The coordinator vouches the offer came from cloud-1; a certificate of edge-2 does not make it cloud-1's."""
    callee = Callee(credentials(ca, "edge-1"), "cloud-1")
    with pytest.raises(rtc.RtcRefused, match="names 'edge-2'"):
        await rtc.dial("edge-1", callee.signal, credentials(ca, "edge-2"))


def test_an_sdp_fingerprint_that_is_not_the_certificates_is_refused(ca):
    tls = credentials(ca, "cloud-1")
    other = credentials(ca, "cloud-1")      # a valid certificate, but not the one whose key runs the DTLS
    sdp = "v=0\r\na=fingerprint:sha-256 " + ":".join(["AB"] * 32) + "\r\n"
    with pytest.raises(rtc.RtcRefused, match="not its mesh certificate's"):
        rtc.check_peer("cloud-1", other.cert_pem, sdp, tls, time.time())
    with pytest.raises(rtc.RtcRefused, match="names no DTLS fingerprint"):
        rtc.check_peer("cloud-1", other.cert_pem, "v=0\r\n", tls, time.time())


def test_a_revoked_or_expired_certificate_is_refused(ca):
    tls = credentials(ca, "cloud-1")
    info = pki.cert_info(tls.cert_pem)
    revoked.replace({info.serial})
    try:
        with pytest.raises(rtc.RtcRefused, match="revoked"):
            rtc.check_peer("cloud-1", tls.cert_pem, "", tls, time.time())
    finally:
        revoked.replace(())
    with pytest.raises(rtc.RtcRefused, match="expired"):
        rtc.check_peer("cloud-1", tls.cert_pem, "", tls, time.time() + 7200)


async def test_an_insecure_mesh_opens_channels_without_certificates():
    callee = Callee(None, "cloud-1")
    channel = await rtc.dial("edge-1", callee.signal, None)
    incoming = await asyncio.wait_for(callee.channels.get(), 30)
    channel.send(b"hello")
    assert await anext(incoming.messages()) == b"hello"
    await channel.close()
    await callee.close()


async def test_a_callee_that_never_answers_fails_the_dial_in_time(ca):
    never = asyncio.Event()

    async def signal(offer: RtcOffer) -> RtcAnswer:
        await never.wait()
        raise AssertionError("unreachable")

    with pytest.raises(rtc.StageFailed, match="no data channel to edge-1"):
        await rtc.dial("edge-1", signal, credentials(ca, "cloud-1"), timeout_s=0.5)


async def test_revoking_a_peers_certificate_closes_its_open_channel(ca):
    callee = Callee(credentials(ca, "edge-1"), "cloud-1")
    caller_tls = credentials(ca, "cloud-1")
    channel = await rtc.dial("edge-1", callee.signal, caller_tls)
    incoming = await asyncio.wait_for(callee.channels.get(), 30)
    channel.send(b"before")
    assert await anext(incoming.messages()) == b"before"
    revoked.replace({pki.cert_info(caller_tls.cert_pem).serial})
    try:
        await asyncio.wait_for(incoming.closed.wait(), 30)       # the callee cuts the revoked caller
        await asyncio.wait_for(channel.closed.wait(), 30)        # ... whose end then closes too
    finally:
        revoked.replace(())
    with pytest.raises(rtc.StageFailed, match="closed"):
        channel.send(b"after")
    await callee.close()


def test_a_daemon_loads_aiortc_only_once_it_meets_a_peer_behind_nat() -> None:
    """Agents and coordinators start without aiortc (and libav): it is imported with the first offer made or answered."""
    code = ("import sys, stratamesh.agent.daemon, stratamesh.coordinator.daemon, stratamesh.fleet.wire.rtc as rtc; "
            "rtc.offer_addresses(['127.0.0.1']); print(sorted(m for m in ('aiortc', 'aioice', 'av') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stderr[-2000:]
