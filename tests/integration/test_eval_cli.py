"""`fedpipe eval` as a real process on a tiny run folder: the table on stdout and eval.json
written with the in-process figures; a missing data file is one line and exit 2."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from harness.export import tiny_model, write_run
from harness.processes import FEDPIPE

from fedpipe.runs.evaluate import evaluate_run

ROOT = Path(__file__).resolve().parents[2]


def _fedpipe(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*FEDPIPE, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("eval")
    return write_run(root / "runs", "r", tiny_model(root / "model", "llama")).path


def test_eval_through_the_cli_writes_the_in_process_figures(run: Path, tmp_path: Path) -> None:
    data = tmp_path / "test.jsonl"
    records = [{"prompt": "The sea", "completion": " is"}, {"prompt": "ab", "completion": "cd"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    done = _fedpipe("eval", str(run), "--data", str(data), "--max-new-tokens", "4")
    assert done.returncode == 0, done.stderr
    written = json.loads((run / "eval.json").read_text())
    expected = evaluate_run(run, data, max_new_tokens=4, write=False)
    for side in ("base", "finetuned"):
        assert written[side] == expected[side]
    assert written["command"].startswith(f"fedpipe eval {run} --data {data}")
    lines = done.stdout.splitlines()
    assert lines[1].split() == [
        "answer_loss",
        f"{expected['base']['answer_loss']:.4f}",
        f"{expected['finetuned']['answer_loss']:.4f}",
    ]
    assert lines[-1] == f"-> {run / 'eval.json'}"


def test_eval_of_a_missing_file_is_one_line_and_exit_2(run: Path, tmp_path: Path) -> None:
    done = _fedpipe("eval", str(run), "--data", str(tmp_path / "none.jsonl"))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no such file" in lines[0], lines
