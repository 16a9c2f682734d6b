"""Compile every ``protos/**/*.proto`` into Python modules under ``fedpipe/proto/``.

Run from anywhere: ``python scripts/gen_protos.py``. The proto path mirrors the package
(``protos/fedpipe/proto/stage.proto`` declares ``package fedpipe.proto;``), so protoc, run with
``protos/`` as its include root, writes ``fedpipe/proto/stage_pb2.py`` whose imports read
``fedpipe.proto....``. The generated files are checked in and never edited by hand;
``tests/unit/test_protos.py`` regenerates them and fails if they are stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Every .proto under ``proto_root``, sorted so output order never depends on the filesystem."""
    return sorted(proto_root.rglob("*.proto"))


def compile_protos(out_dir: Path, *, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Compile all protos into ``out_dir`` (a repo-root-like folder); return the files written."""
    # Imported here so that importing this module (e.g. from a test) stays cheap.
    import grpc_tools
    from grpc_tools import protoc

    files = proto_files(proto_root)
    if not files:
        raise SystemExit(f"no .proto files under {proto_root}")
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"--proto_path={proto_root}",
        f"--proto_path={well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(f.relative_to(proto_root)) for f in files),
    ]
    # File names are relative to proto_root, so generated imports read `fedpipe.proto...`.
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    return _generated_paths(out_dir, files, proto_root)


def _generated_paths(out_dir: Path, files: list[Path], proto_root: Path) -> list[Path]:
    written = []
    for f in files:
        stem = out_dir / f.relative_to(proto_root).with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            written.append(stem.with_name(stem.name + suffix))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT,
        help="folder that receives fedpipe/proto/*_pb2*.py (default: the repo root)",
    )
    args = parser.parse_args(argv)
    for path in compile_protos(args.out.resolve()):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
