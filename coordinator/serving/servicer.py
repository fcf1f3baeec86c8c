"""The Origin gRPC service: last stages stream their tokens (and answers and errors) here."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import grpc

from stratamesh.coordinator.serving.sessions import SessionTable
from stratamesh.fleet.errors import MeshError
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class OriginService(pb_grpc.OriginServicer):
    def __init__(self, sessions: SessionTable):
        self._sessions = sessions

    async def Deliver(self, request_iterator: AsyncIterator[pb.TokenBatch],
                      context: grpc.aio.ServicerContext) -> pb.DeliverSummary:
        num_events = 0
        async for batch in request_iterator:
            arrived_ns, events = time.time_ns(), []
            for message in batch.events:
                num_events += 1
                try:
                    events.append(convert.token_event_from_pb(message))
                except MeshError as exc:
                    log.info("dropped a token event: %s", exc)
            self._sessions.deliver_batch(events, arrived_ns)
        return pb.DeliverSummary(num_events=num_events)
