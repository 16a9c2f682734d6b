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
from harness.schedule import TierScheduling

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

# The system tests' modules by their longest test, longest first (measured with --durations on
# a system-tier run of 2026-12-05, 2-core machine): they start first, so that the last work to
# start on each worker is short. Others (a few seconds each) follow in file order.
LONGEST_FIRST = (
    "test_multihost.py",
    "test_cli_errors.py",
    "test_deployment_failures.py",
    "test_simulation_retry.py",
    "test_simulation_exact.py",
    "test_replica_runs.py",
    "test_guide_path.py",
    "test_deployment_tls.py",
    "test_simulation.py",
    "test_simulation_large_adapter.py",
    "test_family_simulations.py",
    "test_privacy_simulation.py",
    "test_quality_real_path.py",
    "test_bench_runs.py",
    "test_instruct_simulation.py",
    "test_cuts_simulation.py",
    "test_adapter_codec_simulation.py",
    "test_device_weights_simulation.py",
    "test_flower_engines.py",
    "test_offload_bench_runs.py",
    "test_process_tree.py",
    "test_load.py",
    "test_bundled_llm.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier (its folder); order the system tier's longest first."""
    for item in items:
        tier = Path(item.path).resolve().relative_to(TESTS).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in tests/{{{','.join(TIERS)}}}")
        item.add_marker(tier)
    items.sort(key=_start_order)  # stable: file order otherwise


def _start_order(item: pytest.Item) -> tuple[int, int]:
    if item.get_closest_marker("system") is None:
        return (1, 0)
    name = Path(item.path).name
    return (0, LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST))


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker more than the CPUs (the system tier mostly waits), at most 6
    (each simulation or deployment holds 1-2 GB)."""
    return min((os.cpu_count() or 1) + 1, 6)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadscope`` (pyproject's addopts) shares out the suite's own units."""
    if config.getvalue("dist") != "loadscope":
        return None
    return TierScheduling(config, log)
