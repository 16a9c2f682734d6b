"""The suite's shared fixtures (registered by ``tests/conftest.py``).

- ``serve``: the StageServer factory for a test that starts servers inline (each stopped at
  the end of the test, in a finally);
- ``started``: processes a test starts (:class:`~harness.processes.Started`), stopped by PID;
- ``nothing_left_running``: the process-tree check, used automatically by the integration and
  system tiers: every process a test started (a descendant of this one, or a Flower process
  with its ``FLWR_HOME`` under the test's temporary folders) has ended when the test is done.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil
import pytest

from fedpipe.launch.processes import flower_processes_under
from fedpipe.server.stage_server import StageServer
from harness.processes import Started, alive, assert_gone
from harness.stage import stage_server

__all__ = ["nothing_left_running", "serve", "started"]


@pytest.fixture
def serve() -> Iterator[Callable[..., StageServer]]:
    """``serve(config, ...)`` starts a StageServer (see :func:`harness.stage.stage_server`);
    every one started is stopped when the test ends."""
    with ExitStack() as stack:

        def start(*args: Any, **kwargs: Any) -> StageServer:
            return stack.enter_context(stage_server(*args, **kwargs))

        yield start


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Started]:
    """Processes this test starts, with their logs in ``tmp_path``; all stopped at its end."""
    processes = Started(tmp_path)
    try:
        yield processes
    finally:
        processes.stop()


def _running_now(flower_root: Path | None) -> dict[int, psutil.Process]:
    """This process's descendants, and the Flower processes whose home is under the root."""
    procs = {p.pid: p for p in psutil.Process().children(recursive=True)}
    if flower_root is not None:
        for pid in flower_processes_under(flower_root):
            try:
                procs.setdefault(pid, psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
    return procs


@pytest.fixture
def nothing_left_running(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves a process running (found by PID; killed, then named).

    Processes of broader-scoped fixtures (a module's shared deployment) exist before the test
    and are not its own. Flower processes are looked for under the session's temporary root
    in the system tier only (the scan reads every process's environment).
    """
    flower_root = None
    if request.node.get_closest_marker("system") is not None:
        flower_root = request.getfixturevalue("tmp_path_factory").getbasetemp()
    before = _running_now(flower_root)
    yield
    after = _running_now(flower_root)
    new = [p for pid, p in after.items() if pid not in before or before[pid] != p]
    if alive(new):
        assert_gone(new)
