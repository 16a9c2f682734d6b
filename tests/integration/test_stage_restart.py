"""A StageServer that stops and comes back: devices reconnect, the ServerApp is not fooled.

A device opening a session while its StageServer is down retries with backoff and gets its
session once a new StageServer serves the same port. A restarted StageServer holds none of the
run's state, so it refuses the control calls that would carry on from it (FAILED_PRECONDITION,
saying to resume), until the ServerApp reloads the run's adapter, as `fedpipe run --resume`
does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from fedpipe.config import FedpipeConfig
from fedpipe.edge.trainer import split_terms
from fedpipe.server.stage_server import StageServer
from fedpipe.wire.backend import SessionRequest
from fedpipe.wire.control_client import StageControlClient
from fedpipe.wire.link_client import StageClient

CONFIG = FedpipeConfig().with_overrides({"model.name": "tiny-llama"})
SECRET = "a-secret-for-the-restart-tests"


@pytest.fixture(scope="module")
def split(folder: Path):  # type: ignore[no-untyped-def]
    return split_terms(CONFIG, folder)


class _Retries(logging.Handler):
    """Sets ``seen`` once the client logs that it is retrying an UNAVAILABLE server."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = threading.Event()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "UNAVAILABLE" in message and "retrying in" in message:
            self.messages.append(message)
            self.seen.set()


@pytest.fixture
def retries() -> Iterator[_Retries]:
    handler = _Retries()
    logger = logging.getLogger("fedpipe.wire.channels")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def test_device_reconnects_to_a_restarted_stage_server(
    folder: Path, split, retries: _Retries, serve: Callable[..., StageServer]
) -> None:
    first = serve(CONFIG, folder=folder)
    port = first.port
    with StageClient(first.address, reconnect_s=120) as client:
        client.open(
            SessionRequest(device_id="d0", round=0, split=split, learning_rate=1e-3), timeout_s=10
        ).close()
        first.stop(grace=None)  # the server goes away
        opened: list[str] = []
        failed: list[BaseException] = []

        def reopen() -> None:
            try:
                opened.append(
                    client.open(
                        SessionRequest(device_id="d0", round=0, split=split, learning_rate=1e-3),
                        timeout_s=10,
                    ).session_id
                )
            except BaseException as exc:  # reported by the assertions below
                failed.append(exc)

        device = threading.Thread(target=reopen)
        device.start()
        try:
            assert retries.seen.wait(60), "the device never retried"  # it found nothing there
            second = serve(CONFIG, port=port, folder=folder)  # the same port
            device.join(120)
            assert not device.is_alive() and not failed, failed
            assert opened and second.runtime.session(opened[0]).device_id == "d0"
        finally:
            device.join(1)
    assert "(try 1)" in retries.messages[0]


def test_device_gives_up_after_its_reconnect_budget(split, retries: _Retries) -> None:  # type: ignore[no-untyped-def]
    with StageClient("127.0.0.1:1", reconnect_s=0.5) as client:  # nothing listens on port 1
        with pytest.raises(grpc.RpcError) as info:
            client.open(
                SessionRequest(device_id="d0", round=0, split=split, learning_rate=1e-3),
                timeout_s=5,
            )
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_restarted_stage_server_refuses_to_carry_on_a_run(
    folder: Path, serve: Callable[..., StageServer]
) -> None:
    server = serve(CONFIG, secret=SECRET, folder=folder)
    control = StageControlClient(server.address, SECRET)
    try:
        for call in (
            lambda: control.begin_round(3, "run"),
            lambda: control.commit_round(3, {"d0": 1.0}),
            control.get_adapter,
        ):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "fedpipe run --resume" in info.value.details()
        state = {k: v + 0.5 for k, v in server.runtime.bank.global_state().items()}
        control.load_adapter(state)  # what a resumed ServerApp does first
        control.begin_round(3, "run")
        with pytest.raises(grpc.RpcError) as info:
            control.commit_round(2, {})
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "round 2 was not begun" in info.value.details()
        assert control.commit_round(3, {})[:2] == (0, 0)
        assert set(control.get_adapter()) == set(state)
    finally:
        control.close()
