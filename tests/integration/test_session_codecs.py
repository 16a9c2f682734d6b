"""The server sends with the codec the device named, groups, layout and outliers included.

OpenSession's codec enums name only the base codec (INT4); before the full names travelled too,
a device that asked for ``int4tg128`` down got plain ``int4`` (row groups of 64) from the server.
A real StageServer on 127.0.0.1 (port 0) with the tiny model; the downlink's bytes tell which
codec the server used.
"""

from __future__ import annotations

import re

import grpc
import pytest
import torch

from fedpipe.config import FedpipeConfig
from fedpipe.edge.trainer import DeviceTrainer, split_terms
from fedpipe.models import resolve_model
from fedpipe.proto import stage_pb2 as pb
from fedpipe.proto import stage_pb2_grpc as pb_grpc
from fedpipe.server.stage_server import StageServer
from fedpipe.wire.link_client import StageClient
from fedpipe.wire.serde import split_to_proto
from fedpipe.wire.tensors import encoded_nbytes

# Bytes a message's fields (group_size, token_groups, outliers, varint lengths) may add or drop.
_FIELDS = 8
SIZE = {"train.batch_size": 2, "train.seq_len": 64, "pipeline.microbatches": 1}


SERVER_CONFIG = FedpipeConfig().with_overrides(SIZE)  # for the `server` fixture (conftest.py)


def _bytes_down(server: StageServer, downlink: str, gradients: str = "") -> int:
    """Bytes a fresh device receives in a one-step round with ``downlink`` (fp32 up)."""
    settings = {**SIZE, "pipeline.downlink_codec": downlink, "pipeline.gradient_codec": gradients}
    cfg = FedpipeConfig().with_overrides(settings)
    trainer = DeviceTrainer(cfg, device_id="dev", folder=resolve_model(cfg.model.name))
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with StageClient(server.address) as client:
        report = trainer.train_round(client, [{"input_ids": ids, "labels": ids.clone()}])
    return report.bytes_down


def test_the_downlink_uses_the_named_group_layout_and_outliers(server: StageServer) -> None:
    shape = (2, 64, 64)  # one microbatch's OUTPUT and INPUT_GRAD (tiny-llama: width 64)
    plain = _bytes_down(server, "int4")
    for codec in ("int4tg128", "int4o2", "int2g16"):
        # OUTPUT and INPUT_GRAD both in ``codec``: the difference is its payload's, twice
        expected = 2 * (encoded_nbytes(shape, codec) - encoded_nbytes(shape, "int4"))
        assert abs(_bytes_down(server, codec) - plain - expected) <= 2 * _FIELDS, codec
    # gradients' own codec: INPUT_GRAD in int2o, OUTPUT in int4
    expected = encoded_nbytes(shape, "int2o") - encoded_nbytes(shape, "int4")
    assert abs(_bytes_down(server, "int4", "int2o") - plain - expected) <= _FIELDS


def test_a_codec_name_that_disagrees_with_its_enum_is_refused(server: StageServer) -> None:
    cfg = FedpipeConfig().with_overrides(SIZE)
    split = split_to_proto(split_terms(cfg, resolve_model(cfg.model.name)))
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.StageLinkStub(channel)
        for name, pattern in (
            ("int2t", r"codec name 'int2t' is a int2 codec, but its enum says int4"),
            ("int4x", r"unknown codec 'int4x'"),
        ):
            request = pb.OpenSessionRequest(
                device_id="dev",
                split=split,
                downlink_codec=pb.INT4,
                downlink_codec_name=name,
                learning_rate=1e-3,
            )
            with pytest.raises(grpc.RpcError) as caught:
                stub.OpenSession(request, timeout=20)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details() is not None
            assert re.search(pattern, caught.value.details())
