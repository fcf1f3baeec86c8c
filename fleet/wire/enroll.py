"""The client of the coordinator's Enroll service: a join token in, the mesh credentials it proved genuine out."""

from __future__ import annotations

import grpc

from stratamesh.fleet import pki
from stratamesh.fleet.enrollment import (EnrollmentRefused, EnrollRequest, check_mac, parse_token, reply_mac,
                                         request_mac)
from stratamesh.fleet.errors import MeshError
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import MeshTls, describe_error, make_channel

ENROLL_TIMEOUT_S = 10.0


async def enroll(address: str, token_text: str, mesh: str, agent_id: str) -> MeshTls:
    """Presents the join token to the coordinator's Enroll endpoint; returns credentials it proved genuine."""
    token = parse_token(token_text)
    key_pem = pki.new_key()
    csr_pem = pki.make_csr(key_pem, agent_id)
    mac = request_mac(token.secret, mesh, token.token_id, agent_id, csr_pem)
    request = EnrollRequest(mesh, token.token_id, agent_id, csr_pem, mac)
    async with make_channel(address, tls=None) as channel:   # no certificate yet: the MACs protect this call
        try:
            message = await pb_grpc.EnrollStub(channel).Join(convert.enroll_request_to_pb(request),
                                                             timeout=ENROLL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT,
                              grpc.StatusCode.RESOURCE_EXHAUSTED):
                raise EnrollmentRefused(f"the coordinator at {address} refused to enroll {agent_id}: "
                                        f"{exc.details()}") from None
            raise MeshError(f"could not reach the coordinator's enrollment endpoint {address}: "
                            f"{describe_error(exc)}") from None
    reply = convert.enroll_reply_from_pb(message)
    check_mac(reply_mac(token.secret, mac, reply.cert_pem, reply.ca_pem), reply.mac, "the coordinator's reply")
    if not pki.signed_by(reply.cert_pem, reply.ca_pem) or pki.cert_info(reply.cert_pem).name != agent_id:
        raise EnrollmentRefused("the coordinator returned a certificate that is not for this agent or its CA")
    return MeshTls(reply.ca_pem, reply.cert_pem, key_pem)
