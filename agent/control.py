"""The agent's end of the control plane: dial out, register, heartbeat, obey assignments, redial."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass

import grpc

from stratamesh.agent.stages import StageHost
from stratamesh.agent.weights import WeightFetcher
from stratamesh.fleet.errors import InvalidAssignment, InvalidInput, MeshError, Refused, StageFailed
from stratamesh.fleet.links import measure_peers
from stratamesh.fleet.states import StageState
from stratamesh.fleet.boxes import Capabilities, Registration, Telemetry
from stratamesh.fleet.control_messages import (AgentMessage, Heartbeat, KvEventReport, LinkReport, ProbeLinks,
                                               Release, RevokedSerials, RtcAnswer, RtcOffer, Shutdown, Welcome)
from stratamesh.fleet.kv import KvEvents
from stratamesh.fleet.stages import Assignment, StageStatus
from stratamesh.fleet.versions import protocol_version, software_version
from stratamesh.fleet.wire import convert, rtc
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import describe_error, make_channel, revoked
from stratamesh.fleet.wire.rtc import DataChannel

log = logging.getLogger(__name__)

# How often the stages' prefix-cache changes go to the coordinator's router, and the block hashes one message
# carries at most (a stage's whole cache, after a reconnect, may take several).
KV_EVENTS_EVERY_S = 0.05
MAX_HASHES_PER_MESSAGE = 16384
# What the coordinator answers a certificate it will not take, or an agent whose data plane it cannot speak
# (fleet/versions.py): retrying cannot help.
_REFUSED = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED)


class ControlRefused(Refused):
    """The coordinator refuses this agent: its certificate was revoked, or is not the one for its id, or it speaks
    a data-plane protocol the coordinator does not."""


@dataclass(frozen=True, slots=True)
class Identity:
    """Who this agent says it is on every (re)registration."""

    agent_id: str
    name: str
    stage_address: str
    mesh: str
    capabilities: Capabilities
    metrics_address: str = ""


# What an agent's control stream carries up, in order; None ends the stream.
Outbox = asyncio.Queue[AgentMessage | None]


class Signalling:
    """The agent's WebRTC signalling over its control stream: its offers go out and their answers come back matched
    by call id; offers from peers are answered (as accept() decides) and their data channels go to on_channel."""

    def __init__(self, on_channel: Callable[[DataChannel], None] = lambda channel: None):
        self.on_channel = on_channel     # gets each data channel a peer opened to this agent
        self._outbox: Outbox | None = None
        self._waiting: dict[str, asyncio.Future[RtcAnswer]] = {}
        self.nat = ""       # the address this agent's connections come from, if it is behind NAT (the coordinator says)

    async def offer(self, offer: RtcOffer) -> RtcAnswer:
        """Sends an offer to its callee through the coordinator and waits for the answer."""
        if self._outbox is None:
            raise StageFailed(f"cannot signal {offer.peer_id}: not connected to the coordinator")
        answer = self._waiting[offer.call_id] = asyncio.get_running_loop().create_future()
        self._outbox.put_nowait(offer)
        try:
            return await answer
        finally:
            self._waiting.pop(offer.call_id, None)

    def answered(self, answer: RtcAnswer) -> None:
        waiting = self._waiting.get(answer.call_id)
        if waiting is not None and not waiting.done():
            waiting.set_result(answer)

    async def offered(self, outbox: Outbox, offer: RtcOffer) -> None:
        answer, _ = await rtc.accept(offer, self.on_channel)
        outbox.put_nowait(answer)

    def attach(self, outbox: Outbox | None, nat: str = "") -> None:
        """The control stream's outbox while one is up (None: none is); the calls waiting on the old one fail."""
        self._outbox, self.nat = outbox, nat
        if outbox is None:
            for waiting in self._waiting.values():
                if not waiting.done():
                    waiting.set_exception(StageFailed("the control stream to the coordinator dropped"))


