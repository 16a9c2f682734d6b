"""`fedpipe export` and `fedpipe generate` as real processes: a merged model written by the CLI
loads alone in transformers with the split model's logits; a missing round and a base model of
another fingerprint end in one line and exit 2; generate streams transformers' greedy answer."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from harness.close import assert_close_to_scale
from harness.export import split_logits, tiny_model, write_run
from harness.processes import FEDPIPE
from transformers import AutoModelForCausalLM

from fedpipe.runs.folder import RunFolder
from fedpipe.runs.generate import Sampling, generate, load_model

ROOT = Path(__file__).resolve().parents[2]


def _fedpipe(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*FEDPIPE, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("export")
    model = tiny_model(root / "model", "llama")
    aggregation = {"federated.aggregation": "exact"}  # base deltas: merged only
    return write_run(root / "runs", "r", model, **aggregation).path


def test_merged_export_through_the_cli_loads_in_transformers(run: Path, tmp_path: Path) -> None:
    done = _fedpipe("export", str(run), "--out", str(tmp_path / "m"), "--format", "merged")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"round 2 of {run} -> {tmp_path / 'm'} (merged model")
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(tmp_path / "m")(input_ids=ids).logits
    assert_close_to_scale(logits, split_logits(RunFolder(run), 2, ids), atol=1e-5, rel=0)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--round", "9"], "no checkpoint for round 9"),
        (["--model", "tiny-llama"], "is not the model run"),
    ],
)
def test_export_refusals_through_the_cli_are_one_line(
    run: Path, tmp_path: Path, argv: list[str], says: str
) -> None:
    done = _fedpipe("export", str(run), "--out", str(tmp_path / "x"), "--format", "merged", *argv)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedpipe: error: ") and says in lines[0], lines
    assert not (tmp_path / "x").exists()


def test_generate_through_the_cli_streams_the_greedy_answer(run: Path) -> None:
    model, tokenizer = load_model(None, run=run)
    ids = generate(model, tokenizer, "The sea", sampling=Sampling(6), stream=False)
    expected = tokenizer.decode(ids[0, len(tokenizer("The sea")["input_ids"]) :])
    done = _fedpipe("generate", "--run", str(run), "--max-new-tokens", "6", "The sea")
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip("\n") == expected.rstrip("\n") and len(expected) > 0
