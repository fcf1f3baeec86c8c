"""An agent's credentials: kept on disk, checked when read, and obtained from a real Enroll gRPC server."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from stratamesh.agent.credentials import (NotEnrolled, enroll, load_credentials, obtain_credentials,
                                          read_join_token, save_credentials, stored_agent_id)
from stratamesh.coordinator.credentials import CredentialStore
from stratamesh.coordinator.enrollment import Enroller, EnrollService, MeshCa
from stratamesh.coordinator.registry import Registry
from stratamesh.fleet import pki
from stratamesh.fleet.enrollment import EnrollmentRefused, JoinToken
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import MeshTls, bind, make_server


class Coordinator:
    """The coordinator's half of enrollment: a real CA, registry and plaintext Enroll server on loopback."""

    def __init__(self, tmp_path: Path) -> None:
        self.ca = MeshCa.load_or_create(tmp_path / "pki", "m", time.time())
        self.registry = Registry(":memory:")
        self.enroller = Enroller(CredentialStore(self.registry), self.ca, "m", time.time)
        self.address = ""


@pytest.fixture
async def coordinator(tmp_path: Path) -> AsyncIterator[Coordinator]:
    coord = Coordinator(tmp_path)
    server = make_server(tls=None)
    pb_grpc.add_EnrollServicer_to_server(EnrollService(coord.enroller), server)
    coord.address = f"127.0.0.1:{bind(server, '127.0.0.1', 0, tls=None)}"
    await server.start()
    yield coord
    await server.stop(None)
    coord.registry.close()


async def test_enrolling_returns_credentials_the_mesh_ca_signed(coordinator: Coordinator, tmp_path: Path) -> None:
    token, _ = coordinator.enroller.create_token(3600)
    tls = await enroll(coordinator.address, str(token), "m", "edge-1")
    assert tls.ca_pem == coordinator.ca.cert_pem
    assert pki.cert_info(tls.cert_pem).name == "edge-1" and pki.key_matches(tls.key_pem, tls.cert_pem)


async def test_an_expired_or_revoked_or_unknown_token_is_refused(coordinator: Coordinator) -> None:
    expired, _ = coordinator.enroller.create_token(0.05)
    revoked, _ = coordinator.enroller.create_token(3600)
    coordinator.enroller.revoke_token(revoked.token_id)
    time.sleep(0.1)
    for token, why in ((expired, "expired"), (revoked, "revoked"), (JoinToken("0badf00d", "1" * 32), "unknown")):
        with pytest.raises(EnrollmentRefused, match=why):
            await enroll(coordinator.address, str(token), "m", "edge-1")
    assert coordinator.enroller.tokens()[0].num_uses == 0


async def test_a_token_for_another_coordinator_is_refused(coordinator: Coordinator, tmp_path: Path) -> None:
    """The id exists here, but the secret derives from another CA's token key."""
    token, _ = coordinator.enroller.create_token(3600)
    other = MeshCa.load_or_create(tmp_path / "other", "m", time.time())
    from stratamesh.fleet.enrollment import token_for

    with pytest.raises(EnrollmentRefused, match="secret"):
        await enroll(coordinator.address, str(token_for(other.token_key, token.token_id)), "m", "edge-1")


async def test_a_reply_from_an_impostor_is_refused(tmp_path: Path) -> None:
    """Someone in the middle answers with a CA of their own: without the token's secret, its MAC cannot match."""
    impostor_ca = MeshCa.load_or_create(tmp_path / "impostor", "m", time.time())

    class Impostor(pb_grpc.EnrollServicer):
        async def Join(self, request: pb.EnrollRequest, context: grpc.aio.ServicerContext) -> pb.EnrollReply:
            cert = impostor_ca.issue(request.csr_pem, pki.random_serial(), time.time(), 3600)
            return pb.EnrollReply(cert_pem=cert, ca_pem=impostor_ca.cert_pem, mac=b"\0" * 32)

    server = make_server(tls=None)
    pb_grpc.add_EnrollServicer_to_server(Impostor(), server)
    address = f"127.0.0.1:{bind(server, '127.0.0.1', 0, tls=None)}"
    await server.start()
    try:
        with pytest.raises(EnrollmentRefused, match="reply"):
            await enroll(address, f"smj1.0a1b2c3d.{'2' * 32}", "m", "edge-1")
    finally:
        await server.stop(None)


async def test_obtain_keeps_the_certificate_and_needs_no_token_the_second_time(coordinator: Coordinator,
                                                                               tmp_path: Path) -> None:
    token, _ = coordinator.enroller.create_token(3600)
    state = str(tmp_path / "agent")

    async def find() -> str:
        return coordinator.address

    first = await obtain_credentials(state, "edge-1", "m", str(token), find)
    coordinator.enroller.revoke_token(token.token_id)       # the token is spent; the certificate stays good
    again = await obtain_credentials(state, "edge-1", "m", "", find)
    assert again == first
    assert stored_agent_id(state) == "edge-1"
    assert oct(Path(state, "key.pem").stat().st_mode & 0o777) == "0o600"


