"""The coordinator's end of the control plane: one Connect stream per agent."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.control.probes import AgentLink
from stratamesh.coordinator.control.rtc_relay import RtcRelay, nat_address
from stratamesh.coordinator.liveness import heartbeat_interval
from stratamesh.coordinator.weights import ModelWeights
from stratamesh.fleet.errors import CheckpointError, InvalidInput, ModelNotFound
from stratamesh.fleet.pki import COORDINATOR_NAME
from stratamesh.fleet.boxes import Registration
from stratamesh.fleet.control_messages import (AgentMessage, CoordinatorMessage, Heartbeat, KvEventReport,
                                               LinkReport, RevokedSerials, RtcAnswer, RtcOffer, Welcome)
from stratamesh.fleet.stages import StageStatus
from stratamesh.fleet.versions import incompatibility
from stratamesh.fleet.weights import WeightsProgress
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import peer_cert, revoked

log = logging.getLogger(__name__)


class ControlService(pb_grpc.ControlServicer):
    """Registers agents, relays their heartbeats and stage reports, and sends them assignments."""

    def __init__(self, deployer: Deployer, mesh: str, heartbeat_interval_s: float = 0.5,
                 weights: ModelWeights | None = None):
        self._deployer = deployer
        self._weights = weights
        self._mesh = mesh
        self._base_interval_s = heartbeat_interval_s
        self._heartbeat_interval_s = heartbeat_interval_s    # stretched as the fleet grows (heartbeat_interval)
        self._outboxes: dict[str, Callable[[CoordinatorMessage], None]] = {}   # agent id -> its stream
        self._nats: dict[str, str] = {}     # agent id -> the address it is behind NAT at, as its welcome says
        self.metrics_addresses: dict[str, str] = {}   # agent id -> its /metrics host:port, last known
        self.rtc = RtcRelay(self._signal, COORDINATOR_NAME)
        self._num_streams = 0               # agents' streams whose handler has not ended
        self._no_streams = asyncio.Event()  # set while there are none

    async def streams_ended(self, timeout_s: float) -> None:
        """Waits (up to timeout_s) until every agent's stream handler has ended, each having recorded its agent's
        disconnection: what a stopping coordinator awaits after its server cancelled them, before it closes the
        registry they write to."""
        if self._num_streams:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._no_streams.wait(), timeout_s)

    def _pace(self) -> None:
        """Stretches (or, as the fleet shrinks, shortens) the heartbeat interval for the agents connected now, and
        tells every one of them with a new welcome when it changes; leases follow it."""
        interval = heartbeat_interval(self._base_interval_s, len(self._outboxes), self._heartbeat_interval_s)
        self._deployer.roster.liveness.interval_s = interval
        if interval == self._heartbeat_interval_s:
            return
        log.info("%d agents: heartbeats every %.1f s from now on (leases of %.1f s)", len(self._outboxes), interval,
                 self._deployer.roster.liveness.lease_s)
        self._heartbeat_interval_s = interval
        for agent_id, send in list(self._outboxes.items()):
            send(Welcome(agent_id, interval, self._nats[agent_id]))

    def _signal(self, agent_id: str, message: RtcOffer | RtcAnswer) -> bool:
        send = self._outboxes.get(agent_id)
        if send is None:
            return False
        send(message)
        return True

    def broadcast_revocations(self, serials: frozenset[str]) -> None:
        """Sends the whole revoked list to every connected agent."""
        for send in list(self._outboxes.values()):
            send(RevokedSerials(serials))

    async def Connect(self, request_iterator: AsyncIterator[pb.AgentMessage],
                      context: grpc.aio.ServicerContext) -> None:
        try:
            registration = _registration(await anext(aiter(request_iterator), None))
        except InvalidInput as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if registration.mesh != self._mesh:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"register.mesh {registration.mesh!r} is not this mesh ({self._mesh!r})")
        peer = peer_cert(context)   # None only in insecure mode
        if peer is not None and peer.name != registration.agent_id:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"the certificate is {peer.name!r}'s; "
                                f"it cannot register as {registration.agent_id!r}")
        refusal = incompatibility(registration.agent_id, registration.protocol_version,
                                  registration.software_version)
        # (after who it is: only a proven identity's refusal becomes an event) it cannot serve in a pipeline of
        # ours: it must not join, nor retry as it is
        if refusal is not None:
            log.warning("%s", refusal)
            self._deployer.agent_refused(registration.agent_id, refusal)
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, refusal)
        nat = await nat_address(context.peer(), registration.stage_address)
        outbox: asyncio.Queue[CoordinatorMessage] = asyncio.Queue()
        writer = asyncio.create_task(_write(context, outbox))
        cut_off = asyncio.Event()   # set when the coordinator declares the agent dead: the stream ends
        link = AgentLink(registration.agent_id, registration.stage_address, registration.capabilities,
                         outbox.put_nowait, cut_off.set, nat)
        if nat:
            log.info("agent %s is behind NAT: it connects from %s, and %s cannot be dialed", registration.agent_id,
                     nat, registration.stage_address)
        self._outboxes[registration.agent_id], self._nats[registration.agent_id] = outbox.put_nowait, nat
        self._pace()
        outbox.put_nowait(Welcome(registration.agent_id, self._heartbeat_interval_s, nat))
        if peer is not None:   # what this process refuses, the agent must refuse too
            outbox.put_nowait(RevokedSerials(revoked.serials))
        self._deployer.agent_connected(link, registration)
        self.metrics_addresses[registration.agent_id] = registration.metrics_address
        reader = asyncio.create_task(self._read(registration.agent_id, request_iterator))
        closer = asyncio.create_task(cut_off.wait())
        self._num_streams += 1
        self._no_streams.clear()
        try:
            await asyncio.wait((reader, closer), return_when=asyncio.FIRST_COMPLETED)
        finally:
            reader.cancel()
            closer.cancel()
            try:
                self._deployer.agent_disconnected(link)
            finally:
                if self._outboxes.get(registration.agent_id) == outbox.put_nowait:
                    del self._outboxes[registration.agent_id]
                    del self._nats[registration.agent_id]
                    self._pace()
                writer.cancel()
                self._num_streams -= 1
                if not self._num_streams:
                    self._no_streams.set()

    async def GetWeightManifest(self, request: pb.WeightManifestRequest,
                                context: grpc.aio.ServicerContext) -> pb.WeightManifest:
        if self._weights is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this coordinator does not deliver weights")
        try:
            model_id, names, agent_id = convert.weight_manifest_request_from_pb(request)
            return convert.weight_manifest_to_pb(await self._weights.manifest(model_id, names, agent_id))
        except ModelNotFound as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except InvalidInput as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except CheckpointError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))

    async def _read(self, agent_id: str, request_iterator: AsyncIterator[pb.AgentMessage]) -> None:
        async for message in request_iterator:
            self._handle(agent_id, message)

    def _handle(self, agent_id: str, message: pb.AgentMessage) -> None:
        try:
            self._dispatch(agent_id, convert.agent_message_from_pb(message))
        except InvalidInput as exc:
            log.info("agent %s sent a bad message: %s", agent_id, exc)

    def _dispatch(self, agent_id: str, message: AgentMessage) -> None:
        match message:
            case Heartbeat(telemetry=telemetry):
                self._deployer.heartbeat(agent_id, telemetry)
            case StageStatus():
                self._deployer.stage_status(agent_id, message)
            case LinkReport(links):
                self._deployer.roster.links_reported(agent_id, list(links))
            case KvEventReport(reports):
                self._deployer.kv_events(agent_id, list(reports))
            case WeightsProgress():
                self._deployer.weights_progress(agent_id, message)
            case RtcOffer():
                self.rtc.offer_from(agent_id, message)
            case RtcAnswer():
                self.rtc.answer_from(agent_id, message)
            case Registration():
                log.info("agent %s sent a second registration", agent_id)


def _registration(first: pb.AgentMessage | None) -> Registration:
    """The registration a control stream opens with; InvalidInput when it opens with anything else, or a bad one."""
    message = convert.agent_message_from_pb(first) if first is not None else None
    if not isinstance(message, Registration):
        raise InvalidInput("first message must be register")
    return message


async def _write(context: grpc.aio.ServicerContext, outbox: asyncio.Queue[CoordinatorMessage]) -> None:
    while True:
        await context.write(convert.coordinator_message_to_pb(await outbox.get()))


class ControlGate(pb_grpc.ControlServicer):
    """The Control service of a coordinator that may not lead yet (a standby on a shared registry): UNAVAILABLE,
    which an agent retries at the next coordinator it knows (not a refusal), until open() hands it the leader's
    ControlService."""

    def __init__(self) -> None:
        self._service: ControlService | None = None

    def open(self, service: ControlService) -> None:
        self._service = service

    async def Connect(self, request_iterator: AsyncIterator[pb.AgentMessage],
                      context: grpc.aio.ServicerContext) -> None:
        await (await self._leader(context)).Connect(request_iterator, context)

    async def GetWeightManifest(self, request: pb.WeightManifestRequest,
                                context: grpc.aio.ServicerContext) -> pb.WeightManifest:
        return await (await self._leader(context)).GetWeightManifest(request, context)

    async def _leader(self, context: grpc.aio.ServicerContext) -> ControlService:
        if self._service is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this coordinator stands by: another one leads the mesh")
        return self._service
