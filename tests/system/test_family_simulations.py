"""`fedpipe simulate --model DIR` on Flower's simulation engine for new families: a tiny
random model of the family saved as a Hugging Face folder (fedpipe_bench.families, the models
of tests/integration/test_family_rounds.py), two devices, two rounds. Each run exits 0, both
devices train in both rounds, and the held-out loss falls (summary.json).

Each run costs Flower's and Ray's start, most of its time (70 to 410 s a run on the shared
2-core machine, load 7 to 40), so the suite runs one family, the one whose blocks differ most
from Llama's: gemma3_text (sliding and global layers with their own rotaries, a scaled
embedding, four norms a block). What the engine adds to the ServerApp's rounds (the launcher,
the ClientApp in Ray's workers building its stages from the folder) is the same code for every
family; every family trains two rounds through the ServerApp's own rounds in
tests/integration/test_family_rounds.py. ``FEDPIPE_FAMILY_SIMULATIONS`` names others
(comma-separated, or ``all`` for the six new ones): all six passed so (6 passed in 1546 s, one
after another, at load 10 to 40), and qwen3 and phi3 passed in the suite's runs until it was
cut to one for the suite's time (2026-12-05).
The settings are test_family_rounds' (where the loss is known to fall) at one block per
device side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fedpipe_bench.families import tiny_family_folder

ALL_NEW = ["qwen3", "gemma3_text", "phi3", "smollm3", "olmo2", "granite"]
_ASKED = os.environ.get("FEDPIPE_FAMILY_SIMULATIONS", "gemma3_text")
NEW_FAMILIES = ALL_NEW if _ASKED == "all" else [f.strip() for f in _ASKED.split(",") if f.strip()]
SETTINGS = {
    "model.head_layers": 1,
    "model.tail_layers": 1,
    "train.batch_size": 2,
    "train.seq_len": 32,
    "train.local_steps": 3,
    "train.lr": 1e-2,
    "pipeline.microbatches": 2,
}


@pytest.mark.parametrize("model_type", NEW_FAMILIES)
def test_simulate_trains_two_rounds_of_the_family(model_type: str, tmp_path: Path) -> None:
    folder = tiny_family_folder(tmp_path, model_type)
    runs = tmp_path / "runs"
    command = [
        sys.executable, "-m", "fedpipe.cli", "simulate", "--model", str(folder),
        "--devices", "2", "--rounds", "2", "--profiles", "loopback",
        "--runs-dir", str(runs), "--name", model_type, "--no-progress", "--timeout", "540",
        *(arg for key, value in SETTINGS.items() for arg in ("--set", f"{key}={value}")),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=580, check=False
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    summary = json.loads((runs / model_type / "summary.json").read_text())
    assert summary["ok"], summary["problems"]
    assert summary["config"]["model.name"] == str(folder)
    rounds = {r["round"]: r for r in summary["rounds"]}
    assert sorted(rounds) == [0, 1, 2]
    assert all(rounds[r]["devices_trained"] == 2 for r in (1, 2)), summary["rounds"]
    assert summary["last_eval_loss"] < summary["first_eval_loss"], summary["rounds"]
