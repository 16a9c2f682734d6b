"""Preflight checks on their own: names, ports, protocols, splits, Flower's failure logs."""

from __future__ import annotations

import datetime
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fedpipe.cli.preflight import (
    SettingsError,
    check_data,
    check_partition,
    check_port_free,
    check_tls_matches,
    default_split,
    did_you_mean,
    probe_tls,
    split_address,
)
from fedpipe.config import load_config
from fedpipe.launch.processes import explain_failure


def _self_signed(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (PEM files)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


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
    cert, key = _self_signed(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
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


def test_names_and_splits() -> None:
    assert did_you_mean("fedavgg", ["fedavg", "fedprox"]) == " (did you mean 'fedavg'?)"
    assert did_you_mean("zzz", ["fedavg"]) == ""
    # head = tail = 2 where the model allows it, always leaving the server a block
    assert [default_split(n) for n in (2, 3, 4, 5, 8, 30)] == [1, 1, 1, 2, 2, 2]


def test_partition_feasibility_under_each_scheme(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    for i in range(3):  # three sources of ten documents each
        text = "\n\n".join(f"source {i} paragraph {j}. " * 300 for j in range(10))
        (folder / f"user{i}.txt").write_text(text)
    docs = check_data(str(folder), "federated.data")
    by_source = load_config(None, {"federated.data": str(folder)})
    check_partition(by_source, docs, 3)
    with pytest.raises(SettingsError, match="3 source.* for 4 devices"):
        check_partition(by_source, docs, 4)
    iid = load_config(None, {"federated.data": str(folder), "federated.partition": "iid"})
    check_partition(iid, docs, 8)


@pytest.mark.parametrize(
    ("log", "meaning"),
    [
        (
            "ERROR :     Exit Code: 305\nFailed to initialize the connection to the SuperLink.\n"
            "[code: 2004] Failed to activate SuperNode.",
            "refused this SuperNode: register its public key",
        ),
        ("WARNING :   Connection attempt failed, retrying in 0.37 seconds", "could not reach"),
        ("OSError: [Errno 98] Address already in use", "already in use"),
        ("The `--enable-supernode-auth` flag requires encrypted TLS", "needs TLS"),
        ("INFO: all fine", ""),
    ],
)
def test_flower_failures_are_explained(log: str, meaning: str) -> None:
    assert meaning in explain_failure(log)
    if not meaning:
        assert explain_failure(log) == ""


def test_links_take_names_and_inline_specs() -> None:
    from fedpipe.cli.preflight import check_links
    from fedpipe.link import split_specs as split_links

    assert split_links("1gbit-5ms,up=10,down=25,rtt=50ms") == [
        "1gbit-5ms",
        "up=10,down=25,rtt=50ms",
    ]
    assert split_links("up=10,down=25,up=5,down=5,rtt=1ms") == [
        "up=10,down=25",
        "up=5,down=5,rtt=1ms",
    ]
    check_links(split_links("100mbit-5ms,up=10,down=25,rtt=50ms"))
    with pytest.raises(SettingsError, match="--links: unknown link '100mbit-5s'.*did you mean"):
        check_links(["100mbit-5s"])