class ControlClient:
    """Keeps one control stream to the coordinator, redialing (and rediscovering) when it drops."""

    def __init__(self, identity: Identity, host: StageHost,
                 find_coordinator: Callable[[], Awaitable[str]], retry_s: float = 0.5,
                 telemetry: Callable[[], Awaitable[Telemetry]] | None = None,
                 on_shutdown: Callable[[str], None] = lambda reason: None, weights: WeightFetcher | None = None,
                 signalling: Signalling | None = None):
        """weights: fetches a stage's tensors that are not on this box before it loads (None: never fetch);
        signalling: carries WebRTC offers and answers (None: offers from peers go unanswered)."""
        self._identity = identity
        self.signalling = signalling or Signalling()
        self._weights = weights
        self._on_shutdown = on_shutdown     # the coordinator drained (or refuses) this agent: it should exit
        self.refused = ""                   # why the coordinator refuses this agent, once it does
        self._host = host
        self._telemetry = telemetry
        self._find = find_coordinator
        self._retry_s = retry_s
        self.connected = asyncio.Event()
        self._probing = asyncio.Lock()   # one link probe at a time: two would share the wire

    async def run(self) -> None:
        """Connects forever; returns only when cancelled."""
        failures = 0
        while True:
            try:
                address = await self._find()
                await self._session(address)
                failures = 0
            except asyncio.CancelledError:
                raise
            except (grpc.aio.AioRpcError, MeshError, OSError, TimeoutError) as exc:
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() in _REFUSED:
                    self.refused = f"the coordinator refuses this agent: {exc.details()}"
                    log.error("%s", self.refused)
                    self._on_shutdown(self.refused)
                    return
                failures += 1
                level = logging.WARNING if failures == 1 else logging.DEBUG
                log.log(level, "control stream down (%s); retrying", describe_error(exc))
            self.connected.clear()
            # At most 2 s between tries: a restarted coordinator gives its agents 10 s to come back.
            await asyncio.sleep(min(self._retry_s * 2 ** min(failures, 4), 2.0))

    async def _session(self, address: str) -> None:
        outbox: Outbox = asyncio.Queue()
        outbox.put_nowait(self._registration())
        channel = make_channel(address)
        heartbeat: asyncio.Task[None] | None = None
        kv_events: asyncio.Task[None] | None = None
        tasks: set[asyncio.Task[None]] = set()
        try:
            async for received in pb_grpc.ControlStub(channel).Connect(_drain(outbox)):
                try:
                    message = convert.coordinator_message_from_pb(received)
                except InvalidInput as exc:
                    _refuse(outbox, exc)
                    continue
                match message:
                    case Welcome(agent_id, interval_s, nat):
                        # again on the same stream: the fleet grew or shrank, and heartbeats go at another pace
                        if heartbeat is None:
                            log.info("registered with coordinator %s as %s%s", address, agent_id,
                                     f" (behind NAT, seen from {nat})" if nat else "")
                            kv_events = asyncio.create_task(self._kv_events(outbox))
                        else:
                            log.info("heartbeats every %.1f s from now on", interval_s)
                            heartbeat.cancel()
                        self.signalling.attach(outbox, nat)
                        self.connected.set()
                        heartbeat = asyncio.create_task(self._heartbeat(outbox, interval_s))
                    case Assignment():
                        _spawn(tasks, self._assign(outbox, message, channel))
                    case Release(assignment_id):
                        await self._release(outbox, assignment_id)
                    case ProbeLinks():
                        _spawn(tasks, self._probe_links(outbox, message))
                    case RevokedSerials(serials):
                        revoked.replace(serials)
                    case RtcOffer():
                        _spawn(tasks, self.signalling.offered(outbox, message))
                    case RtcAnswer():
                        self.signalling.answered(message)
                    case Shutdown(reason):
                        log.info("the coordinator asks this agent to exit: %s", reason)
                        self._on_shutdown(reason)
        finally:
            self.signalling.attach(None)
            for task in (heartbeat, kv_events):
                if task is not None:
                    task.cancel()
            outbox.put_nowait(None)
            await channel.close(grace=None)

    def _registration(self) -> Registration:
        i = self._identity
        return Registration(i.agent_id, i.name, i.stage_address, i.capabilities,
                            tuple(self._host.assignments()), i.mesh, i.metrics_address, software_version(),
                            protocol_version())

    async def _heartbeat(self, outbox: Outbox, interval_s: float) -> None:
        seq = 0
        while True:
            seq += 1
            telemetry = None
            if self._telemetry is not None:
                try:
                    telemetry = await self._telemetry()
                except Exception:  # a heartbeat without telemetry still says the agent is alive
                    log.warning("could not take telemetry", exc_info=True)
            outbox.put_nowait(Heartbeat(seq, self._host.num_sessions, telemetry))
            await asyncio.sleep(max(interval_s, 0.05))

    async def _kv_events(self, outbox: Outbox) -> None:
        """Reports the stages' prefix-cache changes as they happen; the first report is everything they hold (this
        coordinator, or this stream of it, knows nothing yet)."""
        resend_all = True
        while True:
            for message in _messages(self._host.kv_events(resend_all)):
                outbox.put_nowait(KvEventReport(tuple(message)))
            resend_all = False
            await asyncio.sleep(KV_EVENTS_EVERY_S)

    async def _assign(self, outbox: Outbox, assignment: Assignment, coordinator: grpc.aio.Channel) -> None:
        outbox.put_nowait(StageStatus(assignment.assignment_id, StageState.LOADING))
        try:
            spec = assignment.stage
            if self._weights is not None:
                spec = await self._weights.localize(assignment.assignment_id, spec, coordinator, outbox.put_nowait)
            param_bytes = await self._host.load(assignment, spec)
            status = StageStatus(assignment.assignment_id, StageState.READY, param_bytes=param_bytes)
        except Exception as exc:  # a stage that cannot load is reported, never fatal to the agent
            log.exception("could not load %s", assignment.assignment_id)
            status = StageStatus(assignment.assignment_id, "failed", f"{type(exc).__name__}: {exc}")
        outbox.put_nowait(status)

    async def _release(self, outbox: Outbox, assignment_id: str) -> None:
        self._host.release(assignment_id)
        outbox.put_nowait(StageStatus(assignment_id, StageState.RELEASED))

    async def _probe_links(self, outbox: Outbox, probe: ProbeLinks) -> None:
        """Measures the links to the peers the coordinator named and reports them (failures included)."""
        async with self._probing:
            measurements = await measure_peers(probe.peers)
        outbox.put_nowait(LinkReport(tuple(measurements)))


