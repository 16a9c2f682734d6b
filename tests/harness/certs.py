"""The certificate maker: a CA and loopback certificates, node keys, or `fedpipe certs` itself."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedpipe.auth.certs import CertificateFiles, make_test_certificates
from harness.processes import FEDPIPE

__all__ = ["CertificateFiles", "certificates", "fedpipe_certs", "node_keys"]


def certificates(
    folder: Path, *, clients: Sequence[str] = (), hosts: Sequence[str] = ()
) -> CertificateFiles:
    """A CA, a server certificate for loopback (+ ``hosts``) and ``clients``' certificates."""
    return make_test_certificates(folder, clients=clients, hosts=hosts)


def fedpipe_certs(out: Path, *args: str) -> str:
    """Run `fedpipe certs --out OUT ARGS` as a user would; returns what it printed."""
    done = subprocess.run(  # noqa: S603 - fixed argv
        [*FEDPIPE, "certs", "--out", str(out), *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def node_keys(folder: Path, name: str = "node") -> tuple[Path, Path]:
    """A device's ECDSA SECP384R1 key pair in OpenSSH format, as Flower's node auth wants it
    (what `ssh-keygen -t ecdsa -b 384` writes): the private key's path and the public key's."""
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / name, folder / f"{name}.pub"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
    )
    return private, public
