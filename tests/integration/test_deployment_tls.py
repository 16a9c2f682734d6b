"""A deployment with TLS on both links and node authentication, in the CLI's one flag scheme.

One CA, one server certificate and key serve the SuperLink and the StageServer
(``fedpipe server --tls-ca --tls-cert --tls-key --node-auth``); the device's public key is
registered (``fedpipe register-node``); the device and the run give only ``--tls-ca``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedpipe.auth.certs import make_test_certificates
from fedpipe.launch.processes import free_port

pytestmark = pytest.mark.slow

FEDPIPE = [sys.executable, "-m", "fedpipe.cli"]
SMALL = [
    "--set", "train.local_steps=1",
    "--set", "train.seq_len=32",
    "--set", "train.batch_size=2",
    "--set", "train.eval_batches=1",
    "--set", "pipeline.microbatches=2",
]  # fmt: skip


def _certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for loopback, as `fedpipe certs` makes them."""
    files = make_test_certificates(folder, clients=())
    return files.ca, files.server_cert, files.server_key


def _node_keys(folder: Path) -> tuple[Path, Path]:
    """A device's ECDSA SECP384R1 key pair in OpenSSH format (what `ssh-keygen -t ecdsa -b 384`
    writes)."""
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / "dev1", folder / "dev1.pub"
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


def _spawn(args: list[str], log: Path, home: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, FLWR_HOME=str(home), PYTHONUNBUFFERED="1")
    with log.open("wb") as out:
        return subprocess.Popen([*FEDPIPE, *args], stdout=out, stderr=subprocess.STDOUT, env=env)  # noqa: S603


def _wait(proc: subprocess.Popen[bytes], ready, log: Path, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"not ready (rc {proc.poll()}):\n{log.read_text()[-3000:]}")
        time.sleep(0.3)


def test_tls_and_node_auth_deployment_with_one_flag_scheme(tmp_path: Path) -> None:
    ca, cert, key = _certificates(tmp_path)
    private, public = _node_keys(tmp_path)
    link = f"127.0.0.1:{free_port()}"
    port_file, secret = tmp_path / "stage.port", tmp_path / "secret"
    tls = ["--tls-ca", str(ca)]
    server_log, client_log = tmp_path / "server.out", tmp_path / "client.out"
    server = _spawn(
        [
            "server", *SMALL, "--superlink", link, "--stage-server", "127.0.0.1:0", *tls,
            "--tls-cert", str(cert), "--tls-key", str(key), "--node-auth",
            "--secret-file", str(secret), "--port-file", str(port_file),
            "--workdir", str(tmp_path / "link"),
        ],
        server_log,
        tmp_path / "home-server",
    )  # fmt: skip
    client = None
    try:
        _wait(server, port_file.exists, server_log, timeout_s=180)
        stage = f"127.0.0.1:{port_file.read_text().strip()}"
        assert "(TLS, node auth;" in server_log.read_text()
        register = subprocess.run(  # noqa: S603 - fixed argv
            [*FEDPIPE, "register-node", str(public), "--superlink", link, *tls],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, FLWR_HOME=str(tmp_path / "home-register")),
        )
        assert register.returncode == 0, register.stderr
        client = _spawn(
            [
                "client", "--superlink", link, "--stage-server", stage, *tls,
                "--auth-key", str(private), "--workdir", str(tmp_path / "node"),
            ],
            client_log,
            tmp_path / "home-client",
        )  # fmt: skip
        _wait(client, lambda: "connected to" in client_log.read_text(), client_log, 180)
        run = subprocess.run(  # noqa: S603 - fixed argv
            [
                *FEDPIPE, "run", *SMALL, "--superlink", link, "--stage-server", stage, *tls,
                "--secret-file", str(secret), "--devices", "1", "--rounds", "1",
                "--name", "tls", "--runs-dir", str(tmp_path / "runs"), "--no-progress",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env=dict(os.environ, FLWR_HOME=str(tmp_path / "home-run")),
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-4000:]
        assert "round 1: eval loss" in run.stdout
    finally:
        for proc in (client, server):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in (client, server) if p is not None]
    assert codes == [0, 0]
    assert "deprecated" not in server_log.read_text() + client_log.read_text()
