"""Failures of running commands end in one line that says what to do (real processes).

- a device whose key the SuperLink does not know (node authentication), and one that does not
  give the CA of a TLS SuperLink;
- Ctrl-C in a simulation: where it stopped, and a command that resumes it (which then works).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedpipe.auth.certs import make_test_certificates
from fedpipe.launch.processes import Certificates, start_superlink

pytestmark = pytest.mark.slow

FEDPIPE = [sys.executable, "-m", "fedpipe.cli"]
TINY = [
    "--set", "train.local_steps=1",
    "--set", "train.seq_len=32",
    "--set", "train.batch_size=2",
    "--set", "train.eval_batches=1",
    "--set", "pipeline.microbatches=2",
    "--devices", "2",
    "--profiles", "loopback",
    "--no-progress",
]  # fmt: skip


def _stage_tls_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for loopback, as `fedpipe certs` makes them."""
    files = make_test_certificates(folder, clients=())
    return files.ca, files.server_cert, files.server_key


def _node_key(folder: Path) -> Path:
    """An ECDSA SECP384R1 private key in OpenSSH format, as Flower's node auth wants."""
    key = ec.generate_private_key(ec.SECP384R1())
    path = folder / "node.key"
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    return path


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("fedpipe: error:")]


def test_unregistered_node_key_is_one_line(tmp_path: Path) -> None:
    ca, cert, key = _stage_tls_certificates(tmp_path)
    link = start_superlink(
        insecure=False,
        certificates=Certificates(ca, cert, key),
        enable_node_auth=True,
        workdir=tmp_path / "superlink",
    )
    try:
        args = ["client", "--superlink", link.address, "--tls-ca", str(ca)]
        args += ["--auth-key", str(_node_key(tmp_path)), "--workdir", str(tmp_path / "node")]
        env = dict(os.environ, FLWR_HOME=str(tmp_path / "home"))
        done = subprocess.run(  # noqa: S603 - fixed argv
            [*FEDPIPE, *args], capture_output=True, text=True, env=env, timeout=180
        )
        without_ca = [a for a in args if a not in ("--tls-ca", str(ca))]
        no_ca = subprocess.run(  # noqa: S603 - fixed argv
            [*FEDPIPE, *without_ca], capture_output=True, text=True, env=env, timeout=180
        )
    finally:
        link.stop()
    assert no_ca.returncode == 2, no_ca.stderr
    assert _errors(no_ca.stderr) == [
        f"fedpipe: error: the SuperLink at {link.address} serves TLS: give the CA that signed "
        "its certificate with --tls-ca FILE"
    ], no_ca.stderr
    assert done.returncode == 1, done.stderr
    errors = _errors(done.stderr)
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "refused this SuperNode: register its public key" in errors[0]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_says_where_the_run_stopped_and_how_to_resume(tmp_path: Path) -> None:
    argv = ["simulate", *TINY, "--rounds", "3", "--runs-dir", str(tmp_path), "--name", "r"]
    first_checkpoint = tmp_path / "r" / "checkpoints" / "round-0001"
    with (tmp_path / "err.txt").open("w+") as err:
        # Ctrl-C as a terminal sends it: a process started from a background job (CI scripts,
        # `cmd &`) inherits SIGINT ignored, and Python then keeps it ignored.
        proc = subprocess.Popen(  # noqa: S603
            [*FEDPIPE, *argv], stdout=subprocess.DEVNULL, stderr=err, preexec_fn=_default_sigint
        )
        try:
            deadline = time.monotonic() + 400
            while not first_checkpoint.is_dir():
                assert proc.poll() is None, (tmp_path / "err.txt").read_text()
                assert time.monotonic() < deadline, "no checkpoint of round 1"
                time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    stderr = (tmp_path / "err.txt").read_text()
    assert rc == 130, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("fedpipe: interrupted after round "), stderr
    command = last.split("resume with: ", 1)[1]
    assert command.endswith("--resume") and "--name r" in command
    resumed = subprocess.run(  # noqa: S603 - the command the user is told to run
        [*FEDPIPE, *shlex.split(command)[1:]], capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (tmp_path / "r" / "checkpoints" / "round-0003").is_dir()
