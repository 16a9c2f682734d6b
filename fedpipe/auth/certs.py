"""Test certificates for TLS and mutual TLS on the stage link: ``fedpipe certs``.

One CA signs a server certificate (SANs: 127.0.0.1, ::1, localhost and the hosts given) and one
client certificate per name (the devices, and ``serverapp`` for the ServerApp's control calls
and evaluator on a mutual-TLS StageServer). ECDSA P-256 keys, written with mode 0600. These are
for tests and trials: a production CA keeps its key offline and issues per-device certificates
through the operator's own process.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["CertificateFiles", "make_test_certificates"]

_LOOPBACK = ("127.0.0.1", "::1", "localhost")


@dataclass(frozen=True)
class CertificateFiles:
    """Where ``make_test_certificates`` wrote each PEM file."""

    ca: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    clients: dict[str, tuple[Path, Path]] = field(default_factory=dict)  # name -> (cert, key)


def make_test_certificates(
    out: Path,
    *,
    hosts: Sequence[str] = (),
    clients: Sequence[str] = ("serverapp", "device-0", "device-1"),
    days: int = 30,
) -> CertificateFiles:
    """Write a CA, a server certificate for loopback + ``hosts``, and client certificates."""
    if days < 1:
        raise ValueError(f"days must be >= 1, got {days}")
    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("fedpipe test CA")
    ca = _sign(
        _builder(ca_name, ca_name, ca_key.public_key(), days).add_extension(
            x509.BasicConstraints(ca=True, path_length=0), critical=True
        ),
        ca_key,
    )
    files = CertificateFiles(
        ca=_write_cert(out / "ca.pem", ca),
        ca_key=_write_key(out / "ca.key", ca_key),
        server_cert=out / "server.pem",
        server_key=out / "server.key",
    )
    names = list(dict.fromkeys([*_LOOPBACK, *hosts]))
    common_name = (list(hosts) or ["127.0.0.1"])[0]
    usage = ExtendedKeyUsageOID.SERVER_AUTH
    _leaf(
        files.server_cert, files.server_key, common_name, ca, ca_key, days, usage=usage, sans=names
    )
    for client in clients:
        cert, key = out / f"{client}.pem", out / f"{client}.key"
        _leaf(cert, key, client, ca, ca_key, days, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
        files.clients[client] = (cert, key)
    return files


def _leaf(
    cert_path: Path,
    key_path: Path,
    common_name: str,
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    days: int,
    *,
    usage: x509.ObjectIdentifier,
    sans: Sequence[str] = (),
) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = _builder(_name(common_name), ca.subject, key.public_key(), days)
    builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
    builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([_san(s) for s in sans]), critical=False
        )
    _write_cert(cert_path, _sign(builder, ca_key))
    _write_key(key_path, key)


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey, days: int
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate small clock skew
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def _sign(builder: x509.CertificateBuilder, key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
    return builder.sign(key, hashes.SHA256())


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # never world-readable
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    return path
