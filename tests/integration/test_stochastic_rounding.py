"""``pipeline.stochastic_rounding``: unbiased int4/int2 gradients, chosen per run, off by default.

The round trips go through a real StageServer on 127.0.0.1 (port 0) with the tiny model: the
setting has to reach both ends of the link (the device's encoder for OUTPUT_GRAD, the server's
for INPUT_GRAD, via OpenSession).
"""

from __future__ import annotations

import pytest
import torch

from fedpipe.config import FedpipeConfig
from fedpipe.edge.trainer import DeviceTrainer
from fedpipe.messages import Kind, StageMsg
from fedpipe.models import resolve_model
from fedpipe.server.stage_server import StageServer
from fedpipe.wire.link_client import StageClient
from fedpipe.wire.stream_codec import StreamCodecs, StreamDecoder, StreamEncoder

SIZE = {
    "train.batch_size": 4,
    "train.seq_len": 16,
    "train.lr": 1e-2,
    "pipeline.microbatches": 2,
    "pipeline.timeout_s": 20.0,
}


SERVER_CONFIG = FedpipeConfig().with_overrides(SIZE)  # for the `server` fixture (conftest.py)


def _losses(server: StageServer, settings: dict[str, object]) -> tuple[list[float], int, int]:
    """A fresh device's round of 3 steps: its step losses and the bytes up and down."""
    cfg = FedpipeConfig().with_overrides({**SIZE, **settings})
    trainer = DeviceTrainer(cfg, device_id="dev", folder=resolve_model(cfg.model.name))
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 256, (4, 16), generator=gen)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    with StageClient(server.address) as client:
        report = trainer.train_round(client, batches, round_=1)
    return [s.loss for s in report.steps], report.bytes_up, report.bytes_down


def test_the_mean_of_many_stochastic_roundings_converges_to_the_value() -> None:
    g = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(4))
    encoder = StreamEncoder(StreamCodecs("fp32", "int2", stochastic=True, seed=1), session_id="")
    nearest = StreamEncoder(StreamCodecs("fp32", "int2"), session_id="")
    decoder = StreamDecoder()
    draws = 2000
    total = torch.zeros_like(g)
    for step in range(draws):
        msg = decoder.decode(encoder.encode(StageMsg(Kind.OUTPUT_GRAD, step, 0, tensor=g)))
        assert msg.tensor is not None
        total += msg.tensor
    mean = total / draws
    once = decoder.decode(nearest.encode(StageMsg(Kind.OUTPUT_GRAD, 0, 0, tensor=g))).tensor
    assert once is not None
    # A rounding's error is below one step (range / 3); its mean over n draws has a standard
    # error below step / (2 sqrt(n)). Nearest rounding's error stays put, draw after draw.
    step = (g.reshape(-1, 64).amax(1) - g.reshape(-1, 64).amin(1)).max() / 3
    assert float((mean - g).abs().max()) < 5 * float(step) / (2 * draws**0.5)
    assert float((once - g).abs().mean()) > 10 * float((mean - g).abs().mean())


def test_it_is_off_by_default_and_then_the_traffic_is_unchanged(server: StageServer) -> None:
    assert FedpipeConfig().pipeline.stochastic_rounding is False
    low_bit = {"pipeline.gradient_codec": "int2"}
    default = _losses(server, low_bit)
    assert _losses(server, {**low_bit, "pipeline.stochastic_rounding": False}) == default
    assert _losses(server, low_bit) == default  # nearest rounding: the same bits every run


def test_both_ends_round_stochastically_and_seeded(server: StageServer) -> None:
    # Gradients in int2 only downward: what changes is the server's INPUT_GRAD rounding alone
    # (the device's OUTPUT_GRAD goes fp32, where rounding is moot).
    down_only = {"pipeline.downlink_codec": "int2", "pipeline.error_feedback": False}
    off = _losses(server, down_only)
    on = _losses(server, {**down_only, "pipeline.stochastic_rounding": True})
    assert on[0][0] == off[0][0]  # step 0's forward comes before any gradient
    assert on[0][1:] != off[0][1:] and on[1:] == off[1:]  # the same bytes, other values
    assert _losses(server, {**down_only, "pipeline.stochastic_rounding": True}) == on
    # Upward only (activations and OUTPUT_GRAD in int4): the device's rounding alone.
    up_only = {"pipeline.uplink_codec": "int4", "pipeline.error_feedback": False}
    up_off = _losses(server, up_only)
    up_on = _losses(server, {**up_only, "pipeline.stochastic_rounding": True})
    assert up_on[0][0] == up_off[0][0] and up_on[0][1:] != up_off[0][1:]


@pytest.mark.parametrize(
    "flat",
    [
        {"pipeline.stochastic_rounding": True},  # fp32 gradients: nothing to round
        {"pipeline.stochastic_rounding": True, "pipeline.gradient_codec": "int8"},
    ],
)
def test_it_needs_low_bit_gradients(flat: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"pipeline.stochastic_rounding applies to int4/int2"):
        FedpipeConfig().with_overrides(flat)
