"""Preflight checks against real sockets: TLS or plaintext or nothing, and busy ports."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.certs import certificates

from fedpipe.cli.probes import check_port_free, check_tls_matches, probe_tls, split_address
from fedpipe.errors import SettingsError


def _serve(tls: ssl.SSLContext | None) -> Iterator[int]:
    """A server on 127.0.0.1:0 that accepts connections (TLS ones handshake) until closed."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)  # so that the loop sees `stop`
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(5.0)
            with conn:
                if tls is not None:
                    try:
                        with tls.wrap_socket(conn, server_side=True):
                            pass
                    except (ssl.SSLError, OSError):
                        pass
                else:
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")  # plaintext reply

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


@pytest.fixture
def tls_port(tmp_path: Path) -> Iterator[int]:
    files = certificates(tmp_path)  # a CA and a certificate for 127.0.0.1
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(files.server_cert, files.server_key)
    yield from _serve(context)


@pytest.fixture
def plain_port() -> Iterator[int]:
    yield from _serve(None)


def test_probe_tls_tells_tls_from_plaintext_from_nothing(tls_port: int, plain_port: int) -> None:
    assert probe_tls("127.0.0.1", tls_port) is True
    assert probe_tls("127.0.0.1", plain_port) is False
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    assert probe_tls("127.0.0.1", closed) is None


def test_tls_server_without_its_ca_and_plaintext_with_one(tls_port: int, plain_port: int) -> None:
    with pytest.raises(SettingsError, match="serves TLS: give the CA .* --tls-ca"):
        check_tls_matches(f"127.0.0.1:{tls_port}", None, "--superlink", "SuperLink")
    check_tls_matches(f"127.0.0.1:{tls_port}", "ca.pem", "--superlink", "SuperLink")
    with pytest.raises(SettingsError, match="serves plaintext, not TLS: drop --tls-ca"):
        check_tls_matches(f"127.0.0.1:{plain_port}", "ca.pem", "--stage-server", "StageServer")


def test_port_checks(plain_port: int) -> None:
    check_port_free("127.0.0.1", 0, "--stage-server")  # any free port
    with pytest.raises(SettingsError, match=f"127.0.0.1:{plain_port} is not free"):
        check_port_free("127.0.0.1", plain_port, "--stage-server")
    assert split_address("[::1]:8000", "--superlink") == ("::1", 8000)
    for bad in ("localhost", "host:port", ":80", "h:70000"):
        with pytest.raises(SettingsError, match="expected HOST:PORT"):
            split_address(bad, "--superlink")
