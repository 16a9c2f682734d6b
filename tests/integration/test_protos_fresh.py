"""The checked-in generated protobuf code is what `scripts/gen_protos.py` makes now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
GENERATED_DIR = REPO_ROOT / "fedpipe" / "proto"
GENERATED_GLOBS = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")
FIX = "run `python scripts/gen_protos.py` and commit the result"


def _generated(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for g in GENERATED_GLOBS for p in sorted(folder.glob(g))}


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = _generated(tmp_path / "fedpipe" / "proto")
    checked_in = _generated(GENERATED_DIR)
    assert fresh, "gen_protos.py generated nothing"
    assert sorted(checked_in) == sorted(fresh), f"generated files differ in name; {FIX}"
    stale = [name for name in fresh if fresh[name] != checked_in[name]]
    assert not stale, f"fedpipe/proto/{', '.join(stale)} out of date with protos/; {FIX}"
