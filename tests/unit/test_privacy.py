"""Stage-link defences (clipping, calibrated noise), their accountant, and adapter DP wiring.

Traffic tests run a real StageServer on 127.0.0.1 port 0 with a real device, recorded at the
server by the privacy bench's tap.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.rdp import rdp_privacy_accountant
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
)
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM
from flwr.supercore.task_identity import TaskIdentity
from harness.close import assert_close_to_scale

from fedpipe.config import PrivacyConfig, load_config
from fedpipe.fl.adapter_dp import adapter_clipping_mod, with_adapter_dp
from fedpipe.messages import Kind
from fedpipe.privacy import (
    ChannelNoise,
    LinkAccountant,
    LinkDefence,
    clip_per_token,
    releases_so_far,
    sample_noise_multiplier,
)
from fedpipe.runs.report import report_lines
from fedpipe.runs.summary import build_summary


# -- clipping and noise ------------------------------------------------------------------------
def test_clip_per_token_bounds_every_token_and_keeps_small_ones() -> None:
    x = torch.randn(4, 16, 32) * torch.logspace(-2, 2, 16).reshape(1, 16, 1)  # norms 0.06..570
    y = clip_per_token(x, 1.5)
    norms, before = y.norm(dim=-1), x.norm(dim=-1)
    assert bool((norms <= 1.5 * (1 + 1e-6)).all())
    inside = before <= 1.5
    assert bool(inside.any()) and bool((~inside).any())
    assert torch.equal(y[inside], x[inside])  # untouched, bit for bit
    assert_close_to_scale(norms[~inside], torch.full_like(norms[~inside], 1.5), rel=1e-5, atol=1e-8)
    cos = torch.nn.functional.cosine_similarity(y, x, dim=-1)
    assert_close_to_scale(cos, torch.ones_like(cos), rel=1e-5, atol=1e-5)  # direction kept


def test_noise_std_matches_calibration() -> None:
    gen = torch.Generator().manual_seed(0)
    channel = ChannelNoise(clip=2.0, noise=0.7, generator=gen)
    zeros = torch.zeros(64, 128, 64)  # 524k coordinates, nothing to clip
    noise = channel(zeros)
    assert channel.std == pytest.approx(1.4)
    assert float(noise.std()) == pytest.approx(1.4, rel=0.02)
    assert abs(float(noise.mean())) < 0.01
    assert not torch.equal(channel(zeros), noise)  # fresh draws every call


def test_defence_stays_in_the_graph_through_the_clip() -> None:
    """The head's backward runs through the clipping, with the noise as a constant."""
    defence = LinkDefence(activations=ChannelNoise(1.0, 0.5, torch.Generator().manual_seed(1)))
    h = torch.tensor([[[0.3, 0.4], [3.0, 4.0]]], requires_grad=True)  # norms 0.5 and 5
    sent = defence(Kind.ACTIVATION, h)
    sent.backward(torch.ones_like(sent))
    assert h.grad is not None
    assert_close_to_scale(
        h.grad[0, 0], torch.ones(2), rel=1e-5, atol=1e-8
    )  # inside the ball: identity
    assert not torch.allclose(h.grad[0, 1], torch.ones(2))  # clipped: scaled and projected
    grad = torch.ones(1, 2, 2)
    assert torch.equal(defence(Kind.OUTPUT_GRAD, grad), grad)  # gradients not defended here


def test_settings_validate_naming_the_key() -> None:
    with pytest.raises(ValueError, match="privacy.activation_noise .* privacy.activation_clip"):
        PrivacyConfig(activation_noise=1.0)
    with pytest.raises(ValueError, match="privacy.gradient_clip"):
        PrivacyConfig(gradient_clip=-1.0)
    with pytest.raises(ValueError, match="privacy.adapter_dp"):
        load_config(None, {"privacy.adapter_dp": "local"})
    with pytest.raises(ValueError, match="privacy.delta"):
        PrivacyConfig(delta=0.0)
    cfg = load_config(None, {"privacy.gradient_clip": "0.5", "privacy.gradient_noise": "2"})
    assert cfg.privacy.gradient_noise == 2.0


def test_defaults_are_off() -> None:
    assert LinkDefence.from_config(PrivacyConfig()) is None
    assert LinkAccountant.from_config(PrivacyConfig(), seq_len=128) is None
    strategy = FedAvg()
    assert with_adapter_dp(strategy, PrivacyConfig(), sampled_devices=4) is strategy


