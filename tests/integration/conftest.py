"""Integration tier: every test is checked to leave no process of its own running.

The tier's shared fixtures: ``folder``, the bundled tiny-llama; ``server``, one StageServer per
module serving ``folder`` with the module's ``SERVER_CONFIG``.
"""

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.stage import stage_server

from fedpipe.config import FedpipeConfig
from fedpipe.models import resolve_model
from fedpipe.server.stage_server import StageServer


@pytest.fixture(autouse=True)
def _process_check(nothing_left_running: None) -> None:
    """The process-tree check (harness.fixtures.nothing_left_running) for every test here."""


@pytest.fixture(scope="module")
def folder() -> Path:
    """The bundled tiny-llama's folder: the model most integration tests serve."""
    return resolve_model("tiny-llama")


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, folder: Path) -> Iterator[StageServer]:
    """A StageServer shared by the module's tests: its ``SERVER_CONFIG``, serving ``folder``."""
    config = getattr(request.module, "SERVER_CONFIG", None)
    assert isinstance(config, FedpipeConfig), (
        f"{request.module.__name__} uses `server`: it needs a module-level SERVER_CONFIG"
    )
    with stage_server(config, folder=folder) as served:
        yield served
