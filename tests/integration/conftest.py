"""Integration tier: every test is checked to leave no process of its own running."""

import pytest


@pytest.fixture(autouse=True)
def _process_check(nothing_left_running: None) -> None:
    """The process-tree check (harness.fixtures.nothing_left_running) for every test here."""
