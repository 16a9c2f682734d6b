"""Integration tier: every test is checked to leave no process of its own running."""

from pathlib import Path

import pytest

from fedpipe.models import resolve_model


@pytest.fixture(autouse=True)
def _process_check(nothing_left_running: None) -> None:
    """The process-tree check (harness.fixtures.nothing_left_running) for every test here."""


@pytest.fixture(scope="module")
def folder() -> Path:
    """The bundled tiny-llama's folder: the model most integration tests serve."""
    return resolve_model("tiny-llama")
