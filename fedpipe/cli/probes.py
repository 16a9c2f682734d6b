"""The checks that ask the network, before any process starts: addresses, free ports, which
protocol a server speaks, and whether the StageServer takes the run's secret.

:mod:`fedpipe.cli.preflight` calls them beside its checks of settings, data and model; each
failure is a :class:`~fedpipe.errors.SettingsError` of one line naming the flag to change.
"""

from __future__ import annotations

import logging
import socket
import ssl
from pathlib import Path
from typing import Any

from fedpipe.errors import SettingsError

__all__ = [
    "check_port_free",
    "check_stage_secret",
    "check_tls_matches",
    "probe_tls",
    "split_address",
]

log = logging.getLogger(__name__)


def split_address(address: str, flag: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port), or a SettingsError naming ``flag``."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise SettingsError(f"{flag}: expected HOST:PORT (e.g. 127.0.0.1:8000), got {address!r}")
    return host.strip("[]"), int(port)


def check_port_free(host: str, port: int, flag: str) -> None:
    """Nothing listens on ``host:port`` (port 0 = any free port, always fine)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not "busy"
        try:
            sock.bind((host, port))
        except PermissionError:
            raise SettingsError(
                f"{flag}: port {port} needs privileges on this machine; use a port >= 1024"
            ) from None
        except OSError as exc:
            raise SettingsError(
                f"{flag}: {host}:{port} is not free ({exc.strerror}{_holder(port)}); "
                "choose another port or stop that process"
            ) from None


def _holder(port: int) -> str:
    """``; held by pid N (name)`` when this user may see who listens on ``port``."""
    import psutil

    try:
        for conn in psutil.net_connections(kind="inet"):
            if conn.laddr and conn.laddr.port == port and conn.status == "LISTEN" and conn.pid:
                return f"; held by pid {conn.pid} ({psutil.Process(conn.pid).name()})"
    except (psutil.Error, OSError):
        pass
    return ""


def probe_tls(host: str, port: int, timeout_s: float = 3.0) -> bool | None:
    """True if ``host:port`` completes a TLS handshake, False if it answers in plaintext,
    None if nothing answers. Certificates are not checked: this only asks which protocol."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2", "http/1.1"])
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            try:
                with context.wrap_socket(raw, server_hostname=host):
                    return True
            except (ssl.SSLError, ConnectionResetError, TimeoutError):
                return False
    except OSError:
        return None


def check_tls_matches(
    address: str, ca: str | None, flag: str, what: str, *, required: bool = False
) -> None:
    """A TLS server needs ``--tls-ca``; a plaintext one must not get it. A server that does
    not answer is an error when ``required``, else a warning (it may start later)."""
    host, port = split_address(address, flag)
    speaks_tls = probe_tls(host, port)
    if speaks_tls is None:
        message = f"no {what} answers at {address}"
        if required:
            raise SettingsError(f"{message}: start it first, or fix {flag}")
        log.warning("%s yet; waiting for it", message)
    if speaks_tls and not ca:
        raise SettingsError(
            f"the {what} at {address} serves TLS: give the CA that signed its certificate "
            "with --tls-ca FILE"
        )
    if speaks_tls is False and ca:
        raise SettingsError(
            f"the {what} at {address} serves plaintext, not TLS: drop --tls-ca, or start it "
            "with --tls-cert/--tls-key"
        )


def check_stage_secret(
    address: str,
    secret_file: Path | None,
    stage_ca: str | None,
    identity: tuple[bytes | None, bytes | None] = (None, None),
) -> None:
    """Ask the StageServer at ``address`` (a read-only, signed control call) whether it
    accepts the secret in ``secret_file`` (None: no secret).

    A fresh StageServer answers FAILED_PRECONDITION (no run's adapter yet) only after it checked
    the call's signature, so that answer, too, says the secret is right.
    """
    import grpc  # deferred: gRPC loads only for the commands that reach a server

    from fedpipe.wire.control_client import StageControlClient  # deferred: torch, gRPC

    secret = secret_file.read_text().strip() if secret_file else ""
    ca = Path(stage_ca).expanduser().read_bytes() if stage_ca else None
    client = StageControlClient(
        address,
        secret,
        root_certificates=ca,
        certificate_chain=identity[0],
        private_key=identity[1],
    )
    try:
        client.check_access(timeout=10)
    except grpc.RpcError as exc:
        raise SettingsError(_stage_refusal(address, exc, secret_file)) from None
    finally:
        client.close()


def _stage_refusal(address: str, exc: Any, secret_file: Path | None) -> str:
    import grpc

    code = exc.code()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        given = f"the secret in {secret_file}" if secret_file else "no secret"
        return (
            f"the StageServer at {address} refused {given}: pass the same --secret-file that "
            "`fedpipe server` was started with"
        )
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return (
            f"no StageServer answers at {address} ({exc.details()}): start `fedpipe server` "
            "there or fix --stage-server"
        )
    return f"the StageServer at {address} answered {code.name}: {exc.details()}"
