"""The stage link's serde sizes messages from their shapes and decodes without extra copies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedpipe.pipeline.messages import Kind, StageMsg
from fedpipe.proto import stage_pb2 as pb
from fedpipe.transport.codec import CODECS
from fedpipe.transport.serde import msg_from_proto, msg_to_proto, wire_nbytes

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("labels", [False, True])
def test_wire_size_from_shapes_is_within_the_header_bound(codec: str, labels: bool) -> None:
    msg = StageMsg(Kind.ACTIVATION, 3, 5, tensor=torch.randn(2, 7, 16), loss_scale=0.25)
    if labels:
        msg.labels = torch.randint(0, 50, (2, 7))
    raw = msg_to_proto(msg, session_id="s" * 32, codec=codec)
    assert raw.ByteSize() <= wire_nbytes(raw) <= raw.ByteSize() + 96
    decoded = msg_from_proto(pb.StageMessage.FromString(raw.SerializeToString()))
    assert decoded.wire_bytes == wire_nbytes(raw)


def test_decoded_tensors_do_not_share_memory_with_each_other() -> None:
    """Two decodes of one message are independent: writing one leaves the other intact."""
    raw = msg_to_proto(
        StageMsg(Kind.OUTPUT, 0, 0, tensor=torch.ones(2, 3, 4)), session_id="", codec="fp32"
    )
    first, second = msg_from_proto(raw), msg_from_proto(raw)
    assert first.tensor is not None and second.tensor is not None
    first.tensor.add_(1)
    assert torch.equal(second.tensor, torch.ones(2, 3, 4))
    assert torch.equal(msg_from_proto(raw).tensor, torch.ones(2, 3, 4))


def test_transport_bench_prints_the_ratio_as_json() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/transport_bench.py"), "--json"]
        + ["--messages", "1", "--trials", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(out.stdout)
    assert result["message_mb"] == pytest.approx(9.44, abs=0.01)
    assert result["stage_mb_per_s"] > 0 and result["plain_grpc_mb_per_s"] > 0
    expected = result["stage_mb_per_s"] / result["plain_grpc_mb_per_s"]
    assert result["ratio"] == pytest.approx(expected, rel=1e-2)