def _refuse(outbox: Outbox, exc: InvalidInput) -> None:
    """Skips a message from the coordinator that failed validation; a bad assignment is reported failed."""
    if isinstance(exc, InvalidAssignment):
        outbox.put_nowait(StageStatus(exc.assignment_id, StageState.FAILED, str(exc)))
    else:
        log.warning("the coordinator sent a bad message: %s", exc)


def _spawn(tasks: set[asyncio.Task[None]], work: Coroutine[object, object, None]) -> None:
    """Runs work as a task held in tasks until it is done (the event loop keeps only weak references)."""
    task = asyncio.create_task(work)
    tasks.add(task)
    task.add_done_callback(tasks.discard)


def _messages(reports: list[KvEvents], max_hashes: int = MAX_HASHES_PER_MESSAGE) -> list[list[KvEvents]]:
    """The reports in messages of at most max_hashes hashes; a stage's report too big for one is cut in pieces
    that follow each other (only the first clears)."""
    messages: list[list[KvEvents]] = []
    current: list[KvEvents] = []
    room = max_hashes
    for report in reports:
        hashes = [(True, h) for h in report.stored] + [(False, h) for h in report.evicted]
        cleared = report.cleared
        while True:
            if room == 0:
                messages.append(current)
                current, room = [], max_hashes
            piece, hashes = hashes[:room], hashes[room:]
            current.append(KvEvents(report.assignment_id, report.block_size, cleared,
                                    tuple(h for stored, h in piece if stored),
                                    tuple(h for stored, h in piece if not stored)))
            room -= len(piece)
            cleared = False
            if not hashes:
                break
    if current:
        messages.append(current)
    return messages


async def _drain(outbox: Outbox) -> AsyncIterator[pb.AgentMessage]:
    """The outbox's messages as the control stream carries them, until None."""
    while (message := await outbox.get()) is not None:
        yield convert.agent_message_to_pb(message)
