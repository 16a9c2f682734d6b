"""The library example runs as the README shows it."""

import subprocess
import sys
from pathlib import Path

import pytest

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


def test_instruct_example_passes_the_simulate_preflight(monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/instruct.toml as `fedpipe simulate --config` checks it before starting: its
    data (a relative path, from the repository root), partition by book over 4 devices, and
    its examples' rows (with the tiny model and its tokenizer, to stay fast)."""
    from fedpipe.cli.preflight import check_simulate
    from fedpipe.config import load_config

    monkeypatch.chdir(ROOT)
    tiny = {"model.name": "tiny-llama", "model.head_layers": 1, "model.tail_layers": 1}
    config = load_config(ROOT / "examples" / "instruct.toml", tiny)
    check_simulate(config)
    assert config.federated.partition == "by-source" and config.data.loss_on == "answers"
