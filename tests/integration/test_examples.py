"""The library example runs as the README shows it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_split_training_example_runs(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "examples/split_training.py", "--steps", "2", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "step 1: loss" in result.stdout
    assert (tmp_path / "timeline.png").read_bytes().startswith(b"\x89PNG")