# -- the accountant ----------------------------------------------------------------------------
def test_accountant_grows_with_releases_and_matches_the_library() -> None:
    accountant = LinkAccountant(activation_noise=40.0, gradient_noise=20.0, seq_len=64)
    both = ("activations", "gradients")
    eps = [accountant.epsilon(k, both) for k in (1, 2, 8, 32)]
    assert eps == sorted(eps) and eps[0] < eps[-1]
    assert accountant.epsilon(0, both) == 0.0
    assert accountant.epsilon(8, ("activations",)) < eps[2]  # one channel leaks less
    # The same figure from dp-accounting called directly: z = sigma / (2 sqrt(T)) per channel.
    direct = rdp_privacy_accountant.RdpAccountant()
    z_a, z_g = 40.0 / (2 * math.sqrt(64)), 20.0 / (2 * math.sqrt(64))
    direct.compose(
        dp_accounting.ComposedDpEvent(
            [
                dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z_a), 8),
                dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z_g), 8),
            ]
        )
    )
    assert eps[2] == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    assert sample_noise_multiplier(40.0, 64) == pytest.approx(z_a)


def test_report_names_only_noised_channels() -> None:
    only_act = LinkAccountant.from_config(
        PrivacyConfig(activation_clip=1.0, activation_noise=30.0, gradient_clip=1.0), seq_len=16
    )
    assert only_act is not None
    report = only_act.report(3)
    assert report["privacy-releases"] == 3
    assert "privacy-epsilon-activations" in report
    assert "privacy-epsilon" not in report  # labels unprotected: no guarantee on the text
    assert "privacy-epsilon-gradients" not in report


def test_releases_count_the_most_used_sample() -> None:
    steps = [np.array([0, 1]), np.array([2, 3]), np.array([1, 0]), np.array([1, 4])]
    assert releases_so_far(steps) == 3  # block 1
    assert releases_so_far([]) == 0


def test_summary_keeps_privacy_per_device_and_round() -> None:
    rec = {
        "event": "train",
        "round": 1,
        "partition": 0,
        "train_loss": 3.0,
        "privacy_epsilon": 7.5,
        "privacy_releases": 2.0,
    }
    summary = build_summary([rec, {"event": "eval", "round": 1, "eval_loss": 3.1}], config={})
    assert summary["rounds"][0]["privacy"] == {
        "0": {"privacy_epsilon": 7.5, "privacy_releases": 2.0}
    }


def test_final_report_names_the_rounds_epsilon() -> None:
    rec = {"event": "train", "round": 1, "partition": 0, "train_loss": 3.0}
    one = {**rec, "privacy_epsilon": 7.5, "privacy_delta": 1e-5}
    two = {**rec, "partition": 1, "privacy_epsilon": 9.25, "privacy_delta": 1e-5}
    summary = build_summary([one, two, {"event": "eval", "round": 1, "eval_loss": 3.1}], config={})
    assert report_lines(summary)[0].endswith("stage link epsilon 9.25 per sample (delta 1e-05)")
    plain = build_summary([rec, {"event": "eval", "round": 1, "eval_loss": 3.1}], config={})
    assert "epsilon" not in report_lines(plain)[0]


# -- Flower's DP on the adapters ---------------------------------------------------------------
def test_adapter_dp_uses_flowers_wrappers() -> None:
    server = with_adapter_dp(
        FedAvg(),
        PrivacyConfig(adapter_dp="server", adapter_noise=0.8, adapter_clip=0.5),
        sampled_devices=3,
    )
    assert isinstance(server, DifferentialPrivacyServerSideFixedClipping)
    assert (server.noise_multiplier, server.clipping_norm) == (0.8, 0.5)
    assert server.num_sampled_clients == 3
    client = with_adapter_dp(FedAvg(), PrivacyConfig(adapter_dp="client"), sampled_devices=2)
    assert isinstance(client, DifferentialPrivacyClientSideFixedClipping)


@pytest.fixture
def task_identity() -> Iterator[None]:
    """Messages are built inside a Flower task; restore Flower's (class-level) identity after."""
    saved = {k: getattr(TaskIdentity, k) for k in ("_task_id", "_run_id", "_node_id")}
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(TaskIdentity, key, value)


def _train_message(config: dict[str, float]) -> Message:
    arrays = ArrayRecord({"w": torch.zeros(10)})
    content = RecordDict({"arrays": arrays, "config": ConfigRecord(config)})
    return Message(content=content, dst_node_id=1, message_type="train")


def _big_update(msg: Message, _context: Context) -> Message:
    arrays = ArrayRecord({"w": torch.full((10,), 3.0)})  # update norm 3 * sqrt(10)
    return Message(content=RecordDict({"arrays": arrays}), reply_to=msg)


@pytest.mark.usefixtures("task_identity")
def test_adapter_clipping_mod_clips_only_when_the_round_asks() -> None:
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    plain = adapter_clipping_mod(_train_message({}), context, _big_update)
    untouched = plain.content["arrays"].to_torch_state_dict()["w"]
    assert torch.equal(untouched, torch.full((10,), 3.0))
    asked = _train_message({KEY_CLIPPING_NORM: 1.0})
    clipped = adapter_clipping_mod(asked, context, _big_update)
    update = clipped.content["arrays"].to_torch_state_dict()["w"]
    assert float(update.norm()) == pytest.approx(1.0, rel=1e-5)


# -- real traffic ------------------------------------------------------------------------------
