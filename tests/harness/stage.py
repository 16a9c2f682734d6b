"""The StageServer factory: one started on loopback (port 0 unless given), stopped in a finally.

Either from settings (:func:`fedpipe.server.build.build_stage_server`, as ``fedpipe server``
builds it) or around a runtime a test built itself (a custom optimizer, a model of its own).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedpipe.config import FedpipeConfig
from fedpipe.server.build import build_stage_server
from fedpipe.server.runtime import StageRuntime
from fedpipe.server.stage_server import StageServer

__all__ = ["StreamKeys", "hold_compute", "stage_server"]


@contextmanager
def stage_server(
    config: FedpipeConfig | None = None,
    *,
    runtime: StageRuntime | None = None,
    split: Any = None,
    secret: str | None = None,
    port: int = 0,
    folder: Path | None = None,
    grace: float | None = None,
) -> Iterator[StageServer]:
    """A started StageServer on 127.0.0.1; stopped (``grace``) when the block ends.

    Give ``config`` (built as ``fedpipe server`` builds it, with ``secret`` and the model in
    ``folder``), or a ``runtime`` and its ``split`` (a :class:`SplitInfo`) built by the test.
    """
    if runtime is not None:
        server = StageServer(runtime, split, port=port)
    else:
        server = build_stage_server(
            config or FedpipeConfig(), secret=secret, port=port, folder=folder
        )
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=grace)


@contextmanager
def hold_compute(
    runtime: StageRuntime,
    gate: threading.Event,
    *,
    timeout: float,
    calls: list[list[str]] | None = None,
) -> Iterator[None]:
    """Hold the runtime's worker before each compute call until ``gate`` is set.

    Wraps ``runtime.executor.compute_batch`` (every forward and backward goes through it);
    ``calls`` gets, per call, the session id of each message it computed, in order. Undone
    on exit.
    """
    executor = runtime.executor
    real = executor.compute_batch
    own = "compute_batch" in vars(executor)  # already wrapped on the instance

    def held(work: Any) -> Any:
        gate.wait(timeout)
        if calls is not None:
            calls.append([info.session_id for info, _ in work])
        return real(work)

    executor.compute_batch = held  # type: ignore[method-assign]
    try:
        yield
    finally:
        gate.set()
        if own:
            executor.compute_batch = real  # type: ignore[method-assign]
        else:
            del executor.compute_batch  # the class's method again


class StreamKeys:
    """The stream keys of the sessions a hand-driven test opened: ``open`` records the one
    OpenSession answered, ``metadata`` is what a stream of that session presents."""

    def __init__(self) -> None:
        self._keys: dict[str, str] = {}

    def opened(self, reply: Any) -> str:
        """Record ``reply``'s (an OpenSessionReply) key; its session id."""
        self._keys[reply.session_id] = reply.stream_key
        return str(reply.session_id)

    def metadata(self, session_id: str) -> tuple[tuple[str, str], ...]:
        from fedpipe.wire.channels import SESSION_HEADER, STREAM_KEY_HEADER

        return ((SESSION_HEADER, session_id), (STREAM_KEY_HEADER, self._keys.get(session_id, "")))
