"""The code stays ruff-clean (lint and format), generated protobuf code excluded."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATHS = ["fedpipe", "tests", "scripts", "benchmarks", "examples"]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(args: list[str]) -> None:
    result = subprocess.run(["ruff", *args, *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"ruff {' '.join(args)} failed:\n{result.stdout}{result.stderr}"


@pytest.mark.skipif(shutil.which("mypy") is None, reason="mypy is not installed")
def test_mypy() -> None:
    result = subprocess.run(["mypy", "fedpipe"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"mypy fedpipe failed:\n{result.stdout}{result.stderr}"
