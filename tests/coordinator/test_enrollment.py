"""The coordinator's Enroller and Revoker over a real (in-memory) registry: who gets a certificate, who not."""

from __future__ import annotations

from pathlib import Path

import pytest

from stratamesh.coordinator.credentials import CredentialStore
from stratamesh.coordinator.enrollment import (Enroller, MeshCa, Revoker, UnknownAgentCertificate, parse_duration)
from stratamesh.coordinator.registry import Registry
from stratamesh.fleet import pki
from stratamesh.fleet.enrollment import (EnrollmentRefused, EnrollRequest, JoinToken, check_mac, reply_mac,
                                         request_mac)
from stratamesh.fleet.errors import InvalidInput

NOW = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def ca(tmp_path: Path) -> MeshCa:
    return MeshCa.load_or_create(tmp_path / "pki", "m", NOW)


@pytest.fixture
def store() -> CredentialStore:
    return CredentialStore(Registry(":memory:"))


@pytest.fixture
def enroller(store: CredentialStore, ca: MeshCa, clock: Clock) -> Enroller:
    return Enroller(store, ca, "m", clock)


def request(token: JoinToken, agent_id: str = "edge-1", mesh: str = "m", csr_name: str | None = None,
            secret: str | None = None) -> tuple[EnrollRequest, bytes]:
    key = pki.new_key()
    csr = pki.make_csr(key, csr_name or agent_id)
    mac = request_mac(secret or token.secret, mesh, token.token_id, agent_id, csr)
    return EnrollRequest(mesh, token.token_id, agent_id, csr, mac), key


def test_a_valid_token_gets_a_certificate_for_the_agents_own_key(enroller: Enroller, ca: MeshCa,
                                                                 store: CredentialStore) -> None:
    token, record = enroller.create_token(3600)
    assert record.expires == NOW + 3600
    req, key = request(token)
    reply = enroller.join(req)
    check_mac(reply_mac(token.secret, req.mac, reply.cert_pem, reply.ca_pem), reply.mac, "reply")
    assert reply.ca_pem == ca.cert_pem
    assert pki.signed_by(reply.cert_pem, ca.cert_pem) and pki.key_matches(key, reply.cert_pem)
    assert pki.cert_info(reply.cert_pem).name == "edge-1"
    [cert] = store.certificates("edge-1")
    assert cert.serial == pki.cert_info(reply.cert_pem).serial and cert.token_id == token.token_id
    assert store.token(token.token_id).num_uses == 1


def test_an_unknown_token_is_refused(enroller: Enroller, ca: MeshCa) -> None:
    forged = JoinToken("0badf00d", "0" * 32)
    with pytest.raises(EnrollmentRefused, match="unknown join token"):
        enroller.join(request(forged)[0])


def test_an_expired_token_is_refused(enroller: Enroller, clock: Clock) -> None:
    token, _ = enroller.create_token(60)
    clock.now += 59
    enroller.join(request(token, "edge-1")[0])
    clock.now += 1
    with pytest.raises(EnrollmentRefused, match="expired"):
        enroller.join(request(token, "edge-2")[0])


def test_a_revoked_token_is_refused(enroller: Enroller) -> None:
    token, _ = enroller.create_token(None)
    enroller.revoke_token(token.token_id)
    with pytest.raises(EnrollmentRefused, match="revoked"):
        enroller.join(request(token)[0])
    with pytest.raises(InvalidInput):
        enroller.revoke_token("ffffffff")


def test_a_wrong_secret_is_refused(enroller: Enroller) -> None:
    token, _ = enroller.create_token(3600)
    with pytest.raises(EnrollmentRefused, match="secret"):
        enroller.join(request(token, secret="0" * 32)[0])


def test_the_request_cannot_be_changed_in_flight(enroller: Enroller) -> None:
    token, _ = enroller.create_token(3600)
    req, _ = request(token)
    swapped = EnrollRequest(req.mesh, req.token_id, req.agent_id, pki.make_csr(pki.new_key(), "edge-1"), req.mac)
    with pytest.raises(EnrollmentRefused):
        enroller.join(swapped)


@pytest.mark.parametrize("agent_id, csr_name, mesh, error", [
    ("edge-1", "edge-2", "m", InvalidInput),          # asks for another name than it claims
    ("coordinator", None, "m", InvalidInput),         # would pass for the coordinator
    ("edge-1", None, "other-mesh", EnrollmentRefused),
])
def test_a_request_for_the_wrong_name_or_mesh_is_refused(enroller: Enroller, agent_id: str, csr_name: str | None,
                                                         mesh: str, error: type[Exception]) -> None:
    token, _ = enroller.create_token(3600)
    with pytest.raises(error):
        enroller.join(request(token, agent_id, mesh=mesh, csr_name=csr_name)[0])


def test_revoking_an_agent_publishes_every_revoked_unexpired_serial(enroller: Enroller, store: CredentialStore,
                                                                   clock: Clock) -> None:
    token, _ = enroller.create_token(None)
    serial_of = {a: pki.cert_info(enroller.join(request(token, a)[0]).cert_pem).serial for a in ("e1", "e2")}
    published: list[frozenset[str]] = []
    revoker = Revoker(store, clock, published.append)
    assert revoker.revoke_agent("e1") == [serial_of["e1"]]
    assert published == [frozenset({serial_of["e1"]})]
    assert revoker.revoke_agent("e1") == []         # again: nothing new, the list is the same
    revoker.revoke_agent("e2")
    assert published[-1] == frozenset(serial_of.values())
    with pytest.raises(UnknownAgentCertificate):
        revoker.revoke_agent("never-enrolled")
    clock.now += 400 * 86400                        # past their expiry: TLS refuses them, the list drops them
    assert revoker.current() == frozenset()


def test_the_ca_is_made_once_and_read_back(tmp_path: Path) -> None:
    first = MeshCa.load_or_create(tmp_path / "pki", "m", NOW)
    again = MeshCa.load_or_create(tmp_path / "pki", "m", NOW + 10)
    assert first == again
    assert oct((tmp_path / "pki" / "ca.key").stat().st_mode & 0o777) == "0o600"
    tls = first.coordinator_tls(NOW)
    assert pki.cert_info(tls.cert_pem).name == pki.COORDINATOR_NAME and pki.signed_by(tls.cert_pem, first.cert_pem)


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("30m", 1800), ("24h", 86400), ("7d", 604800),
                                           ("1.5h", 5400), ("never", None)])
def test_durations(text: str, seconds: float | None) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "24", "h", "-1h", "0s", "1w", "1 h"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(InvalidInput):
        parse_duration(text)
