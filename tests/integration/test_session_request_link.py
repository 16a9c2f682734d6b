"""A device's session request over real loopback gRPC: the SessionRequest a DeviceTrainer
builds from its settings is the one the StageServer's runtime opens the session from."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from harness.stage import stage_server

from fedpipe.config import FedpipeConfig
from fedpipe.edge.trainer import DeviceTrainer
from fedpipe.wire.backend import SessionRequest
from fedpipe.wire.link_client import StageClient
from fedpipe.wire.serde import split_to_proto

# Settings that reach the request, away from their defaults (delta coding: an identity too).
SETTINGS = {
    "train.batch_size": 4,
    "train.seq_len": 16,
    "train.lr": 5e-3,
    "train.weight_decay": 0.01,
    "pipeline.microbatches": 2,
    "pipeline.uplink_codec": "bf16",
    "pipeline.downlink_codec": "bf16",
    "pipeline.gradient_codec": "int4",
    "pipeline.stochastic_rounding": True,
    "pipeline.error_feedback": True,
    "pipeline.delta": True,
    "pipeline.delta_cache_mb": 1.0,
    "pipeline.timeout_s": 20.0,
}


def test_the_runtime_opens_the_session_the_device_asked_for(folder) -> None:  # type: ignore[no-untyped-def]
    config = FedpipeConfig().with_overrides(SETTINGS)
    trainer = DeviceTrainer(config, device_id="asker", folder=folder)
    built = trainer.session_request(round_=0, token="")
    assert (built.learning_rate, built.microbatch_size, built.seq_len) == (5e-3, 2, 16)
    assert built.delta_cache_bytes == 1 << 20 and built.gradient_codec == "int4"
    opened: list[SessionRequest] = []
    with stage_server(config, folder=folder) as server:
        real = server.runtime.open

        def record(request: SessionRequest, **kw: Any) -> str:
            opened.append(request)
            return real(request, **kw)

        server.runtime.open = record  # type: ignore[method-assign]
        with StageClient(server.address) as client:
            session, _ = trainer.connect(client, optimizer=None)
            session.close()
    assert trainer.delta is not None  # the device's encoder: its identity went up
    (got,) = opened
    assert got.split == split_to_proto(trainer.split)
    assert got.uplink_codec == "BF16"  # the wire names the uplink codec by its enum only
    assert abs(got.learning_rate - 5e-3) < 1e-9 and abs(got.weight_decay - 0.01) < 1e-9
    expected = replace(built, delta_identity=got.delta_identity)
    assert got.delta_identity.cache_id == trainer.delta.cache.identity.cache_id
    assert (
        replace(got, split=built.split, uplink_codec="bf16", learning_rate=5e-3, weight_decay=0.01)
        == expected
    )
