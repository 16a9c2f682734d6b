"""A deployment with TLS on both links and node authentication, in the CLI's one flag scheme.

One CA, one server certificate and key serve the SuperLink and the StageServer
(``fedpipe server --tls-ca --tls-cert --tls-key --node-auth``); the device's public key is
registered (``fedpipe register-node``); the device and the run give only ``--tls-ca``.

The tests share that server (its SuperLink starts once): first a device whose key the
SuperLink does not know, and one that does not give the CA, are each told so in one line;
then a registered device trains a round and everything stops cleanly.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness.certs import certificates, node_keys
from harness.deploy import Deployment
from harness.processes import FEDPIPE, Started

SMALL = [
    "--set", "train.local_steps=1",
    "--set", "train.seq_len=32",
    "--set", "train.batch_size=2",
    "--set", "train.eval_batches=1",
    "--set", "pipeline.microbatches=2",
]  # fmt: skip


@dataclass
class TLSDeployment:
    deployment: Deployment
    started: Started
    root: Path
    ca: Path

    @property
    def tls(self) -> list[str]:
        return ["--tls-ca", str(self.ca)]


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSDeployment]:
    """`fedpipe server` with TLS and node authentication on both links, started once."""
    root = tmp_path_factory.mktemp("tls")
    files = certificates(root / "certs")
    started = Started(root)
    deployment = Deployment(started, root, settings=SMALL, one_flag=True)
    try:
        deployment.start_server(
            "--tls-ca", str(files.ca), "--tls-cert", str(files.server_cert),
            "--tls-key", str(files.server_key), "--node-auth",
        )  # fmt: skip
        yield TLSDeployment(deployment, started, root, files.ca)
    finally:
        started.stop()


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("fedpipe: error:")]


class TestOneTLSServer:
    """In this order, on one worker: the refusals first, then the run, which stops it all."""

    def test_unregistered_node_key_is_one_line(self, shared: TLSDeployment, tmp_path: Path) -> None:
        link = shared.deployment.superlink
        unknown, _ = node_keys(tmp_path, "unknown")
        args = ["client", "--superlink", link, *shared.tls]
        args += ["--auth-key", str(unknown), "--workdir", str(tmp_path / "node")]
        env = dict(os.environ, FLWR_HOME=str(tmp_path / "home"))
        done = subprocess.run(  # noqa: S603 - fixed argv
            [*FEDPIPE, *args], capture_output=True, text=True, env=env, timeout=180
        )
        without_ca = [a for a in args if a not in shared.tls]
        no_ca = subprocess.run(  # noqa: S603 - fixed argv
            [*FEDPIPE, *without_ca], capture_output=True, text=True, env=env, timeout=180
        )
        assert no_ca.returncode == 2, no_ca.stderr
        assert _errors(no_ca.stderr) == [
            f"fedpipe: error: the SuperLink at {link} serves TLS: give the CA that signed "
            "its certificate with --tls-ca FILE"
        ], no_ca.stderr
        assert done.returncode == 1, done.stderr
        errors = _errors(done.stderr)
        assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
        assert "refused this SuperNode: register its public key" in errors[0]

    def test_tls_and_node_auth_deployment_with_one_flag_scheme(self, shared: TLSDeployment) -> None:
        deployment, started, root = shared.deployment, shared.started, shared.root
        assert "(TLS, node auth;" in started.text("server")
        private, public = node_keys(root, "dev1")
        register = subprocess.run(  # noqa: S603 - fixed argv
            [
                *FEDPIPE,
                "register-node",
                str(public),
                "--superlink",
                deployment.superlink,
                *shared.tls,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, FLWR_HOME=str(root / "home-register")),
        )
        assert register.returncode == 0, register.stderr
        deployment.start_devices(
            1,
            args=lambda i: [
                "--stage-server", deployment.stage, *shared.tls,
                "--auth-key", str(private), "--workdir", str(root / "node"),
            ],
        )  # fmt: skip
        args = deployment.run_args("tls", *shared.tls, "--no-progress", rounds=1, devices=1)
        run = subprocess.run(  # noqa: S603 - fixed argv
            [*FEDPIPE, *args],
            capture_output=True,
            text=True,
            timeout=600,
            env=dict(os.environ, FLWR_HOME=str(root / "home-run")),
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-4000:]
        assert "round 1: eval loss" in run.stdout
        codes = deployment.stop(grace_s=60)
        assert codes == {"client0": 0, "server": 0}
        assert "deprecated" not in started.text("server") + started.text("client0")
