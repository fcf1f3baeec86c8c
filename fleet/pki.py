"""The mesh's X.509 certificates: a CA, keys, signing requests and the certificates it issues. Pure: no files."""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from stratamesh.fleet.errors import InvalidInput

# Every mesh certificate carries this DNS name, and every channel verifies the peer against it: a peer is
# trusted for holding a certificate of this mesh's CA, wherever it runs, so certificates carry no IP address.
MESH_TLS_NAME = "mesh.stratamesh.internal"
COORDINATOR_NAME = "coordinator"    # the coordinator's certificate's common name; agents are named by their ids
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
MAX_PEM_BYTES = 16 * 1024


@dataclass(frozen=True, slots=True)
class CertInfo:
    """What the mesh reads from a certificate: who, which serial, until when."""

    name: str           # the subject's common name: an agent id, or "coordinator"
    serial: str         # hex
    not_after: float    # unix seconds
    fingerprint: str    # sha256 of the DER, hex


def check_name(name: str) -> str:
    """An agent id or certificate name: 1-63 letters, digits, '.', '_' or '-'."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidInput(f"name {name!r} must be 1-63 characters of letters, digits, '.', '_' or '-'")
    return name


def random_serial() -> int:
    """A fresh certificate serial: 159 random bits, as RFC 5280 allows."""
    return x509.random_serial_number()


def new_key() -> bytes:
    """A fresh P-256 private key, as unencrypted PKCS#8 PEM."""
    key = ec.generate_private_key(ec.SECP256R1())
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def create_ca(mesh: str, now: float, valid_s: float = 10 * 365 * 86400) -> tuple[bytes, bytes]:
    """A new self-signed CA for one mesh: (key PEM, certificate PEM)."""
    key_pem = new_key()
    key = _load_key(key_pem)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"stratamesh CA {mesh}"[:64])])
    cert = (_builder(name, name, key.public_key(), now, valid_s)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .sign(key, hashes.SHA256()))
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def make_csr(key_pem: bytes, name: str) -> bytes:
    """A signing request for name, signed with key_pem: the private key never leaves the box."""
    request = (x509.CertificateSigningRequestBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, check_name(name))]))
               .sign(_load_key(key_pem), hashes.SHA256()))
    return request.public_bytes(serialization.Encoding.PEM)


def csr_name(csr_pem: bytes) -> str:
    """The name a signing request asks for, once its signature checks out; InvalidInput otherwise."""
    try:
        request = x509.load_pem_x509_csr(_bounded(csr_pem, "csr"))
    except ValueError as exc:
        raise InvalidInput(f"csr is not a PEM certificate signing request: {exc}") from None
    if not request.is_signature_valid:
        raise InvalidInput("csr signature does not match its public key")
    names = request.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(names) != 1:
        raise InvalidInput("csr must name exactly one common name")
    return check_name(str(names[0].value))


def issue(ca_key_pem: bytes, ca_cert_pem: bytes, csr_pem: bytes, serial: int, now: float,
          valid_s: float) -> bytes:
    """The CA signs csr_pem for its common name, valid for server and client use on the mesh, for valid_s."""
    name = csr_name(csr_pem)
    request = x509.load_pem_x509_csr(csr_pem)
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (_builder(subject, ca_cert.subject, request.public_key(), now, valid_s, serial)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(MESH_TLS_NAME)]), critical=False)
            .sign(_load_key(ca_key_pem), hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM)


def cert_info(cert_pem: bytes) -> CertInfo:
    """The name, serial, expiry and fingerprint of a PEM certificate; InvalidInput if it is not one."""
    try:
        cert = x509.load_pem_x509_certificate(_bounded(cert_pem, "certificate"))
    except ValueError as exc:
        raise InvalidInput(f"not a PEM certificate: {exc}") from None
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return CertInfo(str(names[0].value) if names else "", format(cert.serial_number, "x"),
                    cert.not_valid_after_utc.timestamp(),
                    hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest())


def signed_by(cert_pem: bytes, ca_cert_pem: bytes) -> bool:
    """Whether cert_pem carries a valid signature of the CA in ca_cert_pem."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    ca = x509.load_pem_x509_certificate(ca_cert_pem)
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def key_matches(key_pem: bytes, cert_pem: bytes) -> bool:
    """Whether the private key belongs to the certificate."""
    public = x509.load_pem_x509_certificate(cert_pem).public_key()
    return _load_key(key_pem).public_key().public_numbers() == public.public_numbers()


def _builder(subject: x509.Name, issuer: x509.Name, public_key: object, now: float, valid_s: float,
             serial: int | None = None) -> x509.CertificateBuilder:
    start = dt.datetime.fromtimestamp(now - 300, dt.timezone.utc)   # five minutes of clock skew between boxes
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(serial if serial is not None else x509.random_serial_number())
            .not_valid_before(start).not_valid_after(dt.datetime.fromtimestamp(now + valid_s, dt.timezone.utc)))


def _load_key(key_pem: bytes) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(key_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise InvalidInput("mesh keys are elliptic-curve (P-256) keys")
    return key


def _bounded(pem: bytes, what: str) -> bytes:
    if not isinstance(pem, bytes) or not 0 < len(pem) <= MAX_PEM_BYTES:
        raise InvalidInput(f"{what} must be 1..{MAX_PEM_BYTES} bytes of PEM")
    return pem
