"""The checked-in generated protobuf code is fresh and imports with the installed runtimes."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
GENERATED_DIR = REPO_ROOT / "fedpipe" / "proto"
GENERATED_GLOBS = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")
FIX = "run `python scripts/gen_protos.py` and commit the result"


def _generated(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for g in GENERATED_GLOBS for p in sorted(folder.glob(g))}


def test_generated_code_imports() -> None:
    # grpcio-tools stamps GRPC_GENERATED_VERSION and raises at import on an older grpcio;
    # protobuf's gencode likewise validates its runtime version.
    from fedpipe.proto import stage_pb2, stage_pb2_grpc

    assert stage_pb2.DESCRIPTOR.package == "fedpipe.proto"
    assert stage_pb2_grpc.StageLinkStub and stage_pb2_grpc.StageControlServicer
    msg = stage_pb2.StageMessage(kind=stage_pb2.ACTIVATION, session_id="s", microbatch=3)
    assert stage_pb2.StageMessage.FromString(msg.SerializeToString()) == msg
