"""WebRTC data channels between mesh processes that cannot dial each other (one behind NAT), with the mesh's identities.

A gRPC stream is the data plane's path (50x the throughput: 480-710 MB/s between two processes on loopback, against
a data channel's 10-13 MB/s, on this project's VMs); this one is for a receiver nobody
outside its NAT can dial. The caller makes an offer, the coordinator carries it over the callee's control stream
(it can reach everyone: they dialed it) and the answer back, and ICE finds a way through: the callee's checks go
out through its NAT, which lets the caller's answers in. No STUN or TURN server is needed while one side can be
dialed (both behind NAT is not handled).

Identity: each side's DTLS certificate is its mesh certificate (the one its gRPC mTLS presents). The signalling
carries the certificate, which the other side checks against the mesh's CA, its revocations and the name the
coordinator vouches for; every fingerprint in the SDP must be that certificate's, and the DTLS handshake then
proves the peer holds its key. A peer with any other certificate (a self-signed one) is refused.

The data channel carries whole messages of any size: each data-channel message is one byte (MORE or LAST) and at
most PIECE_BYTES of a message, in order (the channel is ordered and reliable).

aiortc is imported when a process first makes or answers an offer (_webrtc): a daemon that never meets a NAT never
loads it (a tenth of a second at every start here, and libav's 36 MB where it is not installed).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from stratamesh.fleet import pki
from stratamesh.fleet.errors import InvalidInput, Refused, StageFailed
from stratamesh.fleet.control_messages import RtcAnswer, RtcOffer
from stratamesh.fleet.wire.channels import PROCESS, MeshTls, current_tls, revoked

if TYPE_CHECKING:
    from aiortc import RTCDataChannel, RTCPeerConnection

log = logging.getLogger(__name__)

PIECE_BYTES = 64 * 1024 - 1     # under the 64 KiB every WebRTC stack accepts in one data-channel message
MORE, LAST = b"\x00", b"\x01"
OPEN_TIMEOUT_S = 20.0           # from the offer to an open channel: signalling, ICE checks, DTLS, SCTP
LABEL = "stratamesh"

Signal = Callable[[RtcOffer], Awaitable[RtcAnswer]]   # sends an offer through the coordinator, returns the answer

_FINGERPRINT = re.compile(r"^a=fingerprint:(\S+) (\S+)\s*$", re.MULTILINE)


class RtcRefused(Refused):
    """A WebRTC peer is not who the mesh says, or refused us: no channel."""


_offered: list[str] = []     # the addresses ICE candidates are offered on (offer_addresses); []: aioice's choice
_aioice_addresses: Callable[[bool, bool], list[str]] | None = None     # aioice's own lookup, once _webrtc replaced it


def offer_addresses(hosts: Sequence[str]) -> None:
    """Offers ICE candidates on these addresses only (the one a daemon listens on, so that it stays off other
    networks; and loopback, which aioice never offers by itself); empty: every address but loopback.
    aioice has no option for it, so _webrtc replaces its lookup of the host's addresses for the whole process."""
    _offered[:] = [h for h in hosts if _is_address(h) and not ipaddress.ip_address(h).is_unspecified]


def _webrtc() -> ModuleType:
    """aiortc, imported on first use, with aioice's lookup of the host's addresses answering offer_addresses'."""
    import aioice.ice
    import aiortc
    import aiortc.rtcdtlstransport

    global _aioice_addresses
    if _aioice_addresses is None:
        own = _aioice_addresses = aioice.ice.get_host_addresses
        aioice.ice.get_host_addresses = lambda use_ipv4, use_ipv6: (
            list(_offered) if _offered else own(use_ipv4, use_ipv6))
    return aiortc


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def check_peer(peer_id: str, cert_pem: bytes, sdp: str, tls: MeshTls | None, now: float) -> str:
    """The serial of peer_id's certificate; refuses (RtcRefused) a peer whose certificate is not a current one of
    this mesh issued to peer_id, or whose SDP names a DTLS fingerprint that is not that certificate's. Without mesh
    credentials (insecure) anyone goes, and the serial is ""."""
    if tls is None:
        return ""
    if not cert_pem:
        raise RtcRefused(f"{peer_id} presented no mesh certificate")
    try:
        info = pki.cert_info(cert_pem)
        signed = pki.signed_by(cert_pem, tls.ca_pem)
    except (InvalidInput, ValueError) as exc:
        raise RtcRefused(f"{peer_id} presented a certificate that does not parse: {exc}") from None
    if not signed:
        raise RtcRefused(f"{peer_id}'s certificate is not signed by this mesh's CA")
    if info.name != peer_id:
        raise RtcRefused(f"the certificate presented for {peer_id} names {info.name!r}")
    if info.serial in revoked:
        raise RtcRefused(f"{peer_id}'s certificate {info.serial} is revoked")
    if info.not_after <= now:
        raise RtcRefused(f"{peer_id}'s certificate expired")
    fingerprints = _FINGERPRINT.findall(sdp)
    if not fingerprints:
        raise RtcRefused(f"{peer_id}'s SDP names no DTLS fingerprint")
    cert = x509.load_pem_x509_certificate(cert_pem)
    certificate_digest = _webrtc().rtcdtlstransport.certificate_digest
    for algorithm, value in fingerprints:
        if algorithm.lower() not in ("sha-256", "sha-384", "sha-512") or \
                value.upper() != certificate_digest(cert, algorithm.lower()):
            raise RtcRefused(f"{peer_id}'s DTLS fingerprint ({algorithm}) is not its mesh certificate's")
    return info.serial


