"""The guide's path from a fresh folder, as docs/guides/export.md gives it: `fedpipe simulate
--config examples/instruct.toml` (made short with --set), `fedpipe export --format merged`,
then `fedpipe generate` on the exported folder, each a `python -m fedpipe.cli` process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[2]
SHORT = {  # one short round on one loopback device: the path, not the learning
    "federated.rounds": "1",
    "federated.num_devices": "1",
    "federated.profiles": "loopback",
    "federated.data": str(ROOT / "examples" / "instruct" / "train.jsonl"),
    "train.local_steps": "1",
    "train.batch_size": "1",
    "train.eval_batches": "1",
    "pipeline.microbatches": "1",
}


def _fedpipe(cwd: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "fedpipe.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_simulate_export_merged_and_generate_as_the_guide_says(tmp_path: Path) -> None:
    sets = [a for key, value in SHORT.items() for a in ("--set", f"{key}={value}")]
    config = str(ROOT / "examples" / "instruct.toml")
    run = _fedpipe(
        tmp_path, "simulate", "--config", config, *sets, "--name", "guide", "--no-progress"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "runs" / "guide" / "checkpoints").is_dir()
    export = _fedpipe(
        tmp_path, "export", "runs/guide", "--out", "guide-merged", "--format", "merged"
    )
    assert export.returncode == 0, export.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "guide-merged", dtype=torch.float32)
    assert model.config.model_type == "llama"  # SmolLM2, the example's model
    del model
    question = "Which book of the Bible is this verse from? In the beginning God created"
    answer = _fedpipe(
        tmp_path, "generate", "--model", "guide-merged", "--chat", "--max-new-tokens", "8", question
    )
    assert answer.returncode == 0, answer.stderr[-3000:]
    assert answer.stdout.strip(), "generate printed no tokens"
