"""The mesh's certificates: a CA signs what an agent asks for, and nothing else passes for it."""

from __future__ import annotations

import time

import pytest

from stratamesh.fleet import pki
from stratamesh.fleet.errors import InvalidInput

NOW = 1_800_000_000.0


@pytest.fixture(scope="module")
def ca() -> tuple[bytes, bytes]:
    return pki.create_ca("m1", NOW)


def issue_for(ca: tuple[bytes, bytes], name: str, valid_s: float = 3600) -> tuple[bytes, bytes]:
    key = pki.new_key()
    return key, pki.issue(*ca, pki.make_csr(key, name), pki.random_serial(), NOW, valid_s)


def test_an_issued_certificate_names_the_agent_and_is_signed_by_its_ca(ca: tuple[bytes, bytes]) -> None:
    key, cert = issue_for(ca, "edge-7")
    info = pki.cert_info(cert)
    assert info.name == "edge-7"
    assert info.not_after == pytest.approx(NOW + 3600, abs=1)
    assert len(info.fingerprint) == 64 and int(info.serial, 16) > 0
    assert pki.signed_by(cert, ca[1])
    assert pki.key_matches(key, cert)
    assert not pki.key_matches(pki.new_key(), cert)


def test_another_mesh_ca_does_not_vouch_for_it(ca: tuple[bytes, bytes]) -> None:
    _, cert = issue_for(ca, "edge-7")
    other = pki.create_ca("m2", NOW)
    assert not pki.signed_by(cert, other[1])
    assert pki.signed_by(issue_for(other, "edge-7")[1], other[1])


def test_serials_differ_between_certificates(ca: tuple[bytes, bytes]) -> None:
    serials = {pki.cert_info(issue_for(ca, "a")[1]).serial for _ in range(5)}
    assert len(serials) == 5


def test_a_tampered_signing_request_is_refused(ca: tuple[bytes, bytes]) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    csr = pki.make_csr(pki.new_key(), "edge-1")
    assert pki.csr_name(csr) == "edge-1"
    der = bytearray(x509.load_pem_x509_csr(csr).public_bytes(Encoding.DER))
    der[-1] ^= 0x01     # the last byte of the signature's s: still well-formed DER, no longer a valid signature
    tampered = x509.load_der_x509_csr(bytes(der)).public_bytes(Encoding.PEM)
    with pytest.raises(InvalidInput, match="signature"):
        pki.csr_name(tampered)
    with pytest.raises(InvalidInput):
        pki.issue(*ca, tampered, pki.random_serial(), NOW, 60)


@pytest.mark.parametrize("pem", [b"", b"not pem", b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n"
                                 b"-----END CERTIFICATE REQUEST-----\n", b"x" * (pki.MAX_PEM_BYTES + 1)])
def test_garbage_is_not_a_signing_request(pem: bytes) -> None:
    with pytest.raises(InvalidInput):
        pki.csr_name(pem)


@pytest.mark.parametrize("pem", [b"", b"junk", "text".encode() * 5000])
def test_garbage_is_not_a_certificate(pem: bytes) -> None:
    with pytest.raises(InvalidInput):
        pki.cert_info(pem)


@pytest.mark.parametrize("name, ok", [("a", True), ("edge-box_7.site", True), ("A" * 63, True),
                                      ("", False), ("-lead", False), ("A" * 64, False), ("sp ace", False),
                                      ("x/y", False), ("ü", False), ("a\x00", False)])
def test_names(name: str, ok: bool) -> None:
    if ok:
        assert pki.check_name(name) == name
    else:
        with pytest.raises(InvalidInput):
            pki.check_name(name)


def test_a_request_cannot_ask_for_a_bad_name() -> None:
    with pytest.raises(InvalidInput):
        pki.make_csr(pki.new_key(), "bad name")


def test_the_ca_is_valid_from_a_little_before_now() -> None:
    """Five minutes of clock skew between boxes must not make a fresh certificate "not yet valid"."""
    now = time.time()
    _, cert = pki.create_ca("m", now)
    from cryptography import x509

    parsed = x509.load_pem_x509_certificate(cert)
    assert parsed.not_valid_before_utc.timestamp() <= now - 299