class DataChannel:
    """One end of an open data channel: send() whole messages, iterate for those that arrive, until it closes."""

    def __init__(self, pc: RTCPeerConnection, channel: RTCDataChannel, peer_id: str, peer_serial: str = ""):
        self.peer_id = peer_id
        self.peer_serial = peer_serial     # of the peer's mesh certificate ("" in an insecure mesh)
        self._pc = pc
        self._channel = channel
        self._inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._pieces: list[bytes] = []
        self.opened = asyncio.Event()
        self.closed = asyncio.Event()
        channel.on("message", self._piece)
        channel.on("open", self.opened.set)
        channel.on("close", self._closed)
        pc.on("connectionstatechange", self._state)
        if channel.readyState == "open":
            self.opened.set()

    @property
    def is_open(self) -> bool:
        return self._channel.readyState == "open" and not self.closed.is_set()

    def send(self, message: bytes) -> None:
        """Queues one whole message (in pieces); StageFailed once the channel is closed."""
        if not self.is_open:
            raise StageFailed(f"the data channel to {self.peer_id} is closed")
        view = memoryview(message)
        for start in range(0, max(len(message), 1), PIECE_BYTES):
            last = start + PIECE_BYTES >= len(message)
            self._channel.send((LAST if last else MORE) + bytes(view[start:start + PIECE_BYTES]))

    def buffered_bytes(self) -> int:
        """Bytes queued on the channel and not yet sent."""
        return self._channel.bufferedAmount

    async def messages(self) -> AsyncIterator[bytes]:
        """Each whole message as it arrives, until the channel closes."""
        while (message := await self._inbox.get()) is not None:
            yield message

    async def close(self) -> None:
        self._closed()
        await self._pc.close()

    def close_if_revoked(self) -> None:
        """Closes the channel if the peer's certificate is revoked while it is open, as gRPC calls are cut."""
        if not self.peer_serial:
            return

        async def guard() -> None:
            try:
                await self.closed.wait()
            except asyncio.CancelledError:      # what a revocation does to the calls of its serial
                log.warning("closing the data channel with %s: its certificate is revoked", self.peer_id)
                self._closed()
                _background(self._pc.close())

        task = asyncio.ensure_future(guard())
        forget = revoked.track(self.peer_serial, task)
        task.add_done_callback(lambda _: forget())

    def _piece(self, data: bytes | str) -> None:
        if isinstance(data, str) or not data:
            log.warning("dropped a malformed data-channel message from %s", self.peer_id)
            return
        self._pieces.append(data[1:])
        if data[:1] == LAST:
            message, self._pieces = b"".join(self._pieces), []
            self._inbox.put_nowait(message)

    def _closed(self) -> None:
        if not self.closed.is_set():
            self.closed.set()
            self._inbox.put_nowait(None)

    async def _state(self) -> None:
        if self._pc.connectionState in ("failed", "closed"):
            self._closed()


