"""Command-line errors found on the network: a busy port, no StageServer, a wrong secret.

The commands run in-process (`fedpipe.cli.main`) against real sockets and a real StageServer.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from harness.cli import error_line as _error_line

from fedpipe.config import load_config
from fedpipe.server.stage_server import StageServer


def test_busy_port_and_node_auth_without_tls(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = _error_line(capsys, ["server", "--stage-server", f"127.0.0.1:{port}"])
        assert f"127.0.0.1:{port} is not free" in line
        line = _error_line(
            capsys, ["server", "--stage-server", "127.0.0.1:0", "--superlink", f"127.0.0.1:{port}"]
        )
        assert line.startswith("fedpipe: error: --superlink:")
    line = _error_line(capsys, ["server", "--superlink", "--node-auth"])
    assert "--node-auth needs TLS" in line


def test_run_without_a_stage_server(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    line = _error_line(capsys, ["run", "--stage-server", f"127.0.0.1:{port}"])
    assert f"no StageServer answers at 127.0.0.1:{port}" in line


def test_a_wrong_secret_is_refused_before_the_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, serve: Callable[..., StageServer]
) -> None:
    server = serve(load_config(), secret="r" * 32, grace=0)
    wrong = tmp_path / "secret"
    wrong.write_text("w" * 32)
    argv = ["run", "--stage-server", server.address, "--secret-file", str(wrong)]
    line = _error_line(capsys, argv)
    assert "refused the secret" in line and "same --secret-file" in line
