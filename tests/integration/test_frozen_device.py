"""Frozen-device mode over real loopback gRPC: the device trains nothing, no input gradient
comes down, and the server's adapter still trains.

The same two steps run trained and frozen; the frozen run's downlink carries the OUTPUT
tensors only (the INPUT_GRAD replies hold no tensor), its head and tail weights are bit-for-bit
unchanged, and the server's committed adapter moved.
"""

from __future__ import annotations

import pytest
import torch
from harness.batches import random_batches
from harness.stage import stage_server

from fedpipe.config import FedpipeConfig, ModelConfig, PipelineConfig, TrainConfig
from fedpipe.edge.trainer import DeviceTrainer
from fedpipe.server.build import build_runtime
from fedpipe.wire.link_client import StageClient

BATCH, SEQ, STEPS, MICRO = 4, 16, 2, 2


def _config(split: str, trains: bool) -> FedpipeConfig:
    return FedpipeConfig(
        model=ModelConfig(name="tiny-llama", tail_layers=0 if split == "two" else 1, split=split),
        pipeline=PipelineConfig(microbatches=MICRO, device_trains=trains),
        train=TrainConfig(batch_size=BATCH, seq_len=SEQ, lr=1e-2),
    )


def _batches(vocab: int) -> list[dict[str, torch.Tensor]]:
    return random_batches(STEPS, BATCH, SEQ, vocab=vocab)


def _weights(trainer: DeviceTrainer) -> dict[str, torch.Tensor]:
    out = {f"head.{k}": v.clone() for k, v in trainer.head.state_dict().items()}
    if trainer.tail is not None:
        out |= {f"tail.{k}": v.clone() for k, v in trainer.tail.state_dict().items()}
    return out


@pytest.mark.parametrize("split", ["u", "two"])
def test_frozen_device_trains_nothing_and_gets_no_input_gradient(split: str) -> None:
    runtime, info = build_runtime(_config(split, True))
    with stage_server(runtime=runtime, split=info) as server:
        down, moved = {}, {}
        for round_, trains in ((1, True), (2, False)):
            trainer = DeviceTrainer(_config(split, trains), device_id=f"d{round_}")
            before, server_before = _weights(trainer), runtime.global_state()
            vocab = int(trainer.head.state_dict()["embed_tokens.weight"].shape[0])
            with StageClient(f"127.0.0.1:{server.port}") as client:
                report = trainer.train_round(client, _batches(vocab), round_=round_)
            runtime.commit_round(round_, {f"d{round_}": 1.0})
            after = _weights(trainer)
            moved[trains] = [k for k in before if not torch.equal(before[k], after[k])]
            server_after = runtime.global_state()
            assert any(not torch.equal(server_before[k], server_after[k]) for k in server_after)
            down[trains] = report.bytes_down
        assert moved[False] == [] and moved[True] != []
        grad_bytes = STEPS * BATCH * SEQ * info.hidden_size * 4  # fp32 INPUT_GRAD tensors
        assert down[True] - down[False] >= grad_bytes
        headers = 200 * STEPS * (MICRO + 1)  # a generous bound on the frames without tensors
        assert down[False] <= down[True] - grad_bytes + headers
