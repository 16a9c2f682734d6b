"""Stage errors map to the right gRPC status codes; retry_call retries only transient failures."""

from __future__ import annotations

import random

import grpc
import pytest

import fedpipe.errors
from fedpipe.errors import TensorFormatError as CodecTensorFormatError
from fedpipe.wire.status import (
    AuthError,
    MessageTooLargeError,
    SessionStateError,
    StageCapacityError,
    TensorFormatError,
    UnknownSessionError,
    retry_call,
    status_for,
)

S = grpc.StatusCode


class FakeRpcError(grpc.RpcError):
    """What a failed unary call raises on the client: an RpcError with ``code()``."""

    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code.name)
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


class Flaky:
    """Fails with the given codes in order, then returns "ok"."""

    def __init__(self, *codes: grpc.StatusCode) -> None:
        self.codes = list(codes)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.codes:
            raise FakeRpcError(self.codes.pop(0))
        return "ok"


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (TensorFormatError("bad shape"), S.INVALID_ARGUMENT),
        (UnknownSessionError("s1"), S.NOT_FOUND),
        (AuthError("bad token"), S.UNAUTHENTICATED),
        (SessionStateError("duplicate microbatch 3"), S.FAILED_PRECONDITION),
        (MessageTooLargeError("5 MB > 4 MB"), S.RESOURCE_EXHAUSTED),
        (StageCapacityError("too many sessions"), S.RESOURCE_EXHAUSTED),
        (ValueError("a bug"), S.INTERNAL),
        (RuntimeError("CUDA out of memory"), S.INTERNAL),
    ],
)
def test_status_for(exc: Exception, code: grpc.StatusCode) -> None:
    assert status_for(exc) == code


def test_reexports_the_one_definition() -> None:
    assert TensorFormatError is CodecTensorFormatError
    assert issubclass(TensorFormatError, ValueError)
    # pipeline/ raises fedpipe.errors' types; status_for must map those very classes.
    assert AuthError is fedpipe.errors.AuthError
    assert status_for(fedpipe.errors.SessionStateError("step 3")) == S.FAILED_PRECONDITION


def test_retries_unavailable_then_succeeds() -> None:
    sleeps: list[float] = []
    fn = Flaky(S.UNAVAILABLE, S.DEADLINE_EXCEEDED, S.UNAVAILABLE)
    result = retry_call(
        fn, base_delay=0.1, max_delay=0.3, rng=random.Random(0), sleep=sleeps.append
    )
    assert result == "ok" and fn.calls == 4
    caps = [0.1, 0.2, 0.3]  # base_delay * 2**i, capped at max_delay; full jitter below each
    assert len(sleeps) == 3 and all(0 <= s <= c for s, c in zip(sleeps, caps, strict=True))


def test_does_not_retry_other_codes() -> None:
    sleeps: list[float] = []
    fn = Flaky(S.INVALID_ARGUMENT)
    with pytest.raises(FakeRpcError) as info:
        retry_call(fn, sleep=sleeps.append)
    assert info.value.code() == S.INVALID_ARGUMENT and fn.calls == 1 and sleeps == []


def test_does_not_retry_non_rpc_errors() -> None:
    def boom() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        retry_call(boom, sleep=pytest.fail)


def test_gives_up_after_attempts() -> None:
    sleeps: list[float] = []
    fn = Flaky(*[S.UNAVAILABLE] * 10)
    with pytest.raises(FakeRpcError):
        retry_call(fn, attempts=3, sleep=sleeps.append)
    assert fn.calls == 3 and len(sleeps) == 2


def test_custom_retry_on_and_bad_attempts() -> None:
    fn = Flaky(S.RESOURCE_EXHAUSTED)
    assert retry_call(fn, retry_on={S.RESOURCE_EXHAUSTED}, sleep=lambda _: None) == "ok"
    with pytest.raises(ValueError, match="attempts must be >= 1, got 0"):
        retry_call(fn, attempts=0)
