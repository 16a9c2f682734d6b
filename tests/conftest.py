"""The suite's settings: offline, a private model cache, quiet Flower; tiers marked by folder.

Tiers (``pytest -m unit``, ``-m integration``, ``-m system``; see pyproject's markers):

- ``tests/unit``: in-process, no sockets, no subprocesses (enforced: see tests/unit/conftest.py);
- ``tests/integration``: real gRPC over loopback, real processes;
- ``tests/system``: Flower simulations and deployments, the benches' smoke runs, the bundled LLM.

The shared fixtures live in :mod:`harness.fixtures`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FEDPIPE_CACHE", os.path.join(tempfile.gettempdir(), "fedpipe-test-cache"))

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "integration", "system")

# The processes a test starts import the harness (a simulation's test ClientApp) from here.
_path = os.environ.get("PYTHONPATH", "")
if str(TESTS) not in _path.split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), _path) if p)

pytest_plugins = ["harness.fixtures"]


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier (its folder), and group tests for pytest-xdist.

    A unit or integration module runs on one worker (its module-scoped servers and models
    are built once); a system test runs alone unless it shares a run (its own
    ``xdist_group`` mark). System tests go first: they are the longest.
    """
    for item in items:
        path = Path(item.path).resolve().relative_to(TESTS)
        tier = path.parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in tests/{{{','.join(TIERS)}}}")
        item.add_marker(tier)
        if tier != "system" and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(path.as_posix()))
    items.sort(key=lambda item: item.get_closest_marker("system") is None)  # stable
