"""Unit tier: in-process only. A test here that opens a network socket, a gRPC server or
channel, or starts a subprocess fails, saying that it belongs in tests/integration.

The tier's shared fixture: ``folder``, the bundled tiny-llama in a private cache, one per module
(a module that needs another model defines its own ``folder``)."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from fedpipe.models import resolve_model

_SUBPROCESS_EVENTS = {"subprocess.Popen", "os.system", "os.posix_spawn", "os.exec", "os.spawn"}
_SOCKET_EVENTS = {"socket.bind", "socket.connect"}
_NETWORK = (socket.AF_INET, socket.AF_INET6)
_guarding = False  # only while a unit test runs; the hook stays for the session


class OutOfProcess(RuntimeError):
    """A unit test reached for a socket or a process."""


def _refuse(what: str) -> OutOfProcess:
    return OutOfProcess(
        f"unit tests run in-process: {what} belongs in tests/integration (see tests/conftest.py)"
    )


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _guarding:
        return
    if event in _SUBPROCESS_EVENTS:
        raise _refuse(f"a subprocess ({event})")
    if event in _SOCKET_EVENTS and getattr(args[0], "family", None) in _NETWORK:
        raise _refuse(f"a network socket ({event} {args[1]!r})")


sys.addaudithook(_audit)


def _refusing(name: str) -> Callable[..., Any]:
    def refused(*_: Any, **__: Any) -> Any:
        raise _refuse(f"gRPC ({name})")

    return refused


@pytest.fixture(autouse=True)
def _in_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No sockets, gRPC or subprocesses while the test runs."""
    global _guarding
    for name in ("server", "insecure_channel", "secure_channel"):
        monkeypatch.setattr(grpc, name, _refusing(f"grpc.{name}"))
        monkeypatch.setattr(grpc.aio, name, _refusing(f"grpc.aio.{name}"))
    _guarding = True
    try:
        yield
    finally:
        _guarding = False


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled tiny-llama, resolved into this module's own cache folder."""
    return resolve_model("tiny-llama", cache_dir=tmp_path_factory.mktemp("cache"))