async def dial(peer_id: str, signal: Signal, tls: object = PROCESS,
               timeout_s: float = OPEN_TIMEOUT_S) -> DataChannel:
    """Opens a data channel to peer_id (an agent id), signalling through signal(); RtcRefused if the callee refuses
    us or is not who it should be, StageFailed if no channel opens within timeout_s."""
    tls = _tls(tls)
    pc = _peer_connection(tls)
    channel = DataChannel(pc, pc.createDataChannel(LABEL, ordered=True), peer_id)
    try:
        await pc.setLocalDescription(await pc.createOffer())    # gathers the host candidates
        offer = RtcOffer(uuid.uuid4().hex, peer_id, pc.localDescription.sdp, tls.cert_pem if tls else b"")
        answer = await asyncio.wait_for(signal(offer), timeout_s)
        if answer.error:
            raise RtcRefused(f"{peer_id} refused a data channel: {answer.error}")
        channel.peer_serial = check_peer(peer_id, answer.cert_pem, answer.sdp, tls, time.time())
        await pc.setRemoteDescription(_webrtc().RTCSessionDescription(answer.sdp, "answer"))
        await asyncio.wait_for(_opened(channel), timeout_s)
        channel.close_if_revoked()
    except BaseException as exc:
        await pc.close()
        if isinstance(exc, asyncio.TimeoutError):
            raise StageFailed(f"no data channel to {peer_id} opened within {timeout_s:.0f} s") from None
        raise
    log.info("data channel to %s open", peer_id)
    return channel


async def accept(offer: RtcOffer, on_channel: Callable[[DataChannel], None],
                 tls: object = PROCESS) -> tuple[RtcAnswer, RTCPeerConnection | None]:
    """Answers an offer from offer.peer_id (as the coordinator vouches): on_channel gets its data channel once it
    opens. A refused offer is answered with why (and no connection); a connection whose channel does not open within
    OPEN_TIMEOUT_S is closed."""
    tls = _tls(tls)
    try:
        serial = check_peer(offer.peer_id, offer.cert_pem, offer.sdp, tls, time.time())
    except RtcRefused as exc:
        log.warning("refused a data channel: %s", exc)
        return RtcAnswer(offer.call_id, offer.peer_id, error=str(exc)), None
    pc = _peer_connection(tls)

    opened = asyncio.Event()

    @pc.on("datachannel")
    def _incoming(channel: RTCDataChannel) -> None:
        incoming = DataChannel(pc, channel, offer.peer_id, serial)

        async def when_open() -> None:
            with contextlib.suppress(asyncio.TimeoutError, StageFailed):
                await asyncio.wait_for(_opened(incoming), OPEN_TIMEOUT_S)
                opened.set()
                incoming.close_if_revoked()
                log.info("data channel from %s open", offer.peer_id)
                on_channel(incoming)

        _background(when_open())

    async def close_unless_opened() -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(opened.wait(), OPEN_TIMEOUT_S * 2)
            return
        log.warning("no data channel from %s opened: closing its connection", offer.peer_id)
        await pc.close()

    _background(close_unless_opened())

    try:
        await pc.setRemoteDescription(_webrtc().RTCSessionDescription(offer.sdp, "offer"))
        await pc.setLocalDescription(await pc.createAnswer())
    except Exception as exc:  # a malformed SDP: refused, like a bad certificate
        await pc.close()
        return RtcAnswer(offer.call_id, offer.peer_id, error=f"bad offer: {exc}"), None
    return RtcAnswer(offer.call_id, offer.peer_id, pc.localDescription.sdp, tls.cert_pem if tls else b""), pc


_tasks: set[asyncio.Future] = set()


def _background(work: Awaitable[None]) -> None:
    """Runs work in a task this module keeps (the loop holds tasks only weakly)."""
    _tasks.add(task := asyncio.ensure_future(work))
    task.add_done_callback(_tasks.discard)


async def _opened(channel: DataChannel) -> None:
    """Waits until the channel opens; StageFailed if it closes first."""
    opened = asyncio.ensure_future(channel.opened.wait())
    closed = asyncio.ensure_future(channel.closed.wait())
    try:
        await asyncio.wait((opened, closed), return_when=asyncio.FIRST_COMPLETED)
    finally:
        opened.cancel()
        closed.cancel()
    if not channel.opened.is_set():
        raise StageFailed(f"the connection to {channel.peer_id} failed before its data channel opened")


def _peer_connection(tls: MeshTls | None) -> RTCPeerConnection:
    """A peer connection with no STUN server (None would mean Google's) whose DTLS certificate is the mesh one."""
    aiortc = _webrtc()
    pc = aiortc.RTCPeerConnection(aiortc.RTCConfiguration(iceServers=[]))
    if tls is not None:
        key = serialization.load_pem_private_key(tls.key_pem, password=None)
        # aiortc takes no certificate from its caller: it makes one per connection, kept in this attribute
        pc._RTCPeerConnection__certificates = [aiortc.rtcdtlstransport.RTCCertificate(
            key, x509.load_pem_x509_certificate(tls.cert_pem))]
    return pc


def _tls(tls: object) -> MeshTls | None:
    """The credentials given (None: insecure), or with PROCESS this process's."""
    return current_tls() if tls is PROCESS else tls
