"""A model fedpipe cannot split is refused by the real command line: exit 2, one line, before
anything starts (no server, no Flower, no weights read: the folder holds only a config)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "vocab_size": 256}
CASES = {
    "qwen3_moe": (
        {"num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
         "num_experts_per_tok": 2, "moe_intermediate_size": 32},
        "a mixture-of-experts model",
    ),
    "qwen3_next": ({"num_attention_heads": 4, "num_key_value_heads": 2},
                   "hybrid or linear attention"),
}  # fmt: skip


@pytest.mark.parametrize(
    ("model_type", "command"),
    [("qwen3_moe", "simulate"), ("qwen3_next", "server")],
)
def test_an_unsplittable_model_is_refused_in_one_line_with_exit_2(
    tmp_path: Path, model_type: str, command: str
) -> None:
    extra, why = CASES[model_type]
    folder = tmp_path / model_type
    AutoConfig.for_model(model_type, **SMALL, **extra).save_pretrained(folder)
    argv = [sys.executable, "-m", "fedpipe.cli", command, "--model", str(folder)]
    if command == "server":
        argv += ["--stage-server", "127.0.0.1:0"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1, lines
    assert lines[0].startswith("fedpipe: error: model.name: ")
    assert f"model_type {model_type!r} is not supported for splitting: {why}" in lines[0]
    assert "supported: gemma2, gemma3_text, gpt2" in lines[0]
    assert not (tmp_path / "runs").exists()  # nothing started, no run folder made
