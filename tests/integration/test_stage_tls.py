"""TLS on the stage link: a device that trusts the server's CA trains; a plaintext one cannot."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fedpipe.config import load_config
from fedpipe.device import DeviceTrainer
from fedpipe.serving import build_stage_server
from fedpipe.transport.client import StageClient


def _certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it (PEM files)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedpipe test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = folder / "ca.pem", folder / "server.pem", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


def test_stage_link_over_tls(tmp_path: Path) -> None:
    ca, cert, key = _certificates(tmp_path)
    config = load_config(
        None,
        {
            "model.name": "tiny-llama",
            "train.batch_size": 4,
            "train.seq_len": 16,
            "pipeline.microbatches": 2,
            "server.tls_cert": str(cert),
            "server.tls_key": str(key),
            "server.tls_ca": str(ca),
        },
    )
    server = build_stage_server(config, port=0).start()
    try:
        trainer = DeviceTrainer(config, device_id="tls-device")
        ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "labels": ids.clone()}
        roots = config.server.root_certificates()
        with StageClient(server.address, root_certificates=roots) as client:
            report = trainer.train_round(client, [batch])
        assert len(report.steps) == 1 and report.steps[0].loss > 0
        with StageClient(server.address) as plaintext, pytest.raises(grpc.RpcError) as info:
            plaintext.open_session(device_id="plain", timeout_s=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(grace=None)


def test_tls_cert_without_key_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="tls_cert and server.tls_key go together"):
        load_config(None, {"server.tls_cert": "/x.pem"})
