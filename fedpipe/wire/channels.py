"""gRPC channels of the stage link: the options both ends use, TLS, reconnecting, headers."""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

__all__ = [
    "EXCHANGE_METHOD",
    "SESSION_HEADER",
    "STREAM_KEY_HEADER",
    "channel_options",
    "reconnect_call",
    "secure_channel_credentials",
]

log = logging.getLogger(__name__)

SESSION_HEADER = "fedpipe-session-id"
STREAM_KEY_HEADER = "fedpipe-stream-key"  # the session's stream key, from OpenSessionReply
# The stream's method, called with bytes both ways: serde frames messages itself (one copy).
EXCHANGE_METHOD = "/fedpipe.proto.StageLink/Exchange"
T = TypeVar("T")


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC options used by both ends: message limits set on purpose, keepalive on."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # a device whose server restarts tries to reconnect at least every 10 s (gRPC: 120 s)
        ("grpc.max_reconnect_backoff_ms", 10_000),
    ]


def secure_channel_credentials(
    root_certificates: bytes,
    certificate_chain: bytes | None = None,
    private_key: bytes | None = None,
) -> grpc.ChannelCredentials:
    """TLS trusting ``root_certificates``; with a certificate and key, mutual TLS."""
    if (certificate_chain is None) != (private_key is None):
        raise ValueError(
            "a client certificate and its private key go together (--stage-cert with --stage-key)"
        )
    return grpc.ssl_channel_credentials(
        root_certificates=root_certificates,
        private_key=private_key,
        certificate_chain=certificate_chain,
    )


def reconnect_call(
    fn: Callable[[], T],
    *,
    budget_s: float,
    what: str,
    base_delay: float = 0.2,
    max_delay: float = 5.0,
    rng: random.Random | None = None,
) -> T:
    """Call ``fn()``, retrying UNAVAILABLE for up to ``budget_s`` seconds (a server restarting).

    Waits ``uniform(0, min(max_delay, base_delay * 2**i))`` before retry ``i`` (exponential
    backoff, full jitter), so devices that lost the same server do not return in lockstep.
    Other errors, and UNAVAILABLE once the budget is spent, are raised as they are.
    """
    rng = rng or random.Random()
    deadline = time.monotonic() + budget_s
    for attempt in itertools.count():
        try:
            return fn()
        except grpc.RpcError as exc:
            code = exc.code() if callable(getattr(exc, "code", None)) else None
            left = deadline - time.monotonic()
            if code != grpc.StatusCode.UNAVAILABLE or left <= 0:
                raise
            delay = min(left, rng.uniform(0.0, min(max_delay, base_delay * 2**attempt)))
            log.warning(
                "%s: UNAVAILABLE (try %d), retrying in %.2f s for up to %.0f s more",
                what,
                attempt + 1,
                delay,
                left,
            )
            time.sleep(delay)
    raise AssertionError("unreachable")
