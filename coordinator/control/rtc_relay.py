"""WebRTC signalling: the coordinator carries offers and answers between agents over their control streams (it can
reach every agent: each dialed it), and makes offers of its own for its origin's streams into agents behind NAT."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Callable
from dataclasses import replace

from stratamesh.fleet.control_messages import RtcAnswer, RtcOffer
from stratamesh.fleet.wire.stream import address_host, dialable

log = logging.getLogger(__name__)

CALL_TTL_S = 60.0       # an offer not answered by then is forgotten (its caller gave up long before)
DIAL_CHECK_S = 2.0      # how long the coordinator tries to dial an agent's advertised address before calling it NAT'd

# Sends a signalling message to a connected agent; False if that agent is not connected.
Send = Callable[[str, RtcOffer | RtcAnswer], bool]


class RtcRelay:
    """Who offered a data channel to whom (by call id): an answer goes back only to its caller, and only from the
    callee; each offer reaches its callee naming the caller whose control stream it came on."""

    def __init__(self, send: Send, own_id: str, clock: Callable[[], float] = time.monotonic):
        self._send = send
        self.own_id = own_id            # the name the coordinator offers as (its certificate's)
        self._clock = clock
        self._calls: dict[str, tuple[str, str, float]] = {}    # call id -> (caller, callee, when); caller "": us
        self._answers: dict[str, asyncio.Future[RtcAnswer]] = {}

    def offer_from(self, caller: str, offer: RtcOffer) -> None:
        """An agent's offer to offer.peer_id: on to the callee, or refused back to the caller."""
        self._forget_old()
        callee = offer.peer_id
        if callee == caller or offer.call_id in self._calls or not self._send(callee, replace(offer, peer_id=caller)):
            self._send(caller, RtcAnswer(offer.call_id, callee, error=f"agent {callee} is not connected"))
            return
        self._calls[offer.call_id] = (caller, callee, self._clock())

    def answer_from(self, callee: str, answer: RtcAnswer) -> None:
        """An agent's answer: back to the caller of that call, if the call was to this agent."""
        call = self._calls.get(answer.call_id)
        if call is None or call[1] != callee:
            log.info("agent %s answered a call %s it was not offered", callee, answer.call_id)
            return
        del self._calls[answer.call_id]
        answer = replace(answer, peer_id=callee)
        if call[0]:
            self._send(call[0], answer)
        elif (waiting := self._answers.get(answer.call_id)) is not None and not waiting.done():
            waiting.set_result(answer)

    async def offer(self, offer: RtcOffer) -> RtcAnswer:
        """The coordinator's own offer to offer.peer_id (an rtc.Signal): its answer, or a refusal if not connected."""
        self._forget_old()
        callee = offer.peer_id
        if not self._send(callee, replace(offer, peer_id=self.own_id)):
            return RtcAnswer(offer.call_id, callee, error=f"agent {callee} is not connected")
        self._calls[offer.call_id] = ("", callee, self._clock())
        waiting = self._answers[offer.call_id] = asyncio.get_running_loop().create_future()
        try:
            return await waiting
        finally:
            self._answers.pop(offer.call_id, None)
            self._calls.pop(offer.call_id, None)

    def _forget_old(self) -> None:
        cutoff = self._clock() - CALL_TTL_S
        for call_id in [c for c, (_, _, when) in self._calls.items() if when < cutoff]:
            del self._calls[call_id]


async def nat_address(peer: str, stage_address: str, timeout_s: float = DIAL_CHECK_S) -> str:
    """The address an agent is behind NAT at, "" if it is not: its control stream comes from peer (gRPC's
    "ipv4:host:port"), which is not the host it serves at, and this coordinator cannot dial that address (no route
    to it, or no answer in timeout_s)."""
    seen = _peer_host(peer)
    if not seen or seen == address_host(stage_address) or ipaddress.ip_address(seen).is_loopback:
        return ""
    return "" if await dialable(stage_address, timeout_s) else seen


def _peer_host(peer: str) -> str:
    """The IP address in a gRPC peer string ("ipv4:10.0.0.1:5000", "ipv6:[::1]:5000"); "" for any other kind."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    host = address_host(rest)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return ""
    return host
