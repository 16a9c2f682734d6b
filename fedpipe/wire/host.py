"""The gRPC server a StageServer listens with: its services, health, TLS and port.

:class:`GrpcHost` puts a :class:`~fedpipe.wire.backend.StageBackend` on the network: the stage
link (:mod:`fedpipe.wire.link_servicer`), round control (:mod:`fedpipe.wire.control_servicer`)
and the standard ``grpc.health.v1.Health`` service, on one port.
"""

from __future__ import annotations

import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fedpipe.config import is_loopback
from fedpipe.proto import stage_pb2_grpc as pb_grpc
from fedpipe.wire.backend import StageBackend
from fedpipe.wire.channels import channel_options
from fedpipe.wire.control_servicer import ControlAuth, ControlServicer
from fedpipe.wire.link_servicer import LinkServicer, add_link_servicer

__all__ = ["GrpcHost"]

log = logging.getLogger(__name__)

_UNARY_THREADS = 16  # gRPC threads kept free of streams: health, sessions and control
_SERVICES = ("", "fedpipe.proto.StageLink", "fedpipe.proto.StageControl")


class GrpcHost:
    """One gRPC server for a backend; binds at construction, serves from :meth:`start`."""

    def __init__(
        self,
        backend: StageBackend,
        *,
        host: str,
        port: int,
        control_auth: ControlAuth | None,
        max_message_bytes: int,
        max_streams: int,
        tls: tuple[bytes, bytes] | None = None,
        client_ca: bytes | None = None,
    ) -> None:
        # Each live stream holds a gRPC thread; streams are capped below the pool's size so that
        # health checks, sessions and control calls always find a thread.
        workers = max_streams + _UNARY_THREADS
        # Devices ping every 20 s (keepalive) also while they wait quietly for replies queued
        # behind other sessions' work; gRPC's default (one ping per 5 min without data) would
        # answer a wait of about a minute with GOAWAY "too many pings" and drop the device.
        options = [
            *channel_options(max_message_bytes),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
            # Backstops against connections that hold the server's threads: a connection with
            # no call for 5 min is closed, and one older than an hour is asked to go away (its
            # calls get an hour more: a round's stream is never cut).
            ("grpc.max_connection_idle_ms", 5 * 60_000),
            ("grpc.max_connection_age_ms", 60 * 60_000),
            ("grpc.max_connection_age_grace_ms", 60 * 60_000),
        ]
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stage-grpc"),
            options=options,
        )
        self.link = LinkServicer(backend, max_streams=max_streams)
        add_link_servicer(self.link, self._server)
        pb_grpc.add_StageControlServicer_to_server(
            ControlServicer(backend, control_auth), self._server
        )
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.host = host
        self.tls = "mtls" if client_ca is not None else "tls" if tls is not None else "plaintext"
        self.port = self._bind(f"{host}:{port}", tls, client_ca)
        self.address = f"{host}:{self.port}"

    def _bind(self, bind: str, tls: tuple[bytes, bytes] | None, client_ca: bytes | None) -> int:
        if tls is not None:
            creds = grpc.ssl_server_credentials(  # [(key, cert)]; client_ca: mutual TLS
                [(tls[1], tls[0])],
                root_certificates=client_ca,
                require_client_auth=client_ca is not None,
            )
            port = self._server.add_secure_port(bind, creds)
        elif client_ca is not None:
            raise ValueError("client certificates (mutual TLS) need the server's own TLS files")
        else:
            port = self._server.add_insecure_port(bind)
        if port == 0:
            raise OSError(f"could not bind the StageServer to {bind}")
        return port

    def start(self) -> None:
        self._server.start()
        for service in _SERVICES:
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("StageServer listening on %s (%s)", self.address, self.tls)
        if self.tls == "plaintext" and not is_loopback(self.host):
            log.warning(
                "the stage link on %s is plaintext: activations, gradients and session tokens "
                "cross the network readable by anyone on the path; give the StageServer "
                "server.tls_cert and server.tls_key (fedpipe certs makes test ones)",
                self.address,
            )

    def stop(self, grace: float | None) -> None:
        self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait()

    def wait(self) -> None:
        self._server.wait_for_termination()
