"""server.weights over real loopback gRPC: an fp32 device trains its round against a StageServer
whose middle is stored in int8 (the split agreement covers the model, not how the server
stores it), and its step losses stay near those against an fp32 server."""

from __future__ import annotations

import torch
from harness.stage import stage_server

from fedpipe.config import FedpipeConfig, ModelConfig, PipelineConfig, ServerConfig, TrainConfig
from fedpipe.edge.trainer import DeviceTrainer
from fedpipe.server.build import build_runtime
from fedpipe.split.quant import storage_of
from fedpipe.wire.link_client import StageClient

BATCH, SEQ, MICRO = 4, 32, 2
# |step loss - against an fp32 server| on tiny-llama (loss ~5.56), two steps: the middle's
# output moves by ~3e-4 of itself at int8 (tests/unit/test_server_weights.py).
LOSS_TOLERANCE = 0.01


def _config(weights: str) -> FedpipeConfig:
    return FedpipeConfig(
        model=ModelConfig(name="tiny-llama", head_layers=1, tail_layers=1),
        pipeline=PipelineConfig(microbatches=MICRO, schedule="1f1b"),
        train=TrainConfig(batch_size=BATCH, seq_len=SEQ, lr=1e-2, loss_chunk=32),
        server=ServerConfig(weights=weights, offload="auto"),
    )


def test_an_fp32_device_trains_against_an_int8_stage_server() -> None:
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 258, (BATCH, SEQ), generator=gen) for _ in range(2)]
    batches = [{"input_ids": x, "labels": x.clone()} for x in ids]
    losses, splits = {}, {}
    for weights in ("fp32", "int8"):
        runtime, info = build_runtime(_config(weights))
        assert storage_of(runtime.bank.stage) == weights  # type: ignore[union-attr]
        trainer = DeviceTrainer(_config("fp32"), device_id=f"d-{weights}")
        with stage_server(runtime=runtime, split=info) as server:
            with StageClient(f"127.0.0.1:{server.port}") as client:
                report = trainer.train_round(client, batches, round_=1)
            runtime.commit_round(1, {f"d-{weights}": 1.0})
        losses[weights] = [s.loss for s in report.steps]
        splits[weights] = info
    assert splits["int8"] == splits["fp32"]  # what devices check: the base, not its storage
    assert len(losses["int8"]) == 2
    for got, want in zip(losses["int8"], losses["fp32"], strict=True):
        assert abs(got - want) < LOSS_TOLERANCE, losses
    assert losses["int8"] != losses["fp32"]  # the server's rounding is there, and small
