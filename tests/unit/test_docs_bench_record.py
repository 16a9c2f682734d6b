"""bench_record.py: naming a bench's record, and taking the one JSON object it printed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_record  # noqa: E402


@pytest.mark.parametrize(
    ("command", "name"),
    [
        ("fedpipe bench pipeline --json --links 1gbit-5ms", "pipeline"),
        ("/venv/bin/fedpipe bench server --quick --json", "server"),
        ("python benchmarks/codec_bench.py", "codec"),
        ("python benchmarks/gpu_check.py --steps 1", "gpu-check"),
        ("python benchmarks/step_end_bench.py", "step-end"),
        ("python -m fedpipe_bench.load --devices 2", "load"),
    ],
)
def test_a_record_is_named_after_its_bench(command: str, name: str) -> None:
    assert bench_record.bench_name(command.split()) == name


def test_a_command_without_a_bench_needs_a_name() -> None:
    with pytest.raises(ValueError, match="give --name"):
        bench_record.bench_name(["echo", "{}"])


def test_the_result_is_one_json_object() -> None:
    assert bench_record.parse_result('\n{"ratio": 0.8}\n') == {"ratio": 0.8}
    with pytest.raises(ValueError, match="one JSON object"):
        bench_record.parse_result('progress\n{"ratio": 0.8}')
    with pytest.raises(ValueError, match="not an object"):
        bench_record.parse_result("[1, 2]")


def test_a_missing_command_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_record.main(["--"])
    assert "give the bench command" in capsys.readouterr().err


def test_changed_paths_keep_the_first_character_of_a_worktree_only_change():
    # " M path": the status column is a space; stripping the output first ate the path's "f".
    porcelain = " M fedpipe/a.py\nM  fedpipe/b.py\n?? benchmarks/c.py\nR  old.py -> fedpipe/d.py\n"
    assert bench_record.changed_paths(porcelain) == [
        "fedpipe/a.py",
        "fedpipe/b.py",
        "benchmarks/c.py",
        "fedpipe/d.py",
    ]
