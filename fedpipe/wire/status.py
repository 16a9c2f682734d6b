"""Errors the stage link raises, their gRPC status codes, and retries for client calls.

The error types live in ``fedpipe.errors``; they are re-exported here so the wire imports
everything from one place.

The StageServer's servicer catches exceptions, maps them with ``status_for`` and aborts the call
(or sends an ``ERROR`` message on the stream) so the device learns what was wrong. Clients wrap
unary calls in ``retry_call``: transient failures (server restarting, deadline hit) are retried
with exponential backoff and full jitter; every other status is a real error and surfaces at once.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Collection
from typing import TypeVar

import grpc

# One definition of each error, in fedpipe.errors, so every layer can raise them; this module
# re-exports them beside the status mapping.
from fedpipe.errors import (
    AuthError,
    CorruptMessageError,
    IdleTimeoutError,
    InvalidRequestError,
    MessageTooLargeError,
    RunStateError,
    SessionStateError,
    SplitMismatchError,
    StageCapacityError,
    StreamReplacedError,
    TensorFormatError,
    UnknownSessionError,
)

__all__ = [
    "AuthError",
    "CorruptMessageError",
    "IdleTimeoutError",
    "InvalidRequestError",
    "MessageTooLargeError",
    "SessionStateError",
    "StageCapacityError",
    "StreamReplacedError",
    "TensorFormatError",
    "UnknownSessionError",
    "retry_call",
    "status_for",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRYABLE: tuple[grpc.StatusCode, ...] = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)


# Checked in order; the first matching type wins, anything else is INTERNAL (a server bug: bad
# input from a peer always raises one of these types).
_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (CorruptMessageError, grpc.StatusCode.DATA_LOSS),
    (TensorFormatError, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownSessionError, grpc.StatusCode.NOT_FOUND),
    (AuthError, grpc.StatusCode.UNAUTHENTICATED),
    (SessionStateError, grpc.StatusCode.FAILED_PRECONDITION),
    (SplitMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (RunStateError, grpc.StatusCode.FAILED_PRECONDITION),
    (MessageTooLargeError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StageCapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StreamReplacedError, grpc.StatusCode.ABORTED),
    (IdleTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
)


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code a servicer should answer ``exc`` with."""
    for exc_type, code in _STATUS:
        if isinstance(exc, exc_type):
            return code
    return grpc.StatusCode.INTERNAL


def _rpc_code(exc: grpc.RpcError) -> grpc.StatusCode | None:
    code = getattr(exc, "code", None)
    return code() if callable(code) else None


def retry_call(
    fn: Callable[[], T],
    *,
    attempts: int = 5,
    base_delay: float = 0.1,
    max_delay: float = 2.0,
    retry_on: Collection[grpc.StatusCode] = RETRYABLE,
    rng: random.Random | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call ``fn()`` up to ``attempts`` times, retrying ``grpc.RpcError``s whose code is in
    ``retry_on``; return its result or re-raise the last error.

    Before retry ``i`` (0-based) it sleeps ``uniform(0, min(max_delay, base_delay * 2**i))``
    ("full jitter"), so many devices retrying at once spread out instead of stampeding.
    Other exceptions, and RpcErrors with other codes, are re-raised at once.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    rng = rng or random.Random()
    for attempt in range(attempts):
        try:
            return fn()
        except grpc.RpcError as exc:
            code = _rpc_code(exc)
            if code not in retry_on or attempt == attempts - 1:
                raise
            delay = rng.uniform(0.0, min(max_delay, base_delay * 2**attempt))
            log.warning(
                "call failed with %s (attempt %d/%d); retrying in %.2fs",
                code.name if code else code,
                attempt + 1,
                attempts,
                delay,
            )
            sleep(delay)
    raise AssertionError("unreachable")  # the loop returns or raises