async def test_an_agent_tries_again_while_the_coordinator_cannot_answer(coordinator: Coordinator,
                                                                       tmp_path: Path) -> None:
    """The coordinator is found where nothing answers yet (it is starting, or restarting elsewhere): the agent
    tries again, finding it anew, and enrolls once it answers."""
    import socket

    token, _ = coordinator.enroller.create_token(3600)
    with socket.socket() as probe:          # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    found: list[str] = []

    async def find() -> str:
        found.append(dead if len(found) < 2 else coordinator.address)
        return found[-1]

    tls = await obtain_credentials(str(tmp_path / "agent"), "edge-1", "m", str(token), find)
    assert found == [dead, dead, coordinator.address]
    assert pki.cert_info(tls.cert_pem).name == "edge-1"


async def test_an_agent_given_several_enrollment_addresses_enrolls_at_the_one_that_answers(
        coordinator: Coordinator, tmp_path: Path) -> None:
    """--enroll A,B (a coordinator and its standby, only the leader's answering): tried in turn."""
    import socket

    from stratamesh.agent.daemon import AgentOptions, enroll_finder
    from stratamesh.fleet import discovery

    token, _ = coordinator.enroller.create_token(3600)
    with socket.socket() as probe:          # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    browser = discovery.Browser(["127.0.0.1"])      # (never asked: the addresses were given)
    try:
        find = enroll_finder(AgentOptions(mesh="m", enroll=f"{dead}, {coordinator.address}"), browser)
        assert [await find() for _ in range(3)] == [dead, coordinator.address, dead]
        tls = await obtain_credentials(str(tmp_path / "agent"), "edge-1", "m", str(token),
                                       enroll_finder(AgentOptions(mesh="m", enroll=f"{dead},{coordinator.address}"),
                                                     browser))
    finally:
        await browser.close()
    assert pki.cert_info(tls.cert_pem).name == "edge-1"


async def test_without_a_certificate_or_token_the_agent_says_how_to_join(tmp_path: Path) -> None:
    async def find() -> str:
        raise AssertionError("no token: nothing to dial")

    with pytest.raises(NotEnrolled, match="--join-token"):
        await obtain_credentials(str(tmp_path / "agent"), "edge-1", "m", "", find)


async def test_a_token_file_is_read_once_the_coordinator_is_found(coordinator: Coordinator, tmp_path: Path) -> None:
    """As `stratamesh up` starts its agents beside the coordinator: the bootstrap file it reads the token from is
    written by the coordinator before the agent can find it."""
    token_file = tmp_path / "bootstrap.json"

    async def find() -> str:
        token, _ = coordinator.enroller.create_token(3600)
        token_file.write_text(json.dumps({"join_token": str(token), "api_key": "sk-sm-x"}))
        return coordinator.address

    tls = await obtain_credentials(str(tmp_path / "agent"), "edge-1", "m", "", find, str(token_file))
    assert pki.cert_info(tls.cert_pem).name == "edge-1"
    assert stored_agent_id(str(tmp_path / "agent")) == "edge-1"


@pytest.mark.parametrize("text, expected", [
    ("smj1.0a1b2c3d.abc\n", "smj1.0a1b2c3d.abc"),
    ('{"join_token": "smj1.0a1b2c3d.abc", "api_key": "k"}', "smj1.0a1b2c3d.abc"),
    ('{"api_key": "k"}', NotEnrolled),
    ('{"join_token": 7}', NotEnrolled),
    ("{not json", NotEnrolled),
    (None, NotEnrolled),           # no such file
])
def test_read_join_token(tmp_path: Path, text: str | None, expected: str | type[Exception]) -> None:
    path = tmp_path / "token"
    if text is not None:
        path.write_text(text)
    if isinstance(expected, str):
        assert read_join_token(str(path)) == expected
    else:
        with pytest.raises(expected, match=str(path)):
            read_join_token(str(path))


def test_stored_credentials_are_checked_when_read(tmp_path: Path) -> None:
    now = time.time()
    ca = MeshCa.load_or_create(tmp_path / "pki", "m", now)
    other = MeshCa.load_or_create(tmp_path / "other", "m", now)
    key = pki.new_key()
    cert = ca.issue(pki.make_csr(key, "edge-1"), pki.random_serial(), now, 3600)
    good = MeshTls(ca.cert_pem, cert, key)
    cases = {
        "good": (good, "edge-1", now, True),
        "another agent's name": (good, "edge-2", now, False),
        "expired": (good, "edge-1", now + 7200, False),
        "another CA": (MeshTls(other.cert_pem, cert, key), "edge-1", now, False),
        "another key": (MeshTls(ca.cert_pem, cert, pki.new_key()), "edge-1", now, False),
    }
    for name, (tls, agent_id, when, ok) in cases.items():
        state = str(tmp_path / name.replace(" ", "-"))
        save_credentials(state, tls)
        assert (load_credentials(state, agent_id, when) == tls) is ok, name
    assert load_credentials(str(tmp_path / "missing"), "edge-1", now) is None
    Path(tmp_path, "good", "cert.pem").write_bytes(b"garbage")
    assert load_credentials(str(tmp_path / "good"), "edge-1", now) is None


async def test_an_address_that_keeps_presenting_bad_tokens_waits(coordinator: Coordinator) -> None:
    token, _ = coordinator.enroller.create_token(3600)
    forged = f"smj1.{token.token_id}.{'0' * 32}"
    for _ in range(10):
        with pytest.raises(EnrollmentRefused, match="secret"):
            await enroll(coordinator.address, forged, "m", "edge-1")
    with pytest.raises(EnrollmentRefused, match="too many"):
        await enroll(coordinator.address, str(token), "m", "edge-1")    # even the right token waits now
