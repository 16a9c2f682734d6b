"""bench_record.py runs a command and keeps its JSON with the command, date, commit and machine."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_record.py"


def run(tmp_path: Path, *command: str) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, str(SCRIPT), "--name", "probe", "--out", str(tmp_path), "--"]
    return subprocess.run([*args, *command], capture_output=True, text=True, timeout=120)


def test_a_bench_that_prints_json_is_recorded_with_its_source(tmp_path: Path) -> None:
    code = "import json, sys; print('progress', file=sys.stderr); print(json.dumps({'x': 1}))"
    done = run(tmp_path, sys.executable, "-c", code)
    assert done.returncode == 0, done.stderr
    assert "progress" in done.stderr  # the bench's stderr passes through
    entry = json.loads((tmp_path / "probe.json").read_text())
    assert entry["result"] == {"x": 1}
    assert entry["command"] == shlex.join([sys.executable, "-c", code])
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert entry["commit"] == head.stdout.strip()
    assert isinstance(entry["dirty"], list)
    machine = entry["machine"]
    assert machine["cores"] >= 1 and machine["cpu"] and machine["torch"]
    assert "gpu" in machine
    assert len(entry["load_average"]["before"]) == 3
    assert entry["date"].endswith("+00:00") and entry["wall_s"] >= 0


def test_a_failing_or_silent_bench_writes_nothing(tmp_path: Path) -> None:
    failed = run(tmp_path, sys.executable, "-c", "import sys; sys.exit(3)")
    assert failed.returncode == 1 and "exited 3" in failed.stderr
    not_json = run(tmp_path, sys.executable, "-c", "print('hello')")
    assert not_json.returncode == 1 and "one JSON object" in not_json.stderr
    assert not (tmp_path / "probe.json").exists()
